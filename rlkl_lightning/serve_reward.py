"""Serve a reward model over HTTP with LitServe: ``python -m rlkl_lightning.serve_reward``.

Serves any reward model of the library to :class:`~rlkl_lightning.rewards.RemoteReward`
(``api: rlkl``): ``--reward default`` (the default world's reward, VADER), a registered name,
the dotted path of a reward class (with ``--init_args`` as JSON), or the directory of a
Hugging Face sequence classifier (:class:`~rlkl_lightning.rewards.SequenceClassifierReward`,
with ``--label``, ``--score``, ``--text``). Endpoints: ``POST /score`` (``{"prompts",
"responses"}`` -> ``{"scores"}``, ``null`` for a score that is not finite), ``GET /health``,
``GET /info`` (the reward and its settings, under ``model``). Bound to 127.0.0.1 unless
``--host`` says otherwise; a request is refused in one line (4xx) when it is not JSON of two
lists of strings of equal length, holds more than ``--max_pairs`` pairs or more than
``--max_request_mb``. A model directory's own code runs only with ``--trust_remote_code``.

Needs the ``serve`` extra (``pip install -e '.[serve]'``). It sits above the library: it
imports the rewards, nothing in the library imports it.
"""

import argparse
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

try:
    import litserve as ls
except ImportError:  # the `serve` extra is not installed: main() says so
    ls = None

from rlkl_lightning.components import Registry, check_arguments
from rlkl_lightning.rewards import SequenceClassifierReward, VaderSentimentReward, check_pairs

#: The rewards ``--reward`` names by a short name.
SERVED = Registry("--reward", "a reward class")
SERVED.register("default")(VaderSentimentReward)
SERVED.register("vader")(VaderSentimentReward)


def build_reward(args: argparse.Namespace) -> Any:
    """The reward ``--reward`` names: a model directory, a registered name or a class path."""
    if Path(args.reward).is_dir():
        return SequenceClassifierReward(
            args.reward,
            label=int(args.label) if str(args.label).isdigit() else args.label,
            score=args.score,
            text=args.text,
            trust_remote_code=args.trust_remote_code,
        )
    target, _ = SERVED.resolve(args.reward, "--reward")
    check_arguments(target, args.init_args, "--init_args")
    return target(**args.init_args)


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """What ``/info`` says the server serves: what decides the scores, nothing else.

    A client records it and checks it on resume (a server restarted with other limits serves
    the same reward).
    """
    settings: dict[str, Any] = {"init_args": args.init_args}
    if Path(args.reward).is_dir():
        settings.update(label=args.label, score=args.score, text=args.text)
    return {"reward": args.reward, "settings": settings}


def check_request(prompts: list[str], responses: list[str], max_pairs: int) -> None:
    """Refuse unequal lists or too many pairs with an HTTP 4xx whose detail is one line."""
    from fastapi import HTTPException

    try:
        check_pairs(prompts, responses, "the request")
    except ValueError as err:
        raise HTTPException(400, str(err)) from None
    if len(prompts) > max_pairs:
        raise HTTPException(413, f"{len(prompts)} pairs in one request, more than {max_pairs}")


if ls is not None:
    from pydantic import BaseModel, ConfigDict

    class ScoreRequest(BaseModel):
        """The body of ``POST /score``."""

        model_config = ConfigDict(extra="forbid")
        prompts: list[str]
        responses: list[str]

    def one_line_400(request: Any, error: Exception) -> Any:
        """A request that is not ``{"prompts": [str], "responses": [str]}``: 400, one line."""
        from fastapi.responses import JSONResponse

        detail = 'the request must be JSON {"prompts": [strings], "responses": [strings]}'
        return JSONResponse({"detail": detail}, status_code=400)


