"""Padding-free forward passes: a micro-batch's sequences packed into rows of a token budget.

A micro-batch's ``[B, P + R]`` rows are left-padded prompts and right-padded responses (the
responses stop at EOS). With ``optimization.packing="packed"`` the update forwards instead each
sequence's real tokens, from its first prompt token to the last one that predicts a response
token, packed one after another into ``n <= B`` rows of ``L`` tokens, with
``attention_mask=None`` and position ids restarting at 0 for each sequence: transformers then
builds the block-diagonal causal mask from the position ids (``find_packed_sequence_indices``),
so no token attends across sequences. The last hidden states at the positions that predict
each response token are gathered back into the ``[B, R, H]`` layout (zeros where the response
mask is 0), so the losses, masks and aggregation see the padded pass's tensors.

**The row budget.** ``L`` is the longest packed sequence rounded up to a bucket of
:data:`BUCKETS` (so shapes repeat from batch to batch: a compiled pass sees few of them), but
never more than ``P + R``, the padded row's length. Sequences are placed first-fit by
decreasing length, so no row holds more than ``L`` tokens and there are never more rows than
sequences: attention, ``n x L^2`` with the dense block-diagonal mask, cannot grow past the
padded pass's ``B x (P + R)^2``, and the other products, ``n x L`` tokens, shrink with the
padding share.

The positions a sequence keeps are those its ``attention_mask`` marks, in order, with the
position ids the padded pass gives them (``cumsum(mask) - 1``), so each kept token attends to
exactly the keys it attends to there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from rlkl_lightning.models.forward import LMOutput, head_products, plain_lm_head_weight
from rlkl_lightning.models.sharding import is_fsdp

#: ``optimization.packing``: ``none`` (the padded rows) or ``packed`` (this module).
PACKINGS = ("none", "packed")

#: Packed row lengths: 16 x 2^k and 24 x 2^k, two per octave (a row is at most 1.5x its longest
#: sequence, or the padded row's length where that is shorter).
BUCKETS = tuple(sorted({base << k for base in (16, 24) for k in range(16)}))

#: The attention implementations whose masks transformers builds from packed position ids.
PACKABLE_ATTENTION = ("sdpa", "eager")


class PackedRows(NamedTuple):
    """A micro-batch's sequences packed into rows, and where each response position went.

    Attributes:
        input_ids: ``[n, L]`` the packed tokens (filler after the last sequence of a row).
        position_ids: ``[n, L]`` restarting at 0 with each sequence (and at the filler).
        source: ``[B, R]`` long, for response position ``t`` of sequence ``b`` the flat index
            ``row x L + column`` of the packed position that predicts it, or ``n x L`` (a zero
            row appended when gathering) where ``response_mask`` is 0.
        padded_positions: ``B x (P + R)``, the padded pass's token positions.
    """

    input_ids: Tensor
    position_ids: Tensor
    source: Tensor
    padded_positions: int

    @property
    def positions(self) -> int:
        """``n x L``, the packed pass's token positions."""
        return self.input_ids.numel()


def bucket(length: int, cap: int) -> int:
    """The smallest of :data:`BUCKETS` at least ``length``, but at most ``cap``."""
    for size in BUCKETS:
        if size >= length:
            return min(size, cap)
    return cap


