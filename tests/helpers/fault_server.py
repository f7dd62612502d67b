"""A reward server on the loopback address that injects the faults a real one has.

Standard library only: a threading HTTP server that speaks both wire formats of
:class:`~rlkl_lightning.rewards.RemoteReward` (``POST /score``, and vLLM's ``POST /classify``)
and answers each scoring request with the next fault of its script (then ``ok`` forever), or
with the fault a ``rule(request_number, body)`` picks. It records every request (time, path,
headers, body) and the most requests it held at once.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


#: The default score of a response: its length in characters.
def length_score(prompt: str, response: str) -> float:
    """The score the server gives when nothing goes wrong."""
    return float(len(response))


class FaultServer:
    """Started on entering a ``with`` block (a free port on 127.0.0.1), stopped on leaving it.

    Args:
        script: Faults of the first scoring requests, in order: ``"ok"``, ``("sleep", s)``
            (then ok), ``("status", code)``, ``("status", code, retry_after)``, ``"drop"`` (close
            the connection unanswered), ``"malformed"``, ``"wrong_count"``, ``"nan"`` (the first
            score NaN), ``"huge"`` (the first score an integer too large for a float),
            ``"string"`` (the first score, or vLLM probability, a string), ``"same_index"``
            (every vLLM row at index 0), ``"hang"`` (answer nothing for 30 s), ``"drip"`` (the
            answer's headers at once, then its body a byte every 0.3 s).
        rule: Instead of the script, ``rule(n, body) -> fault`` for the ``n``-th request.
        score: ``score(prompt, response) -> float`` of an ok answer.
        probs: vLLM's format: ``probs(text) -> list of class probabilities``.
    """

    def __init__(
        self,
        script: list[Any] | None = None,
        rule: Callable[[int, dict], Any] | None = None,
        score: Callable[[str, str], float] = length_score,
        probs: Callable[[str], list[float]] | None = None,
    ) -> None:
        self.script = list(script or [])
        self.rule = rule
        self.score = score
        self.probs = probs
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()
        self.stop_hanging = threading.Event()

    @property
    def url(self) -> str:
        """The base URL to give the client."""
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def scoring_requests(self) -> list[dict[str, Any]]:
        """The recorded ``/score`` and ``/classify`` requests."""
        return [r for r in self.requests if r["path"] in ("/score", "/classify")]

    def __enter__(self) -> FaultServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                return None

            def _answer(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self._done()  # before the answer leaves: the client may send its next at once
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                server.requests.append({"path": self.path, "headers": dict(self.headers)})
                if self.path == "/health":
                    self._answer(200, b"ok")
                elif self.path == "/info":
                    self._answer(200, json.dumps({"reward": "length", "settings": {}}).encode())
                elif self.path == "/v1/models":
                    self._answer(200, json.dumps({"data": [{"id": "tiny-classifier"}]}).encode())
                else:
                    self._answer(404, b"not found")

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                with server.lock:
                    n = len(server.scoring_requests())
                    server.requests.append(
                        {"path": self.path, "headers": dict(self.headers), "body": body}
                    )
                    server.requests[-1]["time"] = time.monotonic()
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    if server.rule is not None:
                        fault = server.rule(n, body)
                    else:
                        fault = server.script.pop(0) if server.script else "ok"
                self.counted = True
                try:
                    self._serve(fault, body)
                finally:
                    self._done()

            def _done(self) -> None:
                """This request no longer counts as in flight (once)."""
                if getattr(self, "counted", False):
                    self.counted = False
                    with server.lock:
                        server.in_flight -= 1

            def _serve(self, fault: Any, body: dict) -> None:
                kind = fault[0] if isinstance(fault, tuple) else fault
                if kind == "sleep":
                    time.sleep(fault[1])
                elif kind == "hang":
                    server.stop_hanging.wait(30)
                    return
                elif kind == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                elif kind == "status":
                    headers = {"Retry-After": str(fault[2])} if len(fault) > 2 else {}
                    self._answer(fault[1], f"fault {fault[1]}".encode(), headers)
                    return
                elif kind == "malformed":
                    self._answer(200, b'{"scores": [1.0, ')
                    return
                scores = self._scores(body)
                vllm = self.path == "/classify"
                if kind == "wrong_count":
                    scores = scores[:-1]
                elif kind == "nan":
                    scores[0] = math.nan
                elif kind == "huge":
                    scores[0] = 10**400
                elif kind == "string" and vllm:
                    scores[0]["probs"] = ["x", "0.5"]
                elif kind == "string":
                    scores[0] = "1.0"
                elif kind == "same_index":
                    scores = [{**row, "index": 0} for row in scores]
                key = "data" if vllm else "scores"
                answer = json.dumps({key: scores}).encode()
                if kind == "drip":
                    self._done()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    for i in range(len(answer)):  # bounded: the answer's bytes, or the stop
                        self.wfile.write(answer[i : i + 1])
                        self.wfile.flush()
                        if server.stop_hanging.wait(0.3):
                            return
                    return
                self._answer(200, answer)

            def _scores(self, body: dict) -> list[Any]:
                if self.path == "/classify":
                    return [
                        {"index": i, "probs": server.probs(text)}
                        for i, text in enumerate(body["input"])
                    ]
                pairs = zip(body["prompts"], body["responses"], strict=True)
                return [server.score(p, r) for p, r in pairs]

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_hanging.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
