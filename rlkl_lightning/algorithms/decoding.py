"""What the eager sampling loop and the compiled decode step share, so they sample alike.

The KV cache of the prompt's forward, the filtering of the logits, the inverse-CDF draw, the
scores kept without the logits and the loop's end after every row stopped
(:func:`~rlkl_lightning.algorithms.rollout.sample_and_score` and
:mod:`~rlkl_lightning.algorithms.compiled_decode` both use them). Shapes as in
:mod:`~rlkl_lightning.algorithms.rollout`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def kv_cache(policy: nn.Module, capacity: int):
    """A ``DynamicCache`` whose full-attention layers write into buffers allocated once.

    ``DynamicLayer`` grows by concatenation, copying the whole cache at every step of every
    layer; ``_PreallocatedLayer`` writes the new keys and values in place and hands out
    views. Other layer kinds (sliding windows, ...) keep transformers' own classes.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class _PreallocatedLayer(DynamicLayer):
        _layer_type = None  # never registered in transformers' layer-type mappings

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            b, h, _, dk = key_states.shape
            self._keys = key_states.new_empty(b, h, capacity, dk)
            self._values = value_states.new_empty(b, h, capacity, value_states.shape[-1])
            self._length = 0

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, end = self._length, self._length + key_states.shape[-2]
            if end > capacity:  # not reached by sample_and_score; stay correct anyway
                return super().update(key_states, value_states, *args, **kwargs)
            self._keys[:, :, start:end] = key_states
            self._values[:, :, start:end] = value_states
            self._length = end
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
            return self.keys, self.values

    cache = DynamicCache(config=policy.config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [_PreallocatedLayer() for _ in cache.layers]
    return cache


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Top-k, then nucleus (top-p) truncation of ``[B, V]`` logits; removed entries are ``-inf``.

    Nucleus sampling keeps the smallest set of most likely tokens whose probability reaches
    ``top_p`` (Holtzman et al. 2020, arXiv 1904.09751), and always the most likely token.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(
            -1, order, mass_before >= top_p
        )
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(probs: Tensor) -> Tensor:
    """One sample per row of ``[B, V]`` probabilities, by inverting the CDF: ``[B, 1]`` ids.

    With ``u ~ U[0, total)`` the token is the first index whose cumulative probability exceeds
    ``u``, so token ``i`` is drawn with probability ``p_i / total``, never a token of
    probability 0. One uniform number per row; ``torch.multinomial`` draws an exponential
    number per vocabulary entry, which dominated the sampling step on CPU. The CDF is
    accumulated in float64 so the probabilities are kept to float32 precision.
    """
    uniform = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    return invert_cdf(probs, uniform)


def invert_cdf(probs: Tensor, uniform: Tensor) -> Tensor:
    """:func:`draw` with its ``[B, 1]`` float64 numbers in ``[0, 1)`` given (a compiled step's)."""
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(
        max=probs.shape[-1] - 1
    )


def picked_scores(logits: Tensor, token: Tensor, eos: int | None, pad: int) -> Tensor:
    """``[B, 3]``: the logits of ``token`` and of ``pad``, and the row's log-sum-exp.

    Without an eos no position is padded, and ``pad`` may be no token: ``token`` stands in.
    """
    filler = token if eos is None else token.new_full(token.shape, pad)
    chosen = logits.gather(1, torch.cat([token, filler], 1))
    return torch.cat([chosen, torch.logsumexp(logits, dim=-1, keepdim=True)], 1)


def all_stopped(
    finished: Tensor,
    token: Tensor,
    step: int,
    every: int,
    eos: int | None,
    generator: torch.Generator | None,
    states: list[Tensor],
) -> bool:
    """One step's token for the stopping rule: True once every row has drawn ``eos``.

    Marks the rows that drew it in ``finished`` (in place), keeps the generator's state in
    ``states`` and checks every ``every`` steps only (a check reads the device).
    """
    if eos is None:
        return False
    finished |= token[:, 0] == eos
    if generator is not None:
        states.append(generator.get_state())
    return (step + 1) % every == 0 and bool(finished.all())


def steps_kept(
    tokens: list[Tensor],
    all_logits: Tensor | None,
    hidden_steps: list[Tensor],
    picked: list[Tensor],
    states: list[Tensor],
    every: int,
    eos: int | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """A loop's steps as the sampling loop returns them, without those after the last stop.

    ``all_logits``: ``[B, max_new_tokens, V]`` (or None); the lists hold one entry per step
    run, ``states`` the generator's state after each (where ``every > 1``).
    """
    response_ids = torch.cat(tokens, dim=1)
    if every > 1 and bool((response_ids == eos).any(dim=1).all()):
        # Every row stopped, maybe before the last check: keep the steps up to the last stop.
        length = int((response_ids == eos).int().argmax(dim=1).max()) + 1
        if length < len(tokens):
            response_ids = response_ids[:, :length]
            hidden_steps, picked = hidden_steps[:length], picked[:length]
            generator.set_state(states[length - 1])
    length = response_ids.shape[1]
    if all_logits is not None and length < all_logits.shape[1]:
        all_logits = all_logits[:, :length].contiguous()
    scores = torch.stack(picked, dim=1) if picked else None
    return response_ids, all_logits, torch.stack(hidden_steps, dim=1), scores
