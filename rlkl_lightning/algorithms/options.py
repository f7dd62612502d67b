"""The options of the RL modules, in typed groups: each group validates itself, naming its field.

:class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` takes the model objects (policy,
tokenizer, reference, reward, gold reward) and these groups; PPO adds :class:`PPOOptions`,
RLOO/GRPO :class:`GroupOptions`. In a YAML config each group is one block under
``model.init_args`` (``sampling: {top_p: 0.9}``); on the command line a field is
``--model.init_args.sampling.top_p=0.9``. A group's error names its field as
``group.field``; the command line adds the path above it. The rules that join two groups (or a
group and a loaded model) live with the pipeline (``RLPipeline._check_joint``).

Groups are frozen: a module's options do not change under it. To run with another value,
build the group again (``dataclasses.replace(module.sampling, top_p=0.9)``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from rlkl_lightning.algorithms.advantage_estimators import advantage_spec
from rlkl_lightning.algorithms.advantages import GROUP_SCALES
from rlkl_lightning.algorithms.aggregation import LOSS_AGGREGATIONS
from rlkl_lightning.algorithms.engines import (
    CompiledEngine,
    RolloutEngine,
    VLLMRolloutEngine,
    build_engine,
    engine_class,
    engine_spec,
)
from rlkl_lightning.algorithms.losses import IMPORTANCE_RATIOS
from rlkl_lightning.checkpoints import plain
from rlkl_lightning.kl.estimators import estimator_spec, kl_estimator
from rlkl_lightning.kl.loss import KL_PLACEMENTS
from rlkl_lightning.models.packing import PACKINGS
from rlkl_lightning.perf.onednn import check_cpu_matmul

LR_SCHEDULES = ("constant", "linear")


def _finite_above(low: float, strict: bool = True):
    return lambda x: _number(x) and math.isfinite(x) and (x > low if strict else x >= low)


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _int_at_least(low: int):
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= low


def _none_or_positive(x: Any) -> bool:
    return x is None or (_number(x) and math.isfinite(x) and x > 0)


def _unit_interval(x: Any) -> bool:
    return _number(x) and 0.0 <= x <= 1.0


def _boolean(x: Any) -> bool:
    return isinstance(x, bool)


def _one_of(allowed: tuple[str, ...]):
    return lambda x: x in allowed


def check_rules(options: Any) -> None:
    """Apply a group's ``RULES``, ``(field, predicate, allowed)``, naming ``group.field``.

    (A function, not a base class: the parser takes a dataclass with a base for a class that
    a config may swap, and writes ``class_path`` blocks for it.)
    """
    for name, ok, allowed in options.RULES:
        value = getattr(options, name)
        if not ok(value):
            raise ValueError(f"`{options.group}.{name}` must be {allowed}, got {value!r}")
    for f in fields(options):  # a numpy number would reach the optimizer and the checkpoint
        value = getattr(options, f.name)
        if isinstance(value, numbers.Number) and type(value) not in (bool, int, float):
            object.__setattr__(options, f.name, plain(value))


@dataclass(frozen=True)
class Sampling:
    """How responses are sampled (the rollout).

    Args:
        max_prompt_tokens: prompts are truncated on the left to this many tokens.
        max_new_tokens: response length limit (tokens).
        temperature: sampling temperature; log-probs are computed at the same temperature.
        top_k: sample among the top-k tokens only (0 = all). Anything but 0 makes the samples
            come from a truncated distribution, so the KL estimates are biased; keep 0 for
            KL-controlled runs.
        top_p: nucleus sampling (1.0 = off); same caveat as ``top_k``.
        stop_at_eos: stop each response at its first EOS (False: always ``max_new_tokens``).
    """

    group: ClassVar[str] = "sampling"
    RULES: ClassVar[tuple] = (
        ("max_prompt_tokens", _int_at_least(1), "an integer >= 1"),
        ("max_new_tokens", _int_at_least(1), "an integer >= 1"),
        ("temperature", _finite_above(0), "a finite number > 0"),
        ("top_k", _int_at_least(0), "an integer >= 0 (0 = off)"),
        ("top_p", lambda x: _number(x) and 0 < x <= 1, "in (0, 1]"),
        ("stop_at_eos", _boolean, "True or False"),
    )

    max_prompt_tokens: int = 64
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_at_eos: bool = True

    @property
    def truncated(self) -> bool:
        """Whether ``top_k``/``top_p`` cut the sampling distribution (biased KL estimates)."""
        return bool(self.top_k) or self.top_p < 1

    def __post_init__(self) -> None:
        check_rules(self)


@dataclass(frozen=True)
class Optimization:
    """The update loop and the optimizer (AdamW).

    Args:
        ppo_epochs: passes over each batch of rollouts.
        num_minibatches: minibatches per pass (one optimizer step each).
        grad_accum_steps: micro-batches per minibatch, when a minibatch does not fit in memory.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        lr_schedule: ``constant`` or ``linear`` (decay to 0 over the training batches).
        warmup_batches: linear warm-up length in batches.
        max_grad_norm: gradient-norm clip (None: no clip).
        packing: the rows the update's forward passes run on: ``none`` (each micro-batch's
            padded ``[b, P + R]`` rows) or ``packed`` (its sequences without their padding,
            packed into rows of a token budget; the same losses and gradients up to rounding:
            :mod:`rlkl_lightning.models.packing`).
        compile: run each micro-batch's forward and backward passes, the loss included, as one
            ``torch.compile``d graph, its shapes padded to a few buckets
            (:mod:`~rlkl_lightning.algorithms.compiled_update`; docs/benchmarks.md). The
            gradients are the eager pass's to float rounding. With
            ``ppo.value_model_thread`` the policy and the value model are two graphs, one per
            thread. Refused under FSDP; compiled code is kept in the library's cache.
    """

    group: ClassVar[str] = "optimization"
    RULES: ClassVar[tuple] = (
        ("ppo_epochs", _int_at_least(1), "an integer >= 1"),
        ("num_minibatches", _int_at_least(1), "an integer >= 1"),
        ("grad_accum_steps", _int_at_least(1), "an integer >= 1"),
        ("lr", _finite_above(0), "a finite number > 0"),
        ("weight_decay", _finite_above(0, strict=False), "a finite number >= 0"),
        ("lr_schedule", _one_of(LR_SCHEDULES), f"one of {LR_SCHEDULES}"),
        ("warmup_batches", _int_at_least(0), "an integer >= 0"),
        ("max_grad_norm", _none_or_positive, "None or a number > 0"),
        ("packing", _one_of(PACKINGS), f"one of {PACKINGS}"),
        ("compile", _boolean, "True or False"),
    )

    ppo_epochs: int = 4
    num_minibatches: int = 4
    grad_accum_steps: int = 1
    lr: float = 1e-5
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_batches: int = 0
    max_grad_norm: float | None = 1.0
    packing: str = "none"
    compile: bool = False

    def __post_init__(self) -> None:
        check_rules(self)

    def rows_problem(self, rows: int, counted: str = "") -> str | None:
        """Why ``rows`` rows of a batch are too few for ``num_minibatches`` steps, or None.

        A minibatch with no row still takes its optimizer step: AdamW's moments and weight
        decay move the weights with no gradient of the batch behind them.

        Args:
            rows: the rows (responses) of one batch on one process.
            counted: how ``rows`` was counted, said in the message (``data.batch_size``).
        """
        if rows >= self.num_minibatches:
            return None
        how = f" ({counted})" if counted else ""
        return (
            f"`optimization.num_minibatches` must be at most the rows of a batch, {rows}{how}, "
            f"got {self.num_minibatches}: {self.num_minibatches - rows} of its optimizer steps "
            "would have no rows and still move the weights (AdamW's moments and weight decay)"
        )


@dataclass(frozen=True)
class Objective:
    """The policy objective every algorithm uses (:mod:`rlkl_lightning.algorithms.objective`).

    Args:
        cliprange: PPO's ratio clip epsilon (below 1, and above unless ``cliprange_high``).
        cliprange_high: the clip epsilon above 1 (DAPO's clip-higher: larger than
            ``cliprange``); None: ``cliprange``.
        importance_ratio: ``token`` (PPO's ratio per token) or ``sequence`` (GSPO's: each
            response's geometric mean of its token ratios, on all its tokens).
        aggregation: how an optimizer step's per-token loss terms become its loss:
            ``token_mean``, ``sequence_mean``, ``fixed_length`` (Dr. GRPO) or
            ``batch_token_mean`` (DAPO); see :mod:`rlkl_lightning.algorithms.aggregation`.
        ent_coef: weight of an entropy bonus (``- ent_coef x`` the aggregated per-token
            entropy); 0: none, and no full-vocabulary logits in the update.
    """

    group: ClassVar[str] = "objective"
    RULES: ClassVar[tuple] = (
        ("cliprange", _finite_above(0), "a finite number > 0"),
        ("cliprange_high", _none_or_positive, "None or a finite number > 0"),
        ("importance_ratio", _one_of(IMPORTANCE_RATIOS), f"one of {IMPORTANCE_RATIOS}"),
        ("aggregation", _one_of(LOSS_AGGREGATIONS), f"one of {LOSS_AGGREGATIONS}"),
        ("ent_coef", _finite_above(0, strict=False), "a finite number >= 0"),
    )

    cliprange: float = 0.2
    cliprange_high: float | None = None
    importance_ratio: str = "token"
    aggregation: str = "token_mean"
    ent_coef: float = 0.0

    def __post_init__(self) -> None:
        trl = TRL_LOSS_TYPES.get(self.aggregation)
        if trl is not None:  # TRL's `loss_type` names one of ours (docs/pipeline.md)
            raise ValueError(
                f"`objective.aggregation` must be one of {LOSS_AGGREGATIONS}, got "
                f"{self.aggregation!r}: TRL's loss_type {self.aggregation!r} is "
                f"`objective.aggregation: {trl}` here (docs/pipeline.md, 'Loss aggregation')"
            )
        check_rules(self)


# TRL 1.16's GRPO `loss_type` -> the `objective.aggregation` with the same loss.
TRL_LOSS_TYPES = {
    "bnpo": "token_mean",
    "grpo": "sequence_mean",
    "dr_grpo": "fixed_length",
    "dapo": "batch_token_mean",
}


@dataclass(frozen=True)
class KLPenalty:
    """Where and how the KL to the reference enters the update (docs/kl.md).

    Args:
        init_coef: beta before any controller update (a ``KLControllerCallback`` overwrites the
            module's ``kl_coef`` at fit start with its controller's value).
        estimator: the measured per-token KL: ``objective/kl`` (the controller's input) and,
            with ``placement="reward"``, the penalty in the reward: ``k1``, ``k2``, ``k3`` or
            ``exact`` (docs/kl.md, "Units and estimators"), or your own estimator as a
            component: its dotted path, or ``{class_path, init_args}`` of a class or function
            that makes it (docs/extending.md); in Python also the ``Estimator`` itself.
        placement: where ``kl_coef x KL`` enters the update: ``reward`` (subtracted from the
            reward, reaching the policy through the policy-gradient term) or ``loss`` (added
            to the loss as ``kl_coef x kl_loss``, divided by PPO's whitening scale; the
            reward has no KL term); see
            :mod:`rlkl_lightning.kl.loss` and docs/kl.md, "Where the KL goes".
        loss_estimator: with ``placement="loss"``, the estimator that is differentiated:
            ``k1``, ``k2`` or ``k3`` (``k2`` follows the per-token KL gradient on-policy), or
            your own, named as ``estimator``.
        loss_weight_clip: with ``placement="loss"``, the cap of the importance weights
            ``pi / pi_old`` (detached) of the KL loss on samples from an earlier policy
            (``>= 1``; None: no cap).
        trust_region: leave tokens whose ``|log pi - log pi_ref|`` exceeds this out of the
            KL penalty (in the reward: the rollout's log-ratio; in the loss: the current one);
            ``objective/kl`` still measures every token. Biases the KL gradient (docs/kl.md,
            "A per-token trust region"); None: off.
        allow_no_gradient: run ``loss_estimator: k1`` with ``placement: loss`` although its
            expected gradient is 0 (the penalty does not act; the exact world's study shows
            it); off, that pair is refused.
    """

    group: ClassVar[str] = "penalty"
    RULES: ClassVar[tuple] = (
        ("init_coef", _finite_above(0, strict=False), "a finite number >= 0"),
        ("placement", _one_of(KL_PLACEMENTS), f"one of {KL_PLACEMENTS}"),
        (
            "loss_weight_clip",
            lambda x: x is None or _finite_above(1, strict=False)(x),
            "None or a finite number >= 1",
        ),
        ("trust_region", _none_or_positive, "None or a number > 0"),
        ("allow_no_gradient", _boolean, "True or False"),
    )

    init_coef: float = 0.1
    estimator: str | dict[str, Any] = "k1"
    placement: str = "reward"
    loss_estimator: str | dict[str, Any] = "k2"
    loss_weight_clip: float | None = 2.0
    trust_region: float | None = None
    allow_no_gradient: bool = False

    def __post_init__(self) -> None:
        check_rules(self)
        # Components (docs/extending.md): each is resolved and checked here, and kept as a
        # plain value (a name, a path or a {class_path, init_args} spec) for the checkpoint.
        used = {}
        for name, role in (("estimator", "reward"), ("loss_estimator", "loss")):
            value = getattr(self, name)
            used[name] = kl_estimator(value, f"penalty.{name}", role=role)
            object.__setattr__(self, name, estimator_spec(value, f"penalty.{name}"))
        if (
            self.placement == "loss"
            and used["loss_estimator"].name == "k1"
            and not self.allow_no_gradient
        ):
            raise ValueError(
                "`penalty.loss_estimator` k1 with `penalty.placement: loss` has expected "
                "gradient 0, so the penalty would not act on the policy (docs/kl.md, 'Where the "
                "KL goes'): use k2 or k3 in the loss or placement 'reward' "
                "(`penalty.allow_no_gradient: true` runs it on purpose)"
            )


@dataclass(frozen=True)
class Models:
    """How the policy, reference and value models are loaded and run.

    Args:
        trust_remote_code: run code shipped with the policy, reference, value model or
            tokenizer (their own modelling files); off, such a model is refused with an error.
            Set it only for model directories and hub repositories you trust.
        peft: train adapters instead of the policy's weights: the fields of a ``peft``
            ``LoraConfig`` (``{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}``;
            ``peft_type`` picks another adapter method) or a ``peft.PeftConfig``. Only the
            adapters and the value head train (docs/bigger-models.md).
        gradient_checkpointing: recompute the policy's activations in the backward pass
            instead of storing them (less memory, about one more forward per update).
        cpu_matmul: ``onednn``: the float32 CPU products of the policy, reference and value
            models through oneDNN, faster where PyTorch's BLAS lacks AVX-512 kernels (AMD),
            equal to ``default``'s to float32 rounding (:mod:`rlkl_lightning.perf.onednn`);
            ``auto`` (default): ``onednn`` on an AMD processor, ``default`` elsewhere.
    """

    group: ClassVar[str] = "models"
    RULES: ClassVar[tuple] = (
        ("trust_remote_code", _boolean, "True or False"),
        ("gradient_checkpointing", _boolean, "True or False"),
    )

    trust_remote_code: bool = False
    peft: dict[str, Any] | None = None
    gradient_checkpointing: bool = False
    cpu_matmul: str = "auto"

    def __post_init__(self) -> None:
        check_rules(self)
        check_cpu_matmul(self.cpu_matmul, "models.cpu_matmul")


@dataclass(frozen=True)
class Safeguards:
    """What protects a run from a bad reward model or a run of bad batches.

    Args:
        score_clip: clip reward-model scores to ``[-score_clip, score_clip]`` (None: no clip).
        max_skipped_in_a_row: stop the run with an error once this many batches in a row were
            skipped (a reward model that always fails would otherwise burn the whole run);
            None: never stop.
        max_failed_fraction: skip the batch (beta unchanged) when more than this share of its
            samples' rewards failed (a remote reward's, after its retries; over all ranks);
            below it, the failed samples are masked (docs/rewards-at-scale.md).
    """

    group: ClassVar[str] = "safeguards"
    RULES: ClassVar[tuple] = (
        ("score_clip", _none_or_positive, "None or a number > 0"),
        (
            "max_skipped_in_a_row",
            lambda x: x is None or _int_at_least(1)(x),
            "None or an integer >= 1",
        ),
        ("max_failed_fraction", _unit_interval, "a number in [0, 1]"),
    )

    score_clip: float | None = None
    max_skipped_in_a_row: int | None = 20
    max_failed_fraction: float = 0.5

    def __post_init__(self) -> None:
        check_rules(self)


@dataclass(frozen=True)
class Logging:
    """What is logged beside the metrics every run logs (docs/metrics.md).

    Args:
        log_samples_every: write a table of sampled generations to TensorBoard every this many
            batches (0: never).
        num_logged_samples: rows in that table.
        kl_token_threshold: log the per-token KL diagnostics (``kl_tokens/*``: the largest
            per-token log-ratio and KL, upper quantiles, the largest per-sequence KL, and the
            number of tokens with ``|log pi - log pi_ref|`` above this threshold) and name each
            logged response's tokens of largest KL in the samples table; None: off.
        peak_memory: log every rank's process peak memory so far (``perf/peak_mem_gb/rank{r}``)
            each batch; logged with ``engine.kind: vllm`` whatever this says. Each phase's peak
            (``perf/peak_mem_gb/{phase}/rank{r}``) is logged in every run.
    """

    group: ClassVar[str] = "logging"
    RULES: ClassVar[tuple] = (
        ("log_samples_every", _int_at_least(0), "an integer >= 0 (0 = never)"),
        ("num_logged_samples", _int_at_least(1), "an integer >= 1"),
        ("kl_token_threshold", _none_or_positive, "None or a number > 0"),
        ("peak_memory", _boolean, "True or False"),
    )

    log_samples_every: int = 50
    num_logged_samples: int = 4
    kl_token_threshold: float | None = None
    peak_memory: bool = False

    def __post_init__(self) -> None:
        check_rules(self)


#: Corrections of the sampler/trainer mismatch (docs/engines.md): none, truncated importance
#: weights per token (TIS) or a sequence mask beyond a ratio threshold (sequence-level MIS).
MISMATCH_CORRECTIONS = ("none", "token_tis", "sequence_mis")


@dataclass(frozen=True)
class Engine:
    """The rollout engine: what samples the responses (docs/engines.md).

    Args:
        kind: the engine (:mod:`~rlkl_lightning.algorithms.engines`): ``native`` (the module's
            own KV-cache loop; its log-probs are the trainer's), ``compiled`` (that loop with a
            static KV cache and one compiled decode step), ``vllm`` (a vLLM engine in this
            process, its weights pushed after every update; the trainer computes the behaviour
            log-probs again and logs the gap, ``mismatch/*``), or an engine of your own: the
            dotted path of a ``RolloutEngine`` subclass or ``{class_path, init_args}``.
        compiled_decode: with ``native``, the ``compiled`` engine: a static KV cache and one
            compiled decode step (CUDA graphs on a GPU), the eager loop's tokens and random
            stream, its log-probs to float rounding.
        gpu_memory_utilization: with ``vllm``, the share of the accelerator's memory vLLM may
            take for its weights and KV cache (on a CPU: of its KV-cache space).
        sleep_mode: with ``vllm`` on CUDA, free the engine's memory during the update.
        correction: with ``vllm``, how the update corrects for sampling from the engine's
            distribution instead of the trainer's: ``none``, ``token_tis`` (truncated
            importance weights per token) or ``sequence_mis`` (each sequence weighted by its
            importance ratio, those whose ratio leaves the threshold left out of the policy
            loss); docs/mismatch.md.
        correction_threshold: the cap ``C`` of ``token_tis``'s weights, or the bound of
            ``sequence_mis``'s ratio (sequences with a ratio above ``C`` or below ``1 / C``
            are masked).
    """

    group: ClassVar[str] = "engine"
    RULES: ClassVar[tuple] = (
        ("compiled_decode", _boolean, "True or False"),
        ("gpu_memory_utilization", lambda x: _number(x) and 0 < x <= 1, "in (0, 1]"),
        ("sleep_mode", _boolean, "True or False"),
        ("correction", _one_of(MISMATCH_CORRECTIONS), f"one of {MISMATCH_CORRECTIONS}"),
        ("correction_threshold", _finite_above(1), "a finite number > 1"),
    )

    kind: str | dict[str, Any] = "native"
    compiled_decode: bool = False
    gpu_memory_utilization: float = 0.3
    sleep_mode: bool = False
    correction: str = "none"
    correction_threshold: float = 2.0

    def __post_init__(self) -> None:
        check_rules(self)
        # A component (docs/engines.md), kept as a plain value for the checkpoint.
        object.__setattr__(self, "kind", engine_spec(self.kind, "engine.kind"))
        engine, _ = engine_class(self.kind)
        rules = (
            ("sleep_mode", False, engine is VLLMRolloutEngine, ""),
            ("correction", "none", not engine.shares_weights, " (an engine with its own weights)"),
        )
        for name, default, applies, what in rules:
            if not applies and getattr(self, name) != default:
                raise ValueError(
                    f"`engine.{name}` applies to `engine.kind='vllm'`{what} only; with "
                    f"kind={self.kind!r} it must be {default!r}, got {getattr(self, name)!r}"
                )
        if self.compiled_decode and self.kind != "native":
            raise ValueError(
                "`engine.compiled_decode` applies to `engine.kind='native'` only; with "
                f"kind={self.kind!r} it must be False, got True"
            )

    def build(self) -> RolloutEngine:
        """A new engine of ``kind`` (``compiled_decode``: the compiled one), not started."""
        return CompiledEngine() if self.compiled_decode else build_engine(self.kind)


@dataclass(frozen=True)
class PPOOptions:
    """PPO's own options: the advantage estimator, the value function and GAE.

    Args:
        advantage: the advantage estimator, a token-level one (it reads the values): ``gae``
            (KL-shaped rewards, GAE, whitened advantages), another registered with
            ``kind="token"`` (:mod:`~rlkl_lightning.algorithms.advantage_estimators`), or a
            component of your own: its dotted path or ``{class_path, init_args}``.
        value_model: separate value model (a causal LM trunk plus a value head); by default the
            value head sits on the policy trunk.
        cliprange_value: value clip around the rollout-time values.
        vf_coef: weight of the value loss.
        gamma: discount.
        lam: GAE lambda.
        whiten_rewards: scale shaped rewards to unit variance (over valid tokens) before GAE.
        value_model_thread: run the separate value model's passes in a second thread, beside
            the policy's, each with half of torch's threads (``value_thread.py``; one process
            only). Faster on a CPU; the numbers are those of the plain path with that many
            threads per network. None (default): on where it helps, i.e. with a separate
            ``value_model``, one process on a CPU and at least 2 torch threads.
    """

    group: ClassVar[str] = "ppo"
    RULES: ClassVar[tuple] = (
        ("cliprange_value", _finite_above(0), "a finite number > 0"),
        ("vf_coef", _finite_above(0, strict=False), "a finite number >= 0"),
        ("gamma", lambda x: _number(x) and 0 <= x <= 1, "in [0, 1]"),
        ("lam", lambda x: _number(x) and 0 <= x <= 1, "in [0, 1]"),
        ("whiten_rewards", _boolean, "True or False"),
    )

    advantage: str | dict[str, Any] = "gae"
    value_model: str | None = None
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    value_model_thread: bool | None = None

    def __post_init__(self) -> None:
        check_rules(self)
        # A component (docs/extending.md), kept as a plain value for the checkpoint.
        spec = advantage_spec(self.advantage, "token", "ppo.advantage")
        object.__setattr__(self, "advantage", spec)
        if self.value_model_thread and self.value_model is None:
            raise ValueError(
                "`ppo.value_model_thread` must be False or None without a separate "
                "`ppo.value_model` (the value head shares the policy's passes), got True"
            )


@dataclass(frozen=True)
class GroupOptions:
    """RLOO's and GRPO's own options: the responses per prompt and the group advantages.

    Args:
        responses_per_prompt: ``k``, responses sampled per prompt (each prompt of a data
            batch of ``b`` prompts is repeated ``k`` times: ``b * k`` responses per batch, the
            samples the KL callbacks count).
        advantage: ``rloo`` (leave-one-out baseline, unbiased) or ``grpo`` (the group's mean
            subtracted, then divided by its standard deviation), or your own group-level
            estimator as a component: its dotted path, or ``{class_path, init_args}`` of a
            class whose instances are one (docs/extending.md).
        scale_rewards: with ``advantage="grpo"``, what the centred returns are divided by:
            ``group`` (the group's standard deviation), ``batch`` (that of the whole batch,
            every rank's) or ``none`` (Dr. GRPO). ``rloo`` takes only ``group``.
        mask_truncated_completions: leave the responses that end without EOS (cut at
            ``max_new_tokens``) out of the update: their reward scored an unfinished text.
        drop_zero_std_groups: leave the groups whose scores (the reward model's, not the
            returns) are all equal out of the update. With the KL in the reward their returns
            ``c - beta * KL_i`` still differ, so their advantages are not 0 (with ``grpo``
            and ``scale_rewards="group"`` of unit scale whatever beta): dropping them also
            drops that push on the KL (docs/pipeline.md). One process only. The KL callbacks
            still count, and ``objective/kl`` still measures, every response of the batch
            (docs/callbacks.md).
    """

    group: ClassVar[str] = "group"
    RULES: ClassVar[tuple] = (
        ("responses_per_prompt", _int_at_least(2), "an integer >= 2"),
        ("scale_rewards", _one_of(GROUP_SCALES), f"one of {GROUP_SCALES}"),
        ("mask_truncated_completions", _boolean, "True or False"),
        ("drop_zero_std_groups", _boolean, "True or False"),
    )

    responses_per_prompt: int = 4
    advantage: str | dict[str, Any] = "rloo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    drop_zero_std_groups: bool = False

    def __post_init__(self) -> None:
        check_rules(self)
        # A component (docs/extending.md), kept as a plain value for the checkpoint.
        spec = advantage_spec(self.advantage, "group", "group.advantage")
        object.__setattr__(self, "advantage", spec)
        if self.advantage == "rloo" and self.scale_rewards != "group":
            raise ValueError(
                "`group.scale_rewards` must be 'group' with advantage='rloo' (the leave-one-out "
                f"baseline never divides), got {self.scale_rewards!r}"
            )


def as_group(cls: type, value: Any, name: str) -> Any:
    """``value`` as the group ``cls``: an instance as it is, a mapping as its fields.

    Raises:
        ValueError: For a field the group does not have (naming the group's fields) or a value
            of another type.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"`{name}` has no option {unknown[0]!r}; its options are {sorted(known)}"
            )
        return cls(**value)
    raise ValueError(
        f"`{name}` must be a mapping of its options {sorted(f.name for f in fields(cls))} (or a "
        f"{cls.__name__}), got {value!r}"
        + (": an empty block; give an option under it or remove it" if value is None else "")
    )


#: The pipeline's groups: the constructor argument -> its class.
PIPELINE_GROUPS: dict[str, type] = {
    "sampling": Sampling,
    "optimization": Optimization,
    "objective": Objective,
    "penalty": KLPenalty,
    "models": Models,
    "safeguards": Safeguards,
    "logging": Logging,
    "engine": Engine,
}

#: Every group of the modules: the pipeline's and the algorithms' own.
MODULE_GROUPS: dict[str, type] = {
    **PIPELINE_GROUPS,
    "ppo": PPOOptions,
    "group": GroupOptions,
}
