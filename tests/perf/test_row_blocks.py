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
