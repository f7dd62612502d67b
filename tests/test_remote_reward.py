"""RemoteReward against a fault-injecting server on the loopback address: each fault's outcome.

Every request loop is bounded: the client's retries and its batch deadline (a few seconds at
most here), and each server stops when its ``with`` block ends.
"""

import math
import random
import re
import time

import pytest
import torch
from helpers.fault_server import FaultServer

from rlkl_lightning.rewards import RemoteReward, RewardServerDown

PROMPTS = ["p0", "p1", "p2", "p3", "p4"]
RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee"]
EXPECTED = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
FAST = {"timeout_s": 1.0, "deadline_s": 5.0, "backoff_s": 0.01, "max_backoff_s": 0.05}


def client(server, **kwargs):
    return RemoteReward(server.url, **{**FAST, "request_size": 5, **kwargs})


def test_scores_come_back_in_order_in_requests_of_request_size_with_a_bound_in_flight():
    with FaultServer(rule=lambda n, body: ("sleep", 0.2)) as server:
        reward = client(server, request_size=1, max_in_flight=2)
        torch.testing.assert_close(reward(PROMPTS, RESPONSES), EXPECTED, rtol=0, atol=0)
        assert len(server.scoring_requests()) == 5
        assert server.most_in_flight == 2
    assert reward.last_stats["failed"] == 0 and reward.last_stats["retries"] == 0
    assert len(reward.last_stats["latency_ms"]) == 5
    assert all(ms >= 200 for ms in reward.last_stats["latency_ms"])


@pytest.mark.parametrize(
    "fault",
    [("status", 500), ("status", 503), ("status", 408), ("status", 429), "drop"],
    ids=["500", "503", "408", "429", "dropped"],
)
def test_a_transient_fault_is_retried_and_recovers(fault):
    with FaultServer([fault, fault]) as server:
        reward = client(server)
        torch.testing.assert_close(reward(PROMPTS, RESPONSES), EXPECTED, rtol=0, atol=0)
        assert len(server.scoring_requests()) == 3
    assert reward.last_stats["retries"] == 2 and reward.last_stats["failed"] == 0


def test_a_slow_answer_past_the_timeout_is_retried():
    with FaultServer([("sleep", 1.5)]) as server:
        reward = client(server, timeout_s=0.5)
        torch.testing.assert_close(reward(PROMPTS, RESPONSES), EXPECTED, rtol=0, atol=0)
    assert reward.last_stats["retries"] >= 1  # one, unless a busy machine slowed an answer too


def test_retry_after_is_honoured_up_to_the_largest_backoff():
    with FaultServer([("status", 429, 0.3)]) as server:
        client(server, max_backoff_s=1.0)(PROMPTS, RESPONSES)
        first, second = (r["time"] for r in server.scoring_requests())
        assert 0.3 <= second - first < 2.0  # bounds wide for a busy machine
    with FaultServer([("status", 429, 100)]) as server:
        client(server, max_backoff_s=0.2)(PROMPTS, RESPONSES)
        first, second = (r["time"] for r in server.scoring_requests())
        assert 0.2 <= second - first < 2.0  # capped at max_backoff_s, not 100 s


def test_retries_stop_at_max_retries_and_the_samples_fail():
    with FaultServer(rule=lambda n, body: ("status", 500)) as server:
        scores = client(server, max_retries=3)(PROMPTS, RESPONSES)
        assert len(server.scoring_requests()) == 4
    assert torch.isnan(scores).all()


@pytest.mark.parametrize(
    "fault", [("status", 400), ("status", 404), "malformed", "wrong_count"], ids=str
)
def test_a_final_fault_is_not_retried_and_fails_the_request(fault):
    with FaultServer([fault]) as server:
        reward = client(server, request_size=3, max_in_flight=1)
        scores = reward(PROMPTS, RESPONSES)
        assert len(server.scoring_requests()) == 2  # two requests, neither retried
    assert torch.isnan(scores[:3]).all()
    torch.testing.assert_close(scores[3:], EXPECTED[3:], rtol=0, atol=0)
    assert reward.last_stats["failed"] == 3 and reward.last_stats["retries"] == 0


def test_a_nan_score_fails_its_own_sample_only():
    with FaultServer(["nan"]) as server:
        scores = client(server)(PROMPTS, RESPONSES)
    assert math.isnan(scores[0]) and torch.equal(scores[1:], EXPECTED[1:])


@pytest.mark.parametrize("fault", ["huge", "string"])
def test_a_score_that_is_not_a_float_fails_its_own_sample_only(fault):
    """An integer too large for a float (it raised OverflowError through the run) and a
    string (not a number, however it reads) fail their sample, not the batch."""
    with FaultServer([fault]) as server:
        scores = client(server)(PROMPTS, RESPONSES)
    assert math.isnan(scores[0]) and torch.equal(scores[1:], EXPECTED[1:])


def test_vllm_rows_that_are_not_one_per_sample_fail_the_request_and_a_bad_probability_its_sample():
    def probs(text):
        return [1 - len(text) / 10, len(text) / 10]

    with FaultServer(["same_index", "string"], probs=probs) as server:
        reward = client(server, api="vllm")
        assert reward(PROMPTS, RESPONSES).isnan().all()  # accepted as if right before
        assert "the rows' `index` values are not 0..4" in reward.last_stats["errors"][0]
        scores = reward(PROMPTS, RESPONSES)
    assert math.isnan(scores[0]) and torch.allclose(scores[1:], EXPECTED[1:] / 10)


