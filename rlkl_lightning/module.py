"""PPOModule: manual-optimization PPO with a KL penalty to a frozen reference model.

One training batch (a list of prompts) runs the pipeline of the README:

1. rollout with the policy (KV cache, left padding), keeping the policy's log-probs, logits and
   hidden states of its samples (``decode.sample_and_score``: no second policy pass);
2. score: values, reference log-probs, the reward model's score;
3. shape: ``r_t = -kl_coef * kl_t`` plus the score on the last response token
   (Ziegler et al. 2019, arXiv 1909.08593, eq. 2);
4. GAE and advantage whitening;
5. ``ppo_epochs`` x ``num_minibatches`` clipped-surrogate updates (Schulman et al. 2017);
6. log every metric.

``kl_coef`` is a plain attribute: a ``KLControllerCallback`` rewrites it after each batch, and
the next batch's rewards use the new value.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics.text import Perplexity

from rlkl_lightning import kl as klmod
from rlkl_lightning.advantages import gae, shape_rewards
from rlkl_lightning.decode import sample_and_score
from rlkl_lightning.masked import masked_mean, masked_sum, masked_whiten
from rlkl_lightning.models import (
    ValueHead,
    disable_dropout,
    freeze,
    frozen_copy,
    hidden_size_of,
    lm_forward,
    load_causal_lm,
    load_tokenizer,
    plain_lm_head_weight,
    trunk_forward,
)
from rlkl_lightning.ppo_loss import entropy_from_logits, policy_loss, value_loss
from rlkl_lightning.rewards import (
    RewardModel,
    RewardShapeError,
    VaderSentimentReward,
    validate_scores,
)
from rlkl_lightning.rollout import Rollout, gather_logprobs, score_tokens
from rlkl_lightning.token_logprobs import token_logprobs

LR_SCHEDULES = ("constant", "linear")


class PPOModule(LightningModule):
    """PPO fine-tuning of a causal LM with a per-token KL penalty to a frozen reference.

    Args:
        policy: Hugging Face causal LM name or local directory; ``"default"`` is the default
            world's SFT model (built on first use).
        tokenizer: tokenizer name or directory; defaults to ``policy``.
        reference: reference model name or directory; defaults to a frozen copy of the policy.
        value_model: separate value model (a causal LM trunk plus a value head); by default the
            value head sits on the policy trunk.
        reward: the reward model, called as ``reward(prompts, responses) -> [B]`` scores;
            defaults to the VADER sentiment of the response.
        init_kl_coef: beta before any controller update (a ``KLControllerCallback`` overwrites
            ``kl_coef`` at fit start with its controller's value).
        kl_estimator: per-token KL in the reward and in ``objective/kl``: ``k1``, ``k2``,
            ``k3`` or ``exact`` (see the README, "KL units and estimators").
        max_prompt_tokens: prompts are truncated on the left to this many tokens.
        max_new_tokens: response length limit (tokens).
        temperature: sampling temperature; log-probs are computed at the same temperature.
        top_k: sample among the top-k tokens only (0 = all). Anything but 0 makes the samples
            come from a truncated distribution, so the KL estimates are biased; keep 0 for
            KL-controlled runs.
        top_p: nucleus sampling (1.0 = off); same caveat as ``top_k``.
        stop_at_eos: stop each response at its first EOS (False: always ``max_new_tokens``).
        ppo_epochs: passes over each batch of rollouts.
        num_minibatches: minibatches per pass (one optimizer step each).
        grad_accum_steps: micro-batches per minibatch, when a minibatch does not fit in memory.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        lr_schedule: ``constant`` or ``linear`` (decay to 0 over the training batches).
        warmup_batches: linear warm-up length in batches.
        cliprange: PPO ratio clip epsilon.
        cliprange_value: value clip around the rollout-time values.
        vf_coef: weight of the value loss.
        ent_coef: weight of the entropy bonus.
        gamma: discount.
        lam: GAE lambda.
        whiten_rewards: scale shaped rewards to unit variance (over valid tokens) before GAE.
        score_clip: clip reward-model scores to ``[-score_clip, score_clip]`` (None: no clip).
        max_grad_norm: gradient-norm clip (None: no clip).
        log_samples_every: write a table of sampled generations to TensorBoard every this many
            batches (0: never).
        num_logged_samples: rows in that table.
        max_skipped_in_a_row: stop the run with an error once this many batches in a row were
            skipped (a reward model that always fails would otherwise burn the whole run);
            None: never stop.
    """

    def __init__(
        self,
        policy: str = "default",
        tokenizer: str | None = None,
        reference: str | None = None,
        value_model: str | None = None,
        reward: RewardModel | None = None,
        init_kl_coef: float = 0.1,
        kl_estimator: str = "k1",
        max_prompt_tokens: int = 64,
        max_new_tokens: int = 24,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_at_eos: bool = True,
        ppo_epochs: int = 4,
        num_minibatches: int = 4,
        grad_accum_steps: int = 1,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        lr_schedule: str = "constant",
        warmup_batches: int = 0,
        cliprange: float = 0.2,
        cliprange_value: float = 0.2,
        vf_coef: float = 0.1,
        ent_coef: float = 0.0,
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_rewards: bool = False,
        score_clip: float | None = None,
        max_grad_norm: float | None = 1.0,
        log_samples_every: int = 50,
        num_logged_samples: int = 4,
        max_skipped_in_a_row: int | None = 20,
    ):
        super().__init__()
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        _check_args(args)
        self.save_hyperparameters(ignore=["reward"])
        # LightningCLI saves a subclass's own arguments as the hyperparameters; the settings
        # read from `hparams` below must be the ones this module was built with.
        self.hparams.update({k: v for k, v in args.items() if k != "reward"})
        self.automatic_optimization = False

        self.tokenizer = load_tokenizer(tokenizer or policy, "tokenizer" if tokenizer else "policy")
        self.policy = load_causal_lm(policy, option="policy")
        self.reference = freeze(
            load_causal_lm(reference, option="reference") if reference else frozen_copy(self.policy)
        )
        if value_model is None:
            self.value_trunk = None
            self.value_head = ValueHead(hidden_size_of(self.policy))
        else:
            self.value_trunk = load_causal_lm(value_model, option="value_model")
            self.value_head = ValueHead(hidden_size_of(self.value_trunk))
        self.reward = reward if reward is not None else VaderSentimentReward()
        if getattr(self.policy.config, "vocab_size", None) != getattr(
            self.reference.config, "vocab_size", None
        ):
            raise ValueError(
                "PPOModule: `reference` must share the policy's vocabulary: vocab_size "
                f"{getattr(self.reference.config, 'vocab_size', None)} != the policy's "
                f"{getattr(self.policy.config, 'vocab_size', None)}"
            )

        _check_context(self.policy, max_prompt_tokens, max_new_tokens)
        self.kl_coef = float(init_kl_coef)
        self.val_perplexity = Perplexity(ignore_index=-100)
        self.ref_perplexity = Perplexity(ignore_index=-100)
        self.reference_perplexity: float | None = None
        # Counted here: trainer.global_step counts optimizer steps, several per batch.
        self.batches_seen = 0
        self.samples_seen = 0
        self.skipped_batches = 0
        self.skipped_in_a_row = 0

    # ------------------------------------------------------------------ set-up
    def configure_optimizers(self):
        """AdamW over the policy, the value head and the value trunk (if any)."""
        params = [p for p in self.parameters() if p.requires_grad]
        # The fused kernel does one pass per tensor instead of a dozen (same update rule).
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        optimizer = torch.optim.AdamW(
            params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, fused=fused
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def _lr_factor(self, batch: int) -> float:
        warmup = self.hparams.warmup_batches
        if warmup and batch < warmup:
            return (batch + 1) / warmup
        if self.hparams.lr_schedule == "linear" and self._trainer is not None:
            total = max(int(self.trainer.estimated_stepping_batches), 1)
            return max(0.0, 1.0 - (batch - warmup) / max(total - warmup, 1))
        return 1.0

    def on_fit_start(self) -> None:
        """Keep the frozen models frozen and the reward on our device."""
        freeze(self.reference)
        disable_dropout(self.policy)
        if hasattr(self.reward, "to"):
            self.reward.to(self.device)

    # ------------------------------------------------------------------ rollout
    def _encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        if not getattr(self, "_warned_truncation", False):
            limit = self.hparams.max_prompt_tokens
            longest = max(len(ids) for ids in self.tokenizer(prompts)["input_ids"])
            if longest > limit:
                self._warned_truncation = True
                rank_zero_warn(
                    f"PPOModule: a prompt of {longest} tokens is longer than "
                    f"`max_prompt_tokens`={limit}; prompts are cut on the left to their last "
                    f"{limit} tokens (warned once)",
                    category=RuntimeWarning,
                )
        self.tokenizer.truncation_side = "left"
        enc = self.tokenizer(
            prompts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.hparams.max_prompt_tokens,
        )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def _values(self, rollout: Rollout, policy_hidden: Tensor) -> Tensor:
        if self.value_trunk is None:
            return self.value_head(policy_hidden).float()
        keep = rollout.response_ids.shape[1] + 1
        hidden = trunk_forward(self.value_trunk, rollout.input_ids, rollout.attention_mask, keep)
        return self.value_head(hidden[:, :-1]).float()

    def _decode(self, ids: Tensor, mask: Tensor) -> list[str]:
        return [
            self.tokenizer.decode(row[m.bool()], skip_special_tokens=True)
            for row, m in zip(ids, mask, strict=True)
        ]

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Rollout, score, shape, GAE, then the PPO epochs of one batch."""
        hp = self.hparams
        t_start = time.perf_counter()
        prompts = list(batch["prompt"])
        prompt_ids, prompt_mask = self._encode_prompts(prompts)
        # The sampling loop also returns the policy's log-probs, logits and hidden states of
        # its samples, so the policy needs no second scoring pass (see decode.py).
        rollout, pol = sample_and_score(
            self.policy,
            prompt_ids,
            prompt_mask,
            max_new_tokens=hp.max_new_tokens,
            temperature=hp.temperature,
            top_k=hp.top_k,
            top_p=hp.top_p,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            stop_at_eos=hp.stop_at_eos,
        )
        t_rollout = time.perf_counter()
        mask = rollout.response_mask

        with torch.no_grad():
            old_values = self._values(rollout, pol.hidden)
        with torch.inference_mode():
            ref = score_tokens(self.reference, rollout, hp.temperature)
        ref_logits, ref_logprobs = ref.logits.clone(), ref.logprobs.clone()
        responses = self._decode(rollout.response_ids, mask)
        reward_error: Exception | None = None
        try:
            scores = validate_scores(self.reward(prompts, responses), len(prompts), self.reward)
        except (ValueError, RuntimeError) as err:
            scores, reward_error = None, err
        # Every skip decision is agreed by all ranks: under DDP a rank that skipped while the
        # others ran backward would leave them waiting in the gradient all-reduce forever.
        if self._any_rank(reward_error is not None):
            # A wrong shape is a broken reward model, not a numeric fault: stop (on every
            # rank) rather than skip every batch of the run.
            if self._any_rank(isinstance(reward_error, RewardShapeError)):
                raise ValueError(
                    f"PPOModule: `reward` must return one finite score per (prompt, response) "
                    f"pair, shape [{len(prompts)}]: {reward_error or 'failed on another rank'}"
                ) from reward_error
            self._skip(f"the reward model failed: {reward_error or 'on another rank'}")
            return
        scores = scores.to(self.device)
        if hp.score_clip is not None:
            scores = scores.clamp(-hp.score_clip, hp.score_clip)

        diagnostics = {
            name: klmod.per_token_kl(pol.logprobs, ref_logprobs, name)
            for name in ("k1", "k2", "k3")
        }
        diagnostics["exact"] = klmod.exact_kl(pol.logits, ref_logits)
        kl_tokens = diagnostics[hp.kl_estimator]
        kl_seq = klmod.sequence_kl(kl_tokens, mask)
        if self._any_rank(not bool(torch.isfinite(kl_seq).all())):
            self._skip("the KL to the reference is not finite (on this or another rank)")
            return

        rewards = shape_rewards(scores, kl_tokens, self.kl_coef, mask)
        if hp.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, old_values, mask, hp.gamma, hp.lam)
        advantages = masked_whiten(advantages, mask)
        inputs = (pol.logprobs, old_values, advantages, returns)
        valid = mask.bool()
        if self._any_rank(not all(bool(torch.isfinite(t[valid]).all()) for t in inputs)):
            # Caught before any optimizer step, so the weights are untouched.
            self._skip("log-probs, values, advantages or returns are not finite")
            return
        t_scored = time.perf_counter()

        stats = self._ppo_epochs(rollout, pol.logprobs, old_values, advantages, returns)
        if stats is None:
            return
        t_end = time.perf_counter()

        n = len(prompts)
        self.batches_seen += 1
        self.skipped_in_a_row = 0
        self.samples_seen += n * self.trainer.world_size
        n_tokens = mask.sum()
        # Per-token means over the tokens of the global batch (all ranks): sums, then divide.
        kl_sum, entropy_sum, all_tokens = self._global_sum(
            torch.stack(
                [
                    kl_seq.sum(),
                    masked_sum(entropy_from_logits(pol.logits), mask),
                    n_tokens.to(kl_tokens.dtype),
                ]
            )
        )
        metrics = {
            "objective/kl": kl_seq.mean(),
            "objective/kl_per_token": kl_sum / all_tokens,
            "objective/score": scores.mean(),
            "objective/non_score_reward": -self.kl_coef * kl_seq.mean(),
            "objective/entropy": entropy_sum / all_tokens,
            "objective/response_tokens": n_tokens / n,
            "perf/tokens_per_s": n_tokens / (t_end - t_start),
            "perf/rollout_s": torch.tensor(t_rollout - t_start),
            "perf/score_s": torch.tensor(t_scored - t_rollout),
            "perf/update_s": torch.tensor(t_end - t_scored),
            "progress/samples": torch.tensor(float(self.samples_seen)),
            "progress/skipped_batches": torch.tensor(float(self.skipped_batches)),
            **stats,
        }
        for name, values in diagnostics.items():
            metrics[f"objective/kl_{name}"] = klmod.sequence_kl(values, mask).mean()
        if not self._has_kl_controller():
            metrics["objective/kl_coef"] = torch.tensor(self.kl_coef)
        self.log_dict(
            {k: torch.as_tensor(v, dtype=torch.float32) for k, v in metrics.items()},
            on_step=True,
            on_epoch=False,
            batch_size=n,
            sync_dist=self.trainer.world_size > 1,
        )
        self._log_samples(prompts, responses, scores)

    def _ppo_epochs(
        self,
        rollout: Rollout,
        old_logprobs: Tensor,
        old_values: Tensor,
        advantages: Tensor,
        returns: Tensor,
    ) -> dict[str, Tensor] | None:
        """Clipped policy and value updates over shuffled minibatches; returns mean stats."""
        hp = self.hparams
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        batch_size = rollout.input_ids.shape[0]
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(hp.ppo_epochs):
            order = torch.randperm(batch_size, device=self.device)
            for minibatch in order.chunk(hp.num_minibatches):
                mb_tokens = rollout.response_mask[minibatch].sum().clamp(min=1)
                step_stats: dict[str, float] = {}
                for micro in minibatch.chunk(hp.grad_accum_steps):
                    loss, stats = self._loss(
                        rollout, micro, old_logprobs, old_values, advantages, returns
                    )
                    if self._any_rank(not bool(torch.isfinite(loss))):
                        optimizer.zero_grad(set_to_none=True)
                        self._skip("the PPO loss is not finite")
                        return None
                    weight = rollout.response_mask[micro].sum() / mb_tokens
                    self.manual_backward(loss * weight)
                    for key, value in stats.items():
                        step_stats[key] = step_stats.get(key, 0.0) + float(value) * float(weight)
                grad_norm = self._clip_gradients(optimizer)
                if self._any_rank(not math.isfinite(grad_norm)):
                    optimizer.zero_grad(set_to_none=True)
                    self._skip("the gradient norm is not finite")
                    return None
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step_stats["policy/grad_norm"] = grad_norm
                for key, value in step_stats.items():
                    totals[key] = totals.get(key, 0.0) + value
                updates += 1
        scheduler.step()
        result = {key: torch.tensor(value / updates) for key, value in totals.items()}
        result["policy/lr"] = torch.tensor(scheduler.get_last_lr()[0])
        return result

    def _loss(
        self,
        rollout: Rollout,
        idx: Tensor,
        old_logprobs: Tensor,
        old_values: Tensor,
        advantages: Tensor,
        returns: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        hp = self.hparams
        sub = Rollout(*(t[idx] for t in rollout))
        mask = sub.response_mask
        keep = sub.response_ids.shape[1] + 1
        weight = None if hp.ent_coef else plain_lm_head_weight(self.policy)
        if weight is not None:  # no [B, R, V] logits needed: the fused head (token_logprobs.py)
            hidden = trunk_forward(self.policy, sub.input_ids, sub.attention_mask, keep)[:, :-1]
            logprobs = token_logprobs(hidden, weight, sub.response_ids, hp.temperature)
        else:
            out = lm_forward(self.policy, sub.input_ids, sub.attention_mask, keep)
            logits = out.logits[:, :-1].float() / hp.temperature
            logprobs = gather_logprobs(logits, sub.response_ids)
            hidden = out.hidden[:, :-1]
        values = self._values(sub, hidden)
        pg_loss, pg_stats = policy_loss(
            logprobs, old_logprobs[idx], advantages[idx], mask, hp.cliprange
        )
        vf_loss, vf_clipfrac = value_loss(
            values, old_values[idx], returns[idx], mask, hp.cliprange_value
        )
        loss = pg_loss + hp.vf_coef * vf_loss
        stats = {
            "loss/policy": pg_loss.detach(),
            "loss/value": vf_loss.detach(),
            "policy/approx_kl": pg_stats.approx_kl,
            "policy/clipfrac": pg_stats.clipfrac,
            "policy/value_clipfrac": vf_clipfrac,
        }
        if hp.ent_coef:
            entropy = masked_mean(entropy_from_logits(logits), mask)
            loss = loss - hp.ent_coef * entropy
            stats["loss/entropy_bonus"] = entropy.detach()
        stats["loss/total"] = loss.detach()
        return loss, stats

    def _clip_gradients(self, optimizer) -> float:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        max_norm = self.hparams.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        return float(norm)

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
                f"PPOModule: {self.skipped_in_a_row} batches in a row were skipped, the last "
                f"because {why}; stopping (`max_skipped_in_a_row`={limit}). Fix the cause, or "
                "set `max_skipped_in_a_row` higher or to None. Weights and beta are those of "
                "the last trained batch."
            )
        rank_zero_warn(
            f"PPOModule: skipping batch {self.batches_seen + 1}: {why}; kl_coef is unchanged "
            f"({self.skipped_batches} batches skipped so far)",
            category=RuntimeWarning,
        )
        nan = torch.tensor(float("nan"))
        self.log_dict(
            {
                "objective/kl": nan,
                "objective/kl_per_token": nan,
                "progress/skipped_batches": torch.tensor(float(self.skipped_batches)),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
            # The same sync flag as the regular logging: Lightning rejects a key logged with
            # different arguments within an epoch (a skip under DDP would end the run).
            sync_dist=self.trainer.world_size > 1,
        )

    def _has_kl_controller(self) -> bool:
        from rlkl_lightning.kl_callback import KLControllerCallback

        return any(isinstance(cb, KLControllerCallback) for cb in self.trainer.callbacks)

    def _log_samples(self, prompts: list[str], responses: list[str], scores: Tensor) -> None:
        every = self.hparams.log_samples_every
        if not every or (self.batches_seen - 1) % every or self.global_rank != 0:
            return
        experiment = getattr(self.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_text"):
            return
        rows = ["| prompt | response | score |", "|---|---|---|"]
        for prompt, response, score in list(zip(prompts, responses, scores.tolist()))[
            : self.hparams.num_logged_samples
        ]:
            cells = [s.replace("|", "\\|").replace("\n", " ") for s in (prompt, response)]
            rows.append(f"| {cells[0]} | {cells[1]} | {score:.3f} |")
        experiment.add_text("samples", "\n".join(rows), global_step=self.batches_seen)

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Accumulate held-out perplexity of the policy (and of the reference, once)."""
        ids, mask = self._encode_texts(list(batch["text"]))
        # A target counts only if both it and the position predicting it are real tokens
        # (with left padding, the pad just before BOS would otherwise "predict" BOS).
        valid = mask[:, 1:].bool() & mask[:, :-1].bool()
        labels = ids[:, 1:].masked_fill(~valid, -100)
        keep = ids.shape[1]
        logits = lm_forward(self.policy, ids, mask, keep).logits[:, :-1].float()
        self.val_perplexity.update(logits, labels)
        if self.reference_perplexity is None and not self.trainer.sanity_checking:
            with torch.inference_mode():
                ref_logits = lm_forward(self.reference, ids, mask, keep).logits[:, :-1].float()
            self.ref_perplexity.update(ref_logits.clone(), labels)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/perplexity`` and ``val/perplexity_ref`` (the reference's is computed once)."""
        policy_ppl = self.val_perplexity.compute()
        self.val_perplexity.reset()
        if self.trainer.sanity_checking:
            return
        if self.reference_perplexity is None:
            self.reference_perplexity = float(self.ref_perplexity.compute())
            self.ref_perplexity.reset()
        self.log("val/perplexity", policy_ppl, on_epoch=True)
        self.log("val/perplexity_ref", torch.tensor(self.reference_perplexity), on_epoch=True)
        self.log("progress/samples_at_val", torch.tensor(float(self.samples_seen)), on_epoch=True)

    def _encode_texts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        tok = self.tokenizer
        wrapped = [f"{tok.bos_token or ''}{t}{tok.eos_token or ''}" for t in texts]
        limit = getattr(self.policy.config, "n_positions", None) or getattr(
            self.policy.config, "max_position_embeddings", 1024
        )
        tok.truncation_side = "right"
        enc = tok(
            wrapped,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=limit,
            add_special_tokens=False,
        )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store counters; drop the frozen reference (it is rebuilt from the config)."""
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("reference.")
        }
        checkpoint["rlkl_counters"] = {
            "batches_seen": self.batches_seen,
            "samples_seen": self.samples_seen,
            "skipped_batches": self.skipped_batches,
            "skipped_in_a_row": self.skipped_in_a_row,
            "kl_coef": self.kl_coef,
            "reference_perplexity": self.reference_perplexity,
        }
        checkpoint["rlkl_rng"] = self._rng_states()

    def _rng_states(self) -> dict[str, list[Tensor]]:
        """The torch RNG state of every rank: rollouts and minibatch order draw from it.

        Under DDP every rank's state is gathered (all ranks save a checkpoint together), so a
        resumed run continues each rank's own random stream.
        """
        states = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        if self._trainer is None or self.trainer.world_size == 1:
            return {key: [value] for key, value in states.items()}
        strategy = self.trainer.strategy
        return {
            key: list(strategy.all_gather(value.to(strategy.root_device)).cpu().unbind(0))
            for key, value in states.items()
        }

    def on_train_start(self) -> None:
        """Put back the RNG state of a loaded checkpoint, right before the first resumed batch.

        Restored here rather than in ``on_load_checkpoint`` because Lightning draws random
        numbers in between (sanity-check validation, creating the dataloader iterators). A
        fresh multi-process run instead offsets each rank's seed by its rank: ``seed_everything``
        gives every process the same seed, and the ranks would draw the same random numbers for
        their rollouts.
        """
        states, self._rng_to_restore = getattr(self, "_rng_to_restore", None), None
        rank, world = self.trainer.global_rank, self.trainer.world_size
        if states and len(states["cpu"]) == world:
            torch.set_rng_state(states["cpu"][rank])
            if "cuda" in states and self.device.type == "cuda":
                torch.cuda.set_rng_state(states["cuda"][rank], self.device)
            return
        if states:
            rank_zero_warn(
                f"PPOModule: the checkpoint holds the RNG states of {len(states['cpu'])} "
                f"processes but this run has {world}; rollouts continue with fresh random "
                "numbers (training itself resumes correctly)",
                category=RuntimeWarning,
            )
        if world > 1:
            torch.manual_seed((torch.initial_seed() + 104_729 * rank) % 2**63)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore counters and put the current reference weights back for strict loading."""
        state = checkpoint["state_dict"]
        _check_checkpoint_weights(state, self.state_dict())  # before anything is restored
        counters = checkpoint.get("rlkl_counters", {})
        self.batches_seen = int(counters.get("batches_seen", 0))
        self.samples_seen = int(counters.get("samples_seen", 0))
        self.skipped_batches = int(counters.get("skipped_batches", 0))
        self.skipped_in_a_row = int(counters.get("skipped_in_a_row", 0))
        self.kl_coef = float(counters.get("kl_coef", self.kl_coef))
        self.reference_perplexity = counters.get("reference_perplexity")
        self._rng_to_restore = checkpoint.get("rlkl_rng")
        for key, value in self.reference.state_dict().items():
            state.setdefault(f"reference.{key}", value)


def _check_context(policy: torch.nn.Module, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Prompt plus response must fit the policy's context window (``n_positions``)."""
    config = policy.config
    context = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", None
    )
    if context and max_prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"PPOModule: `max_prompt_tokens` ({max_prompt_tokens}) + `max_new_tokens` "
            f"({max_new_tokens}) = {max_prompt_tokens + max_new_tokens} tokens do not fit the "
            f"policy's context of {context} positions; lower them so that their sum is <= "
            f"{context}"
        )


def _check_checkpoint_weights(saved: dict[str, Tensor], current: dict[str, Tensor]) -> None:
    """Raise a clear error if a checkpoint's weights do not belong to this model."""
    ours = {k: v for k, v in current.items() if not k.startswith("reference.")}
    theirs = {k: v for k, v in saved.items() if not k.startswith("reference.")}
    missing = sorted(ours.keys() - theirs.keys())
    unexpected = sorted(theirs.keys() - ours.keys())
    resized = sorted(
        k
        for k in ours.keys() & theirs.keys()
        if hasattr(theirs[k], "shape") and tuple(theirs[k].shape) != tuple(ours[k].shape)
    )
    if missing or unexpected or resized:
        details = "; ".join(
            f"{what}: {keys[:5]}{' ...' if len(keys) > 5 else ''}"
            for what, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("shape differs", resized),
            )
            if keys
        )
        raise ValueError(
            "PPOModule: the checkpoint (`ckpt_path`) was not written for this model "
            f"(policy/value head differ: {details}); resume with the `model` settings it was "
            "trained with, or start a new run without `ckpt_path`"
        )


