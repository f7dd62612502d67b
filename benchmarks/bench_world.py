"""The benchmark's fixed, offline world: tokenizer, policy, reward and value models, prompts.

Everything is built from configs with fixed seeds and saved with ``save_pretrained`` into one
directory, so both libraries load the same files:

- tokenizer: a word-level ``tokenizers`` model over 4096 entries (3 specials + 4093 synthetic
  words), so every prompt word is one token and decoding then re-encoding a response gives the
  same tokens back (the reward model sees the same 48 tokens in both libraries);
- ``policy/``: GPT-2, 4 layers, width 256, 4 heads, vocabulary 4096, 256 positions, random
  weights (seed 0); the reference is a frozen copy of it;
- ``reward/``: ``GPT2ForSequenceClassification`` of the same size with one label (seed 1);
- ``value/``: the same classifier architecture (seed 2), the separate value model that
  PPOTrainer requires;
- prompts: 16 random words each (seed 3), i.e. exactly 16 tokens, no padding.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

N_LAYER, N_EMBD, N_HEAD, VOCAB, N_POSITIONS = 4, 256, 4, 4096, 256
SPECIALS = ("<pad>", "<eos>", "<unk>")
PROMPT_TOKENS = 16
VERSION = 1  # bump when anything below changes: cached worlds are rebuilt


def _words() -> list[str]:
    rng = random.Random(12345)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < VOCAB - len(SPECIALS):
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 8))))
    return sorted(words)


def gpt2_config(**extra):
    """The benchmark's GPT-2 configuration (pad 0, eos 1)."""
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=N_LAYER,
        n_embd=N_EMBD,
        n_head=N_HEAD,
        vocab_size=VOCAB,
        n_positions=N_POSITIONS,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        **extra,
    )


def build(root: Path) -> Path:
    """Build (or reuse) the world under ``root``; returns ``root``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

    root = Path(root)
    stamp = root / "world.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("version") == VERSION:
        return root
    root.mkdir(parents=True, exist_ok=True)

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *_words()])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    for sub in ("policy", "reward", "value"):
        tokenizer.save_pretrained(root / sub)

    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config()).save_pretrained(root / "policy")
    torch.manual_seed(1)
    GPT2ForSequenceClassification(gpt2_config(num_labels=1)).save_pretrained(root / "reward")
    torch.manual_seed(2)
    GPT2ForSequenceClassification(gpt2_config(num_labels=1)).save_pretrained(root / "value")
    stamp.write_text(json.dumps({"version": VERSION}))
    return root


def prompts(n: int) -> list[str]:
    """``n`` prompts of exactly ``PROMPT_TOKENS`` words (= tokens), fixed seed."""
    rng = random.Random(3)
    words = _words()
    return [" ".join(rng.choice(words) for _ in range(PROMPT_TOKENS)) for _ in range(n)]