def test_an_answer_that_arrives_slowly_ends_at_the_batchs_deadline():
    """A byte every 0.3 s never trips the per-read timeout; the deadline still holds."""
    with FaultServer(rule=lambda n, body: "drip") as server:
        reward = client(server, timeout_s=1.0, deadline_s=1.5, max_retries=0)
        start = time.monotonic()
        with pytest.raises(RewardServerDown, match="deadline passed while the answer arrived"):
            reward(PROMPTS, RESPONSES)
        assert time.monotonic() - start < 2.5  # was the whole answer's 30 s


def test_many_retries_wait_at_most_the_largest_backoff():
    reward = RemoteReward("http://127.0.0.1:1", check_health=False, max_backoff_s=2.0)
    assert 1.0 <= reward._backoff(5000, None) <= 2.0  # 2**5000 overflowed a float


def test_a_server_silent_past_the_deadline_raises_naming_the_url():
    with FaultServer(rule=lambda n, body: "hang") as server:
        reward = client(server, timeout_s=0.2, deadline_s=0.6)
        start = time.monotonic()
        with pytest.raises(RewardServerDown, match=f"{server.url} answered nothing"):
            reward(PROMPTS, RESPONSES)
        assert time.monotonic() - start < 3.0  # the deadline, and a try's timeout at most


def test_an_unreachable_server_is_refused_at_set_up_in_one_line():
    with FaultServer() as server:
        url = server.url
    with pytest.raises(RuntimeError, match=f"no reward server answers at {url}/health") as err:
        RemoteReward(url, **FAST)
    assert "\n" not in str(err.value)


def test_the_api_key_is_sent_and_never_stored(monkeypatch):
    monkeypatch.setenv("RLKL_TEST_KEY", "sekrit-123")
    with FaultServer() as server:
        reward = client(server, api_key_env="RLKL_TEST_KEY")
        reward(PROMPTS, RESPONSES)
        assert server.scoring_requests()[0]["headers"]["Authorization"] == "Bearer sekrit-123"
    assert "sekrit-123" not in repr(vars(reward))
    monkeypatch.delenv("RLKL_TEST_KEY")
    with pytest.raises(ValueError, match="`api_key_env`='RLKL_TEST_KEY' names an environment"):
        RemoteReward("http://127.0.0.1:1", api_key_env="RLKL_TEST_KEY", check_health=False)


def test_jitter_leaves_torch_and_the_global_generator_alone():
    torch.manual_seed(0)
    random.seed(0)
    with FaultServer([("status", 500)] * 3) as server:
        client(server)(PROMPTS, RESPONSES)
    after = (torch.rand(1), random.random())
    torch.manual_seed(0)
    random.seed(0)
    assert after == (torch.rand(1), random.random())


def test_vllm_classification_answers_give_the_probability_or_its_log_odds():
    def probs(text):
        p = len(text) / 10
        return [1 - p, p]

    with FaultServer(probs=probs) as server:
        prob = client(server, api="vllm", label=1, score="prob")
        assert prob.model == "tiny-classifier"
        torch.testing.assert_close(prob(PROMPTS, RESPONSES), EXPECTED / 10)
        log_odds = client(server, api="vllm", label=1, score="log_odds")
        p = EXPECTED.double() / 10
        torch.testing.assert_close(log_odds(PROMPTS, RESPONSES), (p / (1 - p)).log().float())
        assert server.scoring_requests()[0]["body"]["input"] == RESPONSES


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("api", "grpc", "one of ('rlkl', 'vllm')"),
        ("score", "logit", "one of ('prob', 'log_odds')"),
        ("timeout_s", 0, "a finite number > 0"),
        ("max_in_flight", 0, "an integer >= 1"),
        ("max_retries", -1, "an integer >= 0"),
        ("url", "ftp://x", "http(s)://HOST[:PORT]"),
        ("url", "http://127.0.0.1:99999", "a port in 0-65535), got 'http://127.0.0.1:99999'"),
        ("url", "http://127.0.0.1:abc", "a port in 0-65535"),
    ],
)
def test_bad_options_are_refused_naming_them(option, value, allowed):
    kwargs = {"url": "http://127.0.0.1:1", "check_health": False, option: value}
    with pytest.raises(ValueError, match=rf"`{option}` must be .*{re.escape(allowed)}"):
        RemoteReward(**kwargs)


def test_a_resume_against_a_server_serving_another_reward_is_refused_naming_the_change():
    import json
    from types import SimpleNamespace

    from rlkl_lightning.algorithms.pipeline import check_reward_server

    saved = json.dumps({"reward": "default", "settings": {"max_pairs": 1024}})
    same = SimpleNamespace(url="http://h:1", server_info=json.loads(saved))
    check_reward_server(saved, same, "PPOModule")  # the same reward: resumes
    check_reward_server(None, same, "PPOModule")  # a checkpoint that recorded none
    other = SimpleNamespace(url="http://h:1", server_info={**same.server_info, "reward": "./clf"})
    with pytest.raises(
        ValueError, match=r"at http://h:1 serves another .*reward: 'default' -> './clf'"
    ):
        check_reward_server(saved, other, "PPOModule")


@pytest.mark.slow  # the CLI's start-up: about 10 s
def test_train_py_refuses_an_unreachable_server_in_one_line_before_the_policy_loads(capfd):
    from pathlib import Path

    from helpers.cli_runs import cli_error

    with FaultServer() as server:
        url = server.url  # then stopped: nothing answers there
    config = Path(__file__).parents[1] / "configs" / "ppo_remote_reward.yaml"
    message = cli_error(
        ["fit", "--config", str(config), f"--model.reward.init_args.url={url}"], capfd
    )
    assert message.startswith(f"RemoteReward: no reward server answers at {url}/health")
    assert "\n" not in message
