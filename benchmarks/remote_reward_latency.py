"""A batch's wall time with a served reward that takes ``--latency`` seconds per request.

PPO on the default world, the reward VADER: in process, and served by a loopback server that
sleeps ``--latency`` seconds before each answer (``RemoteReward``'s defaults: 16 pairs per
request, 4 in flight; the requests go out before the reference's scoring pass). For each batch
size (those of the shipped configs: 32 and 64 responses) it runs ``--batches`` batches after one
warm-up batch on each side, with the same seed, and prints the median batch wall time of each
and their difference against the bound ``latency + 10%`` of the in-process time.

    python benchmarks/remote_reward_latency.py --batches 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lightning.pytorch import Callback, Trainer, seed_everything

from rlkl_lightning import PPOModule
from rlkl_lightning.data import PromptDataModule
from rlkl_lightning.rewards import RemoteReward, VaderSentimentReward


class BatchClock(Callback):
    """Wall seconds of every training batch."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args) -> None:  # noqa: D102
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:  # noqa: D102
        self.seconds.append(time.perf_counter() - self.start)


def slow_server(latency: float) -> ThreadingHTTPServer:
    """VADER at ``POST /score`` after ``latency`` seconds; ``/health`` at once."""
    vader = VaderSentimentReward()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            return None

        def _send(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self._send(b"ok" if self.path == "/health" else b"{}")

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency)
            scores = vader(body["prompts"], body["responses"]).tolist()
            self._send(json.dumps({"scores": scores}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def batch_seconds(batch_size: int, batches: int, reward) -> list[float]:
    """The wall seconds of ``batches`` batches after a warm-up one."""
    seed_everything(0, verbose=False)
    module = PPOModule(reward=reward, logging={"log_samples_every": 0})
    steps = module.optimization.ppo_epochs * module.optimization.num_minibatches
    clock = BatchClock()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=(batches + 1) * steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(module, PromptDataModule(batch_size=batch_size, heldout=None))
    return clock.seconds[1:]


def main() -> None:
    """Both sides at every batch size; one line each and a verdict."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[32, 64])
    args = parser.parse_args()
    server = slow_server(args.latency)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    for size in args.batch_sizes:
        local = statistics.median(batch_seconds(size, args.batches, VaderSentimentReward()))
        remote = statistics.median(batch_seconds(size, args.batches, RemoteReward(url)))
        bound = args.latency + 0.1 * local
        verdict = "within" if remote - local <= bound else "OVER"
        print(
            f"batch {size}: in process {local:.3f} s, served {remote:.3f} s, "
            f"+{remote - local:.3f} s ({verdict} the bound {bound:.3f} s)",
            flush=True,
        )
    server.shutdown()


if __name__ == "__main__":
    main()
