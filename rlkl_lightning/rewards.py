"""Reward models: map (prompt, response) pairs to one scalar score each.

A reward model is any callable ``reward(prompts, responses) -> Tensor[B]`` (float32, on
the CPU); :class:`RewardModel` is that interface, checkable with ``isinstance``. Three
implementations:

- :class:`FunctionReward` wraps a plain Python function.
- :class:`SequenceClassifierReward` scores with a Hugging Face sequence classifier
  (e.g. a sentiment model), by hub name or local directory.
- :class:`VaderSentimentReward` is the VADER compound sentiment of the response, the
  reward of the embedded default world (no model download).

Every output goes through :func:`validate_scores`: a wrong shape or a non-finite score
raises :class:`InvalidRewardError` naming the reward class, so a trainer never learns from
garbage. A non-finite score is a numeric fault of one batch (``PPOModule`` skips it); a
wrong shape or non-numeric output (:class:`RewardShapeError`) means the reward model is
broken, and ``PPOModule`` stops instead of skipping every batch.
"""

import abc
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "FunctionReward",
    "InvalidRewardError",
    "RewardModel",
    "RewardShapeError",
    "SequenceClassifierReward",
    "VaderSentimentReward",
    "validate_scores",
]

SCORES = ("logit", "prob", "log_odds")
TEXTS = ("response", "prompt+response")


class RewardModel(abc.ABC):
    """Scores a batch of responses to their prompts.

    Any object with ``__call__(prompts, responses)`` counts as a reward model for ``isinstance``
    without subclassing this class (a structural check, as for a protocol). It is an abstract
    class rather than a ``typing.Protocol`` so that LightningCLI configs can name a reward by
    ``class_path`` (``PPOModule``'s ``reward`` argument); a protocol with only ``__call__``
    would be read there as a plain callable.
    """

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


def _check_pairs(prompts: Sequence[str], responses: Sequence[str], source: str) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"{source}: got {len(prompts)} prompts but {len(responses)} responses")


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
        _check_pairs(prompts, responses, name)
        if self.batched:
            scores = self.fn(list(prompts), list(responses))
        else:
            scores = [self.fn(p, r) for p, r in zip(prompts, responses, strict=True)]
        return validate_scores(scores, len(prompts), name)

    def __repr__(self) -> str:
        fn_name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"FunctionReward({fn_name}, batched={self.batched})"


