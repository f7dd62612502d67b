"""Skip gates: a batch whose numbers are not finite changes nothing, on every rank.

A phase of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` gates a condition
(``RLPipeline.gate``); if it holds on any rank, every rank drops the gradients of a half-done
update and raises :class:`SkipBatch`, and the pipeline counts the batch as skipped. Weights,
optimizer state and beta stay as they were. The decision is agreed by all ranks: under DDP a
rank that skipped while the others ran backward would leave them waiting in the gradient
all-reduce forever.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from torch import Tensor

from rlkl_lightning.trajectory import Trajectory


class SkipBatch(Exception):
    """Raised by a phase to skip the batch's update; the message says why."""


def any_rank(trainer: Trainer | None, flag: bool) -> bool:
    """True if ``flag`` is true on any rank (a collective under DDP: call it on every rank)."""
    if trainer is None or trainer.world_size == 1:
        return bool(flag)
    return bool(trainer.strategy.reduce_boolean_decision(bool(flag), all=False))


def global_sum(trainer: Trainer | None, values: Tensor) -> Tensor:
    """``values`` summed over all ranks (a collective under DDP: call it on every rank)."""
    if trainer is None or trainer.world_size == 1:
        return values
    return trainer.strategy.reduce(values, reduce_op="sum")


def global_max(trainer: Trainer | None, values: Tensor) -> Tensor:
    """``values`` maximised over all ranks (a collective under DDP: call it on every rank)."""
    if trainer is None or trainer.world_size == 1:
        return values
    return trainer.strategy.reduce(values, reduce_op="max")


def trajectory_is_finite(traj: Trajectory) -> bool:
    """Whether every log-prob, value, advantage, return and weight of a response token is finite.

    The engine's log-probs and the weights computed from them are among them: a non-finite one
    skips the batch instead of reaching the surrogate.
    """
    valid = traj.response_mask.bool()
    tensors = (traj.logprobs, traj.values, traj.advantages, traj.returns)
    tensors += (traj.sampler_logprobs, traj.mismatch_weights)
    return all(bool(torch.isfinite(t[valid]).all()) for t in tensors if t is not None)
