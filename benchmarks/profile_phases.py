"""Where our PPO iteration spends its time: ``torch.profiler`` per phase, on a benchmark world.

Runs our side of ``ppo_throughput.py`` (the same module, world and settings) in this process:
``--warmup`` iterations, ``--iters`` timed ones, then ``--profiled`` ones under the profiler.
Prints, per phase (rollout; scoring, i.e. reference, values, reward and KL; the update's
forward, backward and optimizer steps), its CPU seconds per timed iteration and the operators
that take the most of its profiled time (self time). The CPU seconds are the process's own, so
other processes on a shared machine slow them down less than the wall time.

Usage::

    python benchmarks/profile_phases.py                           # value head, fp32, 2 threads
    python benchmarks/profile_phases.py --separate-value --cpu-matmul onednn --threads 1
    python benchmarks/profile_phases.py --separate-value --value-model-thread --cpu-matmul onednn
    python benchmarks/profile_phases.py --algorithm grpo --compiled-update   # the compiled pass
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_world import PRESETS, build, preset  # noqa: E402

PHASES = ("rollout", "score", "update")


class PhaseProfiler:
    """Wraps a module's phase methods: CPU seconds of each, and a profile of the timed ones."""

    def __init__(self, module, warmup: int, iters: int, rows: int):
        self.warmup, self.iters, self.rows = warmup, iters, rows
        self.cpu: dict[str, list[float]] = {name: [] for name in PHASES}
        self.ops: dict[str, Counter] = {name: Counter() for name in PHASES}
        self.calls: dict[str, Counter] = {name: Counter() for name in PHASES}
        for name in PHASES:
            setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name: str, method):
        from torch.profiler import ProfilerActivity, profile

        def wrapper(*args, **kwargs):
            profiled = len(self.cpu[name]) >= self.warmup + self.iters
            profiler = profile(activities=[ProfilerActivity.CPU]) if profiled else None
            if profiler is not None:
                profiler.__enter__()
            start = time.process_time()
            out = method(*args, **kwargs)
            self.cpu[name].append(time.process_time() - start)
            if profiler is not None:
                profiler.__exit__(None, None, None)
                for event in profiler.key_averages():
                    self.ops[name][event.key] += event.self_cpu_time_total
                    self.calls[name][event.key] += event.count
            return out

        return wrapper

    def report(self) -> None:
        """Print each phase's CPU seconds and top operators."""
        end = self.warmup + self.iters
        timed = {name: seconds[self.warmup : end] for name, seconds in self.cpu.items()}
        n = len(self.cpu["update"]) - end  # profiled iterations
        total = sum(statistics.median(s) for s in timed.values())
        print(
            f"CPU seconds per iteration (median of {self.iters}): "
            + ", ".join(f"{name} {statistics.median(s):.3f}" for name, s in timed.items())
            + f"; sum {total:.3f}"
        )
        for name in PHASES:
            ops = self.ops[name]
            whole = sum(ops.values()) or 1.0
            print(f"\n{name}: operators by self time (share of the phase's profiled time)")
            for key, micros in ops.most_common(self.rows):
                calls = self.calls[name][key] // n
                print(
                    f"  {100 * micros / whole:5.1f}%  {micros / 1e3 / n:8.1f} ms  "
                    f"{calls:6d} calls  {key}"
                )


def main(argv: list[str] | None = None) -> None:
    import torch
    from workers import ours, ours_grpo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--algorithm",
        choices=("ppo", "grpo"),
        default="ppo",
        help="ppo_throughput.py's side, or grpo_throughput.py's (RLOOModule, advantage grpo)",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-4x256")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--cpu-matmul", choices=("auto", "default", "onednn"))
    parser.add_argument("--separate-value", action="store_true")
    parser.add_argument(
        "--value-model-thread", action="store_true", help="with --separate-value: in a thread"
    )
    parser.add_argument(
        "--compiled-update", action="store_true", help="optimization.compile (compiles in warm-up)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations")
    parser.add_argument("--profiled", type=int, default=2, help="profiled iterations")
    parser.add_argument("--rows", type=int, default=15, help="operators listed per phase")
    parser.add_argument("--world", type=Path, help="where to build the models (default: temp)")
    args = parser.parse_args(argv)
    settings = {
        "preset": args.preset,
        "tiny": args.tiny,
        "device": "cpu",
        "precision": args.precision,
        "threads": args.threads,
        "cpu_matmul": args.cpu_matmul,
        "value_model_thread": args.value_model_thread,
        "generations": 4,
        "compile": args.compiled_update,
    }
    chosen = preset(args.preset, args.tiny)
    world = build(args.world or Path(tempfile.mkdtemp(prefix="rlkl-profile-")), chosen)
    total = args.warmup + args.iters + args.profiled
    if args.algorithm == "grpo":
        trainer, module, data = ours_grpo(world, settings, total)
    else:
        trainer, module, data = ours(world, settings, args.separate_value, total)
    profiler = PhaseProfiler(module, args.warmup, args.iters, args.rows)
    torch.set_num_threads(args.threads)
    trainer.fit(module, data)
    print(
        f"\n{args.algorithm}, preset {chosen.name}, {args.precision}, cpu_matmul "
        f"{args.cpu_matmul or 'library default'}, "
        f"{'separate value model' if args.separate_value else 'value head on the trunk'}"
        f"{' in a second thread' if args.separate_value and args.value_model_thread else ''}, "
        f"{'optimization.compile, ' if args.compiled_update else ''}"
        f"{args.threads} threads"
    )
    profiler.report()


if __name__ == "__main__":
    main()
