"""PPO throughput: seconds per PPO iteration of rlkl_lightning, optionally against TRL.

Configuration (fixed, offline, seeded; see ``bench_world.py`` and ``workers.py``): GPT-2
policy with 4 layers, width 256, 4 heads, vocabulary 4096, 256 positions; frozen reference
copy; a GPT-2 sequence classifier of the same size as reward model; 32 prompts of 16 tokens
per iteration; exactly 32 sampled tokens at temperature 0.7; 4 PPO epochs x 4 minibatches
(16 optimizer steps); fp32; 2 threads.

Each side runs in its own worker process (so its peak memory is its own), paced by this
process one iteration at a time: the sides alternate iteration by iteration, so all of them
meet the same machine conditions. After ``--warmup`` iterations each, ``--iters`` iterations
are timed. The fp32 matmul peak is measured by this script on this machine (``flops.py``), and
the FLOPs of an iteration are counted with the analytic model-FLOPs formula of ``flops.py``.

Usage::

    python benchmarks/ppo_throughput.py                              # ours only
    python benchmarks/ppo_throughput.py --vs-trl --json bench.json   # + TRL, and the ratio

``--vs-trl`` needs the ``bench`` extra (``pip install -e '.[bench]'``: TRL 1.12.0, the last
release with a PPOTrainer). The JSON holds ``{"ours": {...}, "ours_separate_value": {...},
"trl": {...}, "speedup": TRL median / ours median, "machine": {...}}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flops  # noqa: E402
from bench_world import N_EMBD, N_LAYER, PROMPT_TOKENS, VOCAB, build  # noqa: E402
from workers import BATCH, EPOCHS, MINIBATCHES, RESPONSE, THREADS  # noqa: E402

SHAPE = flops.Shape(N_LAYER, N_EMBD, VOCAB, BATCH, PROMPT_TOKENS, RESPONSE, EPOCHS)
LABELS = {
    "ours": "rlkl_lightning (value head on the policy trunk)",
    "ours_separate_value": "rlkl_lightning (separate value model)",
    "trl": "TRL 1.12.0 PPOTrainer (separate value model)",
}


class Worker:
    """A worker process running one side, driven one iteration at a time."""

    def __init__(
        self, side: str, world: Path, iterations: int, log_dir: Path, omp_wait_policy: str
    ):
        read_fd, write_fd = os.pipe()
        self.side = side
        self.log = log_dir / f"{side}.log"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(THREADS),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        if omp_wait_policy != "default":
            env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "workers.py"), side, str(world), str(write_fd)]
                + [str(iterations)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                text=True,
                env=env,
            )
        os.close(write_fd)
        self.results = os.fdopen(read_fd)

    def receive(self) -> dict:
        """The worker's next JSON line; raises with the end of its log if it died."""
        line = self.results.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"worker {self.side} died; end of {self.log}:\n{tail}")
        return json.loads(line)

    def step(self) -> dict:
        """Run one iteration and return its report."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        """Let the worker finish."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=300)


