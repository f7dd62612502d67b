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

**The row budget.** A row's length ``L`` is ``P + R``, the padded row's length, or one of
:data:`BUCKETS` at least the longest packed sequence: shapes repeat from batch to batch (a
compiled pass sees few of them). Sequences are placed first fit by decreasing length into ``n``
rows of ``L``; of the lengths whose attention, ``n x L^2`` with the dense block-diagonal mask,
stays within the padded pass's ``B x (P + R)^2``, the one with the fewest positions ``n x L``
is taken (the shorter on a tie). ``L = P + R`` always qualifies (no more rows than
sequences), so the packed pass never attends over more than the padded one, and its other
products, over ``n x L`` positions, shrink with the padding.

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

#: Packed row lengths besides the padded row's: 16 x 2^k and 24 x 2^k, two per octave.
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


def kept_tokens(attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    """``[B, P + R]`` bool: the tokens a packed pass forwards of padded rows.

    Those the attention mask marks, up to the one that predicts the last response token whose
    response mask is nonzero (the prompt alone where none is).
    """
    width, steps = attention_mask.shape[1], response_mask.shape[1]
    device = attention_mask.device
    last = ((response_mask > 0) * torch.arange(steps, device=device)).amax(1)  # 0 with none
    end = width - steps - 1 + last
    return attention_mask.bool() & (torch.arange(width, device=device) <= end.unsqueeze(1))


def row_lengths(longest: int, width: int, batch: int) -> list[int]:
    """The row lengths a pack may take: ``width`` and the buckets from ``longest`` up.

    Only those whose rows could keep within the padded pass's attention at all
    (``L^2 <= batch x width^2``).
    """
    sizes = {size for size in BUCKETS if longest <= size and size * size <= batch * width**2}
    return sorted(sizes | {width})


def first_fit(lengths: list[int], row_length: int) -> tuple[list[int], list[int], list[int]]:
    """Sequences of ``lengths`` into rows of ``row_length``, first fit by decreasing length.

    Returns each row's tokens, and each sequence's row and offset in it.
    """
    rows: list[int] = []
    row_of, offset = [0] * len(lengths), [0] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        for r, used in enumerate(rows):
            if used + lengths[b] <= row_length:
                break
        else:
            r = len(rows)
            rows.append(0)
        row_of[b], offset[b] = r, rows[r]
        rows[r] += lengths[b]
    return rows, row_of, offset


def pack(
    attention_mask: Tensor, response_mask: Tensor, input_ids: Tensor, row_length: int | None = None
) -> PackedRows:
    """Pack the sequences of ``[B, P + R]`` padded rows (module docstring: the row budget).

    ``row_length``: rows of this many tokens (at least the longest sequence) instead of the
    budget's choice, as a compiled pass asks for fewer shapes.

    Raises:
        ValueError: If a position that predicts a response token is masked out (an empty
            prompt), which the packed rows cannot hold.
    """
    batch, width = attention_mask.shape
    steps = response_mask.shape[1]
    device = attention_mask.device
    prompt = width - steps
    valid = response_mask > 0
    keep = kept_tokens(attention_mask, response_mask)
    if bool((valid & ~keep[:, prompt - 1 : prompt - 1 + steps]).any()):
        raise ValueError(
            "`optimization.packing`='packed': a position that predicts a response token is "
            "masked out (an empty prompt?); use 'none'"
        )
    lengths = keep.sum(1).tolist()
    options = []
    sizes = row_lengths(max(lengths), width, batch) if row_length is None else [row_length]
    for size in sizes:
        placed = first_fit(lengths, size)
        if row_length or len(placed[0]) * size * size <= batch * width * width:  # the padded's
            options.append((len(placed[0]) * size, size, placed))
    _, row_length, (rows, row_of, offset) = min(options, key=lambda option: option[:2])
    n = len(rows)
    within = keep.long().cumsum(1) - 1  # the padded pass's position ids on kept tokens
    start = torch.tensor(row_of, device=device) * row_length + torch.tensor(offset, device=device)
    target = start.unsqueeze(1) + within  # [B, P + R] flat packed index of each kept token
    used = torch.tensor(rows, device=device)
    flat_columns = torch.arange(row_length, device=device).repeat(n)
    flat_rows = torch.arange(n, device=device).repeat_interleave(row_length)
    # Filler restarts at 0 (and again every `width`: within the model's positions).
    positions = (flat_columns - used[flat_rows]).clamp(min=0) % width
    tokens = torch.zeros(n * row_length, dtype=input_ids.dtype, device=device)
    tokens[target[keep]] = input_ids[keep]
    positions[target[keep]] = within[keep]
    filler = torch.full_like(target[:, :steps], n * row_length)
    source = torch.where(valid, target[:, prompt - 1 : prompt - 1 + steps], filler)
    shape = (n, row_length)
    return PackedRows(tokens.view(shape), positions.view(shape), source, batch * width)


def pad_rows(rows: PackedRows, count: int) -> PackedRows:
    """``rows`` with filler rows added up to ``count`` (fixed shapes for a compiled pass).

    A filler row holds token 0 at positions restarting every ``P + R`` tokens, as a row's
    filler does; no response position reads it (``source``'s zero row moves past it).
    """
    n, length = rows.input_ids.shape
    if count < n:
        raise ValueError(f"pad_rows: {n} packed rows do not fit {count}")
    if count == n:
        return rows
    width = rows.padded_positions // rows.source.shape[0]
    more = count - n
    filler = torch.arange(length, device=rows.position_ids.device) % width
    return PackedRows(
        torch.cat([rows.input_ids, rows.input_ids.new_zeros(more, length)]),
        torch.cat([rows.position_ids, filler.to(rows.position_ids.dtype).expand(more, length)]),
        torch.where(rows.source == n * length, count * length, rows.source),
        rows.padded_positions,
    )


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
