"""The reward server: what it serves and refuses (fast), and one LitServe smoke run (slow)."""

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from rlkl_lightning import serve_reward
from rlkl_lightning.rewards import RemoteReward, VaderSentimentReward


def args(*argv):
    return serve_reward.parser().parse_args(list(argv))


def test_it_binds_the_loopback_address_and_serves_the_default_worlds_reward_by_default():
    parsed = args()
    assert parsed.host == "127.0.0.1"
    assert isinstance(serve_reward.build_reward(parsed), VaderSentimentReward)
    assert serve_reward.describe(parsed)["reward"] == "default"


def test_a_model_directory_runs_its_own_code_only_with_trust_remote_code(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        serve_reward, "SequenceClassifierReward", lambda model, **kw: seen.append(kw)
    )
    serve_reward.build_reward(args("--reward", str(tmp_path)))
    serve_reward.build_reward(args("--reward", str(tmp_path), "--trust_remote_code"))
    assert [kw["trust_remote_code"] for kw in seen] == [False, True]


def test_an_unknown_reward_is_refused_in_one_line_naming_the_option(capsys):
    with pytest.raises(SystemExit, match=r"error: .*`--reward`.*nosuch"):
        serve_reward.main(["--reward", "nosuch"])


def test_a_bad_request_is_refused_in_one_line():
    from fastapi import HTTPException

    with pytest.raises(HTTPException) as err:
        serve_reward.check_request(["a", "b"], ["c"], max_pairs=8)
    assert err.value.status_code == 400 and "2 prompts but 1 responses" in err.value.detail
    with pytest.raises(HTTPException) as err:
        serve_reward.check_request(["a"] * 3, ["b"] * 3, max_pairs=2)
    assert (
        err.value.status_code == 413 and err.value.detail == "3 pairs in one request, more than 2"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_litserve_serves_vader_as_the_in_process_reward_scores_it(tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "rlkl_lightning.serve_reward", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # bounded: the server's start-up, 120 s at most
            try:
                reward = RemoteReward(url, timeout_s=5, deadline_s=30)
                break
            except RuntimeError:
                assert time.monotonic() < deadline and server.poll() is None, "no server"
                time.sleep(0.5)
        assert reward.server_info["reward"] == "default"
        prompts = ["a", "b", "c"]
        responses = ["what a great film", "awful, boring", ""]
        served = reward(prompts, responses)
        assert torch.equal(served, VaderSentimentReward()(prompts, responses))
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request(
            "POST", "/score", body=b'{"prompts": [', headers={"Content-Type": "application/json"}
        )
        answer = connection.getresponse()
        detail = json.loads(answer.read())["detail"]
        assert answer.status == 400 and "\n" not in detail and "prompts" in detail
        # `kill PID` of the server alone stops its workers too: none is left on the port.
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        deadline = time.monotonic() + 10
        while True:  # bounded: the workers' exit, 10 s at most
            try:
                os.killpg(server.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "a worker of the server outlived it"
            time.sleep(0.2)
        with socket.socket() as s:  # as a new server binds: past TIME_WAIT, not past a listener
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        log.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max_pairs", "0"], "`--max_pairs` must be >= 1, got 0"),  # a 413 for every request
        (["--max_request_mb", "-1"], "`--max_request_mb` must be > 0, got -1"),
        (["--port", "70000"], "`--port` must be >= 0 and <= 65535, got 70000"),
        (["--max_batch_size", "0"], "`--max_batch_size` must be >= 1, got 0"),
        (["--batch_timeout", "-1"], "`--batch_timeout` must be >= 0, got -1"),
        (["--timeout", "nan"], "`--timeout` must be > 0, got nan"),
    ],
)
def test_a_numeric_option_out_of_range_is_refused_in_one_line(args, message):
    with pytest.raises(SystemExit, match=re.escape(f"error: {message}")):
        serve_reward.main(args)


def test_init_args_that_are_not_a_json_object_or_not_the_classs_are_named_once(capsys):
    # Was `--init_args.init_args` for an unknown argument, and "invalid loads value" for bad JSON.
    with pytest.raises(SystemExit, match=re.escape("error: `--init_args` has no argument 'x'")):
        serve_reward.main(["--init_args", '{"x": 1}'])
    for given, said in (("notjson", "must be a JSON object such as"), ("[1]", "must be a JSON")):
        with pytest.raises(SystemExit):
            serve_reward.main(["--init_args", given])
        err = capsys.readouterr().err
        assert f"argument --init_args: {said}" in err and repr(given) in err, err
