"""Write a trained policy as a plain Hugging Face model, LoRA adapters merged into its weights.

    python -m rlkl_lightning.export runs/ppo/version_0/checkpoints/last.ckpt exported/

The checkpoint's hyperparameters name the policy and its ``peft`` config; the base weights
are loaded from there (checkpoints leave the frozen ones out, except those a reference refresh
changed, which are taken from the checkpoint), the trained weights from the checkpoint, every
one of them checked (:func:`~rlkl_lightning.models.lora.load_trainable`), and the adapters are
merged (``merge_and_unload``). The result, and the tokenizer, load with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``, without ``peft``.

LoRA adapters are merged in float32 and, by default (``--dtype auto``), saved so: merged into a
bfloat16 or float16 base and saved in it, a small update falls below the base's resolution and
is rounded away. ``--dtype bfloat16`` saves the smaller file anyway.

A policy that ships its own modelling code loads only with ``--trust_remote_code`` (a checkpoint
is not trusted: its ``models.trust_remote_code`` is not read); :func:`export_module` takes the
module's own setting.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from rlkl_lightning.migrations import upgrade_init_args

#: The dtypes an export saves its weights in (``auto``: see :func:`export_policy`).
EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def export_policy(
    hparams: Mapping[str, Any],
    state_dict: Mapping[str, Tensor],
    directory: str | Path,
    trust_remote_code: bool = False,
    dtype: str = "auto",
) -> Path:
    """Rebuild the policy from ``hparams``, load its trained weights, merge, save.

    Args:
        hparams: The module's hyperparameters (``policy``, ``tokenizer``, ``models.peft``).
        state_dict: The module's weights (keys ``policy.*``; frozen ones may be missing).
        directory: Where to write the model and tokenizer.
        trust_remote_code: Run modelling and tokenizer code shipped with the policy (off:
            such a policy is refused with an error).
        dtype: The saved weights' dtype, one of :data:`EXPORT_DTYPES`; ``auto``: float32 when
            adapters are merged (the update they hold survives), else the policy's as saved.

    Returns:
        ``directory``.
    """
    from rlkl_lightning.models.loading import load_causal_lm, resolve_model_path
    from rlkl_lightning.models.lora import attach_adapters, load_trainable
    from rlkl_lightning.models.tokenizer import pretrained_tokenizer

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"`dtype` must be one of {EXPORT_DTYPES}, got {dtype!r}")
    hparams = upgrade_init_args(hparams)  # a checkpoint of an older version: today's names
    trust = {"trust_remote_code": trust_remote_code}
    model = load_causal_lm(hparams["policy"], option="policy", **trust)
    state = {k.removeprefix("policy."): v for k, v in state_dict.items() if k.startswith("policy.")}
    peft = (hparams.get("models") or {}).get("peft")
    if peft is not None:
        model = model.float()  # exact for a 16-bit base; the adapters' update is merged whole
    wrapped = attach_adapters(model, peft) if peft is not None else None
    load_trainable(model, state, "export")
    if wrapped is not None:
        model = wrapped.merge_and_unload()
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    out = Path(directory)
    model.save_pretrained(out)
    name = hparams.get("tokenizer") or hparams["policy"]
    path = resolve_model_path(name, "tokenizer")
    pretrained_tokenizer(path, "tokenizer", **trust).save_pretrained(out)
    return out


def export_module(module: LightningModule, directory: str | Path, dtype: str = "auto") -> Path:
    """:func:`export_policy` of a module in memory (its own weights are left untouched).

    The module's ``models.trust_remote_code`` is used: it was built with it.
    """
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    models = getattr(module, "models", None)
    trust = bool(getattr(models, "trust_remote_code", False))
    return export_policy(module.hparams, state, directory, trust_remote_code=trust, dtype=dtype)


def export_checkpoint(
    checkpoint: str | Path,
    directory: str | Path,
    trust_remote_code: bool = False,
    dtype: str = "auto",
) -> Path:
    """:func:`export_policy` of a Lightning checkpoint file.

    ``trust_remote_code`` is the caller's: the checkpoint's own setting is not read.
    """
    from rlkl_lightning.checkpoints import check_checkpoint

    # The checked load is the one used: loading the file again (with weights_only=False, as
    # before) would build whatever another writer put there after the check.
    ckpt = check_checkpoint(checkpoint, option="checkpoint", resuming=False)
    hparams = ckpt.get("hyper_parameters")
    if not isinstance(hparams, Mapping) or not hparams.get("policy"):
        raise ValueError(
            f"`checkpoint` {str(checkpoint)!r} names no policy in its hyperparameters; allowed: "
            "a checkpoint of a run of PPOModule, RLOOModule or another RLPipeline module"
        )
    # A refresh of a LoRA policy's reference moved part of the adapters into base weights.
    state = {**ckpt["state_dict"], **(ckpt.get("rlkl_reference") or {})}
    return export_policy(
        hparams, state, directory, trust_remote_code=trust_remote_code, dtype=dtype
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m rlkl_lightning.export CHECKPOINT DIRECTORY``.

    A user's mistake (a missing or foreign checkpoint, a file where the directory goes) ends
    with ``error: MESSAGE`` alone and exit status 2, as ``train.py``'s
    (:func:`rlkl_lightning.errors.user_message`); ``--verbose`` or ``RLKL_VERBOSE=1`` raise it
    with its traceback instead.
    """
    from rlkl_lightning.errors import VERBOSE_ENV, user_message

    parser = argparse.ArgumentParser(
        prog="python -m rlkl_lightning.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("checkpoint", help="a checkpoint written by a run of RLPipeline/PPOModule")
    parser.add_argument("directory", help="where to write the merged model and its tokenizer")
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="run modelling code shipped with the policy (only for a model you trust)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=EXPORT_DTYPES,
        help="the saved weights' dtype (auto: float32 where LoRA adapters are merged, else as "
        "the policy was saved)",
    )
    parser.add_argument("--verbose", action="store_true", help="a mistake's traceback")
    args = parser.parse_args(argv)
    verbose = args.verbose or os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    try:
        if Path(args.directory).exists() and not Path(args.directory).is_dir():
            raise ValueError(
                f"`directory` {args.directory!r} is a file; allowed: a directory (new or "
                "existing) for the model and its tokenizer"
            )
        out = export_checkpoint(
            args.checkpoint, args.directory, args.trust_remote_code, dtype=args.dtype
        )
    except Exception as error:
        message = None if verbose else user_message(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
