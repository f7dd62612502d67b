"""Checks of a module's arguments: every error names the option and the allowed values."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from rlkl_lightning.algorithms.advantages import GROUP_ADVANTAGES, GROUP_SCALES
from rlkl_lightning.algorithms.aggregation import LOSS_AGGREGATIONS
from rlkl_lightning.algorithms.losses import IMPORTANCE_RATIOS
from rlkl_lightning.kl.estimators import KL_ESTIMATORS
from rlkl_lightning.kl.loss import KL_LOSS_ESTIMATORS, KL_PLACEMENTS

LR_SCHEDULES = ("constant", "linear")


def need(owner: str, ok: bool, option: str, allowed: str, value: Any) -> None:
    """Raise ``ValueError("<owner>: `<option>` must be <allowed>, got <value>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{owner}: `{option}` must be {allowed}, got {value!r}")


def check_all(owner: str, args: dict[str, Any], rules: Iterable[tuple[str, Any, str]]) -> None:
    """Apply ``(option, predicate, allowed)`` rules to ``args`` in order."""
    for option, ok, allowed in rules:
        need(owner, bool(ok(args[option])), option, allowed, args[option])


def _finite_above(low: float, strict: bool = True):
    return lambda x: math.isfinite(x) and (x > low if strict else x >= low)


def _int_at_least(low: int):
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= low


def _none_or_positive(x: Any) -> bool:
    return x is None or (math.isfinite(x) and x > 0)


#: The rules of :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline`'s arguments.
PIPELINE_RULES = [
    ("trust_remote_code", lambda x: isinstance(x, bool), "True or False"),
    ("kl_estimator", lambda x: x in KL_ESTIMATORS, f"one of {KL_ESTIMATORS}"),
    ("kl_placement", lambda x: x in KL_PLACEMENTS, f"one of {KL_PLACEMENTS}"),
    ("kl_loss_estimator", lambda x: x in KL_LOSS_ESTIMATORS, f"one of {KL_LOSS_ESTIMATORS}"),
    (
        "kl_loss_weight_clip",
        lambda x: x is None or _finite_above(1, strict=False)(x),
        "None or a finite number >= 1",
    ),
    ("lr_schedule", lambda x: x in LR_SCHEDULES, f"one of {LR_SCHEDULES}"),
    ("init_kl_coef", _finite_above(0, strict=False), "a finite number >= 0"),
    *[
        (name, _int_at_least(1), "an integer >= 1")
        for name in (
            "max_prompt_tokens",
            "max_new_tokens",
            "ppo_epochs",
            "num_minibatches",
            "grad_accum_steps",
        )
    ],
    ("top_k", _int_at_least(0), "an integer >= 0 (0 = off)"),
    ("temperature", _finite_above(0), "a finite number > 0"),
    ("top_p", lambda x: 0 < x <= 1, "in (0, 1]"),
    ("lr", _finite_above(0), "a finite number > 0"),
    ("cliprange", _finite_above(0), "a finite number > 0"),
    ("cliprange_high", _none_or_positive, "None or a finite number > 0"),
    ("importance_ratio", lambda x: x in IMPORTANCE_RATIOS, f"one of {IMPORTANCE_RATIOS}"),
    ("loss_aggregation", lambda x: x in LOSS_AGGREGATIONS, f"one of {LOSS_AGGREGATIONS}"),
    ("weight_decay", _finite_above(0, strict=False), "a finite number >= 0"),
    ("warmup_batches", lambda x: x >= 0, "an integer >= 0"),
    ("log_samples_every", lambda x: x >= 0, "an integer >= 0 (0 = never)"),
    ("max_skipped_in_a_row", lambda x: x is None or _int_at_least(1)(x), "None or an integer >= 1"),
    ("score_clip", _none_or_positive, "None or a number > 0"),
    ("max_grad_norm", _none_or_positive, "None or a number > 0"),
    ("kl_token_threshold", _none_or_positive, "None or a number > 0"),
    ("kl_trust_region", _none_or_positive, "None or a number > 0"),
]

#: The rules of :class:`~rlkl_lightning.algorithms.ppo.PPOModule`'s own arguments.
PPO_RULES = [
    ("cliprange_value", _finite_above(0), "a finite number > 0"),
    ("vf_coef", _finite_above(0, strict=False), "a finite number >= 0"),
    ("ent_coef", _finite_above(0, strict=False), "a finite number >= 0"),
    ("gamma", lambda x: 0 <= x <= 1, "in [0, 1]"),
    ("lam", lambda x: 0 <= x <= 1, "in [0, 1]"),
]

#: The rules of :class:`~rlkl_lightning.algorithms.rloo.RLOOModule`'s own arguments.
RLOO_RULES = [
    ("responses_per_prompt", _int_at_least(2), "an integer >= 2"),
    ("advantage", lambda x: x in GROUP_ADVANTAGES, f"one of {GROUP_ADVANTAGES}"),
    ("scale_rewards", lambda x: x in GROUP_SCALES, f"one of {GROUP_SCALES}"),
    ("ent_coef", _finite_above(0, strict=False), "a finite number >= 0"),
    ("mask_truncated_completions", lambda x: isinstance(x, bool), "True or False"),
    ("drop_zero_std_groups", lambda x: isinstance(x, bool), "True or False"),
]


def check_pipeline_args(owner: str, args: dict[str, Any], more_rules: Iterable = ()) -> None:
    """Validate the shared arguments; warn when sampling is truncated (biased KL estimates).

    ``more_rules``: the rules of options checked elsewhere (the speed-ups'), after these.
    """
    check_all(owner, args, [*PIPELINE_RULES, *more_rules])
    if args["top_k"] or args["top_p"] < 1:
        rank_zero_warn(
            f"{owner}: `top_k`/`top_p` truncate the sampling distribution, so the KL estimates "
            "(and the penalty) no longer refer to the policy itself; use top_k=0, top_p=1.0 "
            "for KL-controlled runs",
            category=RuntimeWarning,
        )


def context_of(model: nn.Module) -> int | None:
    """The model's context length in tokens (``n_positions`` or ``max_position_embeddings``)."""
    config = model.config
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def check_vocabulary(owner: str, policy: nn.Module, reference: Any) -> None:
    """The reference must score the policy's tokens: the same vocabulary size."""
    vocab = [getattr(m.config, "vocab_size", None) for m in (reference, policy)]
    if vocab[0] != vocab[1]:
        raise ValueError(
            f"{owner}: `reference` must share the policy's vocabulary: vocab_size "
            f"{vocab[0]} != the policy's {vocab[1]}"
        )


def check_context(owner: str, policy: nn.Module, max_prompt_tokens: int, max_new_tokens: int):
    """Prompt plus response must fit the policy's context window."""
    context = context_of(policy)
    if context and max_prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"{owner}: `max_prompt_tokens` ({max_prompt_tokens}) + `max_new_tokens` "
            f"({max_new_tokens}) = {max_prompt_tokens + max_new_tokens} tokens do not fit "
            f"the policy's context of {context} positions; lower them so that their sum is "
            f"<= {context}"
        )
