"""PPOModule: manual-optimization PPO with a KL penalty to a frozen reference model.

The shared phases (rollout, scoring, the update loop, logging) are :class:`RLPipeline`'s;
PPO adds a value function and its own shaping and loss:

* score: value estimates at rollout time, from a head on the policy trunk (default) or a
  separate value model;
* shape: ``r_t = -kl_coef * kl_t`` plus the score on the last response token (Ziegler et al.
  2019, arXiv 1909.08593, eq. 2; the score alone with ``kl_placement="loss"``), then GAE
  (Schulman et al. 2016, arXiv 1506.02438) and advantage whitening;
* loss: the clipped surrogate and clipped value loss (Schulman et al. 2017, arXiv 1707.06347,
  eq. 7 and 9), optionally an entropy bonus, and ``kl_coef x kl_loss`` with
  ``kl_placement="loss"``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import Tensor
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.advantages import gae, shape_rewards
from rlkl_lightning.algorithms.checks import PPO_RULES, check_all
from rlkl_lightning.algorithms.losses import entropy_from_logits, policy_loss, value_loss
from rlkl_lightning.algorithms.pipeline import RLPipeline
from rlkl_lightning.algorithms.update import Reduce
from rlkl_lightning.checkpoints import plain
from rlkl_lightning.masked import masked_mean, masked_whiten
from rlkl_lightning.models.forward import trunk_forward
from rlkl_lightning.models.loading import load_causal_lm
from rlkl_lightning.models.logprobs import TokenScores, score_tokens
from rlkl_lightning.models.value_head import ValueHead, hidden_size_of
from rlkl_lightning.trajectory import Trajectory


class PPOModule(RLPipeline):
    """PPO fine-tuning of a causal LM with a per-token KL penalty to a frozen reference.

    Takes every argument of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` (policy, reward,
    sampling, KL, update and logging options) and these:

    Args:
        value_model: separate value model (a causal LM trunk plus a value head); by default the
            value head sits on the policy trunk.
        cliprange_value: value clip around the rollout-time values.
        vf_coef: weight of the value loss.
        ent_coef: weight of the entropy bonus.
        gamma: discount.
        lam: GAE lambda.
        whiten_rewards: scale shaped rewards to unit variance (over valid tokens) before GAE.
        value_model_thread: run the separate value model's passes in a second thread, beside
            the policy's, each with half of torch's threads (``value_thread.py``; one process
            only). Faster on a CPU; the numbers are those of the plain path with that many
            threads per network. None (default): on where it helps, i.e. with a separate
            ``value_model``, one process on a CPU and at least 2 torch threads.
        **kwargs: the arguments of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline`.
    """

    owner: ClassVar[str] = "PPOModule"
    sharded_models = (*RLPipeline.sharded_models, "value_trunk", "value_head")

    def __init__(
        self,
        value_model: str | None = None,
        cliprange_value: float = 0.2,
        vf_coef: float = 0.1,
        ent_coef: float = 0.0,
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_rewards: bool = False,
        value_model_thread: bool | None = None,
        **kwargs: Any,
    ):
        own = {k: v for k, v in locals().items() if k not in ("self", "__class__", "kwargs")}
        check_all(self.owner, own, PPO_RULES)  # before the models load, like the shared ones
        if value_model_thread and value_model is None:
            raise ValueError(
                f"{self.owner}: `value_model_thread`=True needs a separate `value_model`; with "
                "value_model=None the value head shares the policy's passes (set "
                "value_model_thread=False)"
            )
        super().__init__(**kwargs)
        self.hparams.update(plain(own))
        if value_model is None:
            self.value_trunk = None
            self.value_head = ValueHead(hidden_size_of(self.policy))
        else:
            self.value_trunk = load_causal_lm(
                value_model, option="value_model", trust_remote_code=self.hparams.trust_remote_code
            )
            self.speed_up(self.value_trunk)
            self.value_head = ValueHead(hidden_size_of(self.value_trunk))

    def values(self, traj: Trajectory, policy_hidden: Tensor) -> Tensor:
        """Value estimates ``[B, R]`` (float32) at the positions that predict each token."""
        if self.value_trunk is None:
            return self.value_head(policy_hidden).float()
        keep = traj.response_ids.shape[1] + 1
        hidden = trunk_forward(self.value_trunk, traj.input_ids, traj.attention_mask, keep)
        return self.value_head(hidden[:, :-1]).float()

    @override
    def on_fit_start(self) -> None:
        """The shared set-up; ``value_model_thread`` needs one process."""
        super().on_fit_start()
        strategy = self.trainer.strategy
        one_process = isinstance(strategy, SingleDeviceStrategy)
        if self.hparams.value_model_thread and not one_process:
            raise ValueError(
                f"{self.owner}: `value_model_thread`=True needs one process with a single-device "
                f"strategy, got {type(strategy).__name__}; set value_model_thread=False"
            )
        self._value_thread = self.hparams.value_model_thread
        if self._value_thread is None:  # on where it helps
            self._value_thread = (
                self.value_trunk is not None
                and one_process
                and self.device.type == "cpu"
                and torch.get_num_threads() >= 2
            )

    @override
    def score(
        self, prompts: list[str], traj: Trajectory, policy_scores: TokenScores
    ) -> tuple[Trajectory, list[str], dict[str, Tensor]]:
        """The shared scoring, plus the values at rollout time."""
        traj, responses, diagnostics = super().score(prompts, traj, policy_scores)
        with torch.no_grad():
            values = self.values(traj, policy_scores.hidden)
        return traj._replace(values=values), responses, diagnostics

    @override
    def helper_thread_parameters(self) -> list[Tensor] | None:
        """With ``value_model_thread``, the value model's part of the update runs beside."""
        thread = getattr(self, "_value_thread", self.hparams.value_model_thread)
        if not thread:
            return None
        return [*self.value_trunk.parameters(), *self.value_head.parameters()]

    @override
    def shape(self, traj: Trajectory) -> Trajectory:
        """KL-shaped per-token rewards, GAE, and whitened advantages."""
        hp = self.hparams
        mask = traj.response_mask
        rewards = shape_rewards(traj.scores, traj.kl, self.reward_kl_coef, mask)
        if hp.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, traj.values, mask, hp.gamma, hp.lam)
        return traj._replace(advantages=masked_whiten(advantages, mask), returns=returns)

    @override
    def loss(
        self, minibatch: Trajectory, reduce: Reduce = masked_mean
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped policy loss + ``vf_coef`` x clipped value loss (- ``ent_coef`` x entropy).

        With ``kl_placement="loss"``, plus ``kl_coef`` x the KL loss (:meth:`add_kl_loss`).
        Every term's per-token values are made one number by ``reduce`` (the aggregation).
        """
        hp = self.hparams
        mb = minibatch
        threads = self.threads
        value_side = threads.beside(self._value_loss, mb, reduce)  # now, if in a helper thread
        # Without an entropy bonus no [B, R, V] logits are needed: the fused head (logprobs.py).
        new = score_tokens(self.policy, mb, hp.temperature, bool(hp.ent_coef), threads.defer)
        mask = mb.response_mask
        pg_loss, pg_stats = policy_loss(
            new.logprobs,
            mb.logprobs,
            mb.advantages,
            mask,
            hp.cliprange,
            reduce,
            hp.cliprange_high,
            hp.importance_ratio,
        )
        vf_loss, vf_clipfrac = value_side(new.hidden)
        loss = pg_loss + hp.vf_coef * vf_loss
        stats = {
            keys.LOSS_POLICY: pg_loss.detach(),
            keys.LOSS_VALUE: vf_loss.detach(),
            keys.APPROX_KL: pg_stats.approx_kl,
            keys.CLIPFRAC: pg_stats.clipfrac,
            keys.VALUE_CLIPFRAC: vf_clipfrac,
        }
        if hp.ent_coef:
            entropy = reduce(entropy_from_logits(new.logits), mask)
            loss = loss - hp.ent_coef * entropy
            stats[keys.LOSS_ENTROPY_BONUS] = entropy.detach()
        loss = self.add_kl_loss(loss, stats, new.logprobs, mb, reduce)
        stats[keys.LOSS_TOTAL] = loss.detach()
        return loss, stats

    def _value_loss(
        self, mb: Trajectory, reduce: Reduce, policy_hidden: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        values = self.values(mb, policy_hidden)
        hp = self.hparams
        return value_loss(
            values, mb.values, mb.returns, mb.response_mask, hp.cliprange_value, reduce
        )
