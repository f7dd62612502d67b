"""The five laws the package ships, built from the ``kl`` group with their exact arguments.

Each builder passes its controller class (:mod:`rlkl_lightning.kl.controllers`) the options of
that law only: ``kl.horizon``; ``kl.k``; ``kl.kp`` and ``kl.ki``; nothing for ``logpid``, whose
defaults are meant for every world; and the bounds the run sets. Each declares those options
(``register_law(..., options=...)``): the ``kl`` group refuses one set for a law that ignores it.
"""

from __future__ import annotations

from typing import Any

from rlkl_lightning.kl.controllers import (
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
    KLController,
    LogPIDKLController,
    PIKLController,
)
from rlkl_lightning.kl.laws.registry import register_law


@register_law("fixed", options=())
def fixed(settings: Any, init_kl_coef: float, **bounds: float) -> KLController:
    """:class:`FixedKLController`: beta stays ``init_kl_coef``."""
    return FixedKLController(init_kl_coef, **bounds)


@register_law("adaptive", options=("horizon",))
def adaptive(settings: Any, init_kl_coef: float, **bounds: float) -> KLController:
    """:class:`AdaptiveKLController` with ``kl.target`` and ``kl.horizon``."""
    return AdaptiveKLController(init_kl_coef, settings.target, settings.horizon, **bounds)


@register_law("exponential", options=("k",))
def exponential(settings: Any, init_kl_coef: float, **bounds: float) -> KLController:
    """:class:`ExponentialKLController` with ``kl.target`` and ``kl.k``."""
    return ExponentialKLController(init_kl_coef, settings.target, settings.k, **bounds)


@register_law("pi", options=("kp", "ki"))
def pi(settings: Any, init_kl_coef: float, **bounds: float) -> KLController:
    """:class:`PIKLController` with ``kl.target``, ``kl.kp`` and ``kl.ki``."""
    return PIKLController(init_kl_coef, settings.target, settings.kp, settings.ki, **bounds)


@register_law("logpid", options=())
def logpid(settings: Any, init_kl_coef: float, **bounds: float) -> KLController:
    """:class:`LogPIDKLController` with ``kl.target`` (its gains are its defaults)."""
    return LogPIDKLController(init_kl_coef, settings.target, **bounds)
