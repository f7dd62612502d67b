"""The separate value model in a second thread: ``PPOModule(ppo={"value_model_thread": True})``.

Why: on a CPU a small model's step is in good part work that does not spread over threads
(Python, element-wise passes over small tensors, copies); two independent networks side by
side keep both cores busy (docs/benchmarks.md has the figures).

How: with a separate value model, PPO's update runs two networks that share nothing until the
loss adds their terms. Each (micro-)minibatch's value loss is computed in a helper thread
(:meth:`ValueThread.beside`) while the calling thread runs the policy, each with half of
torch's threads. The value loss enters the loss as a leaf copy (:meth:`ValueThread.handoff`):
the calling thread's backward pass ends there, and the helper back-propagates what reaches the
leaf through the value model, concurrently. The helper also computes the LM head's weight
gradient, which nothing in the calling thread's backward pass waits for
(:meth:`ValueThread.defer`). The pipeline's ``backward`` waits for the helper, so every gradient
is complete before Lightning's ``on_after_backward``; the clipping
(:meth:`ValueThread.clip_grad_norm`) and AdamW's step (:meth:`ValueThread.step`) are split the
same way. Every operation is the one the plain path runs, in the same order per network, so
the numbers are those of the plain path with the same number of threads per network (the
tests check it bit for bit). One process only: DDP's and FSDP's gradient hooks expect one
backward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor


def value_thread_on(
    setting: bool | None, separate_model: bool, strategy: Any, device_type: str, owner: str
) -> bool:
    """Whether the separate value model runs in a helper thread: ``ppo.value_model_thread``.

    ``True`` and ``False`` are kept; ``None`` (the default) turns it on where it helps: with a
    separate value model, one process (Lightning's ``SingleDeviceStrategy``), on a CPU with at
    least 2 of torch's threads (read now, when the run starts).

    Raises:
        ValueError: Starting with ``owner``, if ``setting`` is True and ``strategy`` is not a
            single-device one (DDP's and FSDP's gradient hooks expect one backward pass).
    """
    from lightning.pytorch.strategies import SingleDeviceStrategy

    one_process = isinstance(strategy, SingleDeviceStrategy)
    if setting and not one_process:
        raise ValueError(
            f"{owner}: `ppo.value_model_thread`=True needs one process with a single-device "
            f"strategy, got {type(strategy).__name__}; set value_model_thread=False"
        )
    if setting is not None:
        return setting
    return separate_model and one_process and device_type == "cpu" and torch.get_num_threads() >= 2


class ValueThread:
    """A helper thread for the value model during an update; a context manager.

    Args:
        device_type: The device the models run on (``"cpu"``, ``"cuda"``); the helper enters
            the caller's autocast state for it.
        params: The helper's network's parameters: their part of the clipping and of the
            optimizer step runs in the helper.
    """

    #: A helper thread runs the second network's part (``update.OneThread``: False).
    has_helper = True

    def __init__(self, device_type: str, params: Iterable[Tensor] = ()):
        self.device_type = device_type
        self.params = set(params)
        self.threads = torch.get_num_threads()
        self.helper_threads = max(1, self.threads // 2)
        self.pending: Future | None = None
        self.deferred: list[tuple[Tensor, Future]] = []
        self.pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> ValueThread:
        """Start the helper; this thread keeps the other half of the threads until the exit."""
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rlkl-value")
        torch.set_num_threads(self.threads - self.helper_threads or 1)
        return self

    def __exit__(self, *exc: Any) -> None:
        """Wait for the helper's work (its error is raised unless one is on its way already)."""
        try:
            if exc[0] is None:
                self.wait()
            else:
                for future in [self.pending] + [f for _, f in self.deferred]:
                    if future is not None:
                        with contextlib.suppress(Exception):
                            future.result()
        finally:
            self.pool.shutdown(wait=True)
            torch.set_num_threads(self.threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` in the helper, under this thread's grad mode and autocast state."""
        grad = torch.is_grad_enabled()
        kind = self.device_type
        autocast = torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if autocast else None

        def run() -> Any:
            torch.set_num_threads(self.helper_threads)
            cast = torch.autocast(kind, dtype=dtype) if autocast else contextlib.nullcontext()
            with torch.set_grad_enabled(grad), cast:
                return fn(*args)

        return self.pool.submit(run)

    def beside(self, fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
        """Start ``fn(*args)`` in the helper now; the returned function waits for its result.

        ``fn`` returns ``(loss, *statistics)``; the waiting function returns the loss as a
        :meth:`handoff` leaf, so its backward pass runs in the helper too. It takes and ignores
        the arguments the calling thread would have added (``fn`` runs without them).
        """
        future = self.submit(fn, *args)

        def result(*late: Any) -> Any:
            loss, *statistics = future.result()
            return (self.handoff(loss), *statistics)

        return result

    def handoff(self, tensor: Tensor) -> Tensor:
        """A leaf copy of ``tensor``; what reaches it is back-propagated through ``tensor``.

        The calling thread's backward pass ends at the leaf; the helper takes the gradient
        that arrives there and runs ``tensor``'s own backward pass with it, concurrently.
        """
        leaf = tensor.detach().requires_grad_()
        leaf.register_hook(lambda grad: self._backward(tensor, grad))
        return leaf

    def _backward(self, tensor: Tensor, grad: Tensor) -> None:
        if self.pending is not None:
            self.pending.result()
        self.pending = self.submit(torch.autograd.backward, tensor, grad)

    def defer(self, param: Tensor, fn: Callable[..., Tensor], *args: Any) -> Tensor | None:
        """A gradient for ``param``, ``fn(*args)``, computed by the helper (``logprobs.Defer``).

        Returns None and adds it to ``param.grad`` in :meth:`wait`, if ``param.grad`` is None
        now: the backward pass then accumulates at most one more term into it, and ``a + b``
        is ``b + a`` in floating point, so the sum is the one autograd forms. Else (a second
        micro-batch: three terms, whose sum depends on their order) returns ``fn(*args)``.
        """
        if param.grad is not None:
            return fn(*args)
        self.deferred.append((param, self.submit(fn, *args)))
        return None

    def wait(self) -> None:
        """Wait for the helper's work, if any (raise its error)."""
        pending, self.pending = self.pending, None
        deferred, self.deferred = self.deferred, []
        if pending is not None:
            pending.result()
        for param, future in deferred:
            grad = future.result()
            if param.grad is None:
                param.grad = torch.empty_like(param).copy_(grad)
            else:
                param.grad.add_(grad)

    @contextlib.contextmanager
    def all_threads(self):
        """This thread with all of torch's threads, for work that is not split."""
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(self.threads - self.helper_threads or 1)

    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_(params, max_norm)``, the helper's part in the helper.

        The same numbers: the norm of each gradient, the norm of those norms in the order of
        ``params``, then every gradient times the same clamped ``max_norm / (norm + 1e-6)``.
        Gradients of several devices or dtypes (which torch groups first) take torch's own.
        """
        with_grad = [p for p in params if p.grad is not None]
        if len({(p.grad.device, p.grad.dtype) for p in with_grad}) != 1:
            with self.all_threads():
                return torch.nn.utils.clip_grad_norm_(params, max_norm)
        helper = [p for p in with_grad if p in self.params]
        mine = [p for p in with_grad if p not in self.params]
        their_norms = self.submit(_grad_norms, helper)
        norms = dict(zip(mine, _grad_norms(mine), strict=True))
        norms.update(zip(helper, their_norms.result(), strict=True))
        total = torch.linalg.vector_norm(torch.stack([norms[p] for p in with_grad]))
        scaled = self.submit(torch.nn.utils.clip_grads_with_norm_, helper, max_norm, total)
        torch.nn.utils.clip_grads_with_norm_(mine, max_norm, total)
        scaled.result()
        return total

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()``, with the helper's parameters (``params``) updated by the helper.

        For torch's ``Adam`` and ``AdamW``, whose update of a parameter reads nothing of another
        (any other optimizer steps here, with all threads). ``optimizer`` (a Lightning
        optimizer, or torch's) steps once, hooks, closure and LR-scheduler bookkeeping
        included. When its closure has returned (Lightning's ``on_before_optimizer_step``
        hooks run there), the helper updates its parameters through a copy of the optimizer that
        shares its state, and the optimizer's own update, in this thread, sees only the other
        parameters. Without a grad scaler only: one sets attributes on the optimizer itself.
        """
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps it
        # The update alone, without the optimizer hooks (torch's step wrapper keeps it).
        update = getattr(type(inner).step, "__wrapped__", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or update is None:
            with self.all_threads():
                optimizer.step()
            return
        groups, entry = inner.param_groups, inner.step  # entry: an LR scheduler's wrapper, maybe
        had_own_step = "step" in inner.__dict__
        split: list[Future] = []

        def then_split(closure):
            loss = closure() if closure is not None else None
            shadow = object.__new__(type(inner))
            shadow.__dict__.update(inner.__dict__)  # the same state, defaults and hooks
            shadow.param_groups = [
                {**g, "params": [p for p in g["params"] if p in self.params]} for g in groups
            ]
            split.append(self.submit(update, shadow))
            inner.param_groups = [
                {**g, "params": [p for p in g["params"] if p not in self.params]} for g in groups
            ]
            return loss

        inner.step = lambda closure=None: entry(closure=lambda: then_split(closure))
        try:
            optimizer.step()
        finally:
            inner.param_groups = groups
            if had_own_step:
                inner.step = entry
            else:
                del inner.step
            for future in split:
                future.result()


def _grad_norms(params: list[Tensor]) -> list[Tensor]:
    """The 2-norm of each parameter's gradient, equal to ``clip_grad_norm_``'s on the CPU.

    There its ``torch._foreach_norm`` takes ``torch.linalg.vector_norm`` of each tensor in
    turn; this calls the public function itself (the tests compare the bits).
    """
    return [torch.linalg.vector_norm(p.grad) for p in params]
