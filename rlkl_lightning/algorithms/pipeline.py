"""RLPipeline: the phases every KL-regularised policy-gradient module shares.

One training batch (a list of prompts) is five phases over one :class:`Trajectory`
(docs/pipeline.md); ``training_step`` reads them top to bottom:

1. :meth:`RLPipeline.rollout` samples responses with the policy (KV cache, left padding) and
   keeps the policy's log-probs, logits and hidden states of its samples (no second pass);
2. :meth:`RLPipeline.score` adds the reference's log-probs, the reward model's scores and the
   per-token KL, and the per-sequence KL of every estimator for the log;
3. :meth:`RLPipeline.shape` turns them into advantages (the algorithm's own: GAE for PPO);
4. :meth:`RLPipeline.update` runs epochs x minibatches x micro-batches of
   :meth:`RLPipeline.loss` (the algorithm's own), with gradient clipping and one optimizer step
   per minibatch;
5. :meth:`RLPipeline.log_batch` logs every metric (docs/metrics.md).

A subclass supplies ``shape`` and ``loss`` (and may extend ``score``), so a new algorithm is a
short file. ``kl_coef`` is a plain attribute: a ``KLControllerCallback`` rewrites it after each
batch; the next batch's rewards or losses use it.

The parts the pipeline is composed of: the skip gates (:mod:`.gates`), held-out perplexity
(:mod:`.validation`), what a checkpoint carries (:mod:`.resume`). The speed-ups
(:mod:`rlkl_lightning.perf`) are applied here and nowhere else: :meth:`RLPipeline.speed_up` to
every model once it is loaded, and the update's threads (:meth:`RLPipeline.update_threads`).
"""

from __future__ import annotations

import inspect
import json
import time
from functools import partial
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.checks import check_context, check_vocabulary, context_of
from rlkl_lightning.algorithms.compiled_update import CompiledUpdate, use_inductor_cache
from rlkl_lightning.algorithms.compiled_update import check as check_compiled_update
from rlkl_lightning.algorithms.gates import (
    SkipBatch,
    any_rank,
    global_max,
    global_sum,
    trajectory_is_finite,
)
from rlkl_lightning.algorithms.losses import entropy_from_logits
from rlkl_lightning.algorithms.memory import PhasePeaks
from rlkl_lightning.algorithms.metrics import (
    batch_metrics,
    gold_scores,
    log_samples_table,
    peak_memory_metrics,
    reward_metrics,
    token_kl_stats,
    top_kl_tokens,
)
from rlkl_lightning.algorithms.mismatch import mismatch_metrics, mismatch_weights
from rlkl_lightning.algorithms.objective import PolicyObjective
from rlkl_lightning.algorithms.options import (
    PIPELINE_GROUPS,
    Engine,
    KLPenalty,
    Logging,
    Models,
    Objective,
    Optimization,
    Safeguards,
    Sampling,
    as_group,
)
from rlkl_lightning.algorithms.reference_refresh import mix_into_reference
from rlkl_lightning.algorithms.resume import (
    COUNTERS,
    check_process_count,
    refreshed_weights,
    restore_rng_states,
    rng_states,
    trained_weights,
    with_frozen_weights,
    with_refreshed_weights,
)
from rlkl_lightning.algorithms.update import OneThread, run_update
from rlkl_lightning.algorithms.validation import HeldoutPerplexity, encode_texts
from rlkl_lightning.checkpoints import plain, plain_hyperparameters
from rlkl_lightning.data.samplers import align_epoch_progress
from rlkl_lightning.kl import estimators as klmod
from rlkl_lightning.kl.loss import within_trust_region
from rlkl_lightning.masked import masked_sum
from rlkl_lightning.migrations import moved_option, renamed_group
from rlkl_lightning.models.forward import no_grad, plain_lm_head_weight
from rlkl_lightning.models.loading import (
    disable_dropout,
    encode,
    freeze,
    load_tokenizer,
    policy_and_reference,
)
from rlkl_lightning.models.logprobs import TokenScores, score_tokens, step_logits
from rlkl_lightning.models.lora import AdaptersOff
from rlkl_lightning.models.packing import check_packable
from rlkl_lightning.models.sharding import shard_models
from rlkl_lightning.perf.gelu import fuse_tanh_gelu
from rlkl_lightning.perf.onednn import resolve, use_onednn
from rlkl_lightning.perf.row_blocks import in_row_blocks
from rlkl_lightning.perf.value_thread import ValueThread, value_thread_on
from rlkl_lightning.rewards import (
    RewardModel,
    RewardShapeError,
    VaderSentimentReward,
    validate_scores,
)
from rlkl_lightning.trajectory import Trajectory

#: On a CPU, rollout logits up to this size are kept: recomputing small ones cost more time
#: than it saved (docs/benchmarks.md, "Memory").
CPU_KEPT_LOGITS_BYTES = 32 * 2**20


def keep_rollout_logits(policy: nn.Module, device: torch.device, rows: int, tokens: int) -> bool:
    """Whether the rollout keeps the policy's ``[rows, tokens, V]`` float32 logits for scoring.

    Otherwise a plain head computes them again in scoring, a step at a time
    (``RLPipeline._logit_diagnostics``), the same numbers without the whole tensor: always off
    the CPU, where memory limits the batch; on a CPU above :data:`CPU_KEPT_LOGITS_BYTES`. An
    unusual head, or a sharded one, always keeps them.
    """
    weight = plain_lm_head_weight(policy)
    if weight is None:
        return True
    size = rows * tokens * weight.shape[0] * 4
    return device.type == "cpu" and size <= CPU_KEPT_LOGITS_BYTES


