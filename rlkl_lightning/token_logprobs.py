"""Log-probabilities of chosen tokens straight from hidden states, with a hand-written backward.

The PPO update needs ``log softmax(h W^T / T)[y]`` per response token, and its gradient, but
never the ``[N, V]`` logits themselves. Through autograd the logits tensor is copied for the
temperature, reduced, gathered, and its gradient is assembled from several ``[N, V]`` pieces
(a zero-filled gather gradient, the softmax term, the division). With ``p = softmax(z)`` and
``z = h W^T / T`` the gradient is simply::

    d log p_y / d z = onehot(y) - p          (times the incoming gradient g, divided by T)

so :class:`TokenLogProbs` keeps one ``[N, V]`` buffer, turns it into ``-g p / T`` in place,
adds ``g / T`` at the chosen tokens, and multiplies by ``W`` and ``h`` for the two input
gradients. ``tests/test_fast_path.py`` compares values and gradients with autograd's.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


class TokenLogProbs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T / temperature)`` gathered at ``tokens``: ``[N]``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float) -> Tensor:
        """``hidden [N, H]``, ``weight [V, H]``, ``tokens [N]`` -> log-probabilities ``[N]``."""
        logits = (hidden @ weight.t()).float()  # log-probs always in float32
        logits.mul_(1.0 / temperature)
        logz = torch.logsumexp(logits, dim=-1)
        out = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz
        ctx.save_for_backward(hidden, weight, tokens, logits, logz)
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        """Gradients for ``hidden`` and ``weight`` (the saved logits buffer is reused)."""
        hidden, weight, tokens, logits, logz = ctx.saved_tensors
        scale = grad_out.unsqueeze(-1) / ctx.temperature  # [N, 1]
        grad_logits = logits.sub_(logz.unsqueeze(-1)).exp_().mul_(-scale)  # -g p / T
        grad_logits.scatter_add_(-1, tokens.unsqueeze(-1), scale)  # + g / T at y
        grad_logits = grad_logits.to(weight.dtype)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def token_logprobs(hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """Log-probabilities of ``tokens [B, R]`` under ``softmax(hidden [B, R, H] @ weight.T / T)``.

    Equal to ``gather_logprobs((hidden @ weight.T).float() / T, tokens)``, float32.
    """
    flat = TokenLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, tokens.reshape(-1), float(temperature)
    )
    return flat.view(tokens.shape)
