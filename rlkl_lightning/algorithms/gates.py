"""Skip gates: a batch whose numbers are not finite changes nothing, on every rank.

The gradient norm is clipped here too (:meth:`SkipGates._clip_gradients`): a non-finite norm is
the last gate before the optimizer steps.

A phase of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` calls :meth:`SkipGates._gate` with a
condition; if it holds on any rank, every rank raises :class:`SkipBatch`, drops the gradients of
a half-done update and :meth:`SkipGates._skip` counts the batch. Weights, optimizer state and
beta stay as they were. The decision is agreed by all ranks: under DDP a rank that skipped
while the others ran backward would leave them waiting in the gradient all-reduce forever.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from rlkl_lightning.models.sharding import is_fsdp


class SkipBatch(Exception):
    """Raised by a phase to skip the batch's update; the message says why."""


class SkipGates(LightningModule):
    """Agreed skip decisions, and the sums over ranks the pipeline's metrics need.

    For a module with ``owner``, ``batches_seen``, ``skipped_batches``, ``skipped_in_a_row``
    and ``hparams.max_skipped_in_a_row``.
    """

    #: The attributes holding models that may be FSDP units (sharding.py).
    sharded_models: ClassVar[tuple[str, ...]] = ()

    def _gate(self, bad: bool, why: str) -> None:
        """Skip the batch if ``bad`` on any rank (a collective under DDP: call it on every rank).

        The gradients of a half-done update are dropped, so weights and optimizer stay untouched.
        """
        if self._any_rank(bad):
            if self._trainer is not None:
                self.optimizers().zero_grad(set_to_none=True)
            raise SkipBatch(why)

    def _gate_trajectory(self, traj) -> None:
        """Skip the batch if a log-prob, value, advantage or return of a response is not finite."""
        valid = traj.response_mask.bool()
        tensors = (traj.logprobs, traj.values, traj.advantages, traj.returns)
        finite = all(bool(torch.isfinite(t[valid]).all()) for t in tensors if t is not None)
        self._gate(not finite, "log-probs, values, advantages or returns are not finite")

    def _global_sum(self, values: Tensor) -> Tensor:
        """``values`` summed over all ranks (a collective under DDP: call it on every rank)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return values
        return self.trainer.strategy.reduce(values, reduce_op="sum")

    def _any_rank(self, flag: bool) -> bool:
        """True if ``flag`` is true on any rank (a collective under DDP: call it on every rank)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return bool(flag)
        return bool(self.trainer.strategy.reduce_boolean_decision(bool(flag), all=False))

    def _skip(self, why: str) -> None:
        """Skip this batch's update: weights and beta stay as they are.

        The KL is logged as ``nan`` for this batch, so KL callbacks see that there is no
        usable value (they keep beta and count the batch) even when the very first batch is
        skipped; ``progress/skipped_batches`` counts the skips.
        """
        self.skipped_batches += 1
        self.skipped_in_a_row += 1
        limit = self.hparams.max_skipped_in_a_row
        if limit is not None and self.skipped_in_a_row >= limit:
            # Every rank skipped the same batches (the decision is agreed), so all stop here.
            raise RuntimeError(
                f"{self.owner}: {self.skipped_in_a_row} batches in a row were skipped, the last "
                f"because {why}; stopping (`max_skipped_in_a_row`={limit}). Fix the cause, or "
                "set `max_skipped_in_a_row` higher or to None. Weights and beta are those of "
                "the last trained batch."
            )
        rank_zero_warn(
            f"{self.owner}: skipping batch {self.batches_seen + 1}: {why}; kl_coef is unchanged "
            f"({self.skipped_batches} batches skipped so far)",
            category=RuntimeWarning,
        )
        # float32 whatever the default dtype (bf16-true makes bf16 the default inside steps).
        nan = torch.tensor(float("nan"), dtype=torch.float32)
        skipped = torch.tensor(float(self.skipped_batches), dtype=torch.float32)
        # The same sync flag as the regular logging: Lightning rejects a key logged with
        # different arguments within an epoch (a skip under DDP would end the run).
        metrics = {"objective/kl": nan, "objective/kl_per_token": nan}
        metrics["progress/skipped_batches"] = skipped
        sync = self.trainer.world_size > 1
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, sync_dist=sync)

    def _clip_grad_norm(self, params: list[Tensor], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` (split in two threads by ``value_model_thread``)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _clip_gradients(self, optimizer) -> float:
        """Clip the gradient norm to ``max_grad_norm``; returns the norm before clipping.

        Gates a non-finite norm, except under ``16-mixed``: there the loss is scaled, an
        overflow is the scaler's to handle (it skips that optimizer step and lowers the
        scale), and the norm and the clip are those of the unscaled gradients. Under FSDP the
        norm is that of all ranks' gradient shards together.
        """
        max_norm = self.hparams.max_grad_norm if self.hparams.max_grad_norm else float("inf")
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer else None
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # Each rank holds a shard of every gradient (the models shard_models wrapped).
        if any(is_fsdp(getattr(self, name, None)) for name in self.sharded_models):
            grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
            local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            local = local.to(self.device, torch.float32)
            norm = self.trainer.strategy.reduce(local.square(), reduce_op="sum").sqrt()
            torch.nn.utils.clip_grads_with_norm_(params, max_norm * scale, norm)
        else:
            norm = self._clip_grad_norm(params, max_norm * scale)
        grad_norm = float(norm) / scale
        if scaler is None:
            self._gate(not math.isfinite(grad_norm), "the gradient norm is not finite")
        return grad_norm
