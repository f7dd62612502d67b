"""Phase 4, the update: epochs x minibatches x micro-batches, clipping, one step per minibatch.

:func:`run_update` is the loop every algorithm shares; the algorithm supplies only its
``loss``. Where the work of a step runs is the module's ``threads``: :class:`OneThread` (the
plain path) or, with a speed-up, an object with the same methods that runs a second network's
part in a helper thread (:class:`rlkl_lightning.perf.value_thread.ValueThread`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.compiled_update import largest_micro_batch
from rlkl_lightning.algorithms.gates import global_sum
from rlkl_lightning.models.sharding import is_fsdp
from rlkl_lightning.trajectory import Trajectory


class OneThread:
    """The update's parts all in the calling thread: the plain path.

    The interface of :class:`~rlkl_lightning.perf.value_thread.ValueThread`, which runs a
    second network's part of each step in a helper thread.
    """

    #: Where the fused head hands its weight gradient off (``models.logprobs.Defer``): nowhere.
    defer = None
    #: Whether a helper thread runs a second network's part (``ValueThread``: True).
    has_helper = False

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


#: ``reduce(x, mask)``: a micro-batch's ``[b, T]`` per-token loss terms to its scalar loss.
Reduce = Callable[[Tensor, Tensor], Tensor]


class Updatable(Protocol):
    """What the update reads and calls on a module.

    :class:`~rlkl_lightning.algorithms.pipeline.RLPipeline` has all of it.
    """

    optimization: Any  #: the ``optimization`` group (epochs, minibatches, clipping, ...)
    #: the policy objective, which owns the loss aggregation (``tokens_per_rank``, ``weigh``)
    policy_objective: Any
    threads: OneThread  #: or a speed-up with the same methods
    #: None, or the compiled pass each micro-batch's loss runs through (``optimization.compile``)
    compiled_update: Any
    sharded_models: tuple[str, ...]
    device: torch.device
    trainer: Any
    _trainer: Any

    def loss(self, minibatch: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
        """The algorithm's loss of a (micro-)minibatch, reduced as the objective's aggregation."""

    def gate(self, bad: bool, why: str) -> None:
        """Skip the batch (raise ``SkipBatch`` on every rank) if ``bad`` on any rank."""

    def manual_backward(self, loss: Tensor) -> None:
        """Lightning's backward pass."""

    def parameters(self) -> Any:
        """The module's weights (``nn.Module.parameters``)."""

    def optimizers(self) -> Any:
        """Lightning's optimizer."""

    def lr_schedulers(self) -> Any:
        """Lightning's LR scheduler."""


def split(rows: Tensor, parts: int) -> tuple[Tensor, ...]:
    """``rows`` in exactly ``parts`` consecutive pieces; some are empty if there are fewer rows.

    ``torch.chunk``'s pieces where it makes ``parts`` of them (every split whose pieces all have
    rows: they stay what they always were), else ``torch.tensor_split``'s, whose sizes differ by
    at most one. ``torch.chunk`` alone makes pieces of ``ceil(n / parts)`` rows and so fewer
    than ``parts`` of them for some ``n`` (1 piece of 1 row, but 2 of 3 rows and 4 of 4, in
    2 parts; 3 pieces of 6 rows in 4 parts).
    """
    pieces = rows.chunk(parts)
    return pieces if len(pieces) == parts else rows.tensor_split(parts)


def zero_loss(module: Updatable, traj: Trajectory) -> Tensor:
    """A loss of exactly 0 whose backward pass reaches the trainable weights: an empty micro-batch.

    With a row on this rank, the loss of its first row times 0: the models run their forward
    pass as on a real micro-batch (FSDP gathers its weights there, on every rank alike) and
    every weight the loss reaches gets a zero gradient. With none (a one-process update on no
    rows), ``0 x`` the sum of each trainable weight.
    """
    if traj.response_ids.shape[0]:
        first = torch.zeros(1, dtype=torch.long, device=traj.response_ids.device)
        loss, _ = module.loss(traj.select(first))
        return loss * 0
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.stack([p.sum() * 0 for p in params]).sum()


