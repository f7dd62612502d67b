"""Float32 matrix products on the CPU through oneDNN: the ``cpu_matmul="onednn"`` option.

Why: where PyTorch's BLAS (MKL in the x86 wheels) does not take its AVX-512 kernels, oneDNN's
own float32 kernels, which the wheels also carry (``torch.ops.mkldnn._linear_pointwise``), are
faster (docs/benchmarks.md has the figures). With the option, every ``nn.Linear`` and GPT-2
``Conv1D`` of the models, and the LM head's products (:class:`OneDNNHeadProducts`), compute
their three products (forward, input gradient, weight gradient) there.

Everything stays float32, but oneDNN adds the products in another order than MKL, so results
differ from the default at float32 rounding (the tests bound the difference).
Whatever is not a float32 CPU product outside autocast (a GPU, ``bf16-mixed``, bf16 weights)
takes PyTorch's own path, as without the option.

``cpu_matmul="auto"`` (the default) picks oneDNN where MKL is known to skip its AVX-512 kernels
(an AMD processor with AVX-512: MKL dispatches them on Intel's alone) and PyTorch's own path
elsewhere:
:func:`resolve`. The choice depends on the processor only, never on a timing, so a run is
reproducible on its machine.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from transformers.pytorch_utils import Conv1D

CPU_MATMULS = ("auto", "default", "onednn")


def available() -> bool:
    """True if this PyTorch has oneDNN's float32 linear kernel for the CPU."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


def check_cpu_matmul(choice: str, option: str = "cpu_matmul") -> None:
    """Raise ``ValueError`` naming ``option`` unless ``choice`` is a ``cpu_matmul`` value here.

    The one rule of the option, for every model that takes it (the pipeline's, the reward's).
    """
    if choice not in CPU_MATMULS or (choice == "onednn" and not available()):
        allowed = CPU_MATMULS if available() else ("auto", "default")
        why = ""
        if choice == "onednn":
            why = " (this PyTorch has no oneDNN float32 linear kernel)"
        raise ValueError(f"`{option}` must be one of {allowed}{why}, got {choice!r}")


def _cpuinfo(field: str) -> str:
    """The first value of ``field`` in ``/proc/cpuinfo`` (``""`` where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The processor's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...; ``""`` if unknown)."""
    return _cpuinfo("vendor_id")


def has_avx512() -> bool:
    """Whether the processor has AVX-512 (``avx512f``), the width of oneDNN's fast kernels."""
    return "avx512f" in _cpuinfo("flags").split()


def resolve(choice: str) -> str:
    """The products ``cpu_matmul=choice`` takes here: ``"default"`` or ``"onednn"``.

    ``auto``: oneDNN on an AMD processor with AVX-512, where PyTorch's MKL takes its AVX2
    kernels (about half of oneDNN's float32 rate there, docs/benchmarks.md), if this PyTorch
    has the kernel; PyTorch's own products elsewhere.
    """
    if choice == "auto":
        amd = cpu_vendor() == "AuthenticAMD" and has_avx512()
        return "onednn" if amd and available() else "default"
    return choice


def _product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [N, K] @ weight [M, K].T (+ bias)`` by oneDNN; any strides."""
    if torch.compiler.is_compiling():
        return _compiled_product(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


@torch.library.custom_op("rlkl_lightning::onednn_product", mutates_args=())
def _compiled_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`_product` as an opaque operator of a compiled graph (the compiled decode step).

    Inductor lowers ``mkldnn._linear_pointwise`` itself only for weights frozen into the graph,
    and the policy's weights change between rollouts; an operator of its own is called as is.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


@_compiled_product.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _takes(x: Tensor, weight: Tensor) -> bool:
    """Whether the product of ``x`` and ``weight`` is one that oneDNN computes here."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
    )


class _Linear(torch.autograd.Function):
    """``x @ weight.T + bias`` with all three products by oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``x [..., K]``, ``weight [M, K]`` (any strides), ``bias [M]`` -> ``[..., M]``."""
        flat = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(flat, weight)
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        return _product(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        """Input, weight and bias gradients."""
        flat, weight = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t()).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_gradient(grad, flat, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def _weight_gradient(grad: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """``grad [N, M].T @ x [N, K]``, laid out like ``weight [M, K]``.

    oneDNN copies a transposed first operand; with many more rows than columns (an LM head)
    that copy costs more than the product, and the transposed product ``x.T @ grad`` is
    faster. A weight that is itself a transposed view (GPT-2's ``Conv1D``) gets its gradient
    in that layout, so it needs no copy either.
    """
    if weight.shape[0] > weight.shape[1] or not weight.is_contiguous():
        return _product(x.t(), grad.t()).t()
    return _product(grad.t(), x.t())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``torch.nn.functional.linear`` with float32 CPU products by oneDNN."""
    if _takes(x, weight):
        return _Linear.apply(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def product_t(a: Tensor, b: Tensor, onednn: bool) -> Tensor:
    """``a [N, K] @ b [M, K].T``: by oneDNN if ``onednn`` and it takes them (no autograd)."""
    if onednn and _takes(a, b):
        return _product(a, b)
    return a @ b.t()


class OneDNNHeadProducts:
    """The three products of a fused LM head (:mod:`rlkl_lightning.models.logprobs`) by oneDNN."""

    @staticmethod
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` with autograd."""
        return linear(x, weight)

    @staticmethod
    def times_t(a: Tensor, b: Tensor) -> Tensor:
        """``a [N, K] @ b [M, K].T`` (no autograd)."""
        return product_t(a, b, True)

    @staticmethod
    def weight_gradient(grad: Tensor, x: Tensor) -> Tensor:
        """``grad [N, V].T @ x [N, H]``, computed as the faster transposed product."""
        return product_t(x.t(), grad.t(), True).t()


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose float32 CPU products run through oneDNN (same parameters)."""

    #: What a fused LM head computes with when this layer is the model's head.
    head_products = OneDNNHeadProducts

    def forward(self, x: Tensor) -> Tensor:
        """``x @ weight.T + bias``."""
        return linear(x, self.weight, self.bias)


class OneDNNConv1D(Conv1D):
    """GPT-2's ``Conv1D`` (``x @ weight + bias``, weight ``[in, out]``) through oneDNN."""

    def forward(self, x: Tensor) -> Tensor:
        """``x @ weight + bias``."""
        return linear(x, self.weight.t(), self.bias)


def use_onednn(model: nn.Module) -> int:
    """Compute the float32 CPU products of ``model``'s linear layers with oneDNN, in place.

    Each ``nn.Linear`` and GPT-2 ``Conv1D`` becomes its subclass above: the same module with
    the same parameters (state dicts, checkpoints and ``save_pretrained`` are unchanged).

    Returns:
        The number of layers changed.
    """
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
        elif type(module) is Conv1D:
            module.__class__ = OneDNNConv1D
        else:
            continue
        changed += 1
    return changed
