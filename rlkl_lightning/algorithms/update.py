"""Phase 4, the update: epochs x minibatches x micro-batches, clipping, one step per minibatch.

:func:`run_update` is the loop every algorithm shares; the algorithm supplies only its
``loss``. Where the work of a step runs is the module's ``threads``: :class:`OneThread` (the
plain path) or, with a speed-up, an object with the same methods that runs a second network's
part in a helper thread (:class:`rlkl_lightning.perf.value_thread.ValueThread`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.models.sharding import is_fsdp
from rlkl_lightning.trajectory import Trajectory


class OneThread:
    """The update's parts all in the calling thread: the plain path.

    The interface of :class:`~rlkl_lightning.perf.value_thread.ValueThread`, which runs a
    second network's part of each step in a helper thread.
    """

    #: Where the fused head hands its weight gradient off (``models.logprobs.Defer``): nowhere.
    defer = None

    def __enter__(self) -> OneThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def beside(self, fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
        """``fn(*args, *late)``, computed when the returned function is called with ``late``."""
        return lambda *late: fn(*args, *late)

    def wait(self) -> None:
        """Nothing runs elsewhere."""

    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_``."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()``."""
        optimizer.step()


class Updatable(Protocol):
    """What the update reads and calls on a module.

    :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` has all of it.
    """

    hparams: Any  #: ppo_epochs, num_minibatches, grad_accum_steps, max_grad_norm
    threads: OneThread  #: or a speed-up with the same methods
    sharded_models: tuple[str, ...]
    device: torch.device
    trainer: Any
    _trainer: Any

    def loss(self, minibatch: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
        """The algorithm's loss of a (micro-)minibatch and its detached statistics."""

    def gate(self, bad: bool, why: str) -> None:
        """Skip the batch (raise ``SkipBatch`` on every rank) if ``bad`` on any rank."""

    def manual_backward(self, loss: Tensor) -> None:
        """Lightning's backward pass."""

    def optimizers(self) -> Any:
        """Lightning's optimizer."""

    def lr_schedulers(self) -> Any:
        """Lightning's LR scheduler."""


def run_update(module: Updatable, traj: Trajectory) -> dict[str, Tensor]:
    """``ppo_epochs`` x ``num_minibatches`` optimizer steps of ``module.loss`` over ``traj``.

    Each minibatch's loss is the token-weighted mean of its micro-batches' losses; the
    returned statistics are means over the optimizer steps, plus the learning rate.
    """
    hp = module.hparams
    optimizer = module.optimizers()
    scheduler = module.lr_schedulers()
    totals: dict[str, float] = {}
    updates = 0
    for _ in range(hp.ppo_epochs):
        order = torch.randperm(traj.response_ids.shape[0], device=module.device)
        for minibatch in order.chunk(hp.num_minibatches):
            mb_tokens = traj.response_mask[minibatch].sum().clamp(min=1)
            step_stats: dict[str, float] = {}
            for micro in minibatch.chunk(hp.grad_accum_steps):
                part = traj.select(micro)
                loss, stats = module.loss(part)
                module.gate(not bool(torch.isfinite(loss)), "the loss is not finite")
                weight = part.response_mask.sum() / mb_tokens
                module.manual_backward(loss * weight)
                for key, value in stats.items():
                    step_stats[key] = step_stats.get(key, 0.0) + float(value) * float(weight)
            grad_norm = clip_gradients(module, optimizer)
            scaler = getattr(module.trainer.precision_plugin, "scaler", None)
            if scaler is None:
                module.threads.step(optimizer)
            else:  # the scaler hands the optimizer itself its scale: one thread steps
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_stats[keys.GRAD_NORM] = grad_norm
            for key, value in step_stats.items():
                totals[key] = totals.get(key, 0.0) + value
            updates += 1
    scheduler.step()
    # float32 explicitly: under bf16-true Lightning makes bf16 the default dtype in steps.
    f32 = torch.float32
    result = {key: torch.tensor(value / updates, dtype=f32) for key, value in totals.items()}
    result[keys.LR] = torch.tensor(scheduler.get_last_lr()[0], dtype=f32)
    return result


def clip_gradients(module: Updatable, optimizer: Any) -> float:
    """Clip the gradient norm to ``max_grad_norm``; returns the norm before clipping.

    Gates a non-finite norm, except under ``16-mixed``: there the loss is scaled, an
    overflow is the scaler's to handle (it skips that optimizer step and lowers the
    scale), and the norm and the clip are those of the unscaled gradients. Under FSDP the
    norm is that of all ranks' gradient shards together.
    """
    max_norm = module.hparams.max_grad_norm if module.hparams.max_grad_norm else float("inf")
    scaler = getattr(module.trainer.precision_plugin, "scaler", None) if module._trainer else None
    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # Each rank holds a shard of every gradient (the models shard_models wrapped).
    if any(is_fsdp(getattr(module, name, None)) for name in module.sharded_models):
        grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        local = local.to(module.device, torch.float32)
        norm = module.trainer.strategy.reduce(local.square(), reduce_op="sum").sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm * scale, norm)
    else:
        norm = module.threads.clip_grad_norm(params, max_norm * scale)
    grad_norm = float(norm) / scale
    if scaler is None:
        module.gate(not math.isfinite(grad_norm), "the gradient norm is not finite")
    return grad_norm
