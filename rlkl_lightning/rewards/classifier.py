"""A reward from a Hugging Face sequence classifier: the score of one of its labels."""

import os
from typing import Any, Literal

import torch
from torch import Tensor

from rlkl_lightning.rewards.base import check_pairs, validate_scores

SCORES = ("logit", "prob", "log_odds")
TEXTS = ("response", "prompt+response")


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
        check_pairs(prompts, responses, repr(self))
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
