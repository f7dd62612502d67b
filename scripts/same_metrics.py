"""Record every logged training number of the two PPO configs, or compare them with a record.

A refactor must not change behaviour. This script runs ``configs/ppo_adaptive.yaml`` and
``configs/ppo_fixed.yaml`` at seed 0 for 20 batches (``--batches``; validation every 10), reads
every scalar back from the TensorBoard event files and writes them, as exact float32 hex, to a
JSON file.
Timings (``perf/*``) are left out. Run it before a change with ``--record`` and after it with
``--compare``; any value that differs by a single bit is listed and the exit code is 1.

Results are exact only on one machine with one thread count (the default is 1 thread per run):
floating-point sums depend on the CPU's kernels and on how work is split between threads.

    python scripts/same_metrics.py --record /tmp/before.json
    python scripts/same_metrics.py --compare /tmp/before.json
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("configs/ppo_adaptive.yaml", "configs/ppo_fixed.yaml")
BATCHES = 20
OPTIMIZER_STEPS_PER_BATCH = 16  # ppo_epochs x num_minibatches of both configs


def _hex(value: float) -> str:
    return struct.pack(">f", value).hex()


def record(
    threads: int, extra: list[str], batches: int = BATCHES, configs: tuple[str, ...] = CONFIGS
) -> dict[str, dict[str, dict[str, str]]]:
    """Run every config (in parallel, ``threads`` torch threads each) and read its scalars."""
    sys.path.insert(0, str(ROOT))
    from rlkl_lightning.compare.events import read_scalars

    out = Path(tempfile.mkdtemp(prefix="same_metrics_"))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    procs = {}
    for config in configs:
        name = Path(config).stem
        args = [
            sys.executable,
            str(ROOT / "train.py"),
            "fit",
            "--config",
            str(ROOT / config),
            "--seed_everything",
            "0",
            "--trainer.max_steps",
            str(batches * OPTIMIZER_STEPS_PER_BATCH),
            "--trainer.val_check_interval",
            "10",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(out),
            "--trainer.logger.init_args.name",
            name,
            "--trainer.logger.init_args.version",
            "0",
            *extra,
        ]
        log = open(out / f"{name}.log", "w")  # noqa: SIM115
        procs[name] = (subprocess.Popen(args, cwd=out, env=env, stdout=log, stderr=log), log)
    result = {}
    for name, (proc, log) in procs.items():
        if proc.wait():
            log.close()
            sys.exit(f"{name} failed:\n{(out / f'{name}.log').read_text()[-4000:]}")
        log.close()
        scalars = read_scalars(out / name / "version_0")
        result[name] = {
            tag: {str(step): _hex(v) for step, v in sorted(series.items())}
            for tag, series in sorted(scalars.items())
            if not tag.startswith("perf/")
        }
    return result


def compare(before: dict, after: dict) -> list[str]:
    """Every difference between two records, one line each."""
    problems = []
    for run in sorted(before.keys() | after.keys()):
        old, new = before.get(run, {}), after.get(run, {})
        for tag in sorted(old.keys() | new.keys()):
            if tag not in new:
                problems.append(f"{run}: {tag} is no longer logged")
            elif tag not in old:
                problems.append(f"{run}: {tag} is new")
            elif old[tag] != new[tag]:
                steps = [s for s in old[tag] if old[tag].get(s) != new[tag].get(s)]
                steps += [s for s in new[tag] if s not in old[tag]]
                problems.append(f"{run}: {tag} differs at steps {steps[:5]}")
    return problems


def main() -> None:
    """Command line: ``--record FILE`` or ``--compare FILE``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--record", type=Path, help="write the numbers to this JSON file")
    what.add_argument("--compare", type=Path, help="compare the numbers with this JSON file")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--batches", type=int, default=BATCHES, help="training batches per run")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        help="train.py configs to run (16 optimizer steps per batch, like the PPO and RLOO ones)",
    )
    parser.add_argument("extra", nargs="*", help="further train.py arguments for every run")
    args = parser.parse_args()
    numbers = record(args.threads, args.extra, args.batches, tuple(args.configs))
    n_values = sum(len(s) for run in numbers.values() for s in run.values())
    if args.record:
        args.record.write_text(json.dumps(numbers, indent=1))
        print(f"recorded {n_values} values of {len(numbers)} runs in {args.record}")
        return
    problems = compare(json.loads(args.compare.read_text()), numbers)
    for line in problems:
        print(line)
    print(f"{n_values} values compared: {'DIFFERENT' if problems else 'identical, bit for bit'}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
