"""``train.py`` runs scored by a served reward: the same numbers as the in-process reward, and a
run killed with requests in flight continuing with ``--ckpt_path last``.

The runs are those of ``test_kill.py`` (``helpers/kill_runs.py``: tiny PPO, 6 batches, a
checkpoint every 2), with the default world's reward (VADER): in process; served by LitServe
(``python -m rlkl_lightning.serve_reward``); served by the loopback fault server, which holds
batch 5's request unanswered while the trainer is killed with SIGKILL. Every logged scalar the
runs share (timings excepted) is equal bit for bit, and the API key the served runs send is
nowhere in their run directories.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.fault_server import FaultServer
from helpers.kill_runs import write_config
from test_kill import ROOT, TESTS, finish, last_checkpoint, scalars, start

from rlkl_lightning.rewards import RemoteReward, VaderSentimentReward

pytestmark = pytest.mark.slow
KEY_ENV, KEY = "RLKL_TEST_REWARD_KEY", "sk-test-4f1c9e-never-written"


def with_reward(config: Path, url: str) -> Path:
    data = yaml.safe_load(config.read_text())
    data["model"]["init_args"]["reward"] = {
        "class_path": "rlkl_lightning.rewards.RemoteReward",
        "init_args": {"url": url, "api_key_env": KEY_ENV, "timeout_s": 60, "deadline_s": 120},
    }
    config.write_text(yaml.safe_dump(data))
    return config


def served_litserve(port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    command = [sys.executable, "-m", "rlkl_lightning.serve_reward", "--port", str(port)]
    server = subprocess.Popen(
        command, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    deadline = time.monotonic() + 120
    while True:  # bounded: the server's start-up, 120 s at most
        try:
            RemoteReward(f"http://127.0.0.1:{port}", timeout_s=5)
            return server
        except RuntimeError:
            assert time.monotonic() < deadline and server.poll() is None, log.read_text()[-2000:]
            time.sleep(0.5)


def shared(a: dict, b: dict) -> tuple[dict, dict]:
    common = a.keys() & b.keys()
    assert {"objective/kl", "objective/score", "objective/kl_coef", "loss/policy"} <= common
    return {k: a[k] for k in common}, {k: b[k] for k in common}


def no_key_in(run_dir: Path) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_served_runs_equal_the_in_process_run_and_a_kill_in_flight_resumes(
    tiny_lm_dir, tmp_path, monkeypatch
):
    from helpers.ddp_runs import free_port

    monkeypatch.setenv(KEY_ENV, KEY)  # the trainers inherit it
    full = write_config(tmp_path, tiny_lm_dir, "full")
    finish(start(full), full)
    want = scalars(full)

    port = free_port()
    server = served_litserve(port, tmp_path / "server.log")
    try:
        served = with_reward(
            write_config(tmp_path, tiny_lm_dir, "served"), f"http://127.0.0.1:{port}"
        )
        finish(start(served), served)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    got = scalars(served)
    assert got["reward/failed_fraction"] == {step: 0.0 for step in range(6)}
    a, b = shared(got, want)
    assert a == b
    no_key_in(served.parent)

    vader = VaderSentimentReward()
    marker = tmp_path / "in_flight"

    def hold_batch_5(n, body):  # one request per batch: the 5th is held while the kill comes
        if n == 4 and not marker.exists():
            marker.write_text("held")
            return "hang"
        return "ok"

    def score(prompt, response):
        return float(vader([prompt], [response])[0])

    with FaultServer(rule=hold_batch_5, score=score) as fault:
        killed = with_reward(write_config(tmp_path, tiny_lm_dir, "killed"), fault.url)
        proc = start(killed)
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        fault.stop_hanging.set()
        finish(start(killed, False, "--ckpt_path", "last"), killed)
        assert fault.scoring_requests()[0]["headers"]["Authorization"] == f"Bearer {KEY}"
    a, b = shared(scalars(killed), want)
    assert a == b
    assert last_checkpoint(killed)["rlkl_counters"]["batches_seen"] == 6
    assert "rlkl_reward_server" in last_checkpoint(killed)
    no_key_in(killed.parent)
