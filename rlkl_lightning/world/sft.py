"""Supervised fine-tuning (next-token prediction) of a small GPT-2 on review text.

``SFTModule`` trains a GPT-2-architecture model from scratch; ``SFTDataModule``
feeds it texts formatted as ``bos + text + eos``. Both take typed, documented
arguments so LightningCLI can build them from YAML::

    python train.py fit --config configs/sft.yaml

``build_world`` (:mod:`rlkl_lightning.world.build`) uses the same two classes to make the
default world's reference model; their defaults are ``WorldConfig``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.checkpoints import plain, plain_hyperparameters
from rlkl_lightning.perf.gelu import fuse_tanh_gelu
from rlkl_lightning.perplexity import NextTokenNLL, next_token_nll
from rlkl_lightning.texts import load_texts
from rlkl_lightning.world.cache import build_corpus
from rlkl_lightning.world.config import WorldConfig
from rlkl_lightning.world.tokenizer import pretrained_tokenizer


def resolve_tokenizer(tokenizer: str, world: WorldConfig | None = None):
    """Load a tokenizer by path or hub name; ``"default"``: the default world's tokenizer.

    It is loaded as saved (:func:`~rlkl_lightning.world.tokenizer.pretrained_tokenizer`):
    the SFT pads on the right by itself, and a tokenizer without a pad token pads with eos.
    """
    if tokenizer == "default":
        tokenizer = str(build_corpus(world).tokenizer_dir)
    return pretrained_tokenizer(tokenizer)


def encode_texts(tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of ``bos + text + eos`` for each text, cut to ``max_length`` tokens.

    The default world's tokenizer adds bos itself; for tokenizers that do not (GPT-2),
    bos is added here when the tokenizer has one.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encoded = tokenizer(
        list(texts), add_special_tokens=True, truncation=True, max_length=max_length
    )["input_ids"]
    out = []
    for ids in encoded:
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if eos is not None:
            ids = [*ids, eos]
        out.append(ids[:max_length])
    return out


class LMCollator:
    """Right-pads token id lists into ``input_ids`` and ``attention_mask``.

    Args:
        pad_token_id: Id used for padding positions of ``input_ids``.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        """Pad one batch."""
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        return {"input_ids": input_ids, "attention_mask": mask}


def length_grouped_batches(
    sequences: list[list[int]], batch_size: int, seed: int, window: int = 64
) -> list[list[list[int]]]:
    """Cut sequences into batches of similar length, to pad little.

    The sequences are shuffled, then each window of ``window * batch_size`` of them is
    sorted by length and cut into batches. On short, varied texts this halves the
    padded tokens compared with random batches. The batches are fixed; the loader
    shuffles their order every epoch (and shards them under DDP).
    """
    import random

    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    batches = []
    span = window * batch_size
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lambda i: len(sequences[i]))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [[sequences[i] for i in batch] for batch in batches]


