"""What the throughput benchmarks share: worker processes, the alternating loop, summaries.

Each side (a library in one configuration) runs in its own worker process (``workers.py``), so
its peak memory is its own, and this process paces them one iteration at a time, alternating
the order every iteration, so that all sides meet the same machine conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import flops

HERE = Path(__file__).resolve().parent
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
PHASES = ("rollout", "score", "update")


class Worker:
    """A worker process running one side, driven one iteration at a time."""

    def __init__(
        self,
        side: str,
        world: Path,
        iterations: int,
        log_dir: Path,
        settings: dict,
        python: str = sys.executable,
    ):
        read_fd, write_fd = os.pipe()
        self.side = side
        self.log = log_dir / f"{side}.log"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(settings["threads"]),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        if settings["omp_wait_policy"] != "default":
            env["OMP_WAIT_POLICY"] = settings["omp_wait_policy"].upper()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [python, str(HERE / "workers.py"), side, str(world), str(write_fd)]
                + [str(iterations), json.dumps(settings)],
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


def add_common_arguments(parser: argparse.ArgumentParser, presets: list[str]) -> None:
    """The options every throughput benchmark takes (its own are added by the script)."""
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per side")
    parser.add_argument("--preset", choices=presets, default="gpt2-4x256", help="models and batch")
    parser.add_argument(
        "--tiny", action="store_true", help="the preset's architecture at smoke-test size"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        default="32-true",
        help="fp32, or bfloat16 autocast on both sides (on a CPU: where it has bf16 units)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every worker")
    parser.add_argument("--world", type=Path, help="where to build the models (default: temp)")
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="responses of ragged lengths (EOS stops, as the shipped configs): our side runs "
        "twice, optimization.packing none and packed, alternating, and the padding share of "
        "the update's token positions is reported (ours only: no --vs-trl)",
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=("passive", "active", "default"),
        default="default",
        help="OMP_WAIT_POLICY of every worker (default: OpenMP's own). On a shared machine use "
        "passive: with spin-waiting, a 2-thread process on 2 cores runs 10-20x slower whenever "
        "another process computes; passive waiting keeps timings usable (about 15%% slower for "
        "every side on a quiet machine)",
    )


def check_common_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse common options out of range, and ``--device cuda`` without a GPU."""
    if args.iters < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--iters and --threads must be >= 1 and --warmup >= 0")
    if args.ragged and args.vs_trl:
        parser.error("--ragged compares our side with packing off and on: drop --vs-trl")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here; allowed: --device cpu")


def measure(
    sides: dict[str, str], world: Path, log_dir: Path, settings: dict, args: argparse.Namespace
) -> tuple[dict[str, list[dict]], float, list[float]]:
    """Start a worker per side (side -> its interpreter), time them alternately, stop them.

    Returns each side's timed iterations, the device's matmul peak in the run's precision (the
    better of a measurement before and after, taken while the workers are idle) and the load
    average before the workers started.
    """
    import torch

    load_before = load_average()
    total = args.warmup + args.iters
    workers = {
        side: Worker(side, world, total, log_dir, settings, python)
        for side, python in sides.items()
    }
    for w in workers.values():
        w.receive()  # ready: models loaded, trainer built
    dtype = torch.bfloat16 if args.precision == "bf16-mixed" else torch.float32
    peak_kw = {"device": args.device, "dtype": dtype}
    peak = flops.matmul_peak(args.threads, **peak_kw)  # workers are idle: only we compute
    runs = alternate(workers, args.warmup, args.iters)
    for w in workers.values():
        w.close()
    return runs, max(peak, flops.matmul_peak(args.threads, **peak_kw)), load_before


def alternate(workers: dict[str, Worker], warmup: int, iters: int) -> dict[str, list[dict]]:
    """Step every worker ``warmup + iters`` times, the order reversed every iteration.

    Returns each side's timed iterations (the reports after the warm-up).
    """
    sides = list(workers)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    total = warmup + iters
    for i in range(total):
        times = {}
        for side in sides if i % 2 == 0 else sides[::-1]:
            result = workers[side].step()
            times[side] = result["seconds"]
            if i >= warmup:
                runs[side].append(result)
        kind = "warm-up" if i < warmup else "timed"
        print(
            f"iteration {i + 1}/{total} ({kind}): "
            + ", ".join(f"{side} {times[side]:.2f} s" for side in sides),
            flush=True,
        )
    return runs


def summarize(runs: list[dict], phase_flops: dict[str, float], tokens: int, peak: float) -> dict:
    """Median, min and max seconds per iteration, throughput, FLOPs and MFU per phase.

    ``tokens``: sampled tokens per iteration; ``peak``: the device's matmul GFLOP/s.
    """
    seconds = [r["seconds"] for r in runs]
    median = statistics.median(seconds)
    gflop = sum(phase_flops.values()) / 1e9
    phases = {p: statistics.median(r[p] for r in runs) for p in PHASES}
    mfu = {p: phase_flops[p] / 1e9 / phases[p] / peak for p in PHASES}
    summary = {
        "median_s_per_iter": median,
        "min_s_per_iter": min(seconds),
        "max_s_per_iter": max(seconds),
        "iters_per_s": 1.0 / median,
        "tokens_per_s": tokens / median,
        "gflop_per_iter": gflop,
        "gflop_per_phase": {p: f / 1e9 for p, f in phase_flops.items()},
        "phase_median_s": phases,
        "peak_fraction": gflop / median / peak,
        "phase_mfu": mfu,
        "update_peak_fraction": mfu["update"],
        "max_rss_mib": max(r["max_rss_mib"] for r in runs),
        "optimizer_steps_per_iter": sorted({r["optimizer_steps"] for r in runs}),
        "optimizer": runs[0].get("optimizer"),
        "timed_iters": len(runs),
        "seconds": seconds,
    }
    if "sampled_tokens" in runs[0]:
        summary["sampled_tokens_per_iter"] = sorted({r["sampled_tokens"] for r in runs})
    if "max_gpu_mib" in runs[0]:
        summary["max_gpu_mib"] = max(r["max_gpu_mib"] for r in runs)
    return summary


