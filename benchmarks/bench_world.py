"""The benchmark's fixed, offline worlds: presets, tokenizer, policy, reward and value models.

A preset fixes the model shape and the work of one PPO iteration. Everything is built from
configs with fixed seeds (random weights, nothing from a hub) and saved with
``save_pretrained`` into one directory, so both libraries load the same files:

- ``tokenizer/``: a word-level ``tokenizers`` model over the whole vocabulary (3 specials +
  synthetic words), so every prompt word is one token and decoding then re-encoding a response
  gives the same tokens back (the reward model sees the same tokens in both libraries); in a
  directory of its own, where no model config makes ``AutoTokenizer`` pick the model family's
  own tokenizer class;
- ``policy/``: the causal LM (seed 0); the reference is a frozen copy of it;
- ``reward/``: the sequence-classifier version of the same architecture, one label (seed 1);
- ``value/``: the same classifier architecture (seed 2), the separate value model that
  PPOTrainer requires;
- prompts: ``prompt`` random words each (seed 3), i.e. exactly that many tokens, no padding.

Presets (``--preset``; ``--tiny`` shrinks any of them to seconds on a CPU for the smoke test):

- ``gpt2-4x256``: GPT-2, 4 layers, width 256, 4 heads, vocabulary 4096, 256 positions;
  32 prompts of 16 tokens, 32 sampled tokens: the CPU benchmark;
- ``gpt2-124m``: the shapes of GPT-2 124M (12 layers, width 768, 12 heads, vocabulary 50257,
  1024 positions); 256 prompts of 64 tokens, 64 sampled tokens: for a GPU;
- ``qwen2-0.5b``: the shapes of Qwen2 0.5B (24 layers, width 896, 14 query and 2 key-value
  heads, MLP 4864, vocabulary 151936, tied embeddings); 128 prompts of 64 tokens, 64 sampled
  tokens: for a GPU.

Every preset trains 4 PPO epochs x 4 minibatches per iteration.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

SPECIALS = ("<pad>", "<eos>", "<unk>")
VERSION = 2  # bump when anything below changes: cached worlds are rebuilt


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model shape and per-iteration work of one benchmark world."""

    name: str
    arch: str  # "gpt2" or "qwen2"
    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int  # inner width of the MLP
    vocab: int
    positions: int
    batch: int  # prompts per iteration
    prompt: int  # tokens per prompt
    response: int  # sampled tokens per prompt (no early stop)
    epochs: int = 4
    minibatches: int = 4

    @property
    def layer_weights(self) -> int:
        """Weights of one layer's matrix products (attention projections and MLP)."""
        kv = self.width // self.heads * self.kv_heads
        mlp = (2 if self.arch == "gpt2" else 3) * self.width * self.ffn  # qwen2: gate, up, down
        return self.width * (2 * self.width + 2 * kv) + mlp

    def tiny(self) -> Preset:
        """The same architecture at a size that runs in seconds on a CPU (smoke test)."""
        return dataclasses.replace(
            self,
            name=f"{self.name}-tiny",
            layers=2,
            width=64,
            heads=4,
            kv_heads=4 if self.arch == "gpt2" else 2,
            ffn=256 if self.arch == "gpt2" else 128,
            vocab=512,
            positions=64,
            batch=4,
            prompt=8,
            response=8,
            epochs=2,
            minibatches=2,
        )


PRESETS = {
    "gpt2-4x256": Preset("gpt2-4x256", "gpt2", 4, 256, 4, 4, 1024, 4096, 256, 32, 16, 32),
    "gpt2-124m": Preset("gpt2-124m", "gpt2", 12, 768, 12, 12, 3072, 50257, 1024, 256, 64, 64),
    "qwen2-0.5b": Preset("qwen2-0.5b", "qwen2", 24, 896, 14, 2, 4864, 151936, 32768, 128, 64, 64),
}


def preset(name: str, tiny: bool = False, batch: int | None = None) -> Preset:
    """The preset ``name`` (``tiny``: its smoke-test size; ``batch``: other prompts/iteration)."""
    chosen = PRESETS[name].tiny() if tiny else PRESETS[name]
    return dataclasses.replace(chosen, batch=batch) if batch else chosen


def _words(count: int) -> list[str]:
    rng = random.Random(12345)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 8))))
    return sorted(words)


def model_config(p: Preset, **extra):
    """The transformers config of the preset's models (pad 0, eos 1)."""
    ids = {"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}
    if p.arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            n_layer=p.layers,
            n_embd=p.width,
            n_head=p.heads,
            n_inner=p.ffn,
            vocab_size=p.vocab,
            n_positions=p.positions,
            **ids,
            **extra,
        )
    from transformers import Qwen2Config

    return Qwen2Config(
        num_hidden_layers=p.layers,
        hidden_size=p.width,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        intermediate_size=p.ffn,
        vocab_size=p.vocab,
        max_position_embeddings=p.positions,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        **ids,
        **extra,
    )


def build(root: Path, p: Preset) -> Path:
    """Build (or reuse) the world of preset ``p`` under ``root``; returns ``root``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    root = Path(root)
    stamp = root / "world.json"
    work = ("batch", "prompt", "response", "epochs", "minibatches")  # not in the files
    shapes = {k: v for k, v in dataclasses.asdict(p).items() if k not in work}
    wanted = {"version": VERSION, "models": shapes}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return root
    root.mkdir(parents=True, exist_ok=True)

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *_words(p.vocab - len(SPECIALS))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(root / "tokenizer")

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config(p)).save_pretrained(root / "policy")
    for seed, sub in ((1, "reward"), (2, "value")):
        torch.manual_seed(seed)
        config = model_config(p, num_labels=1)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(root / sub)
    stamp.write_text(json.dumps(wanted))
    return root


def prompts(p: Preset, n: int) -> list[str]:
    """``n`` prompts of exactly ``p.prompt`` words (= tokens), fixed seed."""
    rng = random.Random(3)
    words = _words(p.vocab - len(SPECIALS))
    return [" ".join(rng.choice(words) for _ in range(p.prompt)) for _ in range(n)]