def pack(attention_mask: Tensor, response_mask: Tensor, input_ids: Tensor) -> PackedRows:
    """Pack the sequences of ``[B, P + R]`` padded rows (module docstring: the row budget).

    Raises:
        ValueError: If a position that predicts a response token is masked out (an empty
            prompt), which the packed rows cannot hold.
    """
    batch, width = attention_mask.shape
    steps = response_mask.shape[1]
    device = attention_mask.device
    prompt = width - steps
    valid = response_mask > 0
    # The last input position a sequence needs: the one that predicts its last valid token.
    last = (valid * torch.arange(steps, device=device)).amax(1)  # 0 with none
    columns = torch.arange(width, device=device)
    keep = attention_mask.bool() & (columns <= (prompt - 1 + last).unsqueeze(1))
    predicting = keep[:, prompt - 1 : prompt - 1 + steps]
    if bool((valid & ~predicting).any()):
        raise ValueError(
            "`optimization.packing`='packed': a position that predicts a response token is "
            "masked out (an empty prompt?); use 'none'"
        )
    lengths = keep.sum(1).tolist()
    row_length = bucket(max(lengths), width)
    rows: list[int] = []  # tokens used per row
    row_of, offset = [0] * batch, [0] * batch
    for b in sorted(range(batch), key=lambda b: -lengths[b]):  # first fit, decreasing
        for r, used in enumerate(rows):
            if used + lengths[b] <= row_length:
                break
        else:
            r = len(rows)
            rows.append(0)
        row_of[b], offset[b] = r, rows[r]
        rows[r] += lengths[b]
    n = len(rows)
    within = keep.long().cumsum(1) - 1  # the padded pass's position ids on kept tokens
    start = torch.tensor(row_of, device=device) * row_length + torch.tensor(offset, device=device)
    target = start.unsqueeze(1) + within  # [B, P + R] flat packed index of each kept token
    used = torch.tensor(rows, device=device)
    flat_columns = torch.arange(row_length, device=device).repeat(n)
    flat_rows = torch.arange(n, device=device).repeat_interleave(row_length)
    positions = (flat_columns - used[flat_rows]).clamp(min=0)  # filler restarts at 0
    tokens = torch.zeros(n * row_length, dtype=input_ids.dtype, device=device)
    tokens[target[keep]] = input_ids[keep]
    positions[target[keep]] = within[keep]
    filler = torch.full_like(target[:, :steps], n * row_length)
    source = torch.where(valid, target[:, prompt - 1 : prompt - 1 + steps], filler)
    shape = (n, row_length)
    return PackedRows(tokens.view(shape), positions.view(shape), source, batch * width)


def gather_rows(packed: Tensor, rows: PackedRows) -> Tensor:
    """``[n, L, D]`` packed per-position values to the ``[B, R, D]`` layout (0 off the mask)."""
    flat = packed.reshape(-1, packed.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
    return flat[rows.source.reshape(-1)].view(*rows.source.shape, -1)


def check_packable(model: nn.Module) -> None:
    """Refuse, by name, a model whose packed pass would not be the padded pass's.

    Raises:
        ValueError: Under FSDP, or with an attention implementation that does not build its
            mask from packed position ids.
    """
    if is_fsdp(model):
        raise ValueError("`optimization.packing`='packed' is not supported under FSDP: use 'none'")
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in PACKABLE_ATTENTION:
        raise ValueError(
            f"`optimization.packing`='packed' needs an attention implementation in "
            f"{PACKABLE_ATTENTION} (masks built from position ids), got {attention!r}: "
            "use 'none'"
        )


def _packed_inputs(rows: PackedRows) -> dict:
    return {
        "input_ids": rows.input_ids,
        "attention_mask": None,
        "position_ids": rows.position_ids,
        "use_cache": False,
    }


def packed_trunk_forward(model: nn.Module, rows: PackedRows) -> Tensor:
    """:func:`~rlkl_lightning.models.forward.trunk_forward` over packed rows: ``[B, R, H]``.

    The last hidden states at the positions that predict each response token (the padded
    pass's ``trunk_forward(...)[:, :-1]``), zeros where the response mask is 0.
    """
    if plain_lm_head_weight(model) is None:
        return packed_lm_forward(model, rows).hidden
    out = model.base_model(**_packed_inputs(rows))
    return gather_rows(out.last_hidden_state, rows)


def packed_lm_forward(model: nn.Module, rows: PackedRows) -> LMOutput:
    """:func:`~rlkl_lightning.models.forward.lm_forward` over packed rows: ``[B, R, *]``.

    The logits and last hidden states at the positions that predict each response token;
    with a plain LM head the head is applied to those positions alone.
    """
    weight = plain_lm_head_weight(model)
    if weight is not None:
        hidden = gather_rows(model.base_model(**_packed_inputs(rows)).last_hidden_state, rows)
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = head_products(model).linear(flat, weight)
        return LMOutput(logits.view(*hidden.shape[:2], -1), hidden)
    out = model(**_packed_inputs(rows), output_hidden_states=True)
    return LMOutput(gather_rows(out.logits, rows), gather_rows(out.hidden_states[-1], rows))
