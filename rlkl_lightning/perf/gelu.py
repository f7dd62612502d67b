"""GPT-2's tanh-approximated GELU in PyTorch's one fused kernel (applied by the pipeline)."""

from __future__ import annotations

from torch import Tensor, nn


class TanhGELU(nn.Module):
    """The tanh approximation of GELU in PyTorch's fused kernel."""

    def forward(self, x: Tensor) -> Tensor:
        """Element-wise ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
        return nn.functional.gelu(x, approximate="tanh")


def fuse_tanh_gelu(model: nn.Module) -> int:
    """Compute the tanh-approximated GELU with PyTorch's one fused kernel, in place.

    GPT-2's ``gelu_new`` (and ``gelu_fast``) evaluate
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (Hendrycks & Gimpel 2016,
    arXiv 1606.08415) as about eight element-wise operations, each a pass over the MLP
    activations forward and again backward. :class:`TanhGELU` evaluates the same formula with
    ``torch.nn.functional.gelu(x, approximate="tanh")``, one kernel; the results agree to float
    rounding (``tests/perf/test_fast_path.py``).

    Returns:
        The number of activation modules replaced.
    """
    from transformers.activations import FastGELUActivation, NewGELUActivation

    replaced = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) in (NewGELUActivation, FastGELUActivation):
                setattr(module, name, TanhGELU())
                replaced += 1
    return replaced
