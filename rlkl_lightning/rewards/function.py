"""A reward from a plain Python function."""

from collections.abc import Callable, Sequence

from torch import Tensor

from rlkl_lightning.rewards.base import check_pairs, validate_scores


class FunctionReward:
    """A reward from a plain Python function.

    Args:
        fn: ``fn(prompt, response) -> float`` called once per pair, or with
            ``batched=True``, ``fn(prompts, responses) -> sequence of B floats``
            (a list, array or tensor).
        batched: Call ``fn`` once on the whole batch.

    Example:
        >>> reward = FunctionReward(lambda prompt, response: float(len(response)))
        >>> reward(["Hi"], ["there"])
        tensor([5.])
    """

    def __init__(
        self,
        fn: Callable[[str, str], float] | Callable[[list[str], list[str]], Sequence[float]],
        batched: bool = False,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.batched = batched

    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        """Scores the pairs; see :class:`RewardModel`."""
        name = repr(self)
        check_pairs(prompts, responses, name)
        if self.batched:
            scores = self.fn(list(prompts), list(responses))
        else:
            scores = [self.fn(p, r) for p, r in zip(prompts, responses, strict=True)]
        return validate_scores(scores, len(prompts), name)

    def __repr__(self) -> str:
        fn_name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"FunctionReward({fn_name}, batched={self.batched})"
