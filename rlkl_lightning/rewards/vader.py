"""The VADER sentiment of the response: the reward of the embedded default world."""

from torch import Tensor

from rlkl_lightning.rewards.base import check_pairs, validate_scores


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
        check_pairs(prompts, responses, repr(self))
        scores = [self._analyzer.polarity_scores(r)["compound"] for r in responses]
        return validate_scores(scores, len(responses), repr(self))

    def __repr__(self) -> str:
        return "VaderSentimentReward()"
