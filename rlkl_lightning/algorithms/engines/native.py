"""The native engines: the module's own KV-cache loop, eager or with a compiled decode step.

Both sample with the policy module itself
(:func:`~rlkl_lightning.algorithms.rollout.sample_and_score`), so nothing is pushed and the
log-probs they keep are the trainer's.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from rlkl_lightning.algorithms.engines.base import ENGINES, RolloutEngine
from rlkl_lightning.algorithms.rollout import sample_and_score


@ENGINES.register("native")
class NativeEngine(RolloutEngine):
    """The module's own KV-cache sampling loop (``engine.kind: native``, the default)."""

    #: Sample with the compiled decode step (:mod:`~rlkl_lightning.algorithms.compiled_decode`).
    compiled: ClassVar[bool] = False

    def start(self, module: Any) -> None:
        """With the compiled step, check that this policy and machine can run it."""
        if self.compiled:
            from rlkl_lightning.algorithms.compiled_decode import check

            check(module.policy, module.device)

    def sample(
        self, module: Any, prompt_ids: Tensor, prompt_mask: Tensor, keep_logits: bool
    ) -> tuple[Any, Any]:
        """The native loop's samples; it scores them as it draws them (no second pass)."""
        hp = module.sampling
        return sample_and_score(
            module.policy,
            prompt_ids,
            prompt_mask,
            max_new_tokens=hp.max_new_tokens,
            temperature=hp.temperature,
            top_k=hp.top_k,
            top_p=hp.top_p,
            eos_token_id=module.tokenizer.eos_token_id,
            pad_token_id=module.tokenizer.pad_token_id,
            stop_at_eos=hp.stop_at_eos,
            keep_logits=keep_logits,
            compiled=self.compiled,
        )


@ENGINES.register("compiled")
class CompiledEngine(NativeEngine):
    """The native loop with a static KV cache and one compiled decode step.

    ``engine.kind: compiled``, or ``engine.compiled_decode: true`` with ``kind: native``: the
    eager loop's tokens and random stream, its log-probs to float rounding.
    """

    compiled: ClassVar[bool] = True
