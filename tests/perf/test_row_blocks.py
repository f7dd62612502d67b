"""in_row_blocks: the row-wise diagnostics computed a block of rows at a time, bit for bit."""

from __future__ import annotations

import pytest
import torch

from rlkl_lightning.algorithms.losses import entropy_from_logits
from rlkl_lightning.kl.estimators import exact_kl
from rlkl_lightning.perf.row_blocks import BLOCK, in_row_blocks


def _logits(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=gen) * 4
    z[..., :7] = float("-inf")  # masked-out actions: probability 0
    return z


@pytest.mark.parametrize("shape", [(3, 37, 3001), (2, 70, 4096), (130, 1500)])
def test_blocks_equal_whole_tensor_bit_for_bit(shape):
    """Rows split into blocks (the last one short) give exactly the whole-tensor results."""
    assert torch.Size(shape).numel() > BLOCK  # more than one block
    logits, ref = _logits(shape, 0), _logits(shape, 1)
    kl = in_row_blocks(exact_kl, logits, ref)
    entropy = in_row_blocks(entropy_from_logits, logits)
    assert kl.shape == entropy.shape == logits.shape[:-1]
    assert torch.equal(kl, exact_kl(logits, ref))
    assert torch.equal(entropy, entropy_from_logits(logits))


def test_blocks_hold_rows_together():
    """Each row reaches ``fn`` whole and in order: a row's own index comes back."""
    rows = torch.arange(300.0).repeat_interleave(1000).view(300, 1000)
    assert torch.equal(in_row_blocks(lambda x: x[:, 0], rows), torch.arange(300.0))


def test_inputs_that_need_gradients_take_one_pass():
    """With autograd in use ``fn`` sees the whole tensor, so gradients flow as before."""
    logits = _logits((4, 50, 1000), 2).requires_grad_()
    seen = []
    out = in_row_blocks(lambda x: seen.append(x.shape) or entropy_from_logits(x), logits)
    assert seen == [logits.shape]
    out.sum().backward()
    assert torch.isfinite(logits.grad[..., 7:]).all()


def test_off_the_cpu_blocks_are_device_sized():
    """A GPU's pass is split too, in blocks of DEVICE_BLOCK elements (meta tensors: no memory)."""
    from rlkl_lightning.perf import row_blocks

    seen = []

    def fn(x, y):
        seen.append(x.numel())
        return (x + y).sum(-1)

    vocab = 50_000
    rows = 3 * row_blocks.DEVICE_BLOCK // vocab
    x = torch.empty(2, rows // 2, vocab, device="meta")
    out = row_blocks.in_row_blocks(fn, x, x)
    assert out.shape == (2, rows // 2) and out.device.type == "meta"
    assert len(seen) > 1 and max(seen) <= row_blocks.DEVICE_BLOCK
    assert sum(seen) == x.numel()
    seen.clear()
    small = torch.empty(2, 4, vocab, device="meta")  # over the CPU's block, under the device's
    row_blocks.in_row_blocks(fn, small, small)
    assert seen == [small.numel()]
