"""What an RL module carries through a checkpoint besides its trained weights.

Its counters (:data:`COUNTERS`), every rank's random stream (:func:`rng_states`,
:func:`restore_rng_states`), and not its frozen weights, which are rebuilt from the config
(:func:`trained_weights`, :func:`with_frozen_weights`), except those a reference refresh
changed (:func:`refreshed_weights`, :func:`with_refreshed_weights`). Beta is the controller
callback's state. The checks of the checkpoint file itself are in
:mod:`rlkl_lightning.checkpoints`, the data order in :mod:`rlkl_lightning.data.samplers`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from rlkl_lightning.checkpoints import check_checkpoint_weights


def rng_states(trainer: Trainer | None, device: torch.device) -> dict[str, list[Tensor]]:
    """The torch RNG state of every rank, for a checkpoint: rollouts and minibatches draw from it.

    Under DDP every rank's state is gathered (all ranks save a checkpoint together, so this is
    a collective), and a resumed run continues each rank's own random stream.

    Args:
        trainer: The trainer (None outside a fit: this process only).
        device: The module's device; a CUDA device's generator is saved too.

    Returns:
        ``{"cpu": [state per rank], "cuda": [...]}``.
    """
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if trainer is None or trainer.world_size == 1:
        return {key: [value] for key, value in states.items()}
    device = trainer.strategy.root_device
    return {key: _gathered(value.to(device), trainer.world_size) for key, value in states.items()}


def _gathered(value: Tensor, world_size: int) -> list[Tensor]:
    """``value`` of every rank, in rank order, on the CPU (a collective).

    Plain ``torch.distributed``: Lightning's ``strategy.all_gather`` goes through a deprecated
    torch function that warned on every rank.
    """
    gathered = [torch.empty_like(value) for _ in range(world_size)]
    dist.all_gather(gathered, value.contiguous())
    return [t.cpu() for t in gathered]


def restore_rng_states(
    states: dict[str, list[Tensor]] | None, trainer: Trainer, device: torch.device, owner: str
) -> None:
    """Put back this rank's saved RNG state, or give a fresh multi-process run per-rank streams.

    Called right before the first batch of a fit (``on_train_start``): Lightning draws random
    numbers between loading a checkpoint and that point (sanity-check validation, creating the
    dataloader iterators). Without saved states, a run of several processes offsets each rank's
    seed by its rank: ``seed_everything`` gives every process the same seed, and the ranks
    would draw the same random numbers for their rollouts.

    Args:
        states: What :func:`rng_states` saved, or None for a fresh run.
        trainer: The trainer (rank and world size).
        device: The module's device.
        owner: Name of the module, for the warning.
    """
    rank, world = trainer.global_rank, trainer.world_size
    if states and len(states["cpu"]) == world:
        # A copy: the saved states of a DDP run are views into one gathered tensor, and torch
        # 2.13's set_rng_state crashes (segmentation fault) on a view with a storage offset.
        torch.set_rng_state(states["cpu"][rank].clone())
        if "cuda" in states and device.type == "cuda":
            torch.cuda.set_rng_state(states["cuda"][rank].clone(), device)
        return
    if states:
        rank_zero_warn(
            f"{owner}: the checkpoint holds the RNG states of {len(states['cpu'])} processes "
            f"but this run has {world}; rollouts continue with fresh random numbers and a "
            f"global batch of data.batch_size x {world} (training itself resumes: "
            'docs/scaling-out.md, "Resume with another number of devices")',
            category=RuntimeWarning,
        )
    if world > 1:
        torch.manual_seed((torch.initial_seed() + 104_729 * rank) % 2**63)


def check_process_count(
    states: dict[str, list[Tensor]] | None, world: int, where: str | None, owner: str
) -> None:
    """Refuse a resume with another number of processes where it is not built (``where``).

    Args:
        states: What :func:`rng_states` saved (one state per process), or None for a fresh run.
        world: This run's number of processes.
        where: What this run has that such a resume is not tested with (FSDP, an engine with
            weights of its own), or None under DDP with the native or compiled engine.
        owner: Name of the module, for the message.
    """
    if not states or len(states["cpu"]) == world or where is None:
        return
    saved = len(states["cpu"])
    raise ValueError(
        f"{owner}: the checkpoint was written by {saved} processes and this run has {world}, "
        f"under {where}; another number of processes is supported under DDP with the native or "
        'compiled engine only (docs/scaling-out.md, "Resume with another number of devices"): '
        f"resume with `--trainer.devices` x `--trainer.num_nodes` = {saved}"
    )


#: The counters an RL module carries through checkpoints, each an int starting at 0
#: (``trainer.global_step`` counts optimizer steps, several per batch).
COUNTERS = (
    "batches_seen",
    "samples_seen",
    "skipped_batches",
    "skipped_in_a_row",
    "reference_refreshes",
    "last_refresh_batch",
)


def unsaved_keys(module: nn.Module) -> set[str]:
    """The ``state_dict`` keys checkpoints leave out: every frozen weight.

    Frozen weights (the reference, the base weights under a LoRA policy) are rebuilt from the
    config. FSDP and activation-checkpointing wrappers are left out of the names, as they are
    of the keys of the state dict Lightning saves.
    """
    wrappers = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
    frozen = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            for wrapper in wrappers:
                name = name.replace(wrapper, "")
            frozen.add(name)
    return frozen


def trained_weights(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the reference's and the other frozen weights: what a checkpoint keeps."""
    unsaved = unsaved_keys(module)
    return {k: v for k, v in state.items() if not k.startswith("reference.") and k not in unsaved}


def with_frozen_weights(module: nn.Module, state: dict[str, Any], owner: str) -> None:
    """Check that a checkpoint's weights fit ``module``; add the frozen ones, as built, to them.

    Frozen weights may be missing (they are rebuilt from the config); all others must be there,
    with their shapes. Runs before Lightning's strict loading.
    """
    current, unsaved = module.state_dict(), unsaved_keys(module)
    expected = {k: v for k, v in current.items() if k not in unsaved or k in state}
    check_checkpoint_weights(state, expected, owner)  # before any restore
    for key, value in current.items():
        if key.startswith("reference.") or key in unsaved:
            state.setdefault(key, value)


def refreshed_weights(state: dict[str, Any], keys: list[str]) -> dict[str, Tensor]:
    """The weights a reference refresh changed (``keys``), from a full ``state``: saved apart.

    Only these differ from the reference the config rebuilds (a frozen copy: its every weight;
    adapters off: the base weights of the adapted layers), so only these are saved. An empty
    ``state`` gives none: under FSDP only rank 0 is given the gathered state (and saves it).
    """
    return {key: state[key] for key in keys} if state else {}


def with_refreshed_weights(
    module: nn.Module, state: dict[str, Any], refreshed: dict[str, Tensor], owner: str
) -> None:
    """Put a checkpoint's refreshed reference weights into its ``state`` (before loading it).

    Raises:
        ValueError: If a refreshed weight does not fit this model (another model's checkpoint).
    """
    current = module.state_dict()
    wrong = sorted(
        k for k, v in refreshed.items() if k not in current or current[k].shape != v.shape
    )
    if wrong:
        raise ValueError(
            f"{owner}: the checkpoint's refreshed reference weights do not fit this model "
            f"({wrong[:5]}); resume with the `policy`, `reference` and `peft` it was trained with"
        )
    state.update(refreshed)
