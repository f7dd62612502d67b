"""RLOOModule: critic-free policy optimisation over k responses per prompt, with a KL penalty.

The shared phases (rollout, scoring, the KL, the update loop, logging, validation and
checkpoints) are :class:`RLPipeline`'s; RLOO has no value model and adds:

* prompts repeated: each training batch's prompts arrive ``responses_per_prompt`` times in a
  row (:meth:`RLOOModule.on_before_batch_transfer`), so the rollout samples ``k`` responses per
  prompt and everything after it, the KL callbacks included, sees one row per response;
* shape: one return per response, ``score - kl_coef * sum_t kl_t`` (the score alone with
  ``penalty.placement="loss"``), turned into advantages within each prompt's group by the
  leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740) or GRPO's group
  normalisation (Shao et al. 2024, arXiv 2402.03300); every token of a response gets its
  response's advantage;
* loss: the policy objective (:mod:`.objective`) on those advantages, as PPO's without its
  value loss;
* the GRPO family's options (docs/pipeline.md, "GRPO as TRL, verl and DAPO run it"): the
  advantages' scale (``scale_rewards``), responses cut at ``max_new_tokens`` left out of the
  update (``mask_truncated_completions``), groups whose scores are all equal left out of it
  (``drop_zero_std_groups``, DAPO's dynamic sampling without the re-sampling), and their
  fraction logged as ``objective/frac_reward_zero_std`` (with ``grpo`` or the filter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.advantage_estimators import advantage_estimator
from rlkl_lightning.algorithms.advantages import scored_spread, scored_std
from rlkl_lightning.algorithms.options import (
    Engine,
    GroupOptions,
    KLPenalty,
    Logging,
    Models,
    Objective,
    Optimization,
    Safeguards,
    Sampling,
    as_group,
)
from rlkl_lightning.algorithms.pipeline import RLPipeline
from rlkl_lightning.checkpoints import plain
from rlkl_lightning.rewards import RewardModel
from rlkl_lightning.trajectory import Trajectory

__all__ = ["RLOOModule", "repeat_each", "zero_std_groups"]


def repeat_each(batch: Any, k: int) -> Any:
    """Every sample of ``batch`` ``k`` times in a row: ``[a, b] -> [a, a, b, b]`` for ``k = 2``.

    A mapping repeats each of its fields; a list or tuple its elements; a tensor its rows.
    """
    if isinstance(batch, Mapping):
        return {key: repeat_each(value, k) for key, value in batch.items()}
    if isinstance(batch, Tensor):
        return batch.repeat_interleave(k, dim=0)
    if isinstance(batch, (list, tuple)):
        return [item for item in batch for _ in range(k)]
    raise TypeError(f"RLOOModule: cannot repeat a batch field of type {type(batch).__name__}")


def ended_with_eos(traj: Trajectory, eos_token_id: int | None) -> Tensor:
    """``[B]`` True for each response whose valid tokens hold EOS (not cut at the limit)."""
    if eos_token_id is None:
        return torch.zeros_like(traj.scores, dtype=torch.bool)
    return ((traj.response_ids == eos_token_id) & traj.response_mask.bool()).any(dim=1)


def zero_std_groups(scores: Tensor, k: int, scored: Tensor | None = None) -> Tensor:
    """``[n]`` True for each group of ``k`` consecutive scores that are all (close to) equal.

    Such a group carries no reward signal. Its advantages are 0 only without the KL in the
    reward (the KL in the loss, or beta 0): with it, the returns ``c - beta * KL_i`` differ, and
    the advantages are ``-beta * k/(k-1) * (KL_i - mean)`` (``rloo``) or, with ``grpo`` and
    the group's scale, ``-(KL_i - mean) / std`` of the KL: of unit scale, about independent of
    beta. The test is on the scores all the same (DAPO's filter, TRL's
    ``frac_reward_zero_std``): the group's standard deviation is within ``torch.isclose`` of 0.

    ``scored``: ``[n * k]`` bool, the responses whose reward did not fail (``sample_mask``);
    the test is then on a group's scored scores alone (a failed one is ``nan``), as its
    baseline is, and a group with fewer than 2 scored is not flat. None: all scored.
    """
    s = scores.view(-1, k).to(torch.float32)
    if scored is None:
        std = s.std(dim=1)
    else:
        m, _, centred = scored_spread(s, scored.view(-1, k).to(torch.bool))
        std = torch.where(m >= 2, scored_std(m, centred), torch.nan).squeeze(1)
    return torch.isclose(std, torch.zeros_like(std))


def zero_std_fraction(
    scores: Tensor,
    k: int,
    global_sum: Callable[[Tensor], Tensor],
    scored: Tensor | None = None,
) -> Tensor:
    """The fraction of the global batch's groups that :func:`zero_std_groups` finds flat.

    Flat groups over groups, each summed over every rank by ``global_sum`` (a collective under
    DDP; the identity on one process): ranks may hold different numbers of groups, and the mean
    over ranks of each rank's fraction would weigh a rank's groups by its share of the ranks.
    """
    flat = zero_std_groups(scores, k, scored)
    counts = torch.stack([flat.sum(), torch.tensor(flat.numel(), device=flat.device)])
    flat_groups, groups = global_sum(counts.to(torch.float32))
    return flat_groups / groups


class RLOOModule(RLPipeline):
    """RLOO (or GRPO-style) fine-tuning of a causal LM with a KL penalty to a frozen reference.

    Takes the model objects and option groups of
    :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` and the group's own options.

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
        group: the responses per prompt and the group advantages
            (:class:`~rlkl_lightning.algorithms.options.GroupOptions`).
    """

    owner: ClassVar[str] = "RLOOModule"

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
        group: GroupOptions = GroupOptions(),
    ):
        own = as_group(GroupOptions, group, "group")  # checked before the models load
        advantage_estimator(own.advantage, "group", "group.advantage")
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
        self.group = own
        self.hparams["group"] = plain(self.group)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Repeat each training prompt ``responses_per_prompt`` times in a row.

        Lightning hands the batch returned here to ``training_step`` *and* to the callbacks'
        ``on_train_batch_end``, so the KL callbacks count responses with no ``batch_size_fn``.
        It runs on each rank after the sampler has dealt out the prompts, so a prompt's group
        never spans two ranks. Validation batches are left alone.
        """
        if self._trainer is None or not self.trainer.training:
            return batch
        return repeat_each(batch, self.group.responses_per_prompt)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Check that the prompts come in groups of ``k``, then run the shared phases."""
        k = self.group.responses_per_prompt
        prompts = list(batch["prompt"])
        if len(prompts) % k or any(p != prompts[i - i % k] for i, p in enumerate(prompts)):
            raise ValueError(
                f"{self.owner}: a training batch must hold each prompt `group.responses_per_prompt`"
                f"={k} times in a row; got {len(prompts)} prompts that are not. "
                "RLOOModule.on_before_batch_transfer repeats them; a LightningDataModule that "
                "defines its own on_before_batch_transfer replaces that hook and must repeat them"
            )
        super().training_step(batch, batch_idx)

    @override
    def on_fit_start(self) -> None:
        """The shared set-up, after the checks of the options that leave responses out.

        They need one process, and leaving out truncated responses an EOS token to tell them by.
        """
        for option in ("mask_truncated_completions", "drop_zero_std_groups"):
            if getattr(self.group, option) and self.trainer.world_size > 1:
                raise ValueError(
                    f"{self.owner}: `group.{option}`=True needs one process (ranks would train on "
                    f"different numbers of responses), got world_size={self.trainer.world_size};"
                    f" set {option}=False"
                )
        if self.group.mask_truncated_completions and self.tokenizer.eos_token_id is None:
            raise ValueError(  # every response would count as truncated and none would train
                f"{self.owner}: `group.mask_truncated_completions`=True leaves out the responses "
                "that end without EOS, and the tokenizer has no EOS token; set "
                "mask_truncated_completions=False"
            )
        super().on_fit_start()

    @override
    def shape(self, traj: Trajectory) -> Trajectory:
        """Sequence returns, group advantages, the same advantage on every token of a response."""
        estimate = advantage_estimator(self.group.advantage, "group", "group.advantage")
        return estimate(traj, self.reward_kl_coef, self.group, self.global_sum)

    def rows_to_train(self, traj: Trajectory) -> Tensor | None:
        """The responses the update trains on; None: all of them (the default)."""
        hp = self.group
        keep = torch.ones_like(traj.scores, dtype=torch.bool)
        if hp.drop_zero_std_groups:
            flat = zero_std_groups(traj.scores, hp.responses_per_prompt, traj.sample_mask)
            keep &= ~flat.repeat_interleave(hp.responses_per_prompt)
        if hp.mask_truncated_completions:
            keep &= ended_with_eos(traj, self.tokenizer.eos_token_id)
        if not (hp.drop_zero_std_groups or hp.mask_truncated_completions):
            return None
        if traj.sample_mask is not None:  # failed rewards: the update trains on none of them
            keep &= traj.sample_mask.to(torch.bool)
        return keep.nonzero().flatten()

    @override
    def update(self, traj: Trajectory) -> dict[str, Tensor]:
        """The shared update, on the responses :meth:`rows_to_train` keeps.

        It takes its ``ppo_epochs`` x ``num_minibatches`` optimizer steps however few responses
        are kept (:func:`~rlkl_lightning.algorithms.update.run_update`): a ``max_steps``-bound
        run trains as many batches as without the options. With none kept, every step's
        gradient is zero.
        """
        rows = self.rows_to_train(traj)
        if rows is None:
            return super().update(traj)
        stats = {keys.TRAINED_FRACTION: torch.tensor(rows.numel() / traj.scores.numel())}
        return {**super().update(traj.select(rows)), **stats}

    @override
    def log_batch(
        self, prompts, responses, traj, diagnostics, stats, clock, phase_peaks=None
    ) -> None:
        """The shared metrics; with ``grpo`` or the filter, the fraction of flat groups too.

        (Only then: RLOO's default runs log exactly what they logged before the option.)
        """
        hp = self.group
        if hp.advantage == "grpo" or hp.drop_zero_std_groups:
            k = hp.responses_per_prompt
            flat = zero_std_fraction(traj.scores, k, self.global_sum, traj.sample_mask)
            stats = {**stats, keys.FRAC_REWARD_ZERO_STD: flat}
        super().log_batch(prompts, responses, traj, diagnostics, stats, clock, phase_peaks)