class SequenceClassifierReward:
    """Score of one label of a Hugging Face sequence classifier.

    Loads ``AutoModelForSequenceClassification`` and ``AutoTokenizer`` from a hub name
    or a local directory and scores texts in batches, in eval mode under
    ``torch.inference_mode``. Texts longer than ``max_length`` tokens keep their end
    (left truncation), so the end of a response is always scored. Padding is on the
    right; a tokenizer without a pad token pads with its EOS token.

    Args:
        model: Hub name or local directory of the classifier.
        label: The label whose score is the reward: a name from the model config's
            ``id2label``/``label2id`` (case-insensitive) or a class index.
        tokenizer: Hub name or directory of the tokenizer; ``None`` uses ``model``.
        score: ``"logit"``: the label's logit; ``"prob"``: its softmax probability (a
            sigmoid for single-logit models); ``"log_odds"``: ``log p / (1 - p)``,
            i.e. the label's logit minus the logsumexp of the others (for a
            two-label model, the difference of the two logits).
        batch_size: Texts per forward pass (``>= 1``).
        max_length: Maximum tokens per text (``>= 1``).
        text: What is classified: ``"response"`` alone, or ``"prompt+response"``
            concatenated (the response continues the prompt).
        trust_remote_code: Run code shipped with the classifier or its tokenizer; off, such a
            model is refused with an error. Set it only for models you trust.
        cpu_matmul: ``auto`` (default), ``default`` or ``onednn``: the classifier's float32
            CPU matrix products through oneDNN, as the pipeline's option of that name
            (:mod:`rlkl_lightning.perf.onednn`).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        label: str | int = "POSITIVE",
        tokenizer: str | os.PathLike | None = None,
        score: Literal["logit", "prob", "log_odds"] = "logit",
        batch_size: int = 32,
        max_length: int = 512,
        text: Literal["response", "prompt+response"] = "response",
        trust_remote_code: bool = False,
        cpu_matmul: str = "auto",
    ) -> None:
        from rlkl_lightning.perf.onednn import check_cpu_matmul, resolve, use_onednn

        check_cpu_matmul(cpu_matmul)
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if text not in TEXTS:
            raise ValueError(f"text must be one of {TEXTS}, got {text!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if not isinstance(trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = str(model)
        self.score = score
        self.batch_size = batch_size
        self.max_length = max_length
        self.text = text

        trust = {"trust_remote_code": trust_remote_code}
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or model), **trust)
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(
                    f"the tokenizer of {self.name} has neither a pad nor an eos token; "
                    "set one (tokenizer.pad_token) and save it"
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"

        from rlkl_lightning.perf.gelu import fuse_tanh_gelu

        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                str(model), weights_only=True, **trust
            )
        except Exception as err:  # OSError, ValueError, UnpicklingError, SafetensorError, ...
            raise ValueError(
                f"SequenceClassifierReward: could not load a sequence classifier from "
                f"`model` {self.name!r}: {type(err).__name__}: {err}"
            ) from err
        fuse_tanh_gelu(self.model)  # same activation in one kernel (models.fuse_tanh_gelu)
        if resolve(cpu_matmul) == "onednn":
            use_onednn(self.model)
        self.model.eval()
        self.model.requires_grad_(False)
        if self.model.config.pad_token_id is None:
            # Decoder classifiers pool the last non-pad token: they must know the pad id.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label_index = _resolve_label(label, self.model.config, self.name)

    @property
    def device(self) -> torch.device:
        """The device the classifier runs on."""
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> "SequenceClassifierReward":
        """Moves the classifier to ``device`` (scores still come back on the CPU)."""
        self.model.to(device)
        return self

    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        """Scores the pairs; see :class:`RewardModel`."""
        _check_pairs(prompts, responses, repr(self))
        if self.text == "response":
            texts = list(responses)
        else:
            texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        chunks = [
            self._score(texts[i : i + self.batch_size])
            for i in range(0, len(texts), self.batch_size)
        ]
        scores = torch.cat(chunks) if chunks else torch.zeros(0)
        return validate_scores(scores, len(texts), repr(self))

    @torch.inference_mode()
    def _score(self, texts: list[str]) -> Tensor:
        enc = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        logits = self.model(**enc).logits.float()  # [n, num_labels]
        k = self.label_index
        if logits.shape[-1] == 1:  # one logit: a binary classifier's log-odds
            out = torch.sigmoid(logits[:, 0]) if self.score == "prob" else logits[:, 0]
        elif self.score == "logit":
            out = logits[:, k]
        elif self.score == "prob":
            out = torch.softmax(logits, dim=-1)[:, k]
        else:  # log_odds: log p_k - log(1 - p_k)
            others = torch.cat([logits[:, :k], logits[:, k + 1 :]], dim=-1)
            out = logits[:, k] - torch.logsumexp(others, dim=-1)
        return out.cpu()

    def __repr__(self) -> str:
        return (
            f"SequenceClassifierReward({self.name!r}, label={self.label_index}, "
            f"score={self.score!r})"
        )


def _resolve_label(label: str | int, config: Any, name: str) -> int:
    """Index of ``label`` in the classifier's labels (by name, case-insensitive, or index)."""
    num_labels = int(config.num_labels)
    id2label = {int(i): str(n) for i, n in (config.id2label or {}).items()}
    label2id = {str(n): int(i) for n, i in (config.label2id or {}).items()}
    names = {**{n: i for i, n in id2label.items()}, **label2id}
    available = ", ".join(f"{id2label.get(i, i)!s} ({i})" for i in range(num_labels))
    if isinstance(label, int) and not isinstance(label, bool):
        if 0 <= label < num_labels:
            return label
        raise ValueError(
            f"label index {label} out of range for {name} with {num_labels} labels; "
            f"available labels: {available}"
        )
    if isinstance(label, str):
        if label in names:
            return names[label]
        folded = {n.casefold(): i for n, i in names.items()}
        if label.casefold() in folded:
            return folded[label.casefold()]
    raise ValueError(f"label {label!r} not found in {name}; available labels: {available}")


class VaderSentimentReward:
    """VADER compound sentiment of the response, in ``[-1, 1]``.

    The rule-based analyzer of Hutto & Gilbert 2014 (``vaderSentiment`` package): no
    model, no download, fast on a CPU. It is the reward of the embedded default world,
    where PPO learns to write more positive reviews. The prompt is ignored.
    """

    def __init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._analyzer = SentimentIntensityAnalyzer()

    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        """Scores the responses; see :class:`RewardModel`."""
        _check_pairs(prompts, responses, repr(self))
        scores = [self._analyzer.polarity_scores(r)["compound"] for r in responses]
        return validate_scores(scores, len(responses), repr(self))

    def __repr__(self) -> str:
        return "VaderSentimentReward()"
