"""A byte-level BPE tokenizer trained on the default world's corpus.

Byte-level BPE (the GPT-2 scheme) never meets an unknown character, so the tokenizer
can also encode whatever a policy writes. It is wrapped as a ``transformers`` fast
tokenizer with three special tokens:

- ``<|bos|>``, added in front of every encoded text by the tokenizer itself, so that
  ``tokenizer(prompt)`` starts a review exactly as the SFT model saw it in training;
- ``<|eos|>``, which ends every training text (the model learns to stop);
- ``<|pad|>``, with ``padding_side="left"`` saved in the tokenizer config, which is
  what batched generation needs (the SFT collate pads on the right by itself).

:func:`~rlkl_lightning.models.tokenizer.pretrained_tokenizer` (kept importable from here) loads
this or any saved or hub tokenizer as it was saved; the SFT
(:func:`rlkl_lightning.world.sft.resolve_tokenizer`) and PPO
(:func:`rlkl_lightning.models.loading.load_tokenizer`, which then sets it up for generation) both
load through it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from rlkl_lightning.models.tokenizer import pretrained_tokenizer  # noqa: F401  (its old home)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, max_length: int = 128
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for ``transformers``.

    Args:
        texts: Training texts (the train split).
        vocab_size: Size of the vocabulary, special tokens and the 256 bytes included.
        max_length: ``model_max_length`` recorded in the tokenizer (the model context).

    Returns:
        A ``PreTrainedTokenizerFast`` with bos/eos/pad tokens and left padding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size <= minimum:
        raise ValueError(f"train_tokenizer: `vocab_size` must be > {minimum}, got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    bos_id = core.token_to_id(BOS)
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        model_max_length=max_length,
    )
