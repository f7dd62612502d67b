"""What failed rewards do to beta and the KL: masking vs a zero reward vs the KL masked too.

PPO on the default world with the adaptive law (configs/ppo_adaptive.yaml's settings) and the
reward served: ``python -m rlkl_lightning.serve_reward`` serves :class:`FailingVader` (VADER
with 10% of each request's scores failed) on the loopback address, and the run reads it over
HTTP with :class:`~rlkl_lightning.rewards.RemoteReward` (one request per batch). Failures come
in one of two modes: ``uniform`` (each sample by chance, from the server's own generator) or
``longest`` (the longest tenth of the batch's responses, by characters: failures that hit long,
high-KL responses). The server answers a failed sample with ``null`` (the client masks it) or,
for the zero variant, with 0. Three ways to take a failure:

- ``mask``: the library's (the sample out of the advantages, the losses and the KL the
  controller reads: ``objective/kl`` is the trained samples');
- ``zero``: the failed sample scored 0 (verl's);
- ``kl_kept``: masked, but kept in the KL the controller reads (``objective/kl`` every
  sample's): the library's rule up to 0.7.0.
- ``bootstrap``: not masked: the failed sample's score is the value model's estimate at its
  last token, as for a truncated episode, and it is trained on like the others (so the KL
  penalty in its rewards still acts on the policy); not the library's, a candidate.

Beside them the fault-free run (the same server, nothing failed). For every seed it prints the
final beta, the mean true KL (every sample's, nats per sequence) and the mean true VADER score
(every sample's, scored in the trainer) of the last 10 batches, then the mean and standard error
over seeds of each variant.

    python scripts/failed_reward_study.py --seeds 0 1 2 --batches 150
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything

from rlkl_lightning import AdaptiveKLController, KLControllerCallback, PPOModule
from rlkl_lightning.data import PromptDataModule
from rlkl_lightning.rewards import RemoteReward, RewardModel, VaderSentimentReward

RATE = 0.1
VARIANTS = ("mask", "zero", "kl_kept", "bootstrap")
LAST = 10  # batches the final numbers average over
ROOT = Path(__file__).resolve().parent.parent


class FailingVader(RewardModel):
    """VADER with ``RATE`` of each request's samples failed (``nan``) or, ``zero``, scored 0.

    Served by ``python -m rlkl_lightning.serve_reward --reward
    scripts.failed_reward_study.FailingVader --init_args '{"mode": ..., ...}'``.
    """

    def __init__(self, mode: str = "none", variant: str = "mask", seed: int = 0) -> None:
        if mode not in ("none", "uniform", "longest"):
            raise ValueError(f"FailingVader: `mode` must be none, uniform or longest, got {mode!r}")
        self.vader = VaderSentimentReward()
        self.mode, self.zero = mode, variant == "zero"
        self.rng = random.Random(seed)

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """VADER's scores, ``RATE`` of them failed as the mode says."""
        scores = self.vader(prompts, responses)
        n = len(responses)
        if self.mode == "uniform":
            failed = [self.rng.random() < RATE for _ in range(n)]
        elif self.mode == "longest":
            order = sorted(range(n), key=lambda i: (-len(responses[i]), i))
            longest = set(order[: round(RATE * n)])
            failed = [i in longest for i in range(n)]
        else:
            failed = [False] * n
        filler = 0.0 if self.zero else math.nan
        return scores.masked_fill(torch.tensor(failed), filler)


@contextlib.contextmanager
def served(mode: str, variant: str, seed: int) -> Iterator[str]:
    """A reward server of :class:`FailingVader` on a free loopback port; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = json.dumps({"mode": mode, "variant": variant, "seed": seed})
    command = [sys.executable, "-m", "rlkl_lightning.serve_reward", "--port", str(port)]
    command += ["--reward", "scripts.failed_reward_study.FailingVader", "--init_args", init]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    server = subprocess.Popen(  # its own session: LitServe's workers are stopped with it
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a loaded machine takes minutes to import and bind
        while not _healthy(url):
            if server.poll() is not None:
                raise SystemExit(f"error: the reward server for {mode}/{variant} exited")
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the reward server at {url} did not start in 5 minutes")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _healthy(url: str) -> bool:
    """Whether the server answers its health endpoint."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


