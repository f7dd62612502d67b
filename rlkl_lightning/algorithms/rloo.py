"""RLOOModule: critic-free policy optimisation over k responses per prompt, with a KL penalty.

The shared phases (rollout, scoring, the KL, the update loop, logging, validation and
checkpoints) are :class:`RLPipeline`'s; RLOO has no value model and adds:

* prompts repeated: each training batch's prompts arrive ``responses_per_prompt`` times in a
  row (:meth:`RLOOModule.on_before_batch_transfer`), so the rollout samples ``k`` responses per
  prompt and everything after it, the KL callbacks included, sees one row per response;
* shape: one return per response, ``score - kl_coef * sum_t kl_t`` (the score alone with
  ``kl_placement="loss"``), turned into advantages within each prompt's group by the
  leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740) or GRPO's group
  normalisation (Shao et al. 2024, arXiv 2402.03300); every token of a response gets its
  response's advantage;
* loss: PPO's clipped surrogate on those advantages (a token mean, as in the PPO loss, or the
  ``loss_aggregation``), plus ``kl_coef x kl_loss`` with ``kl_placement="loss"``, minus
  ``ent_coef`` x the entropy;
* the GRPO family's options (docs/pipeline.md, "GRPO as TRL, verl and DAPO run it"): the
  advantages' scale (``scale_rewards``), responses cut at ``max_new_tokens`` left out of the
  update (``mask_truncated_completions``), groups whose scores are all equal left out of it
  (``drop_zero_std_groups``, DAPO's dynamic sampling without the re-sampling), and their
  fraction logged as ``objective/frac_reward_zero_std`` (with ``grpo`` or the filter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.advantages import group_advantages
from rlkl_lightning.algorithms.checks import RLOO_RULES, check_all, need
from rlkl_lightning.algorithms.gates import global_sum
from rlkl_lightning.algorithms.losses import entropy_from_logits, policy_loss
from rlkl_lightning.algorithms.pipeline import RLPipeline
from rlkl_lightning.algorithms.update import Reduce
from rlkl_lightning.kl.estimators import sequence_kl
from rlkl_lightning.masked import masked_mean
from rlkl_lightning.models.logprobs import score_tokens
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


def zero_std_groups(scores: Tensor, k: int) -> Tensor:
    """``[n]`` True for each group of ``k`` consecutive scores that are all (close to) equal.

    Such a group carries no reward signal: its advantages are 0 whatever the method (the KL in
    the reward or the loss still differs between its responses). As TRL's
    ``frac_reward_zero_std``: the group's standard deviation is within ``torch.isclose`` of 0.
    """
    std = scores.view(-1, k).to(torch.float32).std(dim=1)
    return torch.isclose(std, torch.zeros_like(std))


class RLOOModule(RLPipeline):
    """RLOO (or GRPO-style) fine-tuning of a causal LM with a KL penalty to a frozen reference.

    Takes every argument of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` and these:

    Args:
        responses_per_prompt: ``k``, responses sampled per prompt (each prompt of a data
            batch of ``b`` prompts is repeated ``k`` times: ``b * k`` responses per batch, the
            samples the KL callbacks count).
        advantage: ``rloo`` (leave-one-out baseline, unbiased) or ``grpo`` (the group's mean
            subtracted, then divided by its standard deviation).
        scale_rewards: with ``advantage="grpo"``, what the centred returns are divided by:
            ``group`` (the group's standard deviation), ``batch`` (that of the whole batch,
            every rank's) or ``none`` (Dr. GRPO). ``rloo`` takes only ``group``.
        ent_coef: weight of an entropy bonus in the loss (``- ent_coef x`` the aggregated
            per-token entropy); 0: none, and no full-vocabulary logits in the update.
        mask_truncated_completions: leave the responses that end without EOS (cut at
            ``max_new_tokens``) out of the update: their reward scored an unfinished text.
        drop_zero_std_groups: leave the groups whose scores are all equal out of the update.
            One process only. The KL callbacks still count, and ``objective/kl`` still
            measures, every response of the batch (docs/callbacks.md).
        **kwargs: the arguments of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline`.
    """

    owner: ClassVar[str] = "RLOOModule"

    def __init__(
        self,
        responses_per_prompt: int = 4,
        advantage: str = "rloo",
        scale_rewards: str = "group",
        ent_coef: float = 0.0,
        mask_truncated_completions: bool = False,
        drop_zero_std_groups: bool = False,
        **kwargs: Any,
    ):
        own = {k: v for k, v in locals().items() if k not in ("self", "__class__", "kwargs")}
        check_all(self.owner, own, RLOO_RULES)  # before the models load, like the shared ones
        need(
            self.owner,
            advantage == "grpo" or scale_rewards == "group",
            "scale_rewards",
            "'group' with advantage='rloo' (the leave-one-out baseline never divides)",
            scale_rewards,
        )
        super().__init__(**kwargs)
        self.hparams.update(own)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Repeat each training prompt ``responses_per_prompt`` times in a row.

        Lightning hands the batch returned here to ``training_step`` *and* to the callbacks'
        ``on_train_batch_end``, so the KL callbacks count responses with no ``batch_size_fn``.
        It runs on each rank after the sampler has dealt out the prompts, so a prompt's group
        never spans two ranks. Validation batches are left alone.
        """
        if self._trainer is None or not self.trainer.training:
            return batch
        return repeat_each(batch, self.hparams.responses_per_prompt)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Check that the prompts come in groups of ``k``, then run the shared phases."""
        k = self.hparams.responses_per_prompt
        prompts = list(batch["prompt"])
        if len(prompts) % k or any(p != prompts[i - i % k] for i, p in enumerate(prompts)):
            raise ValueError(
                f"{self.owner}: a training batch must hold each prompt `responses_per_prompt`"
                f"={k} times in a row; got {len(prompts)} prompts that are not. "
                "RLOOModule.on_before_batch_transfer repeats them; a LightningDataModule that "
                "defines its own on_before_batch_transfer replaces that hook and must repeat them"
            )
        super().training_step(batch, batch_idx)

    @override
    def on_fit_start(self) -> None:
        """The shared set-up; leaving responses out of the update needs one process."""
        super().on_fit_start()
        hp = self.hparams
        for option in ("mask_truncated_completions", "drop_zero_std_groups"):
            if hp[option] and self.trainer.world_size > 1:
                raise ValueError(
                    f"{self.owner}: `{option}`=True needs one process (ranks would train on "
                    f"different numbers of responses), got world_size={self.trainer.world_size};"
                    f" set {option}=False"
                )

    @override
    def shape(self, traj: Trajectory) -> Trajectory:
        """Sequence returns, group advantages, the same advantage on every token of a response."""
        hp = self.hparams
        mask = traj.response_mask
        # With the KL in the reward, the return of a response is its score minus
        # kl_coef x its KL in nats per sequence (Ziegler et al. 2019's R = r - beta KL).
        returns = traj.scores - self.reward_kl_coef * sequence_kl(traj.kl, mask)
        k, scale = hp.responses_per_prompt, hp.scale_rewards
        batch_std = self._batch_std(returns) if scale == "batch" else None
        advantages = group_advantages(returns, k, hp.advantage, scale=scale, batch_std=batch_std)
        return traj._replace(advantages=advantages[:, None] * mask)

    def _batch_std(self, returns: Tensor) -> Tensor:
        """The sample standard deviation of every rank's returns (two passes, one per sum)."""
        r = returns.to(torch.float64)
        count_sum = global_sum(self._trainer, torch.stack([r.new_tensor(r.numel()), r.sum()]))
        mean = count_sum[1] / count_sum[0]
        squares = global_sum(self._trainer, ((r - mean) ** 2).sum())
        return (squares / (count_sum[0] - 1)).sqrt()

    def rows_to_train(self, traj: Trajectory) -> Tensor | None:
        """The responses the update trains on; None: all of them (the default)."""
        hp = self.hparams
        keep = torch.ones_like(traj.scores, dtype=torch.bool)
        if hp.drop_zero_std_groups:
            flat = zero_std_groups(traj.scores, hp.responses_per_prompt)
            keep &= ~flat.repeat_interleave(hp.responses_per_prompt)
        if hp.mask_truncated_completions:
            keep &= ended_with_eos(traj, self.tokenizer.eos_token_id)
        if not (hp.drop_zero_std_groups or hp.mask_truncated_completions):
            return None
        return keep.nonzero().flatten()

    @override
    def update(self, traj: Trajectory) -> dict[str, Tensor]:
        """The shared update, on the responses :meth:`rows_to_train` keeps."""
        rows = self.rows_to_train(traj)
        if rows is None:
            return super().update(traj)
        stats = {keys.TRAINED_FRACTION: torch.tensor(rows.numel() / traj.scores.numel())}
        if rows.numel() == 0:  # nothing to learn from: no step, the schedule moves on
            scheduler = self.lr_schedulers()
            scheduler.step()
            stats[keys.LR] = torch.tensor(scheduler.get_last_lr()[0], dtype=torch.float32)
            return stats
        return {**super().update(traj.select(rows)), **stats}

    @override
    def log_batch(self, prompts, responses, traj, diagnostics, stats, clock) -> None:
        """The shared metrics; with ``grpo`` or the filter, the fraction of flat groups too.

        (Only then: RLOO's default runs log exactly what they logged before the option.)
        """
        hp = self.hparams
        if hp.advantage == "grpo" or hp.drop_zero_std_groups:
            flat = zero_std_groups(traj.scores, hp.responses_per_prompt)
            stats = {**stats, keys.FRAC_REWARD_ZERO_STD: flat.float().mean()}
        super().log_batch(prompts, responses, traj, diagnostics, stats, clock)

    @override
    def loss(
        self, minibatch: Trajectory, reduce: Reduce = masked_mean
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped policy loss on the group advantages (+ ``kl_coef`` x the KL loss).

        The per-token terms are made one number by ``reduce`` (the loss aggregation).
        """
        hp = self.hparams
        mb = minibatch
        new = score_tokens(self.policy, mb, hp.temperature, logits=bool(hp.ent_coef))
        pg_loss, pg_stats = policy_loss(
            new.logprobs,
            mb.logprobs,
            mb.advantages,
            mb.response_mask,
            hp.cliprange,
            reduce,
            hp.cliprange_high,
            hp.importance_ratio,
        )
        stats = {
            keys.LOSS_POLICY: pg_loss.detach(),
            keys.APPROX_KL: pg_stats.approx_kl,
            keys.CLIPFRAC: pg_stats.clipfrac,
        }
        loss = pg_loss
        if hp.ent_coef:
            entropy = reduce(entropy_from_logits(new.logits), mb.response_mask)
            loss = loss - hp.ent_coef * entropy
            stats[keys.LOSS_ENTROPY_BONUS] = entropy.detach()
        loss = self.add_kl_loss(loss, stats, new.logprobs, mb, reduce)
        stats[keys.LOSS_TOTAL] = loss.detach()
        return loss, stats
