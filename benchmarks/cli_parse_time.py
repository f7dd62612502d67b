"""Seconds a run spends in the CLI before training: parsing the config, then building classes.

A study (``rlkl_lightning.compare``) forks each run from a server that imported
``rlkl_lightning.cli`` and ``rlkl_lightning.compare.runs`` once, so a run does not pay those
imports; it pays parsing, the imports the config's class paths pull in, and building the model,
data module and trainer. This script measures that in two ways, each the median of
``--repeats``:

* ``forked``: each repeat in a child forked from this process after it imported what the
  study's server imports (what a study run pays, its lazy imports included);
* ``warm``: repeats in this process after a first call paid every import (parsing and building
  alone).

"parse" ends where LightningCLI calls ``before_instantiate_classes``, "build" where it would
start ``fit``. Then the top ``--top`` cumulative entries of cProfile over one warm call.

    python benchmarks/cli_parse_time.py                       # configs/ppo_adaptive.yaml
    python benchmarks/cli_parse_time.py --config configs/rloo_adaptive.yaml --repeats 7

The default world must be built for configs that use ``policy: default`` (the first call
builds it otherwise, minutes; ``python -m rlkl_lightning.world``).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

PRELOAD = ("rlkl_lightning.cli", "rlkl_lightning.compare.runs")  # compare/runs.py's server's


class _Stop(Exception):
    """Raised where ``fit`` would start: the run is measured up to there."""


def _timed_cli(marks: dict[str, float]):
    """The CLI's class with clocks at its start, after parsing and before ``fit``."""
    import rlkl_lightning.cli

    base = rlkl_lightning.cli.RLKLCLI

    class TimedCLI(base):
        def __init__(self, *args, **kwargs):
            marks["start"] = time.perf_counter()
            super().__init__(*args, **kwargs)

        def before_instantiate_classes(self) -> None:
            marks["parsed"] = time.perf_counter()
            super().before_instantiate_classes()

        def before_fit(self) -> None:
            marks["built"] = time.perf_counter()
            raise _Stop

    return base, TimedCLI


def measure(args: list[str]) -> dict[str, float]:
    """Run the CLI as ``train.py fit`` does up to ``fit``; seconds parsing and building."""
    marks: dict[str, float] = {}
    base, timed = _timed_cli(marks)
    module = sys.modules[base.__module__]  # where ``_cli`` builds the class by its name
    setattr(module, base.__name__, timed)
    try:
        module._cli(args)
    except _Stop:
        pass
    finally:
        setattr(module, base.__name__, base)
    return {
        "parse_s": marks["parsed"] - marks["start"],
        "build_s": marks["built"] - marks["parsed"],
        "total_s": marks["built"] - marks["start"],
    }


def measure_forked(args: list[str]) -> dict[str, float]:
    """:func:`measure` in a child forked from this process (as a study's server forks a run)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        code = 0
        try:
            result = measure(args)
            os.write(write_fd, json.dumps(result).encode())
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os.close(write_fd)
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not text:
        raise RuntimeError("the forked measurement failed (its traceback is above)")
    return json.loads(text)


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/ppo_adaptive.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=10, help="cProfile entries to print")
    parser.add_argument("--no-fork", action="store_true", help="skip the forked measurement")
    opts, extra = parser.parse_known_args(argv)
    sys.argv[1:] = []  # this script's flags are not the run's (as compare/runs.py does)

    import torch

    torch.set_num_threads(1)
    for name in PRELOAD:
        importlib.import_module(name)
    save_dir = tempfile.mkdtemp(prefix="cli_parse_time-")
    args = [
        "fit",
        "--config",
        opts.config,
        "--trainer.logger.init_args.save_dir",
        save_dir,
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]
    results = {}
    if not opts.no_fork and hasattr(os, "fork"):
        results["forked"] = _median([measure_forked(args) for _ in range(opts.repeats)])
    measure(args)  # pays every import (and builds the default world if it must)
    results["warm"] = _median([measure(args) for _ in range(opts.repeats)])

    profile = cProfile.Profile()
    profile.enable()
    measure(args)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(opts.top)

    print(f"{opts.config}: seconds before fit, median of {opts.repeats}")
    print("| way | parse s | build s | total s |\n|---|---|---|---|")
    for way, row in results.items():
        print(f"| {way} | {row['parse_s']:.3f} | {row['build_s']:.3f} | {row['total_s']:.3f} |")
    print(f"\ncProfile of one warm call, top {opts.top} by cumulative time:")
    print(out.getvalue())
    return results


if __name__ == "__main__":
    main()