def summarize(side: str, runs: list[dict], peak_gflops: float) -> dict:
    """Median, min and max seconds per iteration, throughput, FLOPs and peak fractions."""
    phase_flops = flops.phases(SHAPE, side)
    seconds = [r["seconds"] for r in runs]
    median = statistics.median(seconds)
    gflop = sum(phase_flops.values()) / 1e9
    phases = {p: statistics.median(r[p] for r in runs) for p in ("rollout", "score", "update")}
    return {
        "median_s_per_iter": median,
        "min_s_per_iter": min(seconds),
        "max_s_per_iter": max(seconds),
        "iters_per_s": 1.0 / median,
        "tokens_per_s": BATCH * RESPONSE / median,
        "gflop_per_iter": gflop,
        "gflop_per_phase": {p: f / 1e9 for p, f in phase_flops.items()},
        "phase_median_s": phases,
        "peak_fraction": gflop / median / peak_gflops,
        "update_peak_fraction": phase_flops["update"] / 1e9 / phases["update"] / peak_gflops,
        "max_rss_mib": max(r["max_rss_mib"] for r in runs),
        "optimizer_steps_per_iter": sorted({r["optimizer_steps"] for r in runs}),
        "optimizer": runs[0].get("optimizer"),
        "timed_iters": len(runs),
        "seconds": seconds,
    }


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (other processes slow every side down)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def report(side: str, s: dict) -> None:
    """Print one side's summary."""
    ph, gf = s["phase_median_s"], s["gflop_per_phase"]
    print(
        f"{LABELS[side]}\n"
        f"  {s['median_s_per_iter']:.3f} s/iter median (min {s['min_s_per_iter']:.3f}, "
        f"max {s['max_s_per_iter']:.3f}, {s['timed_iters']} iterations), "
        f"{s['tokens_per_s']:.0f} generated tokens/s\n"
        f"  phases (medians): rollout {ph['rollout']:.3f} s, scoring {ph['score']:.3f} s, "
        f"update {ph['update']:.3f} s\n"
        f"  {s['gflop_per_iter']:.1f} GFLOP/iter (rollout {gf['rollout']:.1f}, scoring "
        f"{gf['score']:.1f}, update {gf['update']:.1f}); {100 * s['peak_fraction']:.0f}% of the "
        f"matmul peak overall, {100 * s['update_peak_fraction']:.0f}% in the update\n"
        f"  max RSS {s['max_rss_mib']:.0f} MiB; optimizer steps per iteration "
        f"{s['optimizer_steps_per_iter']}, {s['optimizer']}"
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the results that ``--json`` writes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vs-trl", action="store_true", help="also run TRL's PPOTrainer")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per side")
    parser.add_argument(
        "--no-separate-value",
        action="store_true",
        help="skip our variant with a separate value model",
    )
    parser.add_argument("--world", type=Path, help="where to build the models (default: temp)")
    parser.add_argument(
        "--omp-wait-policy",
        choices=("passive", "active", "default"),
        default="default",
        help="OMP_WAIT_POLICY of every worker (default: OpenMP's own). On a shared machine use "
        "passive: with spin-waiting, a 2-thread process on 2 cores runs 10-20x slower whenever "
        "another process computes; passive waiting keeps timings usable (about 15%% slower for "
        "every side on a quiet machine)",
    )
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.vs_trl and importlib.util.find_spec("trl") is None:
        parser.error("--vs-trl needs TRL 1.12.0: pip install -e '.[bench]'")

    tmp = Path(tempfile.mkdtemp(prefix="rlkl-bench-"))
    world = build(args.world or tmp / "world")
    sides = ["ours"] + ([] if args.no_separate_value else ["ours_separate_value"])
    sides += ["trl"] if args.vs_trl else []
    total = args.warmup + args.iters
    load_before = load_average()
    workers = {side: Worker(side, world, total, tmp, args.omp_wait_policy) for side in sides}
    for w in workers.values():
        w.receive()  # ready: models loaded, trainer built
    peak = flops.matmul_peak(THREADS)  # workers are idle: only this process computes
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(total):
        times = {}
        for side in sides if i % 2 == 0 else sides[::-1]:
            result = workers[side].step()
            times[side] = result["seconds"]
            if i >= args.warmup:
                runs[side].append(result)
        kind = "warm-up" if i < args.warmup else "timed"
        print(
            f"iteration {i + 1}/{total} ({kind}): "
            + ", ".join(f"{side} {times[side]:.2f} s" for side in sides),
            flush=True,
        )
    for w in workers.values():
        w.close()
    peak = max(peak, flops.matmul_peak(THREADS))

    results: dict = {side: summarize(side, runs[side], peak) for side in sides}
    results["machine"] = {
        "cpu": _cpu_name(),
        "threads": THREADS,
        "omp_wait_policy": args.omp_wait_policy,
        "fp32_matmul_peak_gflops": peak,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }
    results["config"] = {
        "prompts": BATCH,
        "prompt_tokens": PROMPT_TOKENS,
        "generated_tokens": RESPONSE,
        "ppo_epochs": EPOCHS,
        "minibatches": MINIBATCHES,
        "warmup_iters": args.warmup,
        "timed_iters": args.iters,
    }
    if args.vs_trl:
        trl_median = results["trl"]["median_s_per_iter"]
        results["speedup"] = trl_median / results["ours"]["median_s_per_iter"]
        if "ours_separate_value" in results:
            sep = results["ours_separate_value"]["median_s_per_iter"]
            results["speedup_separate_value"] = trl_median / sep
    print(
        f"\nmachine: {results['machine']['cpu']}, {THREADS} threads, OMP_WAIT_POLICY "
        f"{args.omp_wait_policy}; measured fp32 matmul peak "
        f"{peak:.1f} GFLOP/s; load average before {load_before}, after "
        f"{results['machine']['load_average_after']}"
    )
    for side in sides:
        report(side, results[side])
    if args.vs_trl:
        print(f"speedup (TRL median / ours median): {results['speedup']:.2f}x")
        if "speedup_separate_value" in results:
            print(f"speedup with a separate value model: {results['speedup_separate_value']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
