"""Refreshing the reference during training: a hard reset to the policy, or a mix with it.

A KL penalty anchors the policy to its reference; long runs move the anchor (docs/kl.md,
"Refreshing the reference"). :class:`ReferenceRefresh` is the callback that decides when;
:func:`mix_into_reference` is what a refresh does to the weights:

* ``alpha = 1`` (a hard reset, as slime's ``--ref-update-interval`` and ProRL, arXiv
  2505.24864): the reference becomes the current policy, and the KL falls to zero;
* ``0 < alpha < 1`` (TR-DPO's soft update, arXiv 2404.09656):
  ``ref <- alpha x policy + (1 - alpha) x ref``, weight by weight; every batch, it is an
  exponential moving average of the policy with decay ``1 - alpha``.

A frozen-copy reference mixes its weights with the policy's. A LoRA policy whose reference is
its base weights (:class:`~rlkl_lightning.models.lora.AdaptersOff`) moves that share of each
adapter's update into the base weights and scales the adapters by ``1 - alpha``
(:func:`~rlkl_lightning.models.lora.mix_adapters_into_base`): the policy is unchanged and the
reference is the mix. The weights a refresh changed are saved in checkpoints
(``RLPipeline.on_save_checkpoint``), so a resumed run continues with the refreshed reference.
Under ``FSDPStrategy`` every rank gathers the full weights for the refresh and keeps its shards.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl.callback_base import KLCallbackBase
from rlkl_lightning.models.lora import AdaptersOff, mix_adapters_into_base

#: The refresh modes of :class:`ReferenceRefresh`.
REFRESH_MODES = ("hard", "mix")


def mix_into_reference(policy: nn.Module, reference: Any, alpha: float) -> list[str]:
    """``reference <- alpha x policy + (1 - alpha) x reference``, in place; ``alpha = 1`` copies.

    Args:
        policy: The policy (an ``nn.Module``; with adapters, the model they were added to).
        reference: A frozen model of the same architecture, or the policy's
            :class:`~rlkl_lightning.models.lora.AdaptersOff`.
        alpha: The policy's share, in ``(0, 1]``.

    Returns:
        The ``state_dict`` keys of the module holding both (``reference.*`` or ``policy.*``)
        whose values changed: what a checkpoint must carry besides the trained weights.

    Under ``FSDPStrategy`` (FSDP units, :mod:`~rlkl_lightning.models.sharding`) every rank
    gathers the full weights of the policy and of a frozen-copy reference, mixes them as one
    process would and writes its shards back: every rank must call it at the same point.

    Raises:
        ValueError: If the reference's weights do not match the policy's (another model).
    """
    sharded = [m for m in (policy, reference) if isinstance(m, FullyShardedDataParallel)]
    with contextlib.ExitStack() as gathered:
        for model in sharded:  # full weights under the unsharded names, written back on exit
            gathered.enter_context(FullyShardedDataParallel.summon_full_params(model))
        if isinstance(reference, AdaptersOff):
            changed = mix_adapters_into_base(reference.peft_model, alpha)
            # Names as in the state dict: without the wrappers of the sharded decoder layers.
            return [f"policy.{name.replace('_fsdp_wrapped_module.', '')}" for name in changed]
        ours = dict(policy.named_parameters(remove_duplicate=False))
        theirs = dict(reference.named_parameters(remove_duplicate=False))
        if ours.keys() != theirs.keys() or any(ours[k].shape != theirs[k].shape for k in ours):
            raise ValueError(
                "ReferenceRefresh: the reference's weights do not match the policy's (an "
                "explicit `reference` of another architecture, or one next to `peft` adapters); "
                "a refresh needs the default reference (a copy of the policy, or its adapters off)"
            )
        with torch.no_grad():
            for name, param in reference.named_parameters():  # tied weights once
                source = ours[name].detach().to(param.dtype)
                param.copy_(source) if alpha == 1 else param.lerp_(source, alpha)
        return [f"reference.{name}" for name in theirs]


class ReferenceRefresh(Callback):
    """Refresh an ``RLPipeline``'s reference every ``every`` trained batches.

    After the batch that makes ``batches_seen`` a multiple of ``every``, the module's
    :meth:`~rlkl_lightning.algorithms.pipeline.RLPipeline.refresh_reference` runs; the next
    batch measures its KL against the refreshed reference and logs the running count of
    refreshes as ``reference/refreshes``, which the KL callbacks read to hold beta
    (``KLControllerCallback(hold_after_refresh=...)``) and to suspend the drift monitor's "too
    low" while the KL climbs back. At set-up it tells those callbacks its period
    (``expect_refreshes``): the monitor says what it suspends, and a ``hold_after_refresh`` of
    ``every`` or more warns (beta would be frozen from the first refresh on).
    The module keeps the count and the refreshed weights in checkpoints; this callback has no
    state of its own, so a resumed run refreshes at the same batches.

    Args:
        every: Trained batches between refreshes, an int >= 1.
        mode: ``hard`` (the reference becomes the policy; the KL falls to zero) or ``mix``
            (``ref <- alpha x policy + (1 - alpha) x ref``; with ``every=1`` an exponential
            moving average of the policy with decay ``1 - alpha``).
        alpha: With ``mode="mix"``, the policy's share, in ``(0, 1)``; with ``hard``, None.
        reset_optimizer: Also clear the optimizer's state (Adam's moments) at each refresh, as
            ProRL does with its hard resets.

    Raises:
        ValueError: At set-up, for a module that is not an ``RLPipeline``.

    Example::

        trainer = Trainer(callbacks=[KLControllerCallback(controller, hold_after_refresh=5),
                                     ReferenceRefresh(every=20)])
    """

    def __init__(
        self,
        every: int,
        mode: str = "hard",
        alpha: float | None = None,
        reset_optimizer: bool = False,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{owner}: `every` must be an int >= 1 (batches), got {every!r}")
        if mode not in REFRESH_MODES:
            raise ValueError(f"{owner}: `mode` must be one of {REFRESH_MODES}, got {mode!r}")
        if mode == "hard" and alpha is not None:
            raise ValueError(f"{owner}: `alpha` must be None with mode 'hard', got {alpha!r}")
        if mode == "mix" and not (
            isinstance(alpha, int | float) and not isinstance(alpha, bool) and 0 < alpha < 1
        ):
            raise ValueError(
                f"{owner}: `alpha` must be a number in (0, 1) with mode 'mix', got {alpha!r}"
            )
        self.every = every
        self.mode = mode
        self.alpha = 1.0 if mode == "hard" else float(alpha)
        self.reset_optimizer = reset_optimizer

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every=self.every, mode=self.mode, alpha=self.alpha)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not callable(getattr(pl_module, "refresh_reference", None)):
            raise ValueError(
                f"{type(self).__name__}: the module must be an RLPipeline (PPOModule, "
                f"RLOOModule), got {type(pl_module).__name__}"
            )
        pl_module.log_reference_refreshes = True
        # The KL callbacks that read the count this module logs learn the period now, and say
        # what it does to them (the monitor what it suspends, the controller a hold too long).
        for callback in trainer.callbacks:
            if (
                isinstance(callback, KLCallbackBase)
                and callback.refresh_key == keys.REFERENCE_REFRESHES
            ):
                callback.expect_refreshes(self.every)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        done = pl_module.batches_seen
        if done % self.every or done <= pl_module.last_refresh_batch:
            return  # not due, or this batch was skipped right after a refresh
        pl_module.refresh_reference(self.alpha)
        if self.reset_optimizer:
            for optimizer in trainer.optimizers:
                optimizer.state.clear()  # Adam starts again from zero moments