class StudyPPO(PPOModule):
    """PPOModule that records every sample's KL and VADER score.

    With ``kl_kept`` the failed samples' KL stays in what the controller reads (0.7.0's rule).
    """

    kl_kept = False
    bootstrap = False

    def log_batch(self, prompts, responses, traj, diagnostics, *args, **kwargs):  # noqa: D102
        if self.kl_kept:  # objective/kl of every sample: the metrics read no mask
            traj = traj._replace(sample_mask=None)
        return super().log_batch(prompts, responses, traj, diagnostics, *args, **kwargs)

    def score(self, prompts, traj, policy_scores):  # noqa: D102
        traj, responses, diagnostics = super().score(prompts, traj, policy_scores)
        self.true_kl = getattr(self, "true_kl", [])
        self.true_kl.append(float(diagnostics["kl_k1"].mean()))
        self.true_scores = getattr(self, "true_scores", [])
        self.vader = getattr(self, "vader", None) or VaderSentimentReward()
        self.true_scores.append(float(self.vader(prompts, responses).mean()))
        if self.bootstrap and "failed" in diagnostics and diagnostics["failed"].any():
            failed = diagnostics["failed"]
            last = traj.response_mask.sum(1).long().clamp(min=1) - 1
            value = traj.values.gather(1, last[:, None]).squeeze(1).to(traj.scores.dtype)
            traj = traj._replace(scores=torch.where(failed, value, traj.scores), sample_mask=None)
        return traj, responses, diagnostics


def run(seed: int, mode: str, variant: str, batches: int) -> tuple[float, float, float]:
    """Final beta, true KL and true score of one run."""
    with served(mode, variant, seed) as url:
        seed_everything(seed, verbose=False)
        reward = RemoteReward(url, request_size=1024, deadline_s=60.0, seed=seed)
        module = StudyPPO(
            reward=reward,
            sampling={"max_prompt_tokens": 16},
            optimization={"lr": 1.0e-4},
            logging={"log_samples_every": 0},
        )
        module.kl_kept = variant == "kl_kept"
        module.bootstrap = variant == "bootstrap"
        law = AdaptiveKLController(init_kl_coef=module.kl_coef, target=6.0, horizon=1000)
        steps = module.optimization.ppo_epochs * module.optimization.num_minibatches
        trainer = Trainer(
            accelerator="cpu",
            max_steps=batches * steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[KLControllerCallback(law)],
        )
        trainer.fit(module, PromptDataModule(batch_size=32, heldout=None, seed=seed))
    kl = statistics.mean(module.true_kl[-LAST:])
    score = statistics.mean(module.true_scores[-LAST:])
    return module.kl_coef, kl, score


def main() -> None:
    """Every variant and seed, then the table of means and standard errors."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--modes", nargs="+", default=["uniform", "longest"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--no_clean", action="store_true", help="leave out the fault-free run")
    parser.add_argument(
        "--out",
        type=Path,
        help="a JSON-lines file each finished run is added to; runs already in it are not run "
        "again, and the table is of every run in it that the other options name",
    )
    args = parser.parse_args()
    cases = [("none", "mask")] * (not args.no_clean) + [
        (m, v) for m in args.modes for v in args.variants
    ]
    done = {}
    if args.out is not None and args.out.exists():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done[row["mode"], row["variant"], row["seed"], row["batches"]] = row["result"]
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for mode, variant in cases:
        for seed in args.seeds:
            key = (mode, variant, seed, args.batches)
            if key not in done:
                done[key] = run(seed, mode, variant, args.batches)
                if args.out is not None:
                    row = dict(zip(("mode", "variant", "seed", "batches"), key, strict=True))
                    with args.out.open("a") as f:
                        f.write(json.dumps({**row, "result": list(done[key])}) + "\n")
            out = done[key]
            results.setdefault((mode, variant), []).append(out)
            print(
                f"{mode:8s} {variant:9s} seed {seed}: beta {out[0]:.4f} kl {out[1]:.3f} "
                f"score {out[2]:.3f}",
                flush=True,
            )
    print(
        "\n| failures | variant | final beta | final KL (nats/seq) | score |\n|---|---|---|---|---|"
    )
    for (mode, variant), rows in results.items():
        cells = []
        for column in zip(*rows, strict=True):
            se = statistics.stdev(column) / math.sqrt(len(column)) if len(column) > 1 else 0.0
            cells.append(f"{statistics.mean(column):.4f} ± {se:.4f}")
        name = "fault-free" if mode == "none" else variant
        print(f"| {mode if mode != 'none' else '-'} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
