"""The value function's head: a linear map from a trunk's last hidden state to one value."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ValueHead(nn.Module):
    """A scalar value per position from a hidden state: ``Linear(H, 1)``, zero-initialised bias.

    The product is taken in float32 whatever the dtype of the hidden states and of the stored
    weights (bf16 under ``bf16-true``), and outside autocast, so values, returns and the value
    loss are float32 numbers.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.linear.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[B, T, H] -> [B, T]``, float32."""
        weight, bias = self.linear.weight, self.linear.bias
        with torch.autocast(hidden.device.type, enabled=False):
            out = nn.functional.linear(hidden.float(), weight.float(), bias.float())
        return out.squeeze(-1)


def hidden_size_of(model: nn.Module) -> int:
    """The width of a transformers model's last hidden state."""
    config = model.config
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"cannot find the hidden size of {type(model).__name__}'s config")
