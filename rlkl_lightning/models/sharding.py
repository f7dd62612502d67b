"""Sharding an RL module's models under Lightning's ``FSDPStrategy``.

Lightning's FSDP strategy wraps the whole LightningModule in one root ``FullyShardedDataParallel``
unless the module wrapped its parts itself in ``configure_model``. The root wrapper cannot serve
an RL module: its ``training_step`` runs several backward passes (PPO epochs x minibatches)
inside the one root forward that Lightning calls, which FSDP does not allow. So the module
shards its models itself: the policy, the reference and the value function each become an FSDP
unit (and every decoder layer of them a unit of its own, from transformers'
``_no_split_modules``), with the strategy's sharding, precision, CPU-offload and extra options.
The LightningModule itself holds no weight outside a unit, and each model is called through its
unit's forward, which gathers its weights for that call.

With one process (or ``sharding_strategy="NO_SHARD"``) nothing is sharded, and the frozen
weights of a model that also trains (the base weights of a LoRA policy) stay outside its
units. torch's FSDP does not put back the weights of a unit that holds only frozen ones (the
root unit of a LoRA policy: the embeddings) after a backward pass under ``NO_SHARD``: they
drop out of ``state_dict`` and ``named_parameters``, and the next forward without gradients
fails.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def layer_wrap_policy(model: nn.Module):
    """An FSDP ``auto_wrap_policy`` making each decoder layer (``_no_split_modules``) a unit."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    return ModuleWrapPolicy(classes) if classes else None


def shard_models(module: nn.Module, names: tuple[str, ...]) -> None:
    """Wrap each ``nn.Module`` attribute of ``module`` named in ``names`` as an FSDP unit.

    Does nothing unless the module is trained under ``FSDPStrategy``, or once it is sharded.

    Raises:
        ValueError: Under ``ModelParallelStrategy``, which leaves the sharding to the module:
            unsharded, each rank would train its own replica (no gradient is averaged).
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    if isinstance(strategy, ModelParallelStrategy):
        raise ValueError(
            "`trainer.strategy`: ModelParallelStrategy (FSDP2, `fully_shard`) is not built yet: "
            "the models would not be sharded and each rank would train its own replica; use "
            "`trainer.strategy=ddp` or `trainer.strategy=fsdp`"
        )
    if not isinstance(strategy, FSDPStrategy):
        return
    options = {k: v for k, v in strategy.kwargs.items() if k != "auto_wrap_policy"}
    device = strategy.root_device
    unsharded = strategy.world_size == 1 or strategy.sharding_strategy == ShardingStrategy.NO_SHARD
    user_ignores = "ignored_states" in options or "ignored_modules" in options
    for name in names:
        model = getattr(module, name, None)
        if not isinstance(model, nn.Module) or is_fsdp(model):
            continue
        policy = strategy.kwargs.get("auto_wrap_policy") or layer_wrap_policy(model)
        extra = {}
        frozen = [p for p in model.parameters() if not p.requires_grad]
        if unsharded and not user_ignores and 0 < len(frozen) < len(list(model.parameters())):
            extra["ignored_states"] = frozen  # FSDP moves all weights but these to the device
            model.to(device)
        unit = FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=strategy.sharding_strategy,
            mixed_precision=strategy.mixed_precision_config,
            cpu_offload=strategy.cpu_offload,
            device_id=device if device.type != "cpu" else torch.device("cpu"),
            **options,
            **extra,
        )
        setattr(module, name, unit)


def is_fsdp(model: Any) -> bool:
    """True if ``model`` is a ``FullyShardedDataParallel`` unit (:func:`shard_models`)."""
    return hasattr(model, "_fsdp_wrapped_module")
