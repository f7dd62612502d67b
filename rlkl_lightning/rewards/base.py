"""The reward contract: a callable ``reward(prompts, responses) -> Tensor[B]``, and its checks.

:class:`RewardModel` is that interface, checkable with ``isinstance``. Every output goes
through :func:`validate_scores`: a wrong shape or a non-finite score raises
:class:`InvalidRewardError` naming the reward class, so a trainer never learns from garbage.
A non-finite score is a numeric fault of one batch (the pipeline skips it); a wrong shape or
non-numeric output (:class:`RewardShapeError`) means the reward model is broken, and the
pipeline stops instead of skipping every batch. A reward whose ``marks_failures`` is true (a
client of a server, :mod:`.remote`) returns ``nan`` for a sample it could not score: the
pipeline leaves that sample out of the advantages, the losses and the logged score, and keeps
it in the KL (docs/rewards-at-scale.md).
"""

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = [
    "InvalidRewardError",
    "RewardModel",
    "RewardShapeError",
    "check_pairs",
    "validate_scores",
]


class RewardModel(abc.ABC):
    """Scores a batch of responses to their prompts.

    Any object with ``__call__(prompts, responses)`` counts as a reward model for ``isinstance``
    without subclassing this class (a structural check, as for a protocol). It is an abstract
    class rather than a ``typing.Protocol`` so that LightningCLI configs can name a reward by
    ``class_path`` (``PPOModule``'s ``reward`` argument); a protocol with only ``__call__``
    would be read there as a plain callable.
    """

    #: Whether a ``nan`` score marks a sample whose reward failed (the pipeline masks it) rather
    #: than a fault of the whole batch (the pipeline skips it); a client of a server sets it.
    marks_failures: ClassVar[bool] = False

    @abc.abstractmethod
    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        """Returns one score per pair.

        Args:
            prompts: ``B`` prompts.
            responses: ``B`` responses (the generated text without the prompt).

        Returns:
            ``[B]`` float32 scores on the CPU.
        """

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        if cls is not RewardModel or issubclass(other, type):  # a class is callable, not a reward
            return NotImplemented
        return any("__call__" in base.__dict__ for base in other.__mro__) or NotImplemented


class InvalidRewardError(ValueError):
    """A reward model returned a wrong shape or non-finite scores."""


class RewardShapeError(InvalidRewardError):
    """A reward model returned non-numeric scores or not one score per sample."""


def validate_scores(scores: Any, batch_size: int, source: object) -> Tensor:
    """Checks a reward output and returns it as a ``[B]`` float32 CPU tensor.

    Args:
        scores: What the reward model returned: a tensor, array or sequence of numbers.
        batch_size: ``B``, the number of (prompt, response) pairs scored.
        source: The reward model, or its name, for the error message (a non-string is
            named by its class).

    Returns:
        ``[B]`` float32 tensor on the CPU.

    Raises:
        RewardShapeError: If ``scores`` is not numeric or not of shape ``[B]``.
        InvalidRewardError: If ``scores`` holds ``nan``/``inf``.
    """
    if not isinstance(source, str):
        source = type(source).__name__
    try:
        if isinstance(scores, Tensor):
            out = scores.detach().to(device="cpu", dtype=torch.float32)
        else:
            out = torch.as_tensor(scores, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RewardShapeError(f"{source} returned non-numeric scores: {err}") from err
    if out.shape != (batch_size,):
        raise RewardShapeError(
            f"{source} must return one score per sample, shape [{batch_size}], "
            f"got shape {list(out.shape)}"
        )
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        idx = bad.nonzero().flatten().tolist()
        raise InvalidRewardError(
            f"{source} returned non-finite scores at indices {idx[:10]}: {out[bad][:10].tolist()}"
        )
    return out


def check_pairs(prompts: Sequence[str], responses: Sequence[str], source: str) -> None:
    """Refuse a batch whose prompts and responses differ in number, naming ``source``."""
    if len(prompts) != len(responses):
        raise ValueError(f"{source}: got {len(prompts)} prompts but {len(responses)} responses")
