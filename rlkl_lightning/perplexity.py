"""Next-token negative log-likelihood of a causal LM on padded batches, and perplexity.

A token is scored when it and the token before it are both real (attention mask 1): with
right padding that is every token after the first; with left padding every token after the
first real one, so the padding in front of a text never "predicts" its first token. The
perplexity of a set of texts is ``exp`` of the mean NLL per scored token, pooled over all
their tokens (not a mean of per-text perplexities).

The SFT of the default world trains on :func:`next_token_nll` and validates with
:class:`NextTokenNLL`; :func:`rlkl_lightning.world.evaluate.perplexity` scores held-out text
with the same metric.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

IGNORE_INDEX = -100


def next_token_nll(
    logits: Tensor, input_ids: Tensor, attention_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Summed negative log-likelihood (nats) of every scored token, and their number.

    Args:
        logits: ``[B, T, V]`` next-token logits at every position (any float dtype; the loss
            is computed in float32 at least).
        input_ids: ``[B, T]`` the tokens.
        attention_mask: ``[B, T]``, 1 (or True) on real tokens, 0 on padding.

    Returns:
        ``(nll_sum, n_tokens)``: scalar tensors; the loss per token is their ratio.
    """
    scored = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    targets = input_ids[:, 1:].masked_fill(~scored, IGNORE_INDEX)
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return nll, scored.sum()


class NextTokenNLL(Metric):
    """Mean next-token NLL (nats per scored token) over every batch given to ``update``.

    ``compute().exp()`` is the perplexity. The sums are reduced across processes by
    torchmetrics, so under DDP every rank gets the NLL of the whole set.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("nll_sum", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("n_tokens", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, logits: Tensor, input_ids: Tensor, attention_mask: Tensor) -> None:
        """Add one batch; arguments as for :func:`next_token_nll`."""
        nll, n_tokens = next_token_nll(logits, input_ids, attention_mask)
        self.nll_sum += nll.detach()
        self.n_tokens += n_tokens

    def compute(self) -> Tensor:
        """The mean NLL per scored token (nan before any token was scored)."""
        return self.nll_sum / self.n_tokens
