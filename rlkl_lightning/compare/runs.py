"""Plan and launch the study's runs: one ``train.py fit`` process per (controller, seed).

Each run's process is forked from a server process that imported torch, Lightning and the
CLI once (multiprocessing's ``forkserver``), so no run pays those seconds of imports again;
where that start method is missing (Windows) each run is a fresh interpreter.

Each run gets a derived config, written to ``<out>/configs/<run>.yaml``: its base config with
the study's overrides merged in, the seed, the run length and a TensorBoard logger writing to
``<out>/runs/<group>/seed<k>/``. So every run can be repeated alone with
``python train.py fit --config <out>/configs/<run>.yaml``.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from lightning.pytorch import Callback
from typing_extensions import override

from rlkl_lightning.compare.config import merge, run_entry, run_seeds
from rlkl_lightning.config_files import compose
from rlkl_lightning.defaults import default_of
from rlkl_lightning.migrations import upgrade_init_args

if TYPE_CHECKING:
    from rlkl_lightning.compare.config import StudyConfig


class RunProgress(Callback):
    """Write the number of finished training batches to a file (read by the study's progress).

    Args:
        path: File to (over)write after every training batch.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.batches = 0

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Count the batch and write the count (replacing the file, so no reader sees it empty)."""
        self.batches += 1
        if trainer.is_global_zero:
            partial = self.path.with_suffix(".partial")
            partial.write_text(str(self.batches))
            os.replace(partial, self.path)


@dataclass(frozen=True)
class Run:
    """One training run of the study.

    Attributes:
        group: What the report aggregates over seeds: a controller name from ``runs``, or
            ``fixed_<beta>`` for a sweep run.
        seed: Its seed.
        kl_coef: The initial beta of the run.
        config: The derived ``train.py`` config.
        log_dir: The TensorBoard run directory.
        out: The study's output directory.
    """

    group: str
    seed: int
    kl_coef: float
    config: Path
    log_dir: Path
    out: Path

    @property
    def name(self) -> str:
        """``<group>-seed<k>``: names its config, log and progress files."""
        return f"{self.group}-seed{self.seed}"

    @property
    def log_file(self) -> Path:
        """Everything the run printed."""
        return self.out / "logs" / f"{self.name}.log"

    @property
    def progress_file(self) -> Path:
        """Written by :class:`RunProgress`."""
        return self.out / "progress" / f"{self.name}.txt"

    @property
    def cpu_file(self) -> Path:
        """The run's CPU seconds, written by its process as it ends."""
        return self.out / "progress" / f"{self.name}.cpu"

    @property
    def done_file(self) -> Path:
        """Written by the run's process when it ends successfully: :func:`run_key` of its config."""
        return self.out / "progress" / f"{self.name}.done"

    def finished_before(self) -> bool:
        """Whether an earlier study in ``out`` finished this run with this config and code."""
        try:
            return self.done_file.read_text() == run_key(self) and self.log_dir.is_dir()
        except OSError:
            return False

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the finished run took; NaN where not known."""
        try:
            return float(self.cpu_file.read_text())
        except (FileNotFoundError, ValueError):
            return math.nan

    def batches_done(self) -> int:
        """Finished training batches so far (0 before the first)."""
        try:
            return int(self.progress_file.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0


def run_key(run: Run) -> str:
    """What makes a run's result: its derived config and the versions of this package and torch."""
    import torch

    from rlkl_lightning import __version__

    text = f"{__version__}\n{torch.__version__}\n{run.config.read_text()}"
    return hashlib.sha256(text.encode()).hexdigest()


def init_arg(config: dict[str, Any], group: str, name: str) -> Any:
    """A class's init argument in a config: its value there, else the class default.

    ``name`` may be an option of a group, ``"penalty.init_coef"``: its value in the config's
    ``init_args.penalty`` block, else the field's default in the group the class's signature
    gives as that argument's default.
    """
    section = config.get(group) or {}
    args = section.get("init_args") or {}
    if group == "model":  # a run config of an older version reads as today's
        args = upgrade_init_args(args)
    outer, _, inner = name.partition(".")
    if outer in args and not inner:
        return args[outer]
    if inner and inner in (args.get(outer) or {}):
        return args[outer][inner]
    path = section.get("class_path")
    if not path:
        raise ValueError(f"compare: the config has no `{group}.class_path`")
    module, _, cls = path.rpartition(".")
    try:
        default = default_of(getattr(importlib.import_module(module), cls), outer)
    except KeyError:
        default = inspect.Parameter.empty
    if inner and default is not inspect.Parameter.empty:
        default = getattr(default, inner, inspect.Parameter.empty)
    if default is inspect.Parameter.empty:
        raise ValueError(f"compare: `{group}.init_args.{name}` is needed and has no default")
    return default


#: What a study writes in its ``out``: a directory holding one of them is a study's.
STUDY_FILES = ("configs", "logs", "progress", "runs", "report.md", "summary.json")


def plan_runs(study: StudyConfig, out: Path) -> list[Run]:
    """Write the derived config of every run; seeds outermost, so early results are balanced."""
    from rlkl_lightning.compare.custom_world import study_overrides, without_replaced_options

    world = study_overrides(study.world, extra=study.world_overrides) if study.world else None
    bases = {}
    for group, entry in study.runs.items():
        path, own = run_entry(group, entry)
        if not Path(path).is_file():
            raise ValueError(f"compare: `runs.{group}` config not found: {path!r}")
        base = compose(path)  # its bases and dotted keys resolved
        bases[group] = merge(merge(base, study.overrides), own)
        if world is not None:  # a custom world: its model, prompts and held-out text
            bases[group] = merge(without_replaced_options(bases[group]), world)
    plan: list[tuple[str, int, dict[str, Any]]] = []
    for seed in range(study.seeds):
        plan += [
            (group, seed, base)
            for group, base in bases.items()
            if seed < run_seeds(study.runs[group], study.seeds)
        ]
    if study.sweep_kl_coefs:
        fixed_beta = float(init_arg(bases["fixed"], "model", "penalty.init_coef"))
        for beta in study.sweep_kl_coefs:
            if beta == fixed_beta:  # the `fixed` runs already cover it
                continue
            swept = merge(
                bases["fixed"], {"model": {"init_args": {"penalty": {"init_coef": beta}}}}
            )
            for seed in range(min(study.sweep_seeds, study.seeds)):
                plan.append((f"fixed_{beta:g}", seed, swept))
    if out.is_dir() and any(out.iterdir()) and not any((out / n).exists() for n in STUDY_FILES):
        raise ValueError(
            f"compare: `out` {str(out)!r} holds other files and no study; name a new or empty "
            "directory, or an earlier study's (whose files it replaces)"
        )
    for sub in ("configs", "logs", "progress"):
        try:
            (out / sub).mkdir(parents=True, exist_ok=True)
        except OSError as error:  # `out`, or a folder above it, is a file
            found = next(p for p in (out, *out.parents) if p.exists())
            why = f"{str(found)!r} is a file" if found.is_file() else error.strerror
            raise ValueError(
                f"compare: `out` {str(out)!r} cannot hold the study: {why}; name a directory"
            ) from None
    return [_derive(group, seed, base, study, out) for group, seed, base in plan]


def _derive(group: str, seed: int, base: dict[str, Any], study: StudyConfig, out: Path) -> Run:
    steps = int(init_arg(base, "model", "optimization.ppo_epochs")) * int(
        init_arg(base, "model", "optimization.num_minibatches")
    )
    log_root = (out / "runs").resolve()
    run = Run(
        group=group,
        seed=seed,
        kl_coef=float(init_arg(base, "model", "penalty.init_coef")),
        config=out / "configs" / f"{group}-seed{seed}.yaml",
        log_dir=log_root / group / f"seed{seed}",
        out=out,
    )
    trainer = {
        "max_epochs": -1,
        "max_steps": study.batches * steps,  # optimizer steps: `steps` per PPO batch
        "val_check_interval": min(study.val_every, study.batches),
        "check_val_every_n_epoch": None,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {
                "save_dir": str(log_root),
                "name": group,
                "version": f"seed{seed}",
                "default_hp_metric": False,
            },
        },
    }
    config = merge(base, {"seed_everything": seed, "trainer": trainer})
    if (config.get("data") or {}).get("class_path", "").endswith("PromptDataModule"):
        config = merge(config, {"data": {"init_args": {"seed": seed}}})  # prompt order
    progress = {
        "class_path": "rlkl_lightning.compare.runs.RunProgress",
        "init_args": {"path": str(run.progress_file.resolve())},
    }
    config["trainer"]["callbacks"] = list(config["trainer"].get("callbacks") or []) + [progress]
    run.config.write_text(yaml.safe_dump(config, sort_keys=False))
    return run


