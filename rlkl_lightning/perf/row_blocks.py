"""Row-wise functions of ``[..., V]`` tensors, computed a block of rows at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: Elements per block on a CPU: 512 KiB of float32, so a block's temporaries stay in a core's
#: L2 cache.
BLOCK = 1 << 17
#: Elements per block on other devices: 128 MiB of float32, so the temporaries of a ``[B, R, V]``
#: pass stay a bounded size instead of several copies of the whole tensor.
DEVICE_BLOCK = 1 << 25


def in_row_blocks(fn: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """``fn(*tensors)`` for a ``fn`` that maps each row ``[V]`` of its inputs to one number.

    ``fn`` takes tensors of one shape ``[..., V]`` and returns ``[...]``; here it sees blocks of
    rows of about :data:`BLOCK` elements (:data:`DEVICE_BLOCK` off the CPU), and the results
    are joined. On a CPU each block's element-wise passes then run in cache instead of
    streaming whole ``[B, T, V]`` tensors through memory several times; on a GPU the
    temporaries of ``fn`` stay one block's size. Rows do not mix, so on a CPU the result equals
    ``fn(*tensors)`` bit for bit (tests/perf/test_row_blocks.py); a GPU's reduction kernels may
    add a row in another order for another number of rows (float rounding). Inputs that need
    gradients get ``fn(*tensors)``.
    """
    first = tensors[0]
    block = BLOCK if first.device.type == "cpu" else DEVICE_BLOCK
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if grads or first.ndim < 2 or first.numel() <= block:
        return fn(*tensors)
    rows = max(1, block // first.shape[-1])  # numel > block: the last dimension is not 0
    flat = [t.reshape(-1, t.shape[-1]) for t in tensors]
    parts = [fn(*block) for block in zip(*(t.split(rows) for t in flat), strict=True)]
    return torch.cat(parts).view(first.shape[:-1])