class RewardAPI(ls.LitAPI if ls is not None else object):
    """Scores (prompt, response) pairs at ``/score``; a batch of requests in one call.

    Args:
        args: The parsed command line (what to serve, the request limits, the batching).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(
            max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout, api_path="/score"
        )
        self.args = args

    def setup(self, device: str) -> None:
        """Build the reward in the worker, on its device."""
        self.reward = build_reward(self.args)
        if hasattr(self.reward, "to"):
            self.reward.to(device)

    def decode_request(self, request: ScoreRequest) -> tuple[list[str], list[str]]:
        """The request's pairs (:func:`check_request`)."""
        check_request(request.prompts, request.responses, self.args.max_pairs)
        return request.prompts, request.responses

    def predict(self, x: Any) -> Any:
        """The scores of one request, or of a batch of them in one call to the reward."""
        batched = self.max_batch_size > 1
        requests = x if batched else [x]
        prompts = [p for request in requests for p in request[0]]
        responses = [r for request in requests for r in request[1]]
        scores = self.reward(prompts, responses).tolist() if prompts else []
        out, start = [], 0
        for request in requests:
            out.append(scores[start : start + len(request[0])])
            start += len(request[0])
        return out if batched else out[0]

    def encode_response(self, output: list[float]) -> dict[str, Any]:
        """``{"scores": [...]}``, ``null`` for a score that is not finite (JSON has no nan)."""
        return {"scores": [s if math.isfinite(s) else None for s in output]}


def json_object(text: str) -> dict[str, Any]:
    """``--init_args``'s value: a JSON object, or an error that says so and shows one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"threshold\": 0.5}}' ({err.msg}), got {text!r}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m rlkl_lightning.serve_reward``."""
    p = argparse.ArgumentParser(
        prog="python -m rlkl_lightning.serve_reward", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--reward", default="default", help="default, a class path or a model dir")
    p.add_argument("--init_args", type=json_object, default={}, help="JSON arguments of a class")
    p.add_argument("--label", default="POSITIVE", help="a classifier's label (name or index)")
    p.add_argument("--score", default="logit", choices=("logit", "prob", "log_odds"))
    p.add_argument("--text", default="response", choices=("response", "prompt+response"))
    p.add_argument("--trust_remote_code", action="store_true", help="run a model dir's code")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_pairs", type=int, default=1024, help="pairs per request, at most")
    p.add_argument("--max_request_mb", type=float, default=16.0, help="request size, at most")
    p.add_argument("--max_batch_size", type=int, default=1, help="requests scored together")
    p.add_argument("--batch_timeout", type=float, default=0.0, help="seconds to fill a batch")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "cuda", "mps"))
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, check the reward builds, and serve it until interrupted."""
    args = parser().parse_args(argv)
    problem = _bad_number(args)
    if problem is not None:
        raise SystemExit(f"error: {problem}")
    if ls is None:
        raise SystemExit("error: the reward server needs LitServe: pip install -e '.[serve]'")
    try:
        build_reward(args)  # a bad --reward fails here, in one line, not in a worker
    except (ValueError, TypeError, OSError) as err:
        raise SystemExit(f"error: {err}") from None
    server = ls.LitServer(
        RewardAPI(args),
        accelerator=args.accelerator,
        timeout=args.timeout,
        model_metadata=describe(args),
        max_payload_size=int(args.max_request_mb * 2**20),
    )
    from fastapi.exceptions import RequestValidationError

    server.app.add_exception_handler(RequestValidationError, one_line_400)
    print(f"serving {args.reward} at http://{args.host}:{args.port}/score", flush=True)
    signal.signal(signal.SIGTERM, _stop)  # `kill PID` stops LitServe's workers too
    server.run(host=args.host, port=args.port, generate_client_file=False)


#: The numeric options, each with its least allowed value and whether it may equal it.
_LIMITS = {
    "port": (0, True),
    "max_pairs": (1, True),
    "max_request_mb": (0, False),
    "max_batch_size": (1, True),
    "batch_timeout": (0, True),
    "timeout": (0, False),
}


def _bad_number(args: argparse.Namespace) -> str | None:
    """One line naming a numeric option out of its range, or None.

    Out of range, the server would refuse every request, or LitServe stop with a traceback.
    """
    for name, (least, equal) in _LIMITS.items():
        value = getattr(args, name)
        ok = math.isfinite(value) and (value >= least if equal else value > least)
        if name == "port":
            ok = ok and value <= 65535
        if not ok:
            bound = f">= {least}" if equal else f"> {least}"
            where = " and <= 65535" if name == "port" else ""
            return f"`--{name}` must be {bound}{where}, got {value:g}"
    return None


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: LitServe then stops its workers (else they outlive it, on the port)."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