class RLPipeline(LightningModule):
    """Rollout, scoring, KL, the update loop and logging, shared by PPO and critic-free methods.

    Args:
        policy: Hugging Face causal LM name or local directory; ``"default"`` is the default
            world's SFT model (built on first use).
        tokenizer: tokenizer name or directory; defaults to ``policy``.
        reference: reference model name or directory; defaults to a frozen copy of the policy,
            or with ``models.peft`` to the policy with its adapters switched off (no copy).
        reward: the reward model, called as ``reward(prompts, responses) -> [B]`` scores;
            defaults to the VADER sentiment of the response.
        gold_reward: a second reward model, logged as ``objective/gold_score`` beside the
            trained score and never trained on (the default world's gold sentiment:
            ``rlkl_lightning.world.gold.GoldSentimentReward``); None: none.
        sampling: how responses are sampled (:class:`~.options.Sampling`).
        optimization: the update loop and AdamW (:class:`~.options.Optimization`).
        objective: the policy objective (:class:`~.options.Objective`).
        penalty: where and how the KL enters the update (:class:`~.options.KLPenalty`).
        models: how the models are loaded and run (:class:`~.options.Models`).
        safeguards: score clipping and the limit of skipped batches
            (:class:`~.options.Safeguards`).
        logging: the samples table and the per-token KL diagnostics
            (:class:`~.options.Logging`).
        engine: what samples the responses: the native loop, its compiled decode step, vLLM
            or an engine of your own (:class:`~.options.Engine`, :mod:`.engines`).
    """

    #: The name messages give the module (its options are named in them too).
    owner: ClassVar[str] = "RLPipeline"
    #: The models sharded as FSDP units under ``FSDPStrategy`` (:func:`.shard_models`).
    sharded_models: ClassVar[tuple[str, ...]] = ("policy", "reference")

    # The counters (:data:`~rlkl_lightning.algorithms.resume.COUNTERS`), kept in checkpoints:
    batches_seen: int  #: training batches done (skipped ones included)
    samples_seen: int  #: prompts (responses, for RLOO) trained on, summed over ranks
    skipped_batches: int  #: batches whose update was skipped (:mod:`.gates`)
    skipped_in_a_row: int  #: skips since the last trained batch
    reference_refreshes: int  #: refreshes of the reference (:meth:`refresh_reference`)
    last_refresh_batch: int  #: ``batches_seen`` at the last refresh (0: none)

    def __new__(cls, *args: Any, **kwargs: Any):
        """Refuse an option by its name of an older version (``kl=``), naming today's.

        Python's own error would name the argument only; an argument a subclass takes under
        that name is its own, and passes.
        """
        own = inspect.signature(cls.__init__).parameters
        for name in kwargs:
            new = renamed_group(name) or moved_option(name)
            if new is not None and name not in own:
                raise TypeError(
                    f"{cls.__name__}: `{name}` is now `{new}` (docs/options.md, 'Migration')"
                )
        return super().__new__(cls)

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
    ):
        super().__init__()
        groups = {k: v for k, v in locals().items() if k in PIPELINE_GROUPS}
        for name, value in groups.items():
            setattr(self, name, as_group(PIPELINE_GROUPS[name], value, name))
        self._check_joint_options()
        for name in COUNTERS:
            setattr(self, name, 0)
        #: The ``state_dict`` keys a refresh changed, saved in checkpoints beside the trained ones.
        self.refreshed_keys: list[str] = []
        #: Log ``reference/refreshes`` (a ``ReferenceRefresh`` callback turns it on).
        self.log_reference_refreshes = False
        self.heldout = HeldoutPerplexity()
        self.heldout_test = HeldoutPerplexity()  # a data module's second loader: test text
        #: What samples the responses, picked once (:mod:`.engines`); started at fit start.
        self.rollout_engine = self.engine.build()
        #: Seconds of the last rollout's weight push (``perf/push_s``).
        self.push_s = 0.0
        #: The phases' peak memory during a training step (None outside one: no reset).
        self.phase_peaks: PhasePeaks | None = None
        #: Counts changes of the policy's weights; an engine that holds an older one gets a push.
        self.weights_version = 0
        self.threads: OneThread | ValueThread = OneThread()
        #: The compiled update's pass (``optimization.compile``), built at fit start; else None.
        self.compiled_update: CompiledUpdate | None = None
        self.save_hyperparameters(ignore=["reward", "gold_reward"])  # objects, not settings
        # LightningCLI saves a subclass's own arguments as the hyperparameters; the record must
        # be the options this module was built with, as plain values: checkpoints load with
        # weights_only=True. The options are read from the groups, never from `hparams`.
        objects = {"policy": policy, "tokenizer": tokenizer, "reference": reference}
        self.hparams.update(plain({**objects, **{k: getattr(self, k) for k in groups}}))
        self.automatic_optimization = False
        #: The policy objective (surrogate, entropy bonus, KL term, aggregation).
        self.policy_objective = PolicyObjective(
            self.objective,
            self.penalty,
            self.sampling.temperature,
            packing=self.optimization.packing,
        )

        trust = {"trust_remote_code": self.models.trust_remote_code}
        self.tokenizer = load_tokenizer(
            tokenizer or policy, "tokenizer" if tokenizer else "policy", **trust
        )
        self.policy, self.reference = policy_and_reference(
            policy,
            reference,
            self.models.peft,
            self.models.gradient_checkpointing,
            prepare=self.speed_up,
            **trust,
        )
        check_vocabulary(self.owner, self.policy, self.reference)
        check_context(
            self.owner, self.policy, self.sampling.max_prompt_tokens, self.sampling.max_new_tokens
        )
        self.reward = reward if reward is not None else VaderSentimentReward()
        self.gold_reward = gold_reward
        self.kl_coef = float(self.penalty.init_coef)

    def _check_joint_options(self) -> None:
        """The rules that join two groups, or a group and this machine; before models load."""
        if self.sampling.truncated:
            rank_zero_warn(
                f"{self.owner}: `sampling.top_k`/`sampling.top_p` truncate the sampling "
                "distribution, so the KL estimates (and the penalty) no longer refer to the "
                "policy itself; use top_k=0, top_p=1.0 for KL-controlled runs",
                category=RuntimeWarning,
            )

    # ------------------------------------------------------------------ set-up
    def speed_up(self, model: torch.nn.Module) -> None:
        """Apply the speed-ups to a model of this module, once, right after it is loaded.

        The one place they are applied: GPT-2's tanh GELU in one fused kernel (always; equal to
        float rounding), and where ``cpu_matmul`` resolves to ``onednn`` the float32 CPU
        products by oneDNN.
        """
        fuse_tanh_gelu(model)
        if resolve(self.models.cpu_matmul) == "onednn":
            use_onednn(model)

    def update_threads(self) -> OneThread | ValueThread:
        """Where the update's parts run: with :meth:`helper_thread_parameters`, two threads."""
        params = self.helper_thread_parameters()
        return OneThread() if params is None else ValueThread(self.device.type, params)

    def helper_thread_parameters(self) -> list[Tensor] | None:
        """The parameters of a network whose part of the update runs in a helper thread.

        None (the default): everything runs in the calling thread.
        """
        return None

    def helper_loss(self, minibatch: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss term of :meth:`helper_thread_parameters`' network alone, and its statistics.

        What the compiled update runs as a graph of its own in the helper thread
        (:class:`~rlkl_lightning.algorithms.compiled_update.CompiledUpdate`); the policy's
        graph is :meth:`loss` without it. Only a module with a helper network has one.
        """
        raise NotImplementedError(f"{self.owner} has no network that runs in a helper thread")

    def value_thread_on(self, setting: bool | None, separate_model: bool) -> bool:
        """Whether a separate value model runs in a helper thread in this run (at fit start).

        ``setting`` (``ppo.value_model_thread``), or where it helps if None: the speed-up
        decides (:func:`~rlkl_lightning.perf.value_thread.value_thread_on`) from this run's
        strategy and device. With ``optimization.compile`` each thread runs a compiled graph.
        """
        strategy = self.trainer.strategy
        return value_thread_on(setting, separate_model, strategy, self.device.type, self.owner)

    @override
    def configure_optimizers(self):
        """AdamW over every trainable parameter (policy, value function if any)."""
        params = [p for p in self.parameters() if p.requires_grad]
        # The fused kernel does one pass per tensor instead of a dozen (same update rule).
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        optimizer = torch.optim.AdamW(
            params,
            lr=self.optimization.lr,
            weight_decay=self.optimization.weight_decay,
            fused=fused,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    @override
    def configure_model(self) -> None:
        """Under ``FSDPStrategy``, make each model an FSDP unit (sharding.py); else nothing."""
        shard_models(self, self.sharded_models)
        if isinstance(self.reference, AdaptersOff):
            self.reference.model = self.policy  # the sharded policy, adapters off

    def _lr_factor(self, batch: int) -> float:
        warmup = self.optimization.warmup_batches
        if warmup and batch < warmup:
            return (batch + 1) / warmup
        if self.optimization.lr_schedule == "linear" and self._trainer is not None:
            total = max(int(self.trainer.estimated_stepping_batches), 1)
            return max(0.0, 1.0 - (batch - warmup) / max(total - warmup, 1))
        return 1.0

    @override
    def on_fit_start(self) -> None:
        """Keep the frozen models frozen and the rewards on our device; start the engine.

        With ``optimization.compile``, the compiled update's checks and its pass; with it or
        ``engine.compiled_decode``, inductor's cache under the library's.

        Every rank starts its engine here, at the same point (vLLM's start is a collective).
        """
        if isinstance(self.reference, torch.nn.Module):  # else: the policy, adapters off
            freeze(self.reference)
        disable_dropout(self.policy)
        if self.optimization.packing == "packed":  # refused here, not at the first loss
            for name in ("policy", "value_trunk"):
                if getattr(self, name, None) is not None:
                    check_packable(getattr(self, name))
        for reward in (self.reward, self.gold_reward):
            if hasattr(reward, "to"):
                reward.to(self.device)
        if self.optimization.compile or self.engine.compiled_decode:
            use_inductor_cache()  # before anything compiles
        if self.optimization.compile:
            check_compiled_update(self)
            sampling = self.sampling
            self.compiled_update = CompiledUpdate(
                sampling.max_prompt_tokens, sampling.max_new_tokens
            )
        self.rollout_engine.start(self)

    @override
    def teardown(self, stage: str) -> None:
        """Close the rollout engine (it starts again if this module samples once more)."""
        self.rollout_engine.close()

    def refresh_reference(self, alpha: float = 1.0) -> None:
        """``reference <- alpha x policy + (1 - alpha) x reference``; ``alpha = 1``: a copy.

        Counted in ``reference_refreshes``; the changed weights go into checkpoints, and the
        reference's held-out perplexity is measured again at the next validation
        (:mod:`.reference_refresh`).
        """
        changed = mix_into_reference(self.policy, self.reference, alpha)
        self.refreshed_keys = sorted(set(self.refreshed_keys) | set(changed))
        self.reference_refreshes += 1
        self.last_refresh_batch = self.batches_seen
        self.weights_version += 1  # LoRA: the base weights moved (the policy did not)
        self.heldout.reference_perplexity = None
        self.heldout_test.reference_perplexity = None

    # ------------------------------------------------------------------ the pipeline
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """One batch of prompts through the five phases (module docstring)."""
        prompts = list(batch["prompt"])
        clock = [time.perf_counter()]
        self._batch_failed = None  # a reward that marks failures: this batch's, once counted
        self.phase_peaks = memory = PhasePeaks(self.device)
        try:
            memory.enter("rollout")
            traj, policy_scores = self.rollout(prompts)  # 1. rollout
            clock.append(time.perf_counter())
            memory.enter("score")
            traj, responses, diagnostics = self.score(prompts, traj, policy_scores)  # 2. score
            traj = self.shape(traj)  # 3. shape
            self.gate(
                not trajectory_is_finite(traj),
                "log-probs, values, advantages or returns are not finite",
            )
            clock.append(time.perf_counter())
            memory.enter("update")
            stats = self.update(traj)  # 4. update
            clock.append(time.perf_counter())
        except SkipBatch as skip:
            self._skip(str(skip))
            return
        finally:
            memory.stop()
            self.phase_peaks = None  # no reset of the peaks outside a training step
        self.log_batch(prompts, responses, traj, diagnostics, stats, clock, memory.peaks)  # 5.

    def rollout(self, prompts: list[str]) -> tuple[Trajectory, TokenScores]:
        """Phase 1: sample a response per prompt; the policy's scores of them come along.

        The engine (``engine.kind``) gets the policy's weights first if it holds its own and
        they changed; an engine other than the native loop keeps its own log-probs as
        ``sampler_logprobs`` beside the trainer's.
        """
        prompt_ids, prompt_mask = self._encode_prompts(prompts)
        rows, tokens = len(prompts), self.sampling.max_new_tokens
        keep = keep_rollout_logits(self.policy, self.device, rows, tokens)
        measured = self.phase_peaks is not None and not self.rollout_engine.shares_weights
        if measured:  # the push's memory apart from the sampling's
            self.phase_peaks.enter("push")
        start = time.perf_counter()
        self.rollout_engine.push(self)
        self.push_s = time.perf_counter() - start
        if measured:
            self.phase_peaks.enter("rollout")
        return self.rollout_engine.sample(self, prompt_ids, prompt_mask, keep)

    def score(
        self, prompts: list[str], traj: Trajectory, policy_scores: TokenScores
    ) -> tuple[Trajectory, list[str], dict[str, Tensor]]:
        """Phase 2: reference log-probs, reward scores and the per-token KL.

        Returns:
            The trajectory with ``ref_logprobs``, ``scores`` and ``kl`` set; the decoded
            responses; and the per-sequence KL ``[B]`` of every estimator (``kl_k1``, ...),
            the policy's summed token entropy (``entropy_sum``, from the full logits that are
            dropped after this phase), with a ``gold_reward`` its scores (``gold``), and with
            ``kl_token_threshold`` the ``kl_tokens/*`` diagnostics and the ``[B, R]`` per-token
            KL (``token_kl``); with ``penalty.trust_region`` the per-sequence KL of the tokens
            inside it (``penalized_kl``, ``[B]``) and the count of those outside
            (``outside_tokens``).
            Where another engine sampled (``sampler_logprobs``), the trajectory also carries
            ``engine.correction``'s ``mismatch_weights`` and the diagnostics the ``mismatch/*``
            metrics (docs/mismatch.md).
            With a reward that marks failed samples, the diagnostics hold them (``failed``,
            ``[B]`` bool; their scores are ``nan``), and where one failed on any rank the
            trajectory's ``sample_mask`` leaves them out of what follows but the KL.
        """
        mask = traj.response_mask
        ids, valid = traj.response_ids.cpu(), mask.bool().cpu()  # one copy off a GPU, not B
        responses = [
            self.tokenizer.decode(row[m], skip_special_tokens=True)
            for row, m in zip(ids, valid, strict=True)
        ]
        pending = self._start_reward(prompts, responses)  # a remote reward works meanwhile
        with no_grad(self.reference):
            ref = score_tokens(self.reference, traj, self.sampling.temperature)
        # The logits only feed the no-grad exact KL below: an inference tensor is fine there,
        # and a copy of [B, R, V] is not (it is a large share of this phase's peak memory).
        ref_logits, ref_logprobs = ref.logits, ref.logprobs.clone()
        scores, failed = self._reward_scores(prompts, responses, pending)
        sample_mask = self._mask_failed(failed)
        measured = klmod.kl_estimator(self.penalty.estimator).name  # a plugged one: its own name
        per_token = {  # every registered estimator with a formula, and a plugged one
            name: estimator.per_token(traj.logprobs, ref_logprobs)
            for name, estimator in klmod.sample_estimators(self.penalty.estimator).items()
        }
        exact, entropy = self._logit_diagnostics(policy_scores, ref_logits)
        per_token["exact"] = exact
        kl = per_token[measured]
        diagnostics = {f"kl_{k}": klmod.sequence_kl(v, mask) for k, v in per_token.items()}
        if self.logging.kl_token_threshold is not None:  # collectives: every rank computes them
            diagnostics.update(self._token_kl_stats(per_token["k1"], kl, mask))
            diagnostics["token_kl"] = kl  # [B, R] for the samples table
        if self.penalty.trust_region is not None:  # the penalty only; the measured KL is whole
            inside = within_trust_region(per_token["k1"], self.penalty.trust_region)
            kl = kl * inside
            diagnostics["penalized_kl"] = klmod.sequence_kl(kl, mask)  # [B], inside only
            diagnostics["outside_tokens"] = masked_sum(1 - inside, mask)  # left out of it
        self.gate(
            not bool(torch.isfinite(diagnostics[f"kl_{measured}"]).all()),
            "the KL to the reference is not finite (on this or another rank)",
        )
        diagnostics["entropy_sum"] = masked_sum(entropy, mask)
        diagnostics.update(gold_scores(self.gold_reward, prompts, responses, self.owner))
        traj = traj._replace(ref_logprobs=ref_logprobs, kl=kl, scores=scores)
        if failed is not None:  # a reward that marks failed samples (RemoteReward)
            diagnostics["failed"] = failed
            traj = traj._replace(sample_mask=sample_mask)
        if traj.sampler_logprobs is not None:  # another engine sampled: its gap to the trainer
            traj, gap = self._mismatch(traj)
            diagnostics.update(gap)
        return traj, responses, diagnostics

    def _mismatch(self, traj: Trajectory) -> tuple[Trajectory, dict[str, Tensor]]:
        """The correction's weights in the trajectory, and the ``mismatch/*`` metrics."""
        engine = self.engine
        weights, corrected = mismatch_weights(traj, engine.correction, engine.correction_threshold)
        gap = mismatch_metrics(
            traj, corrected, partial(global_sum, self._trainer), partial(global_max, self._trainer)
        )
        return traj._replace(mismatch_weights=weights), gap

    def _logit_diagnostics(self, policy: TokenScores, ref_logits: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, R]`` exact KL to the reference and policy entropy, from the full logits.

        Without the rollout's logits, the policy's are computed again one step at a time
        (:func:`~rlkl_lightning.models.logprobs.step_logits`), each dropped once used.
        """
        if policy.logits is not None:
            return (
                in_row_blocks(klmod.exact_kl, policy.logits, ref_logits),
                in_row_blocks(entropy_from_logits, policy.logits),
            )
        temperature = self.sampling.temperature
        exact, entropy = [], []
        with torch.no_grad():
            for step in range(ref_logits.shape[1]):
                logits = step_logits(self.policy, policy.hidden, step, temperature)
                exact.append(in_row_blocks(klmod.exact_kl, logits, ref_logits[:, step]))
                entropy.append(in_row_blocks(entropy_from_logits, logits))
        return torch.stack(exact, dim=1), torch.stack(entropy, dim=1)

    def shape(self, traj: Trajectory) -> Trajectory:
        """Phase 3: advantages (and returns) from scores, KL and ``kl_coef``; per algorithm."""
        raise NotImplementedError

    def loss(self, minibatch: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one (micro-)minibatch and its detached statistics: the policy objective.

        The objective makes the per-token terms one number as the loss aggregation says
        (:meth:`~rlkl_lightning.algorithms.objective.PolicyObjective.reduce`; the token mean
        unless the update weighed the tokens). An algorithm with a loss term of its own (PPO's
        value loss) passes it as the objective's ``extra``, reduced the same way.
        """
        return self.policy_objective(self.policy, minibatch, self.kl_coef, self.threads.defer)

    @property
    def reward_kl_coef(self) -> float:
        """Beta in the reward: ``kl_coef`` with ``penalty.placement="reward"``, else 0."""
        return self.kl_coef if self.penalty.placement == "reward" else 0.0

    def global_sum(self, values: Tensor) -> Tensor:
        """``values`` summed over every rank (a collective under DDP: call it on every rank)."""
        return global_sum(self._trainer, values)

    def update(self, traj: Trajectory) -> dict[str, Tensor]:
        """Phase 4: ``ppo_epochs`` x ``num_minibatches`` optimizer steps over the trajectory.

        Each minibatch's loss aggregates its per-token terms as ``loss_aggregation`` says; the
        returned statistics are means over the optimizer steps. With a ``sample_mask`` (failed
        rewards), on the samples it keeps alone.
        """
        if traj.sample_mask is not None:  # failed rewards: the scored samples alone
            traj = traj.select(traj.sample_mask.nonzero().flatten())
        with self.update_threads() as self.threads:
            try:
                return run_update(self, traj)
            finally:
                self.threads = OneThread()
                self.weights_version += 1  # the rollout engine needs them again

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, and the helper thread's part of it, if any, done."""
        super().backward(loss, *args, **kwargs)
        self.threads.wait()

    def log_batch(
        self,
        prompts: list[str],
        responses: list[str],
        traj: Trajectory,
        diagnostics: dict[str, Tensor],
        stats: dict[str, Tensor],
        clock: list[float],
        phase_peaks: dict[str, int] | None = None,
    ) -> None:
        """Phase 5: count the batch and log every metric (docs/metrics.md).

        ``phase_peaks``: the peak bytes of each phase on this rank
        (:class:`~rlkl_lightning.algorithms.memory.PhasePeaks`), logged per rank.
        """
        n = len(prompts)
        distributed = self.trainer.world_size > 1
        self.batches_seen += 1
        self.skipped_in_a_row = 0
        if distributed:  # ranks may hold different numbers of prompts (a data module's choice)
            count = torch.tensor([float(n)], dtype=torch.float64, device=self.device)
            self.samples_seen += int(global_sum(self._trainer, count).item())
        else:
            self.samples_seen += n
        metrics = batch_metrics(
            traj,
            diagnostics,
            klmod.kl_estimator(self.penalty.estimator).name,
            self.kl_coef,
            clock,
            partial(global_sum, self._trainer),
            distributed,
        )
        if "failed" in diagnostics:  # a reward that marks failures: how it went
            client = getattr(self.reward, "last_stats", {}) or {}
            kl = diagnostics[f"kl_{klmod.kl_estimator(self.penalty.estimator).name}"]
            metrics.update(reward_metrics(diagnostics["failed"], client, self.global_sum, kl))
        metrics[keys.SAMPLES] = torch.tensor(float(self.samples_seen), dtype=torch.float32)
        skipped = torch.tensor(float(self.skipped_batches), dtype=torch.float32)
        metrics[keys.SKIPPED_BATCHES] = skipped
        if self.log_reference_refreshes:
            metrics[keys.REFERENCE_REFRESHES] = torch.tensor(float(self.reference_refreshes))
        prefixes = ("kl_tokens/", "mismatch/")
        metrics.update({k: v for k, v in diagnostics.items() if k.startswith(prefixes)})
        metrics.update(stats)
        own_weights = not self.rollout_engine.shares_weights  # vLLM: pushes, its own memory
        if own_weights:
            metrics[keys.PUSH_S] = torch.tensor(self.push_s, dtype=torch.float32)
        self.log_dict(
            {k: torch.as_tensor(v, dtype=torch.float32) for k, v in metrics.items()},
            on_step=True,
            on_epoch=False,
            batch_size=n,
            sync_dist=distributed,
        )
        # Every rank holds every rank's values (one collective).
        peaks = peak_memory_metrics(
            self.global_rank,
            self.trainer.world_size,
            self.device,
            self.global_sum,
            phase_peaks,
            process=own_weights or self.logging.peak_memory,
        )
        self.log_dict(peaks, on_step=True, on_epoch=False, batch_size=n, sync_dist=False)
        if self.global_rank == 0:
            top_kl = None
            if self.logging.kl_token_threshold is not None:

                def top_kl(rows: int) -> list[str]:
                    return top_kl_tokens(
                        self.tokenizer,
                        traj.response_ids,
                        diagnostics["token_kl"],
                        traj.response_mask,
                        rows,
                    )

            gold = diagnostics.get("gold")
            log_samples_table(self, prompts, responses, traj.scores, gold, top_kl)

    # ------------------------------------------------------------------ pieces of the phases
    def _token_kl_stats(self, log_ratio: Tensor, kl: Tensor, mask: Tensor) -> dict[str, Tensor]:
        return token_kl_stats(
            log_ratio,
            kl,
            mask,
            self.logging.kl_token_threshold,
            partial(global_sum, self._trainer),
            partial(global_max, self._trainer),
        )

    def _encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        if not getattr(self, "_warned_truncation", False):
            limit = self.sampling.max_prompt_tokens
            longest = max(len(ids) for ids in self.tokenizer(prompts)["input_ids"])
            if longest > limit:
                self._warned_truncation = True
                rank_zero_warn(
                    f"{self.owner}: a prompt of {longest} tokens is longer than "
                    f"`sampling.max_prompt_tokens`={limit}; prompts are cut on the left to "
                    f"their last {limit} tokens (warned once)",
                    category=RuntimeWarning,
                )
        ids, mask = encode(self.tokenizer, prompts, "left", self.sampling.max_prompt_tokens)
        return ids.to(self.device), mask.to(self.device)

    def _start_reward(self, prompts: list[str], responses: list[str]) -> Any:
        """A remote reward's requests, sent now (its ``submit``); None: score in place."""
        submit = getattr(self.reward, "submit", None)
        if not callable(submit):
            return None
        try:
            return submit(prompts, responses)
        except (ValueError, RuntimeError, OSError) as err:
            return partial(_raise, err)  # the error is handled where the scores are read

    def _reward_scores(
        self, prompts: list[str], responses: list[str], pending: Any = None
    ) -> tuple[Tensor, Tensor | None]:
        """The reward model's ``[B]`` scores on our device, clipped; skips or stops on faults.

        A ``ValueError``/``RuntimeError`` skips the batch (a wrong shape stops the run). An
        ``OSError`` (``ConnectionError``, ``TimeoutError``: a remote reward that cannot be
        reached) stops the run on every rank with a ``RuntimeError`` naming the batch: skipping
        would train on nothing for as long as the outage lasts. The last checkpoint stays as it
        was (a checkpoint is written only after its batch), so ``--ckpt_path last`` continues.

        Returns:
            The scores, and with a reward that marks failed samples (``marks_failures``:
            ``nan`` where one failed) the ``[B]`` bool of those (their scores stay ``nan``);
            else None.
        """
        error: Exception | None = None
        failed = None
        try:
            raw = pending() if pending is not None else self.reward(prompts, responses)
            if getattr(self.reward, "marks_failures", False):
                raw = torch.as_tensor(raw, dtype=torch.float32).detach().cpu()
                failed = ~torch.isfinite(raw)
                scores = validate_scores(raw.masked_fill(failed, 0.0), len(prompts), self.reward)
                scores = scores.masked_fill(failed, float("nan"))
            else:
                scores = validate_scores(raw, len(prompts), self.reward)
        except (ValueError, RuntimeError, OSError) as err:
            scores, error = None, err
        if any_rank(self._trainer, error is not None):
            if any_rank(self._trainer, isinstance(error, OSError)):
                cause = f"{type(error).__name__}: {error}" if error else "on another rank"
                raise RuntimeError(
                    f"{self.owner}: the reward model could not be reached at batch "
                    f"{self.batch_number} ({cause}); the run stops (a skip would train on "
                    "nothing while it is down). The last checkpoint is kept: once the reward "
                    "answers, continue with the same command plus `--ckpt_path last`"
                ) from error
            # A wrong shape is a broken reward model, not a numeric fault: stop (on every
            # rank) rather than skip every batch of the run.
            if any_rank(self._trainer, isinstance(error, RewardShapeError)):
                raise ValueError(
                    f"{self.owner}: `reward` must return one finite score per (prompt, response) "
                    f"pair, shape [{len(prompts)}]: {error or 'failed on another rank'}"
                ) from error
            raise SkipBatch(f"the reward model failed: {error or 'on another rank'}")
        scores = scores.to(self.device)
        clip = self.safeguards.score_clip
        if clip is not None:
            scores = scores.clamp(-clip, clip)
        return scores, (None if failed is None else failed.to(self.device))

    @property
    def batch_number(self) -> int:
        """The training batch under way, counted from 1: trained and skipped batches before it."""
        return self.batches_seen + self.skipped_batches + 1

    def _mask_failed(self, failed: Tensor | None) -> Tensor | None:
        """The samples to train on where a reward failed on any rank (None: all of them).

        Skips the batch (beta unchanged) when the failed share of all ranks' samples is above
        ``safeguards.max_failed_fraction``. Collectives only with a reward that marks failures.
        """
        if failed is None:
            return None
        counts = torch.stack([failed.sum(), torch.tensor(failed.numel(), device=failed.device)])
        n_failed, n = (int(x) for x in self.global_sum(counts.to(torch.float64)))
        self._batch_failed = failed  # every rank gets here: a skip logs its reward/* too
        if not n_failed:
            return None
        share, limit = n_failed / n, self.safeguards.max_failed_fraction
        stats = getattr(self.reward, "last_stats", {}) or {}
        why = (stats.get("errors") or ["unknown"])[0]
        self.gate(
            share > limit,
            f"the rewards of {n_failed} of {n} samples failed ({why}), more than "
            f"`safeguards.max_failed_fraction`={limit}",
        )
        # A rank with no scored sample would make fewer collectives in the update than the
        # others (its statistics have no loss terms); with none anywhere there is nothing to learn.
        self.gate(
            bool(failed.all()),
            f"the rewards of every sample of a rank failed ({why}; {n_failed} of {n} in all)",
        )
        if not getattr(self, "_warned_failed", False):
            self._warned_failed = True
            rank_zero_warn(
                f"{self.owner}: the rewards of {n_failed} of {n} samples failed at batch "
                f"{self.batch_number} ({why}); they are left out of the advantages, the "
                "losses and the KL the controller reads (warned once; `reward/failed_fraction` "
                "counts every batch's, `reward/failed_kl` their KL)",
                category=RuntimeWarning,
            )
        return ~failed

    def gate(self, bad: bool, why: str) -> None:
        """Skip the batch if ``bad`` on any rank (a collective under DDP: call it on every rank).

        The gradients of a half-done update are dropped, so weights and optimizer stay untouched.
        """
        if any_rank(self._trainer, bad):
            if self._trainer is not None:
                self.optimizers().zero_grad(set_to_none=True)
            raise SkipBatch(why)

    def _skip(self, why: str) -> None:
        """Skip this batch's update: weights and beta stay as they are.

        The KL is logged as ``nan`` for this batch, so KL callbacks see that there is no
        usable value (they keep beta and count the batch) even when the very first batch is
        skipped; ``progress/skipped_batches`` counts the skips.
        """
        self.skipped_batches += 1
        self.skipped_in_a_row += 1
        limit = self.safeguards.max_skipped_in_a_row
        if limit is not None and self.skipped_in_a_row >= limit:
            # Every rank skipped the same batches (the decision is agreed), so all stop here.
            raise RuntimeError(
                f"{self.owner}: {self.skipped_in_a_row} batches in a row were skipped, the last "
                f"because {why}; stopping (`safeguards.max_skipped_in_a_row`={limit}). Fix the "
                "cause, or set `safeguards.max_skipped_in_a_row` higher or to None. Weights and "
                "beta are those of the last trained batch."
            )
        rank_zero_warn(
            f"{self.owner}: skipping batch {self.batch_number - 1}: {why}; kl_coef is unchanged "
            f"({self.skipped_batches} batches skipped so far)",
            category=RuntimeWarning,
        )
        # float32 whatever the default dtype (bf16-true makes bf16 the default inside steps).
        nan = torch.tensor(float("nan"), dtype=torch.float32)
        skipped = torch.tensor(float(self.skipped_batches), dtype=torch.float32)
        # The same sync flag as the regular logging: Lightning rejects a key logged with
        # different arguments within an epoch (a skip under DDP would end the run).
        metrics = {keys.KL: nan, keys.KL_PER_TOKEN: nan}
        metrics[keys.SKIPPED_BATCHES] = skipped
        failed = getattr(self, "_batch_failed", None)
        if failed is not None:  # the batches with the most failures log theirs too
            client = getattr(self.reward, "last_stats", {}) or {}
            reward = reward_metrics(failed, client, self.global_sum)
            metrics.update({k: v.to(torch.float32).cpu() for k, v in reward.items()})
        sync = self.trainer.world_size > 1
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, sync_dist=sync)

    # ------------------------------------------------------------------ validation
    @override
    def validation_step(
        self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Accumulate held-out perplexity of the policy (and of the reference, once).

        A second validation loader (a data module's test text) has sums of its own.
        """
        max_length = context_of(self.policy) or 1024
        ids, mask = encode_texts(self.tokenizer, list(batch["text"]), max_length)
        ids, mask = ids.to(self.device), mask.to(self.device)
        heldout = self.heldout_test if dataloader_idx == 1 else self.heldout
        heldout.update(self.policy, self.reference, ids, mask, self.trainer.sanity_checking)

    @override
    def on_validation_epoch_end(self) -> None:
        """Log ``val/perplexity`` and ``val/perplexity_ref`` (the reference's is computed once).

        With a second loader also ``test/perplexity`` and ``test/perplexity_ref``.
        """
        sanity = self.trainer.sanity_checking
        result = self.heldout.compute(sanity)
        tested = int(self.heldout_test.policy_nll.n_tokens) > 0
        test = self.heldout_test.compute(sanity) if tested else None  # resets its sums too
        if result is None:
            return
        policy_ppl, reference_ppl = result
        self.log(keys.PERPLEXITY, policy_ppl, on_epoch=True)
        self.log(keys.PERPLEXITY_REF, torch.tensor(reference_ppl), on_epoch=True)
        self.log(keys.SAMPLES_AT_VAL, torch.tensor(float(self.samples_seen)), on_epoch=True)
        if test is not None:
            policy_ppl, reference_ppl = test
            self.log(keys.TEST_PERPLEXITY, policy_ppl, on_epoch=True)
            self.log(keys.TEST_PERPLEXITY_REF, torch.tensor(reference_ppl), on_epoch=True)

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store counters, RNG states, plain hparams; drop the reference and frozen weights.

        Beta is the KL controller callback's state (without one it is ``penalty.init_coef``).
        """
        plain_hyperparameters(checkpoint)
        if self.refreshed_keys:  # the reference differs from the one the config builds
            checkpoint["rlkl_reference"] = refreshed_weights(
                checkpoint["state_dict"], self.refreshed_keys
            )
        if not isinstance(getattr(self._trainer, "strategy", None), FSDPStrategy):
            # FSDPStrategy loads the weights strictly before on_load_checkpoint could put the
            # frozen ones back: under it they stay in the file.
            checkpoint["state_dict"] = trained_weights(self, checkpoint["state_dict"])
        checkpoint["rlkl_counters"] = {
            **{name: getattr(self, name) for name in COUNTERS},
            "reference_perplexity": self.heldout.reference_perplexity,
            "test_reference_perplexity": self.heldout_test.reference_perplexity,
        }
        checkpoint["rlkl_rng"] = rng_states(self._trainer, self.device)
        info = getattr(self.reward, "server_info", None)
        if info:  # what a remote reward's server said it serves, checked on resume
            checkpoint["rlkl_reward_server"] = json.dumps(info, sort_keys=True)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check the weights fit, restore the counters, put the (refreshed) frozen weights back."""
        refreshed = checkpoint.get("rlkl_reference") or {}
        if "state_dict" in checkpoint:  # FSDPStrategy loaded it already, whole (on_save_checkpoint)
            with_refreshed_weights(self, checkpoint["state_dict"], refreshed, self.owner)
            with_frozen_weights(self, checkpoint["state_dict"], self.owner)
        self.refreshed_keys = sorted(refreshed)
        counters = checkpoint.get("rlkl_counters", {})
        for name in COUNTERS:
            setattr(self, name, int(counters.get(name, 0)))
        self.heldout.reference_perplexity = counters.get("reference_perplexity")
        self.heldout_test.reference_perplexity = counters.get("test_reference_perplexity")
        self.weights_version += 1  # the rollout engine gets the loaded weights
        self._rng_to_restore = checkpoint.get("rlkl_rng")
        check_reward_server(checkpoint.get("rlkl_reward_server"), self.reward, self.owner)

    @override
    def on_train_start(self) -> None:
        """Put back a checkpoint's RNG state and data place, before the first resumed batch."""
        states, self._rng_to_restore = getattr(self, "_rng_to_restore", None), None
        untested = []  # where another number of processes than the checkpoint's is not built
        if isinstance(self.trainer.strategy, FSDPStrategy):
            untested.append("FSDP")
        if not self.rollout_engine.shares_weights:
            untested.append("an engine with weights of its own (vLLM)")
        where = " and ".join(untested) or None
        check_process_count(states, self.trainer.world_size, where, self.owner)
        restore_rng_states(states, self.trainer, self.device, self.owner)
        align_epoch_progress(self.trainer)


def _raise(error: Exception) -> None:
    raise error


def check_reward_server(saved: str | None, reward: Any, owner: str) -> None:
    """Refuse to resume against a reward server that serves another reward than the checkpoint's.

    ``saved`` is the server's info (JSON) a checkpoint recorded; None: it recorded none.
    """
    info = getattr(reward, "server_info", None)
    if saved is None or not info:
        return
    before, now = json.loads(saved), info
    if before != now:
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        lines = "; ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise ValueError(
            f"{owner}: the reward server at {getattr(reward, 'url', '?')} serves another reward "
            f"than the checkpoint was trained with ({lines}); serve the checkpoint's reward to "
            "resume, or start a new run"
        )
