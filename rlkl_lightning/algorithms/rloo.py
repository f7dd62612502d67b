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
* loss: PPO's clipped surrogate on those advantages (a token mean, as in the PPO loss), plus
  ``kl_coef x kl_loss`` with ``kl_placement="loss"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.advantages import group_advantages
from rlkl_lightning.algorithms.checks import RLOO_RULES, check_all
from rlkl_lightning.algorithms.losses import policy_loss
from rlkl_lightning.algorithms.pipeline import RLPipeline
from rlkl_lightning.algorithms.update import Reduce
from rlkl_lightning.kl.estimators import sequence_kl
from rlkl_lightning.masked import masked_mean
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.trajectory import Trajectory

__all__ = ["RLOOModule", "repeat_each"]


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


class RLOOModule(RLPipeline):
    """RLOO (or GRPO-style) fine-tuning of a causal LM with a KL penalty to a frozen reference.

    Takes every argument of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` and these:

    Args:
        responses_per_prompt: ``k``, responses sampled per prompt (each prompt of a data
            batch of ``b`` prompts is repeated ``k`` times: ``b * k`` responses per batch, the
            samples the KL callbacks count).
        advantage: ``rloo`` (leave-one-out baseline, unbiased) or ``grpo`` (the group's mean
            subtracted, then divided by its standard deviation).
        **kwargs: the arguments of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline`.
    """

    owner: ClassVar[str] = "RLOOModule"

    def __init__(self, responses_per_prompt: int = 4, advantage: str = "rloo", **kwargs: Any):
        own = {k: v for k, v in locals().items() if k not in ("self", "__class__", "kwargs")}
        check_all(self.owner, own, RLOO_RULES)  # before the models load, like the shared ones
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
    def shape(self, traj: Trajectory) -> Trajectory:
        """Sequence returns, group advantages, the same advantage on every token of a response."""
        hp = self.hparams
        mask = traj.response_mask
        # With the KL in the reward, the return of a response is its score minus
        # kl_coef x its KL in nats per sequence (Ziegler et al. 2019's R = r - beta KL).
        returns = traj.scores - self.reward_kl_coef * sequence_kl(traj.kl, mask)
        advantages = group_advantages(returns, hp.responses_per_prompt, hp.advantage)
        return traj._replace(advantages=advantages[:, None] * mask)

    @override
    def loss(
        self, minibatch: Trajectory, reduce: Reduce = masked_mean
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped policy loss on the group advantages (+ ``kl_coef`` x the KL loss).

        The per-token terms are made one number by ``reduce`` (the loss aggregation).
        """
        hp = self.hparams
        mb = minibatch
        new = score_tokens(self.policy, mb, hp.temperature, logits=False)
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
        loss = self.add_kl_loss(pg_loss, stats, new.logprobs, mb, reduce)
        stats[keys.LOSS_TOTAL] = loss.detach()
        return loss, stats