class SFTDataModule(LightningDataModule):
    """Texts for SFT, each formatted as ``bos + text + eos``.

    Training batches group texts of similar length (see :func:`length_grouped_batches`).

    Args:
        tokenizer: Tokenizer path or hub name; ``"default"``: the default world's.
        train_files: Training text (file(s), dataset directory or hub name, read with
            ``datasets``); ``None``: the default world's train split.
        val_files: Validation text, same forms; ``None``: the default world's
            validation split.
        text_column: Column holding the text.
        max_length: Longest sequence in tokens (bos and eos included).
        batch_size: Sequences per batch.
        num_workers: DataLoader worker processes.
        seed: Seed of the training shuffle.
        world: Config of the default world (``None``: the standard one).
    """

    def __init__(
        self,
        tokenizer: str = "default",
        train_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        text_column: str = "text",
        max_length: int = WorldConfig.n_positions,
        batch_size: int = WorldConfig.batch_size,
        num_workers: int = 0,
        seed: int = WorldConfig.seed,
        world: WorldConfig | None = None,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"SFTDataModule: `max_length` must be >= 2, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"SFTDataModule: `batch_size` must be >= 1, got {batch_size}")
        self.save_hyperparameters(ignore=["world"])
        self.hparams.update(plain(dict(self.hparams)))  # paths as str: see resumable.plain
        self.world = world
        self.train_data: list[list[int]] | None = None
        self.train_batches: list[list[list[int]]] | None = None
        self.val_data: list[list[int]] | None = None
        self.collate: LMCollator | None = None

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and tokenize the texts."""
        if self.train_data is not None:
            return
        hp = self.hparams
        tokenizer = resolve_tokenizer(hp.tokenizer, self.world)
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
            raise ValueError("SFTDataModule: `tokenizer` has neither a pad nor an eos token")
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.collate = LMCollator(pad)
        sources = {"train_files": hp.train_files, "val_files": hp.val_files}
        if None in sources.values():
            corpus = build_corpus(self.world)
            sources["train_files"] = sources["train_files"] or str(corpus.splits["train"])
            sources["val_files"] = sources["val_files"] or str(corpus.splits["validation"])
        texts = {
            name: load_texts(
                source,
                hp.text_column,
                owner="SFTDataModule",
                source_option=name,
                column_option="text_column",
            )
            for name, source in sources.items()
        }
        self.train_data = encode_texts(tokenizer, texts["train_files"], hp.max_length)
        self.train_batches = length_grouped_batches(self.train_data, hp.batch_size, hp.seed)
        self.val_data = encode_texts(tokenizer, texts["val_files"], hp.max_length)

    @property
    def num_train_tokens(self) -> int:
        """Tokens in the training set (bos and eos included)."""
        return sum(len(s) for s in self.train_data or [])

    @override
    def train_dataloader(self) -> DataLoader:
        """Length-grouped training batches in shuffled order."""
        return DataLoader(
            self.train_batches,  # each item is already a batch
            batch_size=None,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.hparams.seed),
            collate_fn=self.collate,
            num_workers=self.hparams.num_workers,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        """Validation batches in file order."""
        return DataLoader(
            self.val_data,
            batch_size=self.hparams.batch_size,
            collate_fn=self.collate,
            num_workers=self.hparams.num_workers,
        )


class SFTModule(LightningModule):
    """Trains a GPT-2-architecture causal LM from scratch on next-token loss.

    Logs ``train/loss`` (nats per token), ``val/loss`` and ``val/perplexity``
    (token-weighted over the whole validation set).

    Args:
        tokenizer: Tokenizer path or hub name; ``"default"``: the default world's.
            Gives the vocabulary size and the bos/eos/pad ids of the model.
        n_layer: Transformer blocks.
        n_head: Attention heads per block.
        n_embd: Width of the residual stream.
        n_positions: Context length in tokens.
        dropout: Dropout of embeddings, attention and residual paths.
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW weight decay, applied to weight matrices only.
        warmup_steps: Linear warm-up steps before the cosine decay.
        min_lr_ratio: Learning rate at the end of the cosine, as a fraction of ``lr``.
        seed: Seed of the weight initialisation.
        export_dir: If set, the model and tokenizer are saved there with
            ``save_pretrained`` when training ends (``AutoModelForCausalLM`` loads them).
        world: Config of the default world (``None``: the standard one).
    """

    def __init__(
        self,
        tokenizer: str = "default",
        n_layer: int = WorldConfig.n_layer,
        n_head: int = WorldConfig.n_head,
        n_embd: int = WorldConfig.n_embd,
        n_positions: int = WorldConfig.n_positions,
        dropout: float = 0.0,
        lr: float = WorldConfig.lr,
        weight_decay: float = WorldConfig.weight_decay,
        warmup_steps: int = WorldConfig.warmup_steps,
        min_lr_ratio: float = 0.1,
        seed: int = WorldConfig.seed,
        export_dir: str | None = None,
        world: WorldConfig | None = None,
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        if n_embd % n_head:
            raise ValueError(
                f"SFTModule: `n_embd` ({n_embd}) must be divisible by `n_head` ({n_head})"
            )
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_positions", n_positions)):
            if value < 1:
                raise ValueError(f"SFTModule: `{name}` must be >= 1, got {value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"SFTModule: `dropout` must be in [0, 1), got {dropout}")
        if lr <= 0 or weight_decay < 0 or warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(
                "SFTModule: need `lr` > 0, `weight_decay` >= 0, `warmup_steps` >= 0 and "
                f"0 <= `min_lr_ratio` <= 1; got {lr}, {weight_decay}, {warmup_steps}, "
                f"{min_lr_ratio}"
            )
        self.save_hyperparameters(ignore=["world"])
        self.hparams.update(plain(dict(self.hparams)))  # e.g. a numpy lr: see resumable.plain
        self.tokenizer = resolve_tokenizer(tokenizer, world)
        tok = self.tokenizer
        config = GPT2Config(
            vocab_size=len(tok),
            n_positions=n_positions,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = GPT2LMHeadModel(config)
        fuse_tanh_gelu(self.model)  # GPT-2's GELU as one kernel (the RL pipeline does the same)
        self.val_nll = NextTokenNLL()

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Logits of the causal LM."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean next-token loss of the batch (nats per token)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        nll, n_tokens = next_token_nll(self(ids, mask), ids, mask)
        loss = nll / n_tokens.clamp(min=1)
        self.log("train/loss", loss, prog_bar=True, batch_size=int(n_tokens))
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate the validation loss over all tokens."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        self.val_nll.update(self(ids, mask), ids, mask)

    @override
    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss`` and ``val/perplexity`` over the whole validation set."""
        loss = self.val_nll.compute()
        self.val_nll.reset()
        self.log(keys.VAL_LOSS, loss, prog_bar=True)
        self.log(keys.PERPLEXITY, loss.exp())

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Store the hyperparameters as plain values (checkpoints load with weights_only=True)."""
        plain_hyperparameters(checkpoint)

    @override
    def on_train_end(self) -> None:
        """Export to ``export_dir`` (global rank 0) if set."""
        if self.hparams.export_dir and self.trainer.is_global_zero:
            self.save_pretrained(self.hparams.export_dir)

    @override
    def configure_optimizers(self):
        """AdamW with linear warm-up and cosine decay, stepped every batch."""
        hp = self.hparams
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            betas=(0.9, 0.95),
            fused=decay[0].device.type in ("cpu", "cuda"),  # one kernel over all parameters
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(hp.warmup_steps, total - 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (
                1 + math.cos(math.pi * progress)
            )

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def save_pretrained(self, directory: str | Path) -> Path:
        """Save model, generation defaults and tokenizer in one directory.

        The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.
        """
        directory = Path(directory)
        model = self.model
        model.generation_config.bos_token_id = model.config.bos_token_id
        model.generation_config.eos_token_id = model.config.eos_token_id
        model.generation_config.pad_token_id = model.config.pad_token_id
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return directory
