"""RemoteReward: the client of a served reward model, with timeouts, retries and masked failures.

The pairs of a batch go out in requests of ``request_size`` pairs, at most ``max_in_flight`` at
a time. Each try of a request has a timeout (``timeout_s``, for the connection and each read);
the whole batch has a deadline (``deadline_s``) that no try or wait passes. A try that fails on
the connection (refused, reset, dropped, timed out) or is answered 408, 429 or 5xx is tried
again, up to ``max_retries`` times, after an exponential backoff with jitter from this client's
own :class:`random.Random` (never torch's or the global generator: an exact resume relies on
those); a ``Retry-After`` header is honoured up to ``max_backoff_s`` and the deadline. Any other
answer is final: another 4xx, malformed JSON or the wrong number of scores fail every sample of
the request; a score that is not a finite number fails its own sample. A failed sample scores
``nan`` and the pipeline masks it (:attr:`RewardModel.marks_failures`); a batch to which the
server answered nothing at all raises :class:`RewardServerDown` (the pipeline stops the run).

Two wire formats (``api``):

- ``rlkl``: this library's server (``python -m rlkl_lightning.serve_reward``): ``POST /score``
  with ``{"prompts": [...], "responses": [...]}``, answered ``{"scores": [...]}``; ``GET
  /health`` and ``GET /info`` (the reward and its settings).
- ``vllm``: the classification API of ``vllm serve`` (``POST /classify`` with ``{"model",
  "input": [texts]}``, answered ``{"data": [{"index", "probs"}]}``). vLLM answers softmax
  probabilities, so only what they determine can be scored: the label's probability
  (``prob``) and its log-odds ``log p / (1 - p)`` (``log_odds``, which for a single-logit
  model, whose one probability is a sigmoid, is its logit). A multi-label model's logits are
  not recoverable (softmax forgets their common shift).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Literal
from urllib.parse import urlsplit

import torch
from torch import Tensor

from rlkl_lightning.rewards.base import RewardModel, check_pairs

__all__ = ["RemoteReward", "RewardServerDown"]

APIS = ("rlkl", "vllm")
VLLM_SCORES = ("prob", "log_odds")
TEXTS = ("response", "prompt+response")
#: Answers that are worth another try besides 5xx: the request timed out, too many requests.
RETRIED_STATUS = (408, 429)


class RewardServerDown(ConnectionError):
    """The reward server answered nothing to a whole batch within its deadline."""


@dataclass
class Answer:
    """The outcome of one request (after its retries)."""

    scores: list[float]  #: one per pair, ``nan`` where it failed
    answered: bool  #: the server sent an HTTP answer to some try
    retries: int  #: tries after the first
    latency_ms: float  #: from the first try to the outcome
    error: str | None = None  #: why samples failed, if some did


def _positive(name: str, value: Any, integer: bool = False) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value <= 0:
        kind = "an integer >= 1" if integer else "a finite number > 0"
        raise ValueError(f"RemoteReward: `{name}` must be {kind}, got {value!r}")


class RemoteReward(RewardModel):
    """Scores with a served reward model: this library's server or ``vllm serve``.

    Args:
        url: The server's base URL (``http://127.0.0.1:8000``); no proxy is used.
        api: ``rlkl`` (``python -m rlkl_lightning.serve_reward``) or ``vllm`` (the
            classification API of ``vllm serve``).
        model: ``api="vllm"``: the served model's name (None: the first of ``/v1/models``).
        label: ``api="vllm"``: the index of the class whose score is the reward.
        score: ``api="vllm"``: ``prob`` or ``log_odds`` of ``label`` (the module docstring
            says why not the logit).
        text: ``api="vllm"``: classify the ``response`` or ``prompt+response``.
        request_size: Pairs per request (``>= 1``).
        max_in_flight: Requests sent at once, at most (``>= 1``).
        timeout_s: Seconds a try may wait for the connection or a read.
        deadline_s: Seconds a whole batch may take, retries and waits included.
        max_retries: Tries after the first, on connection errors, 408, 429 and 5xx only.
        backoff_s: The wait before the first retry; it doubles per retry, times a jitter in
            ``[0.5, 1)``.
        max_backoff_s: The longest wait between tries, a ``Retry-After`` included.
        api_key_env: The name of an environment variable holding an API key, sent as
            ``Authorization: Bearer``; the key itself is read at each request and never stored.
        seed: Seeds this client's own generator of jitter.
        check_health: Ask the server's health endpoint at construction (before the policy
            loads) and refuse an unreachable server in one line naming the URL.
    """

    marks_failures = True

    def __init__(
        self,
        url: str,
        api: Literal["rlkl", "vllm"] = "rlkl",
        model: str | None = None,
        label: int = 1,
        score: Literal["prob", "log_odds"] = "prob",
        text: Literal["response", "prompt+response"] = "response",
        request_size: int = 16,
        max_in_flight: int = 4,
        timeout_s: float = 30.0,
        deadline_s: float = 120.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        api_key_env: str | None = None,
        seed: int = 0,
        check_health: bool = True,
    ) -> None:
        parts = urlsplit(str(url))
        try:
            parts.port  # noqa: B018 (urlsplit checks the port when it is read)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"RemoteReward: `url` must be http(s)://HOST[:PORT] (a port in 0-65535), got "
                f"{url!r}"
            )
        for name, allowed in (("api", APIS), ("score", VLLM_SCORES), ("text", TEXTS)):
            if locals()[name] not in allowed:
                value = locals()[name]
                raise ValueError(f"RemoteReward: `{name}` must be one of {allowed}, got {value!r}")
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"RemoteReward: `label` must be a class index >= 0, got {label!r}")
        for name in ("request_size", "max_in_flight"):
            _positive(name, locals()[name], integer=True)
        for name in ("timeout_s", "deadline_s", "backoff_s", "max_backoff_s"):
            _positive(name, locals()[name])
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(
                f"RemoteReward: `max_retries` must be an integer >= 0, got {max_retries!r}"
            )
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise ValueError(
                f"RemoteReward: `api_key_env`={api_key_env!r} names an environment variable "
                "that is not set (set it to the API key, or set api_key_env to None)"
            )
        self.url = str(url).rstrip("/")
        self.api, self.model, self.label, self.score, self.text = api, model, label, score, text
        self.request_size, self.max_in_flight = request_size, max_in_flight
        self.timeout_s, self.deadline_s = float(timeout_s), float(deadline_s)
        self.max_retries, self.backoff_s = max_retries, float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.api_key_env = api_key_env
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        #: The last batch's ``retries``, ``latency_ms`` (per request), ``failed``, ``errors``.
        self.last_stats: dict[str, Any] = {}
        #: What the server says it serves (``/info``, or vLLM's ``/v1/models``); checked on resume.
        self.server_info: dict[str, Any] = {}
        if check_health:
            self.server_info = self.connect()

    # ------------------------------------------------------------------ set-up
    def connect(self) -> dict[str, Any]:
        """Ask the health endpoint (one line naming the URL if it fails); returns the info."""
        try:
            status, _, body = self._send("GET", "/health", None, self.timeout_s)
        except (OSError, http.client.HTTPException) as err:
            status, body = None, f"{type(err).__name__}: {err}".encode()
        if status != 200:
            why = f"HTTP {status}" if status is not None else body.decode(errors="replace")
            raise RuntimeError(
                f"RemoteReward: no reward server answers at {self.url}/health ({why}); start "
                "it (python -m rlkl_lightning.serve_reward) or fix the reward's `url`"
            )
        path = "/info" if self.api == "rlkl" else "/v1/models"
        try:
            status, _, body = self._send("GET", path, None, self.timeout_s)
            info = json.loads(body) if status == 200 else {}
        except (OSError, http.client.HTTPException, ValueError):
            info = {}
        info = info if isinstance(info, dict) else {}
        if self.api == "rlkl" and isinstance(info.get("model"), dict):
            info = info["model"]  # LitServe's /info: the reward under `model`, then its own
        if self.api == "vllm" and self.model is None:
            models = info.get("data") or [{}]
            self.model = models[0].get("id") if isinstance(models[0], dict) else None
        return info

    # ------------------------------------------------------------------ scoring
    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        """Scores the pairs (``nan`` where a sample failed); see :class:`RewardModel`."""
        return self.submit(prompts, responses)()

    def submit(self, prompts: list[str], responses: list[str]) -> Callable[[], Tensor]:
        """Send the batch's requests now; the returned function waits for them and scores.

        The pipeline sends them before its own scoring passes and collects them after.

        Raises (from the returned function):
            RewardServerDown: If the server answered none of the batch's requests.
        """
        check_pairs(prompts, responses, repr(self))
        deadline = time.monotonic() + self.deadline_s
        size = self.request_size
        starts = range(0, len(prompts), size)
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.max_in_flight, len(starts))))
        futures = [
            pool.submit(self._request, prompts[i : i + size], responses[i : i + size], deadline)
            for i in starts
        ]
        pool.shutdown(wait=False)

        def result() -> Tensor:
            answers = [future.result() for future in futures]
            scores = [s for answer in answers for s in answer.scores]
            errors = [a.error for a in answers if a.error]
            self.last_stats = {
                "retries": sum(a.retries for a in answers),
                "latency_ms": [a.latency_ms for a in answers],
                "failed": sum(not math.isfinite(s) for s in scores),
                "errors": errors,
            }
            if answers and not any(a.answered for a in answers):
                raise RewardServerDown(
                    f"the reward server at {self.url} answered nothing within the batch's "
                    f"deadline of {self.deadline_s:g} s ({errors[0] if errors else 'no answer'})"
                )
            return torch.tensor(scores, dtype=torch.float32)

        return result

    def _request(self, prompts: list[str], responses: list[str], deadline: float) -> Answer:
        """One request's tries until an answer, a final failure, ``max_retries`` or the deadline."""
        path, body = self._payload(prompts, responses)
        start, retries, answered, error = time.monotonic(), 0, False, None
        while (remaining := deadline - time.monotonic()) > 0:
            retry_after = None
            try:
                status, headers, data = self._send(
                    "POST", path, body, min(self.timeout_s, remaining), deadline
                )
            except (
                OSError,
                http.client.HTTPException,
            ) as err:  # refused, reset, dropped, timed out
                error = f"{type(err).__name__}: {err}".rstrip(": ")
            else:
                answered = True
                if status == 200:
                    scores, error = self._parse(data, len(prompts))
                    return Answer(scores, True, retries, _ms_since(start), error)
                error = f"HTTP {status}: {_first_line(data)}"
                if not (status in RETRIED_STATUS or 500 <= status < 600):
                    break  # another 4xx: the request is wrong, a retry would be too
                retry_after = _retry_after(headers.get("Retry-After"))
            if retries >= self.max_retries:
                break
            delay = self._backoff(retries, retry_after)
            if time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
            retries += 1
        else:
            error = error or f"the batch's deadline of {self.deadline_s:g} s passed"
        return Answer([math.nan] * len(prompts), answered, retries, _ms_since(start), error)

    def _backoff(self, retries: int, retry_after: float | None) -> float:
        """``backoff_s x 2^retries`` x jitter in [0.5, 1), ``Retry-After`` if longer, capped."""
        with self._rng_lock:
            jitter = 0.5 + 0.5 * self._rng.random()
        doubled = self.backoff_s * 2.0 ** min(retries, 64)  # capped below: no float overflow
        delay = min(self.max_backoff_s, doubled) * jitter
        if retry_after is not None:
            delay = max(delay, retry_after)
        return min(delay, self.max_backoff_s)

    def _payload(self, prompts: list[str], responses: list[str]) -> tuple[str, bytes]:
        if self.api == "rlkl":
            return "/score", json.dumps({"prompts": prompts, "responses": responses}).encode()
        texts = (
            responses
            if self.text == "response"
            else [p + r for p, r in zip(prompts, responses, strict=True)]
        )
        return "/classify", json.dumps({"model": self.model, "input": list(texts)}).encode()

    def _parse(self, data: bytes, n: int) -> tuple[list[float], str | None]:
        """The scores of an answer (``nan`` where one is not a finite number), and why not all."""
        failed = [math.nan] * n
        try:
            answer = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return failed, f"malformed JSON: {_first_line(data)}"
        try:
            raw = self._raw_scores(answer, n)
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as err:
            return failed, f"unexpected answer ({type(err).__name__}: {err})"
        if len(raw) != n:
            return failed, f"{len(raw)} scores for {n} samples"
        scores = [_finite(x) for x in raw]
        bad = sum(not math.isfinite(s) for s in scores)
        return scores, (f"{bad} scores not finite numbers" if bad else None)

    def _raw_scores(self, answer: Any, n: int) -> list[Any]:
        if self.api == "rlkl":
            scores = answer["scores"]
            if not isinstance(scores, list):
                raise TypeError("`scores` is not a list")
            return scores
        rows = sorted(answer["data"], key=lambda row: row["index"])
        indices = [row["index"] for row in rows]
        if len(rows) == n and indices != list(range(n)):
            raise ValueError(f"the rows' `index` values are not 0..{n - 1}")
        return [self._from_probs(row["probs"]) for row in rows]

    def _from_probs(self, probs: list[float]) -> float:
        p = _finite(probs[self.label])  # a value that is not a number: this sample fails
        if self.score == "prob":
            return p
        return math.log(p) - math.log1p(-p) if 0.0 < p < 1.0 else math.nan

    def _send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        timeout: float,
        deadline: float | None = None,
    ) -> tuple[int, Any, bytes]:
        """One HTTP exchange on a fresh connection: status, headers, body.

        With a ``deadline`` (``time.monotonic()``) the body is read in pieces, each wait cut to
        the time left: an answer that arrives slowly ends at the deadline (``TimeoutError``).
        """
        parts = urlsplit(self.url)
        connection_class = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        connection = connection_class(parts.hostname, parts.port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key_env is not None:
            headers["Authorization"] = f"Bearer {os.environ.get(self.api_key_env, '')}"
        try:
            connection.request(method, parts.path + path, body=body, headers=headers)
            response = connection.getresponse()
            if deadline is None:
                return response.status, response.headers, response.read()
            pieces = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the batch's deadline passed while the answer arrived")
                if connection.sock is not None:
                    connection.sock.settimeout(min(timeout, left))
                piece = response.read1(1 << 16)
                if not piece:
                    return response.status, response.headers, b"".join(pieces)
                pieces.append(piece)
        finally:
            connection.close()

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, api={self.api!r})"


def _finite(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return math.nan
    try:
        x = float(x)
    except OverflowError:  # a JSON integer too large for a float
        return math.nan
    return x if math.isfinite(x) else math.nan


def _ms_since(start: float) -> float:
    return (time.monotonic() - start) * 1000.0


def _first_line(data: bytes) -> str:
    text = data.decode(errors="replace").strip()
    return (text.splitlines() or [""])[0][:200]


def _retry_after(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header (a number or an HTTP date); None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None
