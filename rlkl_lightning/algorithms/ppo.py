"""PPOModule: manual-optimization PPO with a KL penalty to a frozen reference model.

The shared phases (rollout, scoring, the update loop, logging) are :class:`RLPipeline`'s;
PPO adds a value function and its own shaping and loss:

* score: value estimates at rollout time, from a head on the policy trunk (default) or a
  separate value model;
* shape: the advantage estimator of ``ppo.advantage`` (:mod:`.advantage_estimators`), by
  default ``gae``: ``r_t = -kl_coef * kl_t`` plus the score on the last response token
  (Ziegler et al. 2019, arXiv 1909.08593, eq. 2; the score alone with
  ``penalty.placement="loss"``), then GAE (Schulman et al. 2016, arXiv 1506.02438) and advantage
  whitening; any other registered token-level estimator, or a function by dotted path;
* loss: the policy objective (:mod:`.objective`) with the clipped value loss (Schulman et al.
  2017, arXiv 1707.06347, eq. 9) times ``ppo.vf_coef`` added right after the surrogate.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.advantage_estimators import advantage_estimator, on_scored_rows
from rlkl_lightning.algorithms.losses import value_loss
from rlkl_lightning.algorithms.options import (
    Engine,
    KLPenalty,
    Logging,
    Models,
    Objective,
    Optimization,
    PPOOptions,
    Safeguards,
    Sampling,
    as_group,
)
from rlkl_lightning.algorithms.pipeline import RLPipeline
from rlkl_lightning.checkpoints import plain
from rlkl_lightning.models.forward import trunk_forward
from rlkl_lightning.models.loading import load_causal_lm
from rlkl_lightning.models.logprobs import TokenScores
from rlkl_lightning.models.packing import PackedRows, packed_trunk_forward
from rlkl_lightning.models.value_head import ValueHead, hidden_size_of
from rlkl_lightning.rewards import RewardModel
from rlkl_lightning.trajectory import Trajectory


class PPOModule(RLPipeline):
    """PPO fine-tuning of a causal LM with a per-token KL penalty to a frozen reference.

    Takes the model objects and option groups of
    :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` and PPO's own group.

    Args:
        policy: as :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline`'s.
        tokenizer: as the pipeline's.
        reference: as the pipeline's.
        reward: as the pipeline's.
        gold_reward: as the pipeline's.
        sampling: as the pipeline's.
        optimization: as the pipeline's.
        objective: as the pipeline's.
        penalty: as the pipeline's.
        models: as the pipeline's.
        safeguards: as the pipeline's.
        logging: as the pipeline's.
        engine: as the pipeline's.
        ppo: the advantage estimator, the value function and GAE
            (:class:`~rlkl_lightning.algorithms.options.PPOOptions`).
    """

    owner: ClassVar[str] = "PPOModule"
    sharded_models = (*RLPipeline.sharded_models, "value_trunk", "value_head")

    def __init__(
        self,
        policy: str = "default",
        tokenizer: str | None = None,
        reference: str | None = None,
        reward: RewardModel | None = None,
        gold_reward: RewardModel | None = None,
        sampling: Sampling = Sampling(),
        optimization: Optimization = Optimization(),
        objective: Objective = Objective(),
        penalty: KLPenalty = KLPenalty(),
        models: Models = Models(),
        safeguards: Safeguards = Safeguards(),
        logging: Logging = Logging(),
        engine: Engine = Engine(),
        ppo: PPOOptions = PPOOptions(),
    ):
        own = as_group(PPOOptions, ppo, "ppo")  # checked before the models load
        advantage_estimator(own.advantage, "token", "ppo.advantage")
        super().__init__(
            policy,
            tokenizer,
            reference,
            reward,
            gold_reward,
            sampling,
            optimization,
            objective,
            penalty,
            models,
            safeguards,
            logging,
            engine,
        )
        self.ppo = own
        self.hparams["ppo"] = plain(self.ppo)
        if self.ppo.value_model is None:
            self.value_trunk = None
            self.value_head = ValueHead(hidden_size_of(self.policy))
        else:
            self.value_trunk = load_causal_lm(
                self.ppo.value_model,
                option="ppo.value_model",
                trust_remote_code=self.models.trust_remote_code,
            )
            self.speed_up(self.value_trunk)
            self.value_head = ValueHead(hidden_size_of(self.value_trunk))

    def values(
        self, traj: Trajectory, policy_hidden: Tensor, rows: PackedRows | None = None
    ) -> Tensor:
        """Value estimates ``[B, R]`` (float32) at the positions that predict each token.

        ``rows``: ``traj``'s sequences packed: the separate value model forwards those.
        """
        if self.value_trunk is None:
            return self.value_head(policy_hidden).float()
        if rows is not None:
            return self.value_head(packed_trunk_forward(self.value_trunk, rows)).float()
        keep = traj.response_ids.shape[1] + 1
        hidden = trunk_forward(self.value_trunk, traj.input_ids, traj.attention_mask, keep)
        return self.value_head(hidden[:, :-1]).float()

    @override
    def on_fit_start(self) -> None:
        """The shared set-up; whether the separate value model runs in a helper thread."""
        super().on_fit_start()
        separate = self.value_trunk is not None
        self._value_thread = self.value_thread_on(self.ppo.value_model_thread, separate)

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
        """With ``ppo.value_model_thread``, the value model's part of the update runs beside."""
        thread = getattr(self, "_value_thread", self.ppo.value_model_thread)
        if not thread:
            return None
        return [*self.value_trunk.parameters(), *self.value_head.parameters()]

    @override
    def shape(self, traj: Trajectory) -> Trajectory:
        """The advantages of ``ppo.advantage`` (``gae``: KL-shaped rewards, GAE, whitening).

        Where some rewards failed, on the scored responses alone (their whitening too).
        """
        estimate = advantage_estimator(self.ppo.advantage, "token", "ppo.advantage")
        if traj.sample_mask is not None:  # some rewards failed: the scored rows alone
            return on_scored_rows(estimate, traj, self.reward_kl_coef, self.ppo, self.global_sum)
        return estimate(traj, self.reward_kl_coef, self.ppo, self.global_sum)

    @override
    def loss(self, minibatch: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy objective with ``vf_coef`` x the clipped value loss after the surrogate.

        The value model's part starts first: in a helper thread, it runs beside the policy's.
        The value loss is aggregated as the objective aggregates its terms.
        """
        threads = self.threads
        value_side = threads.beside(self._value_loss, minibatch)  # now, if in a thread

        def value_term(new: TokenScores) -> tuple[Tensor, dict[str, Tensor]]:
            return self._value_term(*value_side(new.hidden))

        return self.policy_objective(
            self.policy, minibatch, self.kl_coef, threads.defer, value_term
        )

    @override
    def helper_loss(self, minibatch: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
        """The separate value model's term alone: ``vf_coef`` x its value loss, and statistics."""
        return self._value_term(*self._value_loss(minibatch))

    def _value_term(self, vf_loss: Tensor, vf_clipfrac: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        stats = {keys.LOSS_VALUE: vf_loss.detach(), keys.VALUE_CLIPFRAC: vf_clipfrac}
        return self.ppo.vf_coef * vf_loss, stats

    def _value_loss(
        self, mb: Trajectory, policy_hidden: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        rows = None
        if self.value_trunk is not None:  # the policy's hidden states come packed already
            rows = self.policy_objective.packed_rows(self.value_trunk, mb)
        values = self.values(mb, policy_hidden, rows)
        reduce = self.policy_objective.reduce(mb)
        return value_loss(
            values, mb.values, mb.returns, mb.response_mask, self.ppo.cliprange_value, reduce
        )
