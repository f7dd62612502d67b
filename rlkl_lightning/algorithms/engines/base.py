"""The rollout-engine interface: start, push weights, sample, close; and the engines' registry.

A rollout engine is what samples a batch's responses (phase 1 of the pipeline,
docs/pipeline.md). The module picks its engine once, when it is built, from ``engine.kind``
(a registered name, a dotted path, or ``{class_path, init_args}``: the one idiom of
:mod:`rlkl_lightning.components`), and from then on calls only the four methods of
:class:`RolloutEngine`:

* :meth:`~RolloutEngine.start` at ``on_fit_start``, on every rank at the same point (building
  vLLM's engine is a collective under DDP), or at the first rollout without a trainer;
* :meth:`~RolloutEngine.push` before every rollout: the policy's weights, if they changed
  since the engine last got them (the module's ``weights_version`` counts the changes);
* :meth:`~RolloutEngine.sample`: the trajectory and the policy's scores of its samples;
* :meth:`~RolloutEngine.close` when the module is done with it.

An engine reads what it needs from the module it is given: ``policy``, ``tokenizer``,
``sampling`` (the options group), ``engine`` (the engine options group), ``device``,
``global_rank``, ``batches_seen + skipped_batches`` (the batch, restored on a resume),
``weights_version`` and, where there is one, ``trainer``. It imports nothing of the pipeline,
which imports it.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from torch import Tensor

from rlkl_lightning.components import Registry, check_arguments, plain_spec

__all__ = ["ENGINES", "RolloutEngine", "build_engine", "engine_class", "engine_spec"]


class RolloutEngine:
    """What samples the responses of a batch; subclass it and register it (docs/engines.md).

    ``shares_weights``: the engine samples with the policy module itself (the native loop):
    there is nothing to push, its log-probs are the trainer's and a mismatch correction has
    nothing to correct. An engine with weights of its own (vLLM) sets it False; the pipeline
    then logs the sampler/trainer gap (``mismatch/*``).
    """

    shares_weights: ClassVar[bool] = True

    def start(self, module: Any) -> None:
        """Check the settings and build what the engine needs (on every rank, at fit start)."""

    def push(self, module: Any) -> None:
        """Give the engine ``module.policy``'s weights if they changed since it last got them."""

    def sample(
        self, module: Any, prompt_ids: Tensor, prompt_mask: Tensor, keep_logits: bool
    ) -> tuple[Any, Any]:
        """One response per row of the left-padded ``[B, P]`` prompts.

        Returns:
            The :class:`~rlkl_lightning.trajectory.Trajectory` (``input_ids``,
            ``attention_mask``, ``response_ids``, ``response_mask``, the trainer's
            ``logprobs``, and the engine's own as ``sampler_logprobs`` where they differ) and
            the policy's :class:`~rlkl_lightning.models.logprobs.TokenScores` of the samples
            (with the logits if ``keep_logits``).
        """
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the engine holds."""


def _check_engine(name: str, component: Any) -> None:
    if not (inspect.isclass(component) and issubclass(component, RolloutEngine)):
        raise ValueError(f"register: engine {name!r} must be a RolloutEngine subclass")


#: The registered rollout engines, by name (``engine.kind``).
ENGINES = Registry("engine.kind", "a RolloutEngine subclass", _check_engine)


def engine_class(value: Any, option: str = "engine.kind") -> tuple[type, dict[str, Any]]:
    """The engine class ``value`` names and its arguments, checked.

    Raises:
        ValueError: Naming ``option`` and the registered engines, for a value that names no
            RolloutEngine class, or arguments it does not take.
    """
    target, init_args = ENGINES.resolve(value, option)
    if not (inspect.isclass(target) and issubclass(target, RolloutEngine)):
        raise ENGINES.error(value, option, f", which names {type(target).__name__} {target!r}")
    check_arguments(target, init_args, option)
    return target, init_args


def engine_spec(value: Any, option: str = "engine.kind") -> str | dict[str, Any]:
    """``engine.kind`` as a plain value: a registered name or a path as it is, else its spec."""
    target, init_args = engine_class(value, option)
    if isinstance(value, str):
        return value
    name = ENGINES.name_of(target)
    return name if name is not None and not init_args else plain_spec(target, init_args)


def build_engine(value: Any, option: str = "engine.kind") -> RolloutEngine:
    """A new engine of the kind ``value`` names, built with its ``init_args`` (not started)."""
    target, init_args = engine_class(value, option)
    return target(**init_args)