def _check_args(args: dict[str, Any]) -> None:
    """Validate constructor arguments; every error names the option and the allowed values."""

    def need(ok: bool, option: str, allowed: str) -> None:
        if not ok:
            raise ValueError(f"PPOModule: `{option}` must be {allowed}, got {args[option]!r}")

    finite = math.isfinite
    need(
        args["kl_estimator"] in klmod.KL_ESTIMATORS, "kl_estimator", f"one of {klmod.KL_ESTIMATORS}"
    )
    need(args["lr_schedule"] in LR_SCHEDULES, "lr_schedule", f"one of {LR_SCHEDULES}")
    need(
        finite(args["init_kl_coef"]) and args["init_kl_coef"] >= 0,
        "init_kl_coef",
        "a finite number >= 0",
    )
    for name in (
        "max_prompt_tokens",
        "max_new_tokens",
        "ppo_epochs",
        "num_minibatches",
        "grad_accum_steps",
    ):
        need(isinstance(args[name], int) and args[name] >= 1, name, "an integer >= 1")
    need(
        isinstance(args["top_k"], int) and args["top_k"] >= 0, "top_k", "an integer >= 0 (0 = off)"
    )
    need(
        finite(args["temperature"]) and args["temperature"] > 0,
        "temperature",
        "a finite number > 0",
    )
    need(0 < args["top_p"] <= 1, "top_p", "in (0, 1]")
    for name in ("lr", "cliprange", "cliprange_value"):
        need(finite(args[name]) and args[name] > 0, name, "a finite number > 0")
    for name in ("weight_decay", "vf_coef", "ent_coef"):
        need(finite(args[name]) and args[name] >= 0, name, "a finite number >= 0")
    for name in ("gamma", "lam"):
        need(0 <= args[name] <= 1, name, "in [0, 1]")
    need(args["warmup_batches"] >= 0, "warmup_batches", "an integer >= 0")
    need(args["log_samples_every"] >= 0, "log_samples_every", "an integer >= 0 (0 = never)")
    need(
        args["max_skipped_in_a_row"] is None
        or (isinstance(args["max_skipped_in_a_row"], int) and args["max_skipped_in_a_row"] >= 1),
        "max_skipped_in_a_row",
        "None or an integer >= 1",
    )
    for name in ("score_clip", "max_grad_norm"):
        need(
            args[name] is None or (finite(args[name]) and args[name] > 0),
            name,
            "None or a number > 0",
        )
    if args["top_k"] or args["top_p"] < 1:
        rank_zero_warn(
            "PPOModule: `top_k`/`top_p` truncate the sampling distribution, so the KL estimates "
            "(and the penalty) no longer refer to the policy itself; use top_k=0, top_p=1.0 "
            "for KL-controlled runs",
            category=RuntimeWarning,
        )
