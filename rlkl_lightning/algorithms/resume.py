"""Counters, beta, random streams and the frozen weights of an RL module across a checkpoint.

:func:`rng_states` and :func:`restore_rng_states` carry every rank's random stream across a
resume; the checks of the checkpoint file itself are :mod:`rlkl_lightning.checkpoints`', the
data order :mod:`rlkl_lightning.data.samplers`'.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from rlkl_lightning.checkpoints import check_checkpoint_weights, plain_hyperparameters


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
    strategy = trainer.strategy
    return {  # one tensor per rank, not views into the gathered one (restore_rng_states)
        key: [t.clone() for t in strategy.all_gather(value.to(strategy.root_device)).cpu()]
        for key, value in states.items()
    }


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
            f"but this run has {world}; rollouts continue with fresh random numbers (training "
            "itself resumes correctly)",
            category=RuntimeWarning,
        )
    if world > 1:
        torch.manual_seed((torch.initial_seed() + 104_729 * rank) % 2**63)


class ResumableModule(LightningModule):
    """Counters, beta and random streams of an RL module, carried through checkpoints.

    Checkpoints store the counters (``trainer.global_step`` counts optimizer steps, several per
    batch, so batches and samples are counted here), ``kl_coef``, the reference's held-out
    perplexity and every rank's RNG state, and leave out the frozen ``reference`` and every
    other frozen weight (the base weights under a LoRA policy): they are rebuilt from the
    config, and put back before Lightning's strict loading. For a module with ``owner``,
    ``reference``, ``kl_coef`` and ``reference_perplexity`` attributes.
    """

    #: The counters saved in checkpoints, each an int starting at 0.
    COUNTERS = ("batches_seen", "samples_seen", "skipped_batches", "skipped_in_a_row")

    def __init__(self) -> None:
        super().__init__()
        for name in self.COUNTERS:
            setattr(self, name, 0)

    def unsaved_keys(self) -> set[str]:
        """The ``state_dict`` keys checkpoints leave out: the reference and every frozen weight.

        FSDP and activation-checkpointing wrappers are left out of the names, as they are of
        the keys of the state dict Lightning saves.
        """
        wrappers = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
        frozen = set()
        for name, param in self.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                for wrapper in wrappers:
                    name = name.replace(wrapper, "")
                frozen.add(name)
        return frozen

    def _saved(self, state: dict[str, Any]) -> dict[str, Any]:
        unsaved = self.unsaved_keys()
        return {
            k: v for k, v in state.items() if not k.startswith("reference.") and k not in unsaved
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store counters, beta, RNG states, plain hparams; drop the reference, frozen weights."""
        plain_hyperparameters(checkpoint)
        checkpoint["state_dict"] = self._saved(checkpoint["state_dict"])
        checkpoint["rlkl_counters"] = {
            **{name: getattr(self, name) for name in self.COUNTERS},
            "kl_coef": self.kl_coef,
            "reference_perplexity": self.reference_perplexity,
        }
        checkpoint["rlkl_rng"] = rng_states(self._trainer, self.device)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check the weights fit, restore counters and beta, put the reference weights back."""
        state = checkpoint["state_dict"]
        current, unsaved = self.state_dict(), self.unsaved_keys()
        # Frozen weights may be missing (they are rebuilt); all others must be there.
        expected = {k: v for k, v in current.items() if k not in unsaved or k in state}
        check_checkpoint_weights(state, expected, self.owner)  # before any restore
        counters = checkpoint.get("rlkl_counters", {})
        for name in self.COUNTERS:
            setattr(self, name, int(counters.get(name, 0)))
        self.kl_coef = float(counters.get("kl_coef", self.kl_coef))
        self.reference_perplexity = counters.get("reference_perplexity")
        self._rng_to_restore = checkpoint.get("rlkl_rng")
        for key, value in current.items():  # the frozen weights, as the config built them
            if key.startswith("reference.") or key in unsaved:
                state.setdefault(key, value)

    def on_train_start(self) -> None:
        """Put back a loaded checkpoint's RNG state, right before the first resumed batch."""
        states, self._rng_to_restore = getattr(self, "_rng_to_restore", None), None
        restore_rng_states(states, self.trainer, self.device, self.owner)
