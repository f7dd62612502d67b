"""Reductions over the valid positions of padded tensors.

Every function takes a tensor ``x`` and a ``mask`` of the same shape whose nonzero (or
``True``) entries mark valid positions, e.g. the response tokens of a right-padded
batch. Padded positions never enter a result, whatever they hold (even ``nan`` or
``inf``): they are selected away with :func:`torch.where`, not multiplied by zero, so
they cannot leak into values or gradients.

:func:`masked_whiten` is DDP-aware: under an initialized ``torch.distributed`` process
group its mean and variance are computed over the valid entries of *all* ranks, so
advantage whitening with a per-rank batch of 8 behaves like whitening one batch of
``8 * world_size``. The other reductions are local to the calling process.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "valid_mask",
    "zero_padding",
]


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Accumulation dtype: float32 at least (half-precision sums lose too much)."""
    return torch.promote_types(x.dtype, torch.float32)


def zero_padding(x: Tensor, valid: Tensor) -> Tensor:
    """``x`` with the entries where ``valid`` is False replaced by 0.

    They are selected away with :func:`torch.where`, not multiplied by zero, so a ``nan`` or
    ``inf`` there reaches neither the values nor the gradients.

    Args:
        x: Values, any shape.
        valid: Boolean tensor broadcastable to ``x``; True keeps an entry.
    """
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def valid_mask(
    x: Tensor,
    mask: Tensor | None,
    caller: str,
    *,
    name: str = "x",
    others: Sequence[tuple[str, Tensor]] = (),
    batch_by_time: bool = False,
    zero_one: bool = False,
) -> Tensor | None:
    """Check the shapes of a masked computation; return ``mask`` as bool on ``x``'s device.

    The one checker of every masked computation (this module, :mod:`rlkl_lightning.kl.estimators`,
    :mod:`rlkl_lightning.algorithms.advantages`, :mod:`rlkl_lightning.algorithms.losses`); its
    errors name the
    calling function and the argument.

    Args:
        x: The values the mask selects from.
        mask: Same shape as ``x``; nonzero (or True) marks a valid entry. ``None`` (every
            entry valid) is returned as ``None`` after the checks of ``x`` and ``others``.
        caller: Name of the public function, for the error messages.
        name: Name of ``x``'s argument, for the error messages.
        others: ``(name, tensor)`` pairs that must have the shape of ``x``.
        batch_by_time: ``x`` must be ``[B, T]``.
        zero_one: A numeric ``mask`` may hold only 0 and 1.

    Raises:
        ValueError: If a shape differs, ``x`` is not ``[B, T]`` when ``batch_by_time`` is set,
            or ``mask`` holds a value other than 0 and 1 when ``zero_one`` is set.
    """
    if batch_by_time and x.ndim != 2:
        raise ValueError(f"{caller}: `{name}` must have shape [B, T], got {tuple(x.shape)}")
    for other, tensor in others:
        if tensor.shape != x.shape:
            raise ValueError(
                f"{caller}: `{other}` must have the same shape as `{name}`, got `{name}` "
                f"{tuple(x.shape)} and `{other}` {tuple(tensor.shape)}"
            )
    if mask is None:
        return None
    if mask.shape != x.shape:
        raise ValueError(
            f"{caller}: `mask` must have the same shape as `{name}`, got `{name}` "
            f"{tuple(x.shape)} and `mask` {tuple(mask.shape)}"
        )
    if zero_one and mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{caller}: `mask` must be bool or hold only 0 and 1")
    return mask.to(device=x.device, dtype=torch.bool)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of the valid entries of ``x``.

    Args:
        x: Values, any shape ``S``.
        mask: Shape ``S``; nonzero marks a valid entry.
        dim: ``None`` sums over all entries (scalar result); an int sums along that
            dimension only.

    Returns:
        A scalar tensor if ``dim`` is ``None``, else ``S`` with ``dim`` removed. Sums
        with no valid entry are 0.

    Raises:
        ValueError: If ``mask`` and ``x`` differ in shape.
    """
    valid = valid_mask(x, mask, "masked_sum")
    selected = zero_padding(x, valid)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of the valid entries of ``x``: ``sum(x[valid]) / count(valid)``.

    Args:
        x: Values, any shape ``S``.
        mask: Shape ``S``; nonzero marks a valid entry.
        dim: ``None`` averages over all valid entries (scalar result); an int averages
            along that dimension only (e.g. ``dim=1`` on ``[B, T]`` gives ``[B]``, the
            per-sequence token mean).

    Returns:
        A scalar tensor if ``dim`` is ``None``, else ``S`` with ``dim`` removed.

    Raises:
        ValueError: If the shapes differ, or if a mean would be taken over zero valid
            entries (the whole mask when ``dim`` is ``None``, any slice otherwise).
    """
    valid = valid_mask(x, mask, "masked_mean")
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    # Compiled (perf/compiled_update.py) the check would split the graph; the compiled update
    # pads only micro-batches that hold a valid token.
    if not torch.compiler.is_compiling() and bool((count == 0).any()):
        where = "" if dim is None else f" along dim={dim} (at least one slice is empty)"
        raise ValueError(f"masked_mean: mask has no valid entries{where}")
    return masked_sum(x, valid, dim=dim) / count.to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the valid entries of ``x`` (over all of them, a scalar).

    Two passes (mean, then the mean of squared deviations), which is numerically
    stable. ``unbiased=True`` applies Bessel's correction, dividing by ``n - 1``.

    Args:
        x: Values, any shape ``S``.
        mask: Shape ``S``; nonzero marks a valid entry.
        unbiased: Divide by ``n - 1`` (sample variance) instead of ``n``.

    Returns:
        Scalar tensor.

    Raises:
        ValueError: If the shapes differ, the mask has no valid entry, or
            ``unbiased`` is set and there is only one.
    """
    valid = valid_mask(x, mask, "masked_var")
    n = int(valid.sum())
    _require_count(n, unbiased, "masked_var")
    x = zero_padding(x, valid)
    mean = masked_sum(x, valid) / n
    sq_dev = masked_sum((x - mean) ** 2, valid)
    return sq_dev / (n - 1 if unbiased else n)


def _require_count(n: int, unbiased: bool, name: str) -> None:
    if n == 0:
        raise ValueError(f"{name}: mask has no valid entries")
    if unbiased and n == 1:
        raise ValueError(
            f"{name}: the unbiased variance needs at least 2 valid entries, the mask has 1"
        )


def _use_distributed(distributed: bool) -> bool:
    return distributed and dist.is_available() and dist.is_initialized()


def _all_reduce_sum(t: Tensor) -> Tensor:
    # The functional collective is autograd-aware (torch 2.13 registers its backward: the
    # incoming gradients all-reduced), so every rank must run backward when x requires grad.
    # Its gradient equals torch.distributed.nn.functional.all_reduce's bit for bit (a `dist`
    # test), without that function's deprecation warning on every rank.
    from torch.distributed import _functional_collectives as collectives

    return collectives.wait_tensor(collectives.all_reduce(t, "sum", dist.group.WORLD))


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    distributed: bool = True,
) -> Tensor:
    """Whitens the valid entries of ``x``: ``(x - mean) / sqrt(var + eps)``.

    ``mean`` and ``var`` (unbiased, Bessel's correction) are taken over the valid
    entries only. With ``shift_mean=False`` the mean is added back,
    ``(x - mean) / sqrt(var + eps) + mean``, which rescales without centering (as is
    usual for rewards, where the sign carries meaning).

    When ``distributed`` is set and a ``torch.distributed`` process group is
    initialized, the count, the sum and then the sum of squared deviations are
    all-reduced (SUM) over the default group, so the statistics are those of the
    concatenated global batch and every rank whitens with the same numbers. Every rank
    must then call this function (it is a collective); a rank may hold no valid entry
    as long as the global batch has at least two.

    Args:
        x: Values, any shape ``S`` (e.g. advantages ``[B, T]``).
        mask: Shape ``S``; nonzero marks a valid entry.
        shift_mean: Keep the result centered at 0 (``True``) or restore the mean.
        eps: Added to the variance before the square root; must be ``>= 0``.
        distributed: All-reduce the statistics when a process group is initialized.

    Returns:
        Shape ``S``, dtype of ``x``: whitened values on valid entries, 0 on padding.

    Raises:
        ValueError: If the shapes differ, ``eps < 0``, or fewer than two valid entries
            exist (globally, in the distributed case).
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    valid = valid_mask(x, mask, "masked_whiten")
    reduce = _use_distributed(distributed)
    xs = zero_padding(x.to(_stat_dtype(x)), valid)

    # Pass 1: count and sum -> global mean.
    count_sum = torch.stack([valid.sum().to(xs.dtype), masked_sum(xs, valid)])
    if reduce:
        count_sum = _all_reduce_sum(count_sum)
    n = int(count_sum[0].detach())
    # Raised after the collective, so all ranks agree on raising (no rank hangs).
    _require_count(n, True, "masked_whiten")
    mean = count_sum[1] / n

    # Pass 2: sum of squared deviations from the global mean -> global variance.
    sq_dev = masked_sum((xs - mean) ** 2, valid)
    if reduce:
        sq_dev = _all_reduce_sum(sq_dev)
    var = sq_dev / (n - 1)

    whitened = (xs - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_padding(whitened.to(x.dtype), valid)
