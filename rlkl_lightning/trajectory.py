"""The ``Trajectory``: every tensor of one training batch, filled in phase by phase.

Shapes: ``B`` sequences, ``P`` prompt tokens (left padded), ``R`` response tokens (right
padded after the first EOS). The rollout fills the first five fields, scoring the next four,
shaping the next three; with vLLM the rollout adds the engine's log-probs and scoring the
correction's weights (the next two); the update weighs each micro-batch's tokens (the next);
where a reward failed for some samples, scoring marks the samples the update uses (the last).
Minibatches are ``trajectory.select(rows)``.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Trajectory(NamedTuple):
    """Sampled sequences and what the pipeline computed about them.

    Attributes:
        input_ids: ``[B, P + R]`` prompt and response tokens.
        attention_mask: ``[B, P + R]`` 1 on real prompt tokens and valid response tokens.
        response_ids: ``[B, R]`` the sampled tokens (``input_ids[:, P:]``); pad after EOS.
        response_mask: ``[B, R]`` float, 1 up to and including the first EOS, 0 after it.
        logprobs: ``[B, R]`` float32 log-probs of the sampled tokens under the policy at
            rollout time (the "old" log-probs of PPO's ratio).
        ref_logprobs: ``[B, R]`` float32 log-probs of the same tokens under the reference.
        kl: ``[B, R]`` per-token KL to the reference, by the run's ``penalty.estimator``.
        scores: ``[B]`` reward-model scores (clipped if the run clips them).
        values: ``[B, R]`` value estimates at rollout time (None without a critic).
        advantages: ``[B, R]`` advantages (whitened where the algorithm whitens them).
        returns: ``[B, R]`` value targets (None without a critic).
        kl_scale: ``[B]`` what the KL term of the loss is divided by, per sequence (detached):
            the scale the algorithm divided its advantages by, so that beta keeps the reward's
            units (PPO: the whitening's standard deviation); None: 1 (docs/kl.md, "What beta
            means in the loss").
        sampler_logprobs: ``[B, R]`` float32 log-probs of the sampled tokens under the engine
            that sampled them, where that is not the trainer (``engine.kind="vllm"``); None
            with the native loop, whose ``logprobs`` are the trainer's own.
        mismatch_weights: ``[B, R]`` detached weights of each token's surrogate term that
            correct for sampling from the engine instead of the trainer (``engine.correction``,
            :mod:`rlkl_lightning.algorithms.mismatch`), 0 on padding; None: no correction.
        loss_weights: ``[B, R]`` each token's weight in its minibatch's loss, set on a
            micro-batch by the update as the loss aggregation says
            (:meth:`~rlkl_lightning.algorithms.objective.PolicyObjective.weigh`), 0 on padding;
            None: the loss is the token mean.
        sample_mask: ``[B]`` bool, the samples the advantages, the group baselines and the
            losses use: False where the reward failed (after a remote reward's retries) and,
            with group advantages, for every member of a group with fewer than 2 scored; such
            a sample stays in the measured KL. None: every sample (docs/rewards-at-scale.md).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    kl: Tensor | None = None
    scores: Tensor | None = None
    values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    kl_scale: Tensor | None = None
    sampler_logprobs: Tensor | None = None
    mismatch_weights: Tensor | None = None
    loss_weights: Tensor | None = None
    sample_mask: Tensor | None = None

    def select(self, rows: Tensor) -> Trajectory:
        """The trajectory of the sequences ``rows`` (a minibatch); unset fields stay None."""
        return Trajectory(*(None if t is None else t[rows] for t in self))