def phase_line(s: dict) -> str:
    """Seconds, GFLOP and MFU per phase, and memory, of one side's summary (indented lines)."""
    ph, gf, mfu = s["phase_median_s"], s["gflop_per_phase"], s["phase_mfu"]
    memory = f"max RSS {s['max_rss_mib']:.0f} MiB"
    if "max_gpu_mib" in s:
        memory += f", peak GPU memory {s['max_gpu_mib']:.0f} MiB (max_memory_allocated)"
    return (
        f"  {s['median_s_per_iter']:.3f} s/iter median (min {s['min_s_per_iter']:.3f}, "
        f"max {s['max_s_per_iter']:.3f}, {s['timed_iters']} iterations), "
        f"{s['tokens_per_s']:.0f} generated tokens/s\n"
        f"  phases (medians): rollout {ph['rollout']:.3f} s, scoring {ph['score']:.3f} s, "
        f"update {ph['update']:.3f} s\n"
        f"  {s['gflop_per_iter']:.1f} GFLOP/iter (rollout {gf['rollout']:.1f}, scoring "
        f"{gf['score']:.1f}, update {gf['update']:.1f}); MFU {100 * s['peak_fraction']:.0f}% "
        f"overall, rollout {100 * mfu['rollout']:.0f}%, scoring {100 * mfu['score']:.0f}%, "
        f"update {100 * mfu['update']:.0f}%\n"
        f"  {memory}; optimizer steps per iteration "
        f"{s['optimizer_steps_per_iter']}, {s['optimizer']}"
    )


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (other processes slow every side down)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def device_name(device: str) -> str:
    """The CPU model and its core count, or the GPU's name."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect(
    runs: dict[str, list[dict]], phase_flops, tokens: int, peak: float, load_before, args
) -> tuple[dict, str]:
    """Each side's :func:`summarize`, the ``machine`` record, and the precision's name.

    ``phase_flops(side)``: that side's FLOPs per phase; the name is ``bf16`` or ``fp32``.
    """
    precision = "bf16" if args.precision == "bf16-mixed" else "fp32"
    results: dict = {
        side: summarize(r, phase_flops(side), tokens, peak) for side, r in runs.items()
    }
    results["machine"] = machine(
        args.device, args.threads, args.omp_wait_policy, precision, peak, load_before
    )
    return results, precision


def machine(device: str, threads: int, wait_policy: str, precision: str, peak: float, load_before):
    """The JSON's ``machine`` record."""
    import torch

    return {
        "device": device_name(device),
        "cpu_bf16_flags": sorted(cpu_flags() & set(BF16_FLAGS)),
        "threads": threads,
        "omp_wait_policy": wait_policy,
        f"{precision}_matmul_peak_gflops": peak,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "torch": torch.__version__,
    }


def flops_shape(preset) -> flops.Shape:
    """The FLOP model's shape of a ``bench_world.Preset``."""
    return flops.Shape.of(preset)


def ragged_summary(runs: dict[str, list[dict]], padded: str, packed: str) -> dict:
    """``--ragged``: the update's token positions and the gain of packing, from medians.

    ``padding_share``: the padded rows' positions that hold no token the update needs;
    ``packed_padding_share``: the packed rows' (filler up to their bucket); the gains are the
    padded side's median seconds over the packed side's, per iteration and per update.
    """

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    real, positions = median(padded, "real_positions"), median(padded, "padded_positions")
    packed_positions = median(packed, "packed_positions")
    return {
        "update_positions_per_iter": {"padded": positions, "packed": packed_positions},
        "needed_positions_per_iter": real,
        "padding_share": 1 - real / positions,
        "packed_padding_share": 1 - median(packed, "real_positions") / packed_positions,
        "iteration_gain": median(padded, "seconds") / median(packed, "seconds"),
        "update_gain": median(padded, "update") / median(packed, "update"),
    }


def ragged_line(r: dict) -> str:
    """The printed line of :func:`ragged_summary`."""
    return (
        f"ragged: padding {100 * r['padding_share']:.0f}% of the padded update's token "
        f"positions, {100 * r['packed_padding_share']:.0f}% of the packed ones "
        f"({r['update_positions_per_iter']['padded']:.0f} -> "
        f"{r['update_positions_per_iter']['packed']:.0f} per iteration); packing off / on: "
        f"{r['iteration_gain']:.2f}x per iteration, {r['update_gain']:.2f}x per update"
    )


def result_line(result: dict) -> None:
    """Print a child process's result as the one line :func:`in_fresh_process` reads."""
    print("RESULT " + json.dumps(result), flush=True)


def in_fresh_process(command: list, env: dict | None = None) -> dict:
    """Run ``command`` (a benchmark's own child) and return the result its last line printed.

    A fresh process per measurement: its peak memory is its own.
    """
    proc = subprocess.run([str(c) for c in command], env=env, capture_output=True, text=True)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{command[1:]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(results[-1].removeprefix("RESULT "))
