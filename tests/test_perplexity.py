"""Next-token NLL and perplexity on padded batches, against per-text sums and torchmetrics."""

import math

import pytest
import torch
from torchmetrics.text import Perplexity

from rlkl_lightning.perplexity import NextTokenNLL, next_token_nll

VOCAB = 11
LENGTHS = [5, 2, 7, 4]


def _texts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _model(ids: torch.Tensor) -> torch.Tensor:
    """A fixed 'LM': logits that depend on the token and its position among real tokens."""
    table = torch.linspace(-3, 3, 64 * VOCAB, dtype=torch.float64).reshape(64, VOCAB)
    return table[(ids * 5 + 3) % 64]


def _pad(texts: list[torch.Tensor], side: str, pad_id: int = 0, garbage: float = 1e9):
    width = max(len(t) for t in texts)
    ids = torch.full((len(texts), width), pad_id)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    logits = torch.full((len(texts), width, VOCAB), garbage, dtype=torch.float64)
    for row, text in enumerate(texts):
        cols = slice(0, len(text)) if side == "right" else slice(width - len(text), width)
        ids[row, cols], mask[row, cols], logits[row, cols] = text, 1, _model(text)
    return logits, ids, mask


def _per_text_nll(texts: list[torch.Tensor]) -> tuple[float, int]:
    total, count = 0.0, 0
    for text in texts:
        logprobs = _model(text).log_softmax(-1)
        total -= sum(float(logprobs[t, text[t + 1]]) for t in range(len(text) - 1))
        count += len(text) - 1
    return total, count


@pytest.mark.parametrize("side", ["right", "left"])
def test_next_token_nll_scores_each_token_after_the_first_real_one(side):
    texts = _texts()
    nll, n = next_token_nll(*_pad(texts, side))
    total, count = _per_text_nll(texts)
    assert int(n) == count == sum(LENGTHS) - len(LENGTHS)
    assert float(nll) == pytest.approx(total, rel=1e-6)  # computed in float32


def test_metric_pools_tokens_over_batches_and_matches_torchmetrics_perplexity():
    texts = _texts(1)
    metric = NextTokenNLL()
    for start in (0, 3):  # two batches of unequal size
        metric.update(*_pad(texts[start : start + 3], "left"))
    total, count = _per_text_nll(texts)
    assert float(metric.compute()) == pytest.approx(total / count, rel=1e-6)

    # torchmetrics' Perplexity on the same left-padded batch, with the targets a real token
    # predicts (what PPOModule's validation feeds it): the same number.
    logits, ids, mask = _pad(texts, "left")
    scored = mask[:, 1:].bool() & mask[:, :-1].bool()
    reference = Perplexity(ignore_index=-100)
    reference.update(logits[:, :-1].float(), ids[:, 1:].masked_fill(~scored, -100))
    assert math.exp(float(metric.compute())) == pytest.approx(float(reference.compute()), rel=1e-5)


def test_logits_at_padding_and_at_the_last_token_get_no_gradient():
    logits, ids, mask = _pad(_texts(2), "right")  # 1e9 logits at padding
    logits.requires_grad_(True)
    next_token_nll(logits, ids, mask)[0].backward()
    predicts_nothing = torch.ones_like(mask, dtype=torch.bool)
    predicts_nothing[:, :-1] = (mask[:, 1:] == 0) | (mask[:, :-1] == 0)
    assert (logits.grad[predicts_nothing] == 0).all()
    assert (logits.grad[~predicts_nothing].abs().sum(-1) > 0).all()
