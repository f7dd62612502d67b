"""The advantage estimators behind one seam: a name (or a dotted path) -> estimator.

An estimator turns a scored trajectory (scores, per-token KL, values where there are some)
into advantages, given beta in the reward (0 with the KL in the loss), the algorithm's own
options group and a sum over ranks::

    estimator(traj, reward_kl_coef, options, global_sum) -> traj with advantages (and returns)

Each is of a ``kind``, with a registry of its own (:data:`ADVANTAGES`): ``token`` estimators
need a value per token (PPO's group, :class:`~rlkl_lightning.algorithms.options.PPOOptions`),
``group`` estimators one return per response in groups of ``k``
(:class:`~rlkl_lightning.algorithms.options.GroupOptions`). A new one is a function registered
with the one call shape of every registry, ``@ADVANTAGES["group"].register("name")``, or a
component the config names (:mod:`rlkl_lightning.components`): the dotted path of a function
(``group: {advantage: mypackage.my_advantage}``), or a ``{class_path, init_args}`` block of a
class whose instances are estimators, built with its arguments (docs/extending.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlkl_lightning.algorithms.advantages import (
    gae,
    group_advantages,
    scored_groups,
    shape_rewards,
)
from rlkl_lightning.components import Registry, check_arguments, plain_spec
from rlkl_lightning.kl.estimators import sequence_kl
from rlkl_lightning.masked import masked_whiten
from rlkl_lightning.trajectory import Trajectory

#: ``global_sum(x)``: ``x`` summed over every rank (``x`` itself in one process).
GlobalSum = Callable[[Tensor], Tensor]
AdvantageEstimator = Callable[[Trajectory, float, Any, GlobalSum], Trajectory]
KINDS = ("token", "group")

#: The registered estimators of each kind, by name.
ADVANTAGES: dict[str, Registry] = {
    kind: Registry(
        f"{'ppo' if kind == 'token' else 'group'}.advantage",
        f"a {kind}-level advantage estimator (a function, or a class whose instances are one)",
    )
    for kind in KINDS
}


def advantage_names(kind: str) -> tuple[str, ...]:
    """The registered estimators of ``kind``."""
    return ADVANTAGES[kind].names()


def advantage_estimator(value: Any, kind: str, option: str = "advantage") -> AdvantageEstimator:
    """The estimator a registered name, a dotted path or a ``{class_path, init_args}`` names.

    A class (a ``class_path`` block, or a path to it) is built with its ``init_args``; a
    function is used as it is.

    Raises:
        ValueError: Naming ``option`` and the registered estimators of ``kind``, for a value
            that names none, arguments the class does not take, or what is not callable.
    """
    if kind not in KINDS:
        raise ValueError(f"advantage_estimator: `kind` must be one of {KINDS}, got {kind!r}")
    registry = ADVANTAGES[kind]
    target, init_args = registry.resolve(value, option)
    if inspect.isclass(target):
        check_arguments(target, init_args, option)
        target = target(**init_args)
    elif init_args:
        raise ValueError(f"`{option}`: {value!r} names no class to give `init_args` to")
    if not callable(target):
        raise registry.error(value, option, f", which names {type(target).__name__} {target!r}")
    return target


def advantage_spec(value: Any, kind: str, option: str = "advantage") -> str | dict[str, Any]:
    """An advantage option as a plain value: a name or path as it is, a class as its spec."""
    if isinstance(value, str):
        advantage_estimator(value, kind, option)
        return value
    target, init_args = ADVANTAGES[kind].resolve(value, option)
    advantage_estimator(value, kind, option)
    name = ADVANTAGES[kind].name_of(target)
    return name if name is not None else plain_spec(target, init_args)


@ADVANTAGES["token"].register("gae")
def gae_advantages(traj: Trajectory, kl_coef: float, options: Any, global_sum: GlobalSum):
    """KL-shaped per-token rewards, GAE, and whitened advantages (PPO).

    ``r_t = -kl_coef * kl_t`` plus the score on the last response token (Ziegler et al. 2019,
    arXiv 1909.08593, eq. 2), GAE (Schulman et al. 2016, arXiv 1506.02438) with ``gamma`` and
    ``lam``, optionally rewards whitened first (``whiten_rewards``).

    The advantages are whitened: divided by their standard deviation over the batch's tokens,
    ``s = sqrt(var + 1e-8)`` (so ``s >= 1e-4``). ``kl_scale`` records ``s`` (times the rewards'
    own divisor with ``whiten_rewards``), detached, so that a KL term in the loss is divided by
    it too: the whole policy objective is then ``(raw surrogate + beta x KL) / s``, beta keeps
    the reward's units, and whitening changes the step's scale, not where training ends. An
    unscaled KL term would weigh ``beta x s`` against the raw reward, and ``s`` shrinks as the
    policy sharpens (docs/exact.md: PPO with k2 in the loss ran away so).
    """
    mask = traj.response_mask
    rewards = shape_rewards(traj.scores, traj.kl, kl_coef, mask)
    reward_scale = None
    if options.whiten_rewards:
        reward_scale = whitening_scale(rewards, mask, global_sum)
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, traj.values, mask, options.gamma, options.lam)
    scale = whitening_scale(advantages, mask, global_sum)
    if reward_scale is not None:
        scale = scale * reward_scale
    kl_scale = scale.to(advantages.dtype).expand(mask.shape[0]).clone()
    return traj._replace(
        advantages=masked_whiten(advantages, mask), returns=returns, kl_scale=kl_scale
    )


def whitening_scale(x: Tensor, mask: Tensor, global_sum: GlobalSum, eps: float = 1e-8) -> Tensor:
    """What :func:`~rlkl_lightning.masked.masked_whiten` divides by: ``sqrt(var + eps)``, detached.

    The unbiased variance of the valid entries of every rank (float64, two passes, one per sum),
    so the scale is the one ``masked_whiten`` uses to float rounding; ``eps`` floors it at
    ``sqrt(eps)``.
    """
    x = x.detach().to(torch.float64)
    valid = mask.to(torch.bool)
    count_sum = global_sum(torch.stack([valid.sum().to(x.dtype), x[valid].sum()]))
    mean = count_sum[1] / count_sum[0]
    squares = global_sum(((x[valid] - mean) ** 2).sum())
    return (squares / (count_sum[0] - 1) + eps).sqrt()


def _group_estimator(method: str) -> AdvantageEstimator:
    def estimate(traj: Trajectory, kl_coef: float, options: Any, global_sum: GlobalSum):
        mask = traj.response_mask
        # With the KL in the reward, the return of a response is its score minus
        # kl_coef x its KL in nats per sequence (Ziegler et al. 2019's R = r - beta KL).
        returns = traj.scores - kl_coef * sequence_kl(traj.kl, mask)
        k, scale = options.responses_per_prompt, options.scale_rewards
        if traj.sample_mask is not None:  # failed rewards: baselines of the scored, per group
            kept = scored_groups(traj.sample_mask, k)
            std = batch_std_of(returns[kept], global_sum) if scale == "batch" else None
            advantages = group_advantages(
                returns, k, method, scale=scale, batch_std=std, scored=kept
            )
            return traj._replace(advantages=advantages[:, None] * mask, sample_mask=kept)
        batch_std = batch_std_of(returns, global_sum) if scale == "batch" else None
        advantages = group_advantages(returns, k, method, scale=scale, batch_std=batch_std)
        return traj._replace(advantages=advantages[:, None] * mask)

    estimate.__doc__ = (
        f"Sequence returns, ``{method}`` group advantages "
        "(:func:`~rlkl_lightning.algorithms.advantages.group_advantages`), the same advantage "
        "on every token of a response."
    )
    return estimate


def on_scored_rows(
    estimate: AdvantageEstimator,
    traj: Trajectory,
    kl_coef: float,
    options: Any,
    global_sum: GlobalSum,
) -> Trajectory:
    """A token-level estimator run on the rows of ``traj.sample_mask`` alone, put back in place.

    The rows left out (failed rewards) get advantages and returns 0 and ``kl_scale`` 1; the
    update leaves them out (``RLPipeline.update``). Whatever the estimator sums over ranks
    (PPO's whitening scale) is a sum over the scored rows of every rank.
    """
    rows = traj.sample_mask.nonzero().flatten()
    part = estimate(traj.select(rows), kl_coef, options, global_sum)
    filled = {}
    for name in ("advantages", "returns", "kl_scale"):
        value = getattr(part, name)
        if value is not None:
            full_shape = (traj.response_mask.shape[0], *value.shape[1:])
            fill = 1.0 if name == "kl_scale" else 0.0
            whole = value.new_full(full_shape, fill)
            whole[rows] = value
            filled[name] = whole
    return traj._replace(**filled)


ADVANTAGES["group"].register("rloo")(_group_estimator("rloo"))
ADVANTAGES["group"].register("grpo")(_group_estimator("grpo"))


def batch_std_of(returns: Tensor, global_sum: GlobalSum) -> Tensor:
    """The sample standard deviation of every rank's returns (two passes, one per sum)."""
    r = returns.to(torch.float64)
    count_sum = global_sum(torch.stack([r.new_tensor(r.numel()), r.sum()]))
    mean = count_sum[1] / count_sum[0]
    squares = global_sum(((r - mean) ** 2).sum())
    return (squares / (count_sum[0] - 1)).sqrt()
