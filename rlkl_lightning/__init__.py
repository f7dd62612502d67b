"""rlkl_lightning: RL fine-tuning of causal language models with KL control.

The KL-control core (estimators, controllers, callbacks) imports only torch and
Lightning; ``PPOModule``, ``RLOOModule`` and the default world load transformers lazily.

Importing the package registers the worlds' model names (``"default"``, ``"exact"``) with
:mod:`rlkl_lightning.models.named` (:mod:`rlkl_lightning.world.names`, standard library only
until a name is resolved), so ``policy: default`` resolves wherever the package is used.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "CapabilityBudget": "rlkl_lightning.kl.capability_budget",
    "AdaptiveKLController": "rlkl_lightning.kl.controllers",
    "ExponentialKLController": "rlkl_lightning.kl.controllers",
    "FixedKLController": "rlkl_lightning.kl.controllers",
    "KLController": "rlkl_lightning.kl.controllers",
    "KLLaw": "rlkl_lightning.kl.controllers",
    "LogPIDKLController": "rlkl_lightning.kl.controllers",
    "PIKLController": "rlkl_lightning.kl.controllers",
    "KLControllerCallback": "rlkl_lightning.kl.controller_callback",
    "KLDriftMonitor": "rlkl_lightning.kl.drift_monitor",
    "PPOModule": "rlkl_lightning.algorithms.ppo",
    "RLOOModule": "rlkl_lightning.algorithms.rloo",
    "RLPipeline": "rlkl_lightning.algorithms.pipeline",
    "ReferenceRefresh": "rlkl_lightning.algorithms.reference_refresh",
    "Trajectory": "rlkl_lightning.trajectory",
}

__all__ = sorted(_LAZY)
__version__ = "0.15.0"


def __getattr__(name: str) -> Any:
    """Import public names on first use, so ``import rlkl_lightning`` stays light."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlkl_lightning' has no attribute {name!r}")


# Last: the world imports from the package. The models never import the world; it registers.
from rlkl_lightning.world import names as _world_names  # noqa: E402, F401
