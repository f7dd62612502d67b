"""RemoteReward against ``vllm serve`` of a small classifier, as SequenceClassifierReward scores.

The classifier is built from the default world's GPT-2 (its trunk, a seeded two-label head) and
served by vLLM's OpenAI-compatible server in a process of its own, on the loopback address;
the wait for it is bounded. vLLM answers softmax probabilities: the probability and the
log-odds of a label are what both rewards can give, and they agree within 1e-4.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS

from rlkl_lightning.rewards import RemoteReward, SequenceClassifierReward

RESPONSES = ["the food was great", "awful service and a cold room", "fine", "we will come back"]


@pytest.fixture(scope="module")
def classifier_dir(world_dir, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, GPT2ForSequenceClassification

    path = tmp_path_factory.mktemp("world_classifier")
    torch.manual_seed(0)
    labels = {0: "NEGATIVE", 1: "POSITIVE"}
    model = GPT2ForSequenceClassification.from_pretrained(
        world_dir, num_labels=2, id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    tokenizer = AutoTokenizer.from_pretrained(world_dir)
    pad = tokenizer.pad_token_id
    model.config.pad_token_id = pad if pad is not None else tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(classifier_dir, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm_serve") / "log.txt"
    # `vllm serve` is this module's command line (the CLI wrapper needs vLLM's package metadata).
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    command += [str(classifier_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    command += ["--max-model-len", "64", "--runner", "pooling"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:  # bounded: vLLM's start-up, 10 minutes at most
            try:
                yield RemoteReward(url, api="vllm", timeout_s=60, deadline_s=120)
                break
            except RuntimeError:
                assert server.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, "vllm serve did not start in 10 minutes"
                time.sleep(2)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.parametrize("score", ["prob", "log_odds"])
def test_vllm_served_scores_match_the_in_process_classifier(served, classifier_dir, score):
    prompts = PROMPTS[: len(RESPONSES)]
    local = SequenceClassifierReward(classifier_dir, label="POSITIVE", score=score)
    served.score, served.label = score, 1
    remote = served(prompts, RESPONSES)
    assert torch.isfinite(remote).all()
    torch.testing.assert_close(remote, local(prompts, RESPONSES), rtol=0, atol=1e-4)
