"""The rollout engines behind one interface (:mod:`.base`): native, compiled, vLLM.

``engine.kind`` names one (docs/engines.md): ``native`` (:class:`.native.NativeEngine`),
``compiled`` (:class:`.native.CompiledEngine`), ``vllm`` (:class:`.vllm.VLLMRolloutEngine`),
or a user's own :class:`~.base.RolloutEngine` by its dotted path or ``{class_path,
init_args}``. vLLM itself is imported only when its engine starts.
"""

from __future__ import annotations

from rlkl_lightning.algorithms.engines.base import (
    ENGINES,
    RolloutEngine,
    build_engine,
    engine_class,
    engine_spec,
)
from rlkl_lightning.algorithms.engines.native import CompiledEngine, NativeEngine
from rlkl_lightning.algorithms.engines.vllm import VLLMRolloutEngine

__all__ = [
    "ENGINES",
    "CompiledEngine",
    "NativeEngine",
    "RolloutEngine",
    "VLLMRolloutEngine",
    "build_engine",
    "engine_class",
    "engine_spec",
]
