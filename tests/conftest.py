"""Shared fixtures: tiny causal LMs and tokenizers made locally (nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One torch thread per test process: `pytest -n 2` then uses the 2 cores without
# oversubscription (torch's OpenMP threads slow down badly when they outnumber the cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

WORDS = (
    "good bad the a film book food was is very not really great awful fine dull "
    "plot taste story and but it this too quite nice poor"
).split()


def make_tiny_lm(
    path: Path, *, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, seed: int = 0
) -> Path:
    """Save a word-level tokenizer and a randomly initialised GPT-2 to ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(vocab),
        n_positions=64,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_same_loss_and_grads(plain, other, loss_tol: dict, grad_tol: dict) -> None:
    """The LM losses of two models on one random batch agree, and so do all their gradients."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(4, plain.config.vocab_size, (3, 12))
    losses = []
    for model in (plain, other):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], **loss_tol)
    for (name, p), q in zip(plain.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **grad_tol, msg=name)


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> Path:
    """A tiny GPT-2 and its tokenizer, saved with ``save_pretrained``."""
    return make_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))


def cpu_trainer(callbacks=(), **settings):
    """A quiet Trainer for one epoch on the CPU.

    No logger, progress bar, model summary or validation, and no checkpoints but those of a
    ``ModelCheckpoint`` among ``callbacks``; ``settings`` (``max_steps``, ``precision``,
    ``logger``, ...) replace these defaults.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    defaults = dict(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    return Trainer(callbacks=list(callbacks), **{**defaults, **settings})


def fit_on_prompts(module, prompts, batch_size=8, callbacks=(), ckpt_path=None, **settings):
    """Train ``module`` over ``prompts`` with ``cpu_trainer(callbacks, **settings)``.

    ``prompts`` is a list of prompts (in batches of ``batch_size``) or a data module.
    """
    from torch.utils.data import DataLoader

    if isinstance(prompts, list):
        prompts = DataLoader(prompts, batch_size=batch_size, collate_fn=lambda xs: {"prompt": xs})
    trainer = cpu_trainer(callbacks, **settings)
    trainer.fit(module, prompts, ckpt_path=ckpt_path)
    return trainer
