"""Per-token rewards with a KL penalty, GAE, and critic-free group advantages.

A batch holds ``B`` responses right-padded to ``T`` tokens. ``mask[b, t]`` is true for
the response tokens of row ``b``: a contiguous prefix of ones (the response, up to and
including EOS), then padding. Each response is one episode whose actions are its
tokens; the episode ends after the last valid token.

:func:`shape_rewards` and :func:`gae` are pure tensor math: padded positions never influence
a result and are 0 in every output, whatever the inputs hold there (even ``nan``).
:func:`group_advantages` works on one return per response (no padding).
"""

import math

import torch
from torch import Tensor

from rlkl_lightning.masked import valid_mask, zero_padding

__all__ = [
    "GROUP_ADVANTAGES",
    "GROUP_SCALES",
    "gae",
    "group_advantages",
    "scored_groups",
    "scored_spread",
    "scored_std",
    "shape_rewards",
]

GROUP_ADVANTAGES = ("rloo", "grpo")
#: What ``grpo`` advantages are divided by: the group's standard deviation, the batch's, or 1.
GROUP_SCALES = ("group", "batch", "none")


def _check_unit_interval(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def shape_rewards(scores: Tensor, kl: Tensor, kl_coef: float, mask: Tensor) -> Tensor:
    """Per-token rewards: a KL penalty on every token, the score on the last one.

    Ziegler et al. 2019 (arXiv 1909.08593, Sec. 2) optimize
    ``R(x, y) = r(x, y) - beta * KL``; spread over the tokens of a response this is::

        rewards[b, t] = -kl_coef * kl[b, t]                 valid t before the last
        rewards[b, t] = -kl_coef * kl[b, t] + scores[b]     t = last valid token of row b
        rewards[b, t] = 0                                   padding

    Args:
        scores: ``[B]`` reward model score of each response. Moved to ``kl``'s device.
        kl: ``[B, T]`` per-token KL estimate to the reference policy (nats).
        kl_coef: The KL coefficient beta, finite and ``>= 0``.
        mask: ``[B, T]``, nonzero on response tokens.

    Returns:
        ``[B, T]`` rewards, in the floating dtype of ``kl`` and ``scores`` combined
        (float32 at least).

    Raises:
        ValueError: On shape mismatches, a negative or non-finite ``kl_coef``, or a row
            without any valid token (its score would have no token to go to).
    """
    kl_coef = float(kl_coef)
    if not (math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef}")
    valid = valid_mask(kl, mask, "shape_rewards", name="kl", batch_by_time=True)
    if scores.shape != (kl.shape[0],):
        raise ValueError(f"scores must be [B] = [{kl.shape[0]}], got {tuple(scores.shape)}")
    dtype = torch.promote_types(torch.promote_types(kl.dtype, scores.dtype), torch.float32)
    empty = ~valid.any(dim=1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"shape_rewards: rows {rows} have no valid token to put the score on")

    rewards = zero_padding(-kl_coef * kl.to(dtype), valid)
    # Index of the last valid token of each row (robust to any mask, not only prefixes).
    positions = torch.arange(kl.shape[1], device=kl.device).expand_as(valid)
    last = torch.where(valid, positions, -1).amax(dim=1)
    rows = torch.arange(kl.shape[0], device=kl.device)
    rewards[rows, last] += scores.to(device=kl.device, dtype=dtype)
    return rewards


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015, arXiv 1506.02438, eqn. 16).

    With ``v_{t+1}`` the value of the next token, taken as 0 after the last valid token
    (the episode ends there, so the final step bootstraps from nothing)::

        delta_t = r_t + gamma * v_{t+1} - V(s_t)
        A_t     = delta_t + gamma * lam * A_{t+1}         (A = 0 past the end)
        R_t     = A_t + V(s_t)                            (the value targets, "returns")

    ``lam = 0`` gives one-step TD errors; ``gamma = lam = 1`` gives the undiscounted
    reward-to-go minus the value. Vectorized over the batch, a loop over ``T``.
    Outputs are targets and carry no gradient.

    Args:
        rewards: ``[B, T]`` per-token rewards (see :func:`shape_rewards`).
        values: ``[B, T]`` value estimates ``V(s_t)`` of the old policy.
        mask: ``[B, T]``, a contiguous prefix of ones per row (right padding).
        gamma: Discount factor in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, each ``[B, T]``, 0 on padding.

    Raises:
        ValueError: On shape mismatches, ``gamma`` or ``lam`` outside ``[0, 1]``, or a
            mask row that is not a prefix of ones (a gap would silently end the episode).
    """
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    valid = valid_mask(
        rewards, mask, "gae", name="rewards", others=[("values", values)], batch_by_time=True
    )
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("gae: each mask row must be a prefix of ones followed by padding")

    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    r = zero_padding(rewards.to(dtype), valid)
    v = zero_padding(values.to(device=rewards.device, dtype=dtype), valid)
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_advantage = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        # Padding has v = 0 and A = 0, so past the last valid token nothing is carried.
        delta = r[:, t] + gamma * next_value - v[:, t]
        next_advantage = zero_padding(delta + gamma * lam * next_advantage, valid[:, t])
        advantages[:, t] = next_advantage
        next_value = v[:, t]
    returns = zero_padding(advantages + v, valid)
    return advantages, returns


@torch.no_grad()
def group_advantages(
    returns: Tensor,
    group_size: int,
    method: str = "rloo",
    eps: float = 1e-4,
    scale: str = "group",
    batch_std: Tensor | None = None,
    scored: Tensor | None = None,
) -> Tensor:
    """Advantages of ``k`` responses per prompt from their returns, with no value function.

    ``returns`` holds ``n`` groups of ``k = group_size`` consecutive responses to one prompt.
    Within a group, with ``mean`` its mean and ``std`` its sample standard deviation (Bessel-
    corrected, divided by ``k - 1``: at ``k = 2`` the advantages are ``+-1/sqrt(2)``, a factor
    ``sqrt(2)`` below those of the population std)::

        rloo:  A_i = r_i - 1/(k-1) sum_{j != i} r_j  =  k/(k-1) (r_i - mean)
        grpo:  A_i = (r_i - mean) / (std + eps)

    ``rloo`` is the leave-one-out baseline of Ahmadian et al. 2024 (arXiv 2402.14740, after
    Kool et al. 2019): the baseline of response ``i`` does not depend on ``i``'s own sample, so
    ``E[A_i grad log pi(y_i)] = grad E[r]`` (unbiased). ``grpo`` is GRPO's group normalisation
    (Shao et al. 2024, arXiv 2402.03300, outcome supervision): the mean includes ``r_i`` and the
    division by ``std`` rescales each group, so it is not unbiased.

    Args:
        returns: ``[n * k]`` one return per response, the ``k`` of a prompt in a row.
        group_size: ``k >= 2``.
        method: ``"rloo"`` or ``"grpo"``.
        eps: Added to the standard deviation (``grpo``), so that a group of equal returns
            gets advantages 0.
        scale: ``grpo`` only: divide by the group's ``std`` (``group``), by the sample standard
            deviation of all returns (``batch``) or by nothing (``none``: Dr. GRPO, Liu et al.
            2025, arXiv 2503.20783, which drops the division as a bias towards easy and hard
            prompts). ``rloo`` takes only ``group`` (it never divides).
        batch_std: with ``scale="batch"``, the standard deviation to use (the global batch's
            under DDP); None: that of ``returns``.
        scored: ``[n * k]`` bool, False for a response whose reward failed: it is left out of
            its group's mean and standard deviation (``k`` is then the group's number of
            scored responses, ``m``) and its advantage is 0; a group with ``m < 2`` has no
            baseline, and all its advantages are 0. None: all scored (the formulas above).

    Returns:
        ``[n * k]`` advantages (each group's sum is 0), dtype of ``returns`` (float32 at least).

    Raises:
        ValueError: For an unknown method, ``k < 2``, or a length that is not a multiple of ``k``.
    """
    if method not in GROUP_ADVANTAGES:
        raise ValueError(
            f"group_advantages: `method` must be one of {GROUP_ADVANTAGES}, got {method!r}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_advantages: `group_size` must be an integer >= 2, got {group_size!r}"
        )
    if returns.dim() != 1 or returns.shape[0] % group_size:
        raise ValueError(
            f"group_advantages: `returns` must be [n * {group_size}], got {tuple(returns.shape)}"
        )
    r = returns.to(torch.promote_types(returns.dtype, torch.float32)).view(-1, group_size)
    if scale not in GROUP_SCALES or (method == "rloo" and scale != "group"):
        allowed = GROUP_SCALES if method == "grpo" else ("group",)
        raise ValueError(f"group_advantages: `scale` must be one of {allowed}, got {scale!r}")
    if scored is not None:
        return _scored_group_advantages(r, scored.view_as(r), method, eps, scale, batch_std)
    centred = r - r.mean(dim=1, keepdim=True)
    if method == "rloo":
        advantages = centred * (group_size / (group_size - 1))
    elif scale == "group":
        advantages = centred / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        std = r.std() if batch_std is None else batch_std.to(r.dtype)
        advantages = centred / (std + eps)
    else:
        advantages = centred
    return advantages.flatten()


def _scored_group_advantages(
    r: Tensor, scored: Tensor, method: str, eps: float, scale: str, batch_std: Tensor | None
) -> Tensor:
    """:func:`group_advantages` over each group's scored responses only (``m`` of them)."""
    scored = scored.to(torch.bool)
    m, values, centred = scored_spread(r, scored)
    has_baseline = m >= 2
    if method == "rloo":
        advantages = centred * (m / (m - 1).clamp(min=1))
    elif scale == "group":
        advantages = centred / (scored_std(m, centred) + eps)
    elif scale == "batch":
        std = values[scored].std() if batch_std is None else batch_std.to(r.dtype)
        advantages = centred / (std + eps)
    else:
        advantages = centred
    return torch.where(scored & has_baseline, advantages, torch.zeros_like(r)).flatten()


def scored_spread(r: Tensor, scored: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, values, centred)`` of each group ``[G, k]`` over its scored members.

    ``m`` ``[G, 1]`` counts them; ``values`` has failed ones 0 (a failed return may be nan);
    ``centred`` is the values less their group's mean, failed ones 0.
    """
    m = scored.sum(dim=1, keepdim=True).to(r.dtype)
    values = torch.where(scored, r, torch.zeros_like(r))
    mean = values.sum(dim=1, keepdim=True) / m.clamp(min=1)
    return m, values, torch.where(scored, values - mean, torch.zeros_like(r))


def scored_std(m: Tensor, centred: Tensor) -> Tensor:
    """``[G, 1]`` the sample standard deviation (Bessel's) of :func:`scored_spread`'s groups."""
    return (centred.square().sum(dim=1, keepdim=True) / (m - 1).clamp(min=1)).sqrt()


def scored_groups(scored: Tensor, group_size: int) -> Tensor:
    """``[n * k]`` bool: the scored responses of groups with at least 2 scored (a baseline)."""
    groups = scored.to(torch.bool).view(-1, group_size)
    return (groups & (groups.sum(dim=1, keepdim=True) >= 2)).flatten()
