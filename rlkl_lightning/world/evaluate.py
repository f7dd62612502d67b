"""Held-out perplexity of a causal LM and of an add-one unigram baseline.

Both score the same tokens: every text is encoded as ``bos + text + eos`` and each
token after ``bos`` is predicted (so the model is also scored on ending the text).
Perplexity is ``exp`` of the mean negative log-likelihood per scored token
(:mod:`rlkl_lightning.perplexity`, which the SFT validation uses too).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlkl_lightning.perplexity import NextTokenNLL
from rlkl_lightning.world.sft import LMCollator, encode_texts


@torch.no_grad()
def perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    batch_size: int = 64,
    max_length: int | None = None,
) -> float:
    """Token-level perplexity of ``model`` on ``texts``.

    Args:
        model: A causal LM returning ``.logits`` (e.g. ``AutoModelForCausalLM``).
        tokenizer: Its tokenizer.
        texts: Texts to score.
        batch_size: Texts per forward pass.
        max_length: Longest sequence in tokens (bos and eos included); ``None``: the
            model's context length (``n_positions`` or ``max_position_embeddings``).
    """
    if max_length is None:
        config = model.config
        max_length = getattr(config, "n_positions", None) or config.max_position_embeddings
    sequences = encode_texts(tokenizer, texts, max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collate = LMCollator(pad)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll = NextTokenNLL().to(device)
    for start in range(0, len(sequences), batch_size):
        batch = {k: v.to(device) for k, v in collate(sequences[start : start + batch_size]).items()}
        nll.update(model(**batch).logits, batch["input_ids"], batch["attention_mask"])
    model.train(was_training)
    return math.exp(float(nll.compute()))


def unigram_perplexity(
    tokenizer, train_texts: Sequence[str], test_texts: Sequence[str], max_length: int = 128
) -> float:
    """Perplexity on ``test_texts`` of an add-one smoothed unigram fit on ``train_texts``.

    ``p(t) = (count(t) + 1) / (N + V)`` over the tokenizer's full vocabulary ``V``,
    counting the same scored tokens (everything after ``bos``) as :func:`perplexity`.
    """
    counts = Counter(t for ids in encode_texts(tokenizer, train_texts, max_length) for t in ids[1:])
    n_train, vocab = sum(counts.values()), len(tokenizer)
    total, count = 0.0, 0
    for ids in encode_texts(tokenizer, test_texts, max_length):
        for token in ids[1:]:
            total -= math.log((counts[token] + 1) / (n_train + vocab))
            count += 1
    return math.exp(total / count)
