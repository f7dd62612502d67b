import math

import numpy as np
import pytest
import torch
from helpers.tiny_models import save_tiny_classifier

from rlkl_lightning.rewards import (
    FunctionReward,
    InvalidRewardError,
    RewardModel,
    SequenceClassifierReward,
    VaderSentimentReward,
    validate_scores,
)

TEXTS = [
    "the film was great",
    "a terrible boring movie that was far too long and i did not like the plot at all",
    "wonderful",
    "the plot was boring",
    "lovely ending and great acting",
]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_classifier")
    save_tiny_classifier(path)
    return path


@pytest.fixture(scope="module")
def reference(classifier_dir):
    """The same model and tokenizer loaded directly: logits of one unpadded text."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()

    def logits(text: str) -> torch.Tensor:
        with torch.no_grad():
            return model(**tok(text, return_tensors="pt")).logits[0]

    return logits


def test_scores_match_direct_unpadded_forward_passes(classifier_dir, reference):
    direct = torch.stack([reference(t) for t in TEXTS])  # [5, 2]
    prompts = [""] * len(TEXTS)
    logit = SequenceClassifierReward(classifier_dir, batch_size=2)(prompts, TEXTS)
    assert logit.dtype == torch.float32 and logit.device.type == "cpu" and logit.shape == (5,)
    torch.testing.assert_close(logit, direct[:, 1], rtol=0, atol=1e-5)
    prob = SequenceClassifierReward(classifier_dir, score="prob")(prompts, TEXTS)
    torch.testing.assert_close(prob, torch.softmax(direct, -1)[:, 1], rtol=0, atol=1e-6)
    log_odds = SequenceClassifierReward(classifier_dir, score="log_odds")(prompts, TEXTS)
    torch.testing.assert_close(log_odds, direct[:, 1] - direct[:, 0], rtol=0, atol=1e-5)
    # log_odds is log p / (1 - p), a second way to reach it.
    torch.testing.assert_close(log_odds, torch.logit(prob.double()).float(), rtol=0, atol=1e-4)
    negative = SequenceClassifierReward(classifier_dir, label="negative")(prompts, TEXTS)
    torch.testing.assert_close(negative, direct[:, 0], rtol=0, atol=1e-5)


def test_batched_equals_per_sample(classifier_dir):
    reward = SequenceClassifierReward(classifier_dir, batch_size=3)
    batched = reward([""] * len(TEXTS), TEXTS)
    single = torch.cat([reward([""], [t]) for t in TEXTS])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)
    assert batched.std() > 0  # the texts really get different scores


def test_prompt_plus_response_and_left_truncation(classifier_dir, reference):
    both = SequenceClassifierReward(classifier_dir, text="prompt+response")
    prompts, responses = ["the film was ", "wonderful "], ["great", "acting"]
    expected = torch.stack([reference("the film was great")[1], reference("wonderful acting")[1]])
    torch.testing.assert_close(both(prompts, responses), expected, rtol=0, atol=1e-5)
    # Past max_length the end of the text is kept.
    short = SequenceClassifierReward(classifier_dir, max_length=4)
    long = "a terrible boring movie that was far too long"
    torch.testing.assert_close(
        short([""], [long]), reference("was far too long")[1:2], rtol=0, atol=1e-5
    )


def test_label_lookup_and_errors(classifier_dir):
    assert SequenceClassifierReward(classifier_dir).label_index == 1
    assert SequenceClassifierReward(classifier_dir, label="Negative").label_index == 0
    assert SequenceClassifierReward(classifier_dir, label=0).label_index == 0
    with pytest.raises(ValueError, match=r"'joy' not found.*NEGATIVE \(0\), POSITIVE \(1\)"):
        SequenceClassifierReward(classifier_dir, label="joy")
    with pytest.raises(ValueError, match=r"index 2 out of range.*NEGATIVE \(0\), POSITIVE"):
        SequenceClassifierReward(classifier_dir, label=2)
    for kwargs, option in [
        ({"score": "softmax"}, "score"),
        ({"text": "prompt"}, "text"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_length": 0}, "max_length"),
    ]:
        with pytest.raises(ValueError, match=option):
            SequenceClassifierReward(classifier_dir, **kwargs)
    reward = SequenceClassifierReward(classifier_dir)
    assert isinstance(reward, RewardModel)
    assert reward.to("cpu") is reward and reward.device.type == "cpu"
    assert not reward.model.training
    assert not any(p.requires_grad for p in reward.model.parameters())
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reward(["a", "b"], ["c"])


def test_tokenizer_without_pad_token_pads_with_eos(tmp_path):
    save_tiny_classifier(tmp_path, with_pad=False)
    reward = SequenceClassifierReward(tmp_path, batch_size=5)
    assert reward.tokenizer.pad_token == "[EOS]"
    assert reward.model.config.pad_token_id == reward.tokenizer.eos_token_id
    batched = reward([""] * len(TEXTS), TEXTS)
    single = torch.cat([reward([""], [t]) for t in TEXTS])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-5)


def test_single_logit_classifier(tmp_path):
    save_tiny_classifier(tmp_path, num_labels=1)
    logit = SequenceClassifierReward(tmp_path, label=0)([""] * 2, TEXTS[:2])
    prob = SequenceClassifierReward(tmp_path, label=0, score="prob")([""] * 2, TEXTS[:2])
    torch.testing.assert_close(prob, torch.sigmoid(logit), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"LABEL_0 \(0\)"):
        SequenceClassifierReward(tmp_path)  # default "POSITIVE" does not exist here


def test_function_reward_per_sample_and_batched():
    per_sample = FunctionReward(lambda p, r: len(p) - 2 * len(r))
    out = per_sample(["abc", "", "xy"], ["a", "bcd", ""])
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert out.tolist() == [1.0, -6.0, 2.0]

    calls = []

    def batched_fn(prompts, responses):
        calls.append(len(prompts))
        return np.array([float(r.count("!")) for r in responses])

    batched = FunctionReward(batched_fn, batched=True)
    assert batched(["p", "q"], ["wow!!", "ok"]).tolist() == [2.0, 0.0]
    assert calls == [2]  # one call for the whole batch
    assert isinstance(per_sample, RewardModel) and isinstance(batched, RewardModel)
    assert per_sample([], []).shape == (0,)
    with pytest.raises(ValueError, match="callable"):
        FunctionReward(3.0)


def test_function_reward_output_is_validated():
    with pytest.raises(InvalidRewardError, match=r"FunctionReward.*shape \[2\].*\[3\]"):
        FunctionReward(lambda p, r: [1.0, 2.0, 3.0], batched=True)(["a", "b"], ["c", "d"])
    with pytest.raises(InvalidRewardError, match=r"FunctionReward.*non-finite.*\[1\]"):
        FunctionReward(lambda p, r: math.nan if r == "bad" else 0.0)(["a", "b"], ["ok", "bad"])
    with pytest.raises(InvalidRewardError, match="FunctionReward.*non-numeric"):
        FunctionReward(lambda p, r: "high")(["a"], ["b"])
    with pytest.raises(ValueError, match="1 prompts but 2 responses"):
        FunctionReward(lambda p, r: 0.0)(["a"], ["b", "c"])


def test_validate_scores():
    ok = validate_scores(torch.tensor([1.0, -2.0], dtype=torch.float64), 2, "R")
    assert ok.dtype == torch.float32 and ok.tolist() == [1.0, -2.0]
    torch.testing.assert_close(validate_scores([0.5, 1], 2, "R"), torch.tensor([0.5, 1.0]))
    with pytest.raises(
        InvalidRewardError, match=r"R must return .* shape \[2\], got shape \[2, 1\]"
    ):
        validate_scores(torch.zeros(2, 1), 2, "R")
    with pytest.raises(InvalidRewardError, match=r"got shape \[\]"):
        validate_scores(torch.tensor(1.0), 1, "R")
    with pytest.raises(
        InvalidRewardError, match=r"R returned non-finite scores at indices \[0, 2\]"
    ):
        validate_scores([math.inf, 0.0, math.nan], 3, "R")
    assert issubclass(InvalidRewardError, ValueError)
    # A reward object is named by its class.
    with pytest.raises(InvalidRewardError, match="^VaderSentimentReward must return"):
        validate_scores([1.0], 2, VaderSentimentReward())


def test_vader_sentiment_reward():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    reward = VaderSentimentReward()
    assert isinstance(reward, RewardModel)
    responses = ["This film is wonderful and moving.", "Terrible, boring and far too long."]
    scores = reward(["Review:", "Review:"], responses)
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    assert scores[0] > 0.3 and scores[1] < -0.3
    analyzer = SentimentIntensityAnalyzer()
    expected = [analyzer.polarity_scores(r)["compound"] for r in responses]
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=0, atol=0)
    # The prompt is ignored.
    torch.testing.assert_close(reward(["I hate it.", "Great!"], responses), scores)
