"""Training data: prompts and held-out texts, and the samplers that make data order resumable.

The data module loads Lightning and torch on first use of its name, so that the registry of
named text sources (:mod:`.sources`, which the world fills when the package is imported) stays
light.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "PromptDataModule": "rlkl_lightning.data.prompts",
    "chat_prompts": "rlkl_lightning.data.prompts",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Import the data module (Lightning, torch) on first use."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlkl_lightning.data' has no attribute {name!r}")