def uses_default_world(config: dict[str, Any]) -> bool:
    """Whether a run reads the default world (its policy, prompts or held-out text)."""
    if init_arg(config, "model", "policy") == "default":
        return True
    data = config.get("data") or {}
    if not data.get("class_path", "").endswith("PromptDataModule"):
        return False
    return "default" in (init_arg(config, "data", "prompts"), init_arg(config, "data", "heldout"))


def run_all(runs: list[Run], study: StudyConfig) -> list[Run]:
    """Run everything, ``study.workers`` at a time, showing progress (:mod:`.progress`).

    Returns the runs kept from an earlier study (``study.keep_finished``), not run again.

    Raises:
        RuntimeError: If a run fails (the others are stopped; its log is quoted).
    """
    from rlkl_lightning.compare.progress import study_progress

    env = {
        "OMP_NUM_THREADS": str(study.threads),
        "MKL_NUM_THREADS": str(study.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    kept = [r for r in runs if r.finished_before()] if study.keep_finished else []
    if kept:
        print(
            f"compare: kept {len(kept)} of {len(runs)} runs that an earlier study in "
            f"{str(runs[0].out)!r} finished with the same config ({', '.join(r.name for r in kept)}"
            "); `--keep_finished false` runs them again",
            flush=True,
        )
    pending, running = [r for r in runs if r not in kept], {}
    if not pending:
        return kept
    context = _run_context(env)  # its server imports while the world builds
    if any(uses_default_world(yaml.safe_load(r.config.read_text())) for r in pending):
        from rlkl_lightning.world import build_world

        build_world(num_threads=os.cpu_count())  # once, before the runs race for it
    with study_progress(len(pending), study.batches) as progress:
        try:
            while pending or running:
                while pending and len(running) < study.workers:
                    run = pending.pop(0)
                    running[run] = _start(context, run, env, study.threads)
                    progress.started(run.name)
                for run, proc in list(running.items()):
                    if proc.exitcode is None:
                        continue
                    del running[run]
                    if proc.exitcode != 0:
                        raise RuntimeError(_failure(run, proc.exitcode))
                    progress.finished(run.name, run.cpu_s())
                progress.update({r.name: r.batches_done() for r in running})
                time.sleep(0.5)
        finally:
            for proc in running.values():
                proc.terminate()
            for proc in running.values():
                proc.join()
    return kept


def _failure(run: Run, exitcode: int) -> str:
    """What a failed run's error says: the end of its log, or why there is none."""
    if not run.log_file.exists():  # the process ended before ``_train`` opened it
        return (
            f"compare: run {run.name}'s process ended (exit {exitcode}) before its run "
            "started, so it wrote no log; its error is printed above. Each run's process "
            "imports the script that started the study again: a script that calls "
            '`rlkl_lightning.compare.main` must call it under `if __name__ == "__main__":`.'
        )
    tail = run.log_file.read_text()[-4000:]
    return f"compare: run {run.name} failed (exit {exitcode}); end of {run.log_file}:\n{tail}"


def _run_context(env: dict[str, str]) -> multiprocessing.context.BaseContext:
    """``forkserver`` with the CLI imported once, where it exists; else ``spawn``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["rlkl_lightning.cli", "rlkl_lightning.compare.runs"])
    # The server reads the thread settings from its environment when OpenMP loads.
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return context


def _start(
    context: multiprocessing.context.BaseContext, run: Run, env: dict[str, str], threads: int
) -> multiprocessing.process.BaseProcess:
    shutil.rmtree(run.log_dir, ignore_errors=True)  # never mix event files of two studies
    for stale in (run.done_file, run.progress_file, run.cpu_file, run.log_file):  # earlier
        stale.unlink(missing_ok=True)
    proc = context.Process(
        target=_train,
        args=(run, {**os.environ, **env}, threads),
        name=f"rlkl-study-{run.name}",
        daemon=False,
    )
    proc.start()
    return proc


def _train(run: Run, env: dict[str, str], threads: int) -> None:
    """In a run's own process: ``train.py fit --config`` its config, printing to its log."""
    import torch

    from rlkl_lightning.cli import main

    os.environ.clear()  # the study's environment now, not the server's when it started
    os.environ.update(env)
    torch.set_num_threads(threads)
    with open(run.log_file, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.argv[1:] = []  # the study's own flags are not this run's
    try:
        main(["fit", "--config", str(run.config)])
        run.done_file.write_text(run_key(run))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        run.cpu_file.write_text(repr(_own_cpu_s()))


def _own_cpu_s() -> float:
    """CPU seconds (user + system) of this process so far; NaN without ``resource`` (Windows)."""
    try:
        import resource
    except ImportError:
        return math.nan
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
