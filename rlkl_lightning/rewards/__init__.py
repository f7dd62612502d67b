"""Reward models: map (prompt, response) pairs to one scalar score each.

A reward model is any callable ``reward(prompts, responses) -> Tensor[B]`` (float32, on the
CPU); :class:`RewardModel` is that interface (``base.py``). The implementations:

- :class:`FunctionReward` wraps a plain Python function (``function.py``).
- :class:`SequenceClassifierReward` scores with a Hugging Face sequence classifier (e.g. a
  sentiment model), by hub name or local directory (``classifier.py``).
- :class:`VaderSentimentReward` is the VADER compound sentiment of the response, the reward of
  the embedded default world (no model download) (``vader.py``).
- :class:`RemoteReward` posts the pairs to a served reward model: this library's server
  (``python -m rlkl_lightning.serve_reward``) or ``vllm serve``'s classification API, with
  timeouts, retries and failed samples marked for masking (``remote.py``).

Every class is importable from here, and a config names it here
(``class_path: rlkl_lightning.rewards.SequenceClassifierReward``).
"""

from rlkl_lightning.rewards.base import (
    InvalidRewardError,
    RewardModel,
    RewardShapeError,
    check_pairs,
    validate_scores,
)
from rlkl_lightning.rewards.classifier import SequenceClassifierReward
from rlkl_lightning.rewards.function import FunctionReward
from rlkl_lightning.rewards.remote import RemoteReward, RewardServerDown
from rlkl_lightning.rewards.vader import VaderSentimentReward

__all__ = [
    "FunctionReward",
    "InvalidRewardError",
    "RemoteReward",
    "RewardModel",
    "RewardServerDown",
    "RewardShapeError",
    "SequenceClassifierReward",
    "VaderSentimentReward",
    "check_pairs",
    "validate_scores",
]
