"""Write a trained policy as a plain Hugging Face model, LoRA adapters merged into its weights.

    python -m rlkl_lightning.export runs/ppo/version_0/checkpoints/last.ckpt exported/

The checkpoint's hyperparameters name the policy and its ``peft`` config; the base weights
are loaded from there (checkpoints leave the frozen ones out, except those a reference refresh
changed, which are taken from the checkpoint), the trained weights from the checkpoint, every
one of them checked (:func:`~rlkl_lightning.models.lora.load_trainable`), and the adapters are
merged (``merge_and_unload``). The result, and the tokenizer, load with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``, without ``peft``.
"""

from __future__ import annotations

import argparse
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from rlkl_lightning.migrations import upgrade_init_args


def export_policy(
    hparams: Mapping[str, Any], state_dict: Mapping[str, Tensor], directory: str | Path
) -> Path:
    """Rebuild the policy from ``hparams``, load its trained weights, merge, save.

    Args:
        hparams: The module's hyperparameters (``policy``, ``tokenizer``, ``models.peft``).
        state_dict: The module's weights (keys ``policy.*``; frozen ones may be missing).
        directory: Where to write the model and tokenizer.

    Returns:
        ``directory``.
    """
    from rlkl_lightning.models.loading import load_causal_lm, resolve_model_path
    from rlkl_lightning.models.lora import attach_adapters, load_trainable
    from rlkl_lightning.models.tokenizer import pretrained_tokenizer

    hparams = upgrade_init_args(hparams)  # a checkpoint of an older version: today's names
    model = load_causal_lm(hparams["policy"], option="policy")
    state = {k.removeprefix("policy."): v for k, v in state_dict.items() if k.startswith("policy.")}
    peft = (hparams.get("models") or {}).get("peft")
    wrapped = attach_adapters(model, peft) if peft is not None else None
    load_trainable(model, state, "export")
    if wrapped is not None:
        model = wrapped.merge_and_unload()
    out = Path(directory)
    model.save_pretrained(out)
    name = hparams.get("tokenizer") or hparams["policy"]
    pretrained_tokenizer(resolve_model_path(name, "tokenizer"), "tokenizer").save_pretrained(out)
    return out


def export_module(module: LightningModule, directory: str | Path) -> Path:
    """:func:`export_policy` of a module in memory (its own weights are left untouched)."""
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return export_policy(module.hparams, state, directory)


def export_checkpoint(checkpoint: str | Path, directory: str | Path) -> Path:
    """:func:`export_policy` of a Lightning checkpoint file."""
    from rlkl_lightning.checkpoints import check_checkpoint

    check_checkpoint(checkpoint, option="checkpoint")
    ckpt = torch.load(
        checkpoint, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(checkpoint)
    )
    # A refresh of a LoRA policy's reference moved part of the adapters into base weights.
    state = {**ckpt["state_dict"], **(ckpt.get("rlkl_reference") or {})}
    return export_policy(ckpt["hyper_parameters"], state, directory)


def main(argv: list[str] | None = None) -> None:
    """``python -m rlkl_lightning.export CHECKPOINT DIRECTORY``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint written by a run of RLPipeline/PPOModule")
    parser.add_argument("directory", help="where to write the merged model and its tokenizer")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.directory)
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