def run_update(module: Updatable, traj: Trajectory) -> dict[str, Tensor]:
    """``ppo_epochs`` x ``num_minibatches`` optimizer steps of ``module.loss`` over ``traj``.

    Each minibatch's loss aggregates its per-token terms as ``objective.aggregation`` says
    (:mod:`~rlkl_lightning.algorithms.aggregation`; by default the token-weighted mean of its
    micro-batches' token means): the policy objective weighs each micro-batch
    (:meth:`~rlkl_lightning.algorithms.objective.PolicyObjective.weigh`); the returned
    statistics are means over the optimizer steps that had rows, plus the learning rate. The
    ``loss/*`` statistics are the minibatch's aggregated losses, the others token means.

    The number of steps, and of micro-batches in each (``grad_accum_steps``), depends on the
    options alone, never on the rows: ranks with different numbers of rows make the same
    backward passes (each an all-reduce under DDP) and take the same steps, and a batch takes
    as many steps whatever rows an algorithm trains on (:func:`split`). A micro-batch that gets
    no row runs the backward pass of :func:`zero_loss` where another rank may be waiting on it
    (under DDP), or where its whole minibatch is empty (one process): that step's gradient is
    the other ranks' alone, or zero (AdamW's moments and weight decay still move the weights).
    """
    hp = module.optimization
    objective = module.policy_objective
    optimizer = module.optimizers()
    scheduler = module.lr_schedulers()
    world = module.trainer.world_size if module._trainer is not None else 1
    everywhere = partial(global_sum, module._trainer)
    tokens_per_rank = objective.tokens_per_rank(traj.response_mask, everywhere, world)
    _warn_empty_steps(module, traj.response_ids.shape[0], world)
    loss_of = _micro_batch_loss(module, traj.response_ids.shape[0])
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for _ in range(hp.ppo_epochs):
        order = torch.randperm(traj.response_ids.shape[0], device=module.device)
        for minibatch in split(order, hp.num_minibatches):
            mb_tokens = traj.response_mask[minibatch].sum().clamp(min=1)
            step_stats: dict[str, float] = {}
            for micro in split(minibatch, hp.grad_accum_steps):
                if not len(micro):
                    if world > 1 or not len(minibatch):
                        loss = zero_loss(module, traj)
                        module.gate(not bool(torch.isfinite(loss)), "the loss is not finite")
                        module.manual_backward(loss)
                    continue
                part = traj.select(micro)
                weight = part.response_mask.sum() / mb_tokens
                part, loss_weight = objective.weigh(part, len(minibatch), weight, tokens_per_rank)
                loss, stats = loss_of(part)
                module.gate(not bool(torch.isfinite(loss)), "the loss is not finite")
                module.manual_backward(loss * loss_weight)
                for key, value in stats.items():
                    share = loss_weight if key.startswith("loss/") else weight
                    step_stats[key] = step_stats.get(key, 0.0) + float(value) * float(share)
            grad_norm = clip_gradients(module, optimizer)
            scaler = getattr(module.trainer.precision_plugin, "scaler", None)
            if scaler is None:
                module.threads.step(optimizer)
            else:  # the scaler hands the optimizer itself its scale: one thread steps
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if len(minibatch) or world > 1:  # one process, no rows: no gradient to measure
                step_stats[keys.GRAD_NORM] = grad_norm
            for key, value in step_stats.items():
                totals[key] = totals.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
    scheduler.step()
    # float32 explicitly: under bf16-true Lightning makes bf16 the default dtype in steps.
    f32 = torch.float32
    result = {key: torch.tensor(value / counts[key], dtype=f32) for key, value in totals.items()}
    result[keys.LR] = torch.tensor(scheduler.get_last_lr()[0], dtype=f32)
    return result


def _micro_batch_loss(
    module: Updatable, rows: int
) -> Callable[[Trajectory], tuple[Tensor, dict[str, Tensor]]]:
    """``module.loss``, or its compiled pass, which pads to this update's largest micro-batch."""
    compiled = getattr(module, "compiled_update", None)
    if compiled is None:
        return module.loss
    hp = module.optimization
    largest = largest_micro_batch(rows, hp.num_minibatches, hp.grad_accum_steps)
    return partial(compiled, module, rows=largest)


def _warn_empty_steps(module: Updatable, rows: int, world: int) -> None:
    """Warn once per module when one process has fewer rows than ``num_minibatches``.

    Under DDP a rank short of rows is expected (the others' rows make the step's gradient).
    """
    problem = module.optimization.rows_problem(rows, "this batch")
    if world > 1 or problem is None or getattr(module, "_warned_empty_steps", False):
        return
    module._warned_empty_steps = True
    warnings.warn(problem, RuntimeWarning, stacklevel=2)


def clip_gradients(module: Updatable, optimizer: Any) -> float:
    """Clip the gradient norm to ``max_grad_norm``; returns the norm before clipping.

    Gates a non-finite norm, except under ``16-mixed``: there the loss is scaled, an
    overflow is the scaler's to handle (it skips that optimizer step and lowers the
    scale), and the norm and the clip are those of the unscaled gradients. Under FSDP the
    norm is that of all ranks' gradient shards together.
    """
    clip = module.optimization.max_grad_norm
    max_norm = clip if clip else float("inf")
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
