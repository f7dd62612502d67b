"""What the study runs: :class:`StudyConfig`, the settings of the study command."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class StudyConfig:
    """What the study runs.

    Args:
        runs: Run name (a controller, an algorithm) -> the ``train.py`` config of its run
            (paths relative to the working directory), or ``{config: PATH, overrides: {...}}``
            to merge settings into that config for this run only (after the study's
            ``overrides``); ``seeds: N`` in that form runs it on the first ``N`` seeds only.
            The report compares ``adaptive`` with ``fixed`` when both exist, and every other
            run with the first; the default pair is fair: the fixed beta is the
            adaptive controller's initial one.
        seeds: Seeds per controller: ``0 .. seeds-1``, the same for every controller (the seed
            of ``seed_everything`` and of the prompt order).
        batches: PPO batches per run (each run's ``trainer.max_steps`` is set to
            ``batches * ppo_epochs * num_minibatches``). The default is 4,800 samples per run
            at the default configs' 32 prompts per batch: the length that the adaptive
            config's ``horizon`` is scaled to.
        val_every: Training batches between held-out perplexity evaluations.
        sweep_kl_coefs: Extra fixed-beta runs (on the ``fixed`` config) for a score-vs-KL
            frontier; empty: none.
        sweep_seeds: Seeds of each sweep run (the first ones of ``seeds``).
        workers: Runs in parallel, each its own process (two runs of one thread each finish
            sooner than one run on two threads).
        threads: torch threads per run.
        out: Output directory (event files under ``runs/``, derived configs, logs, report): a
            new or empty directory, or an earlier study's.
        keep_finished: A run that finished in an earlier study in ``out`` with the same
            derived config (and the same versions of this package and torch) is kept, not run
            again: an interrupted study, run again, continues where it stopped. ``False``:
            every run again.
        overrides: Nested settings merged into every run's config, e.g.
            ``{"model": {"init_args": {"policy": "path/to/model"}}}``.
        world: A world directory made by ``python -m rlkl_lightning.world --texts FILES``:
            every run trains its model on that world's prompts and held-out text (its
            ``study.yaml``, merged after ``overrides``); ``None``: the runs' own settings.
        world_overrides: Settings merged into every run's config after the ``world``'s
            ``study.yaml`` (a value starting with ``./`` is a path in the world's directory),
            e.g. which of its splits a run validates on; ignored without ``world``.
        report: ``default`` (curves, KL tracking, the comparison of runs), ``exact`` (the
            exact world's distances to the optimum and to the frontier,
            :mod:`rlkl_lightning.compare.exact`) or ``budget`` (capability budgets beside
            fixed targets, :mod:`rlkl_lightning.compare.budget`).
        quick_settings: Settings used instead with ``--quick`` (a short check of the whole
            pipeline): any of ``runs`` (a shorter list), ``seeds``, ``batches``,
            ``val_every``, ``sweep_kl_coefs``, ``sweep_seeds``, ``workers``, and ``overrides``
            (merged after the ones above).
    """

    runs: dict[str, str | dict[str, Any]] = field(
        default_factory=lambda: {
            "fixed": "configs/ppo_fixed.yaml",
            "adaptive": "configs/ppo_adaptive.yaml",
        }
    )
    seeds: int = 3
    batches: int = 150
    val_every: int = 25
    sweep_kl_coefs: list[float] = field(default_factory=list)
    sweep_seeds: int = 1
    workers: int = 2
    threads: int = 1
    out: str = "study"
    keep_finished: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    world: str | None = None
    world_overrides: dict[str, Any] = field(default_factory=dict)
    report: str = "default"
    quick_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("seeds", "batches", "val_every", "sweep_seeds", "workers", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"compare: `{name}` must be an integer >= 1, got {value!r}")
        if not self.runs:
            raise ValueError("compare: `runs` must name at least one controller and its config")
        for name, entry in self.runs.items():
            run_entry(name, entry)  # raises on a malformed entry
        if self.report not in REPORTS:
            raise ValueError(f"compare: `report` must be one of {REPORTS}, got {self.report!r}")
        for beta in self.sweep_kl_coefs:
            if not beta > 0:
                raise ValueError(f"compare: `sweep_kl_coefs` must be > 0, got {beta!r}")
        if self.sweep_kl_coefs and "fixed" not in self.runs:
            raise ValueError("compare: `sweep_kl_coefs` needs a `fixed` entry in `runs`")
        unknown = set(self.quick_settings) - {
            "runs",
            "seeds",
            "batches",
            "val_every",
            "sweep_kl_coefs",
            "sweep_seeds",
            "workers",
            "overrides",
        }
        if unknown:
            raise ValueError(f"compare: unknown `quick_settings` {sorted(unknown)}")

    def as_quick(self) -> StudyConfig:
        """These settings with ``quick_settings`` applied (its ``overrides`` merged after ours)."""
        quick = self.quick_settings
        settings = {k: v for k, v in quick.items() if k != "overrides"}
        overrides = merge(self.overrides, quick.get("overrides", {}))
        return replace(self, **settings, overrides=overrides, quick_settings={})


REPORTS = ("default", "exact", "budget")


def run_entry(name: str, entry: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ``runs`` entry as ``(config path, overrides)``.

    Raises:
        ValueError: If the entry is neither a path nor ``{config: PATH, overrides: {...}}``.
    """
    if isinstance(entry, str):
        return entry, {}
    seeds = entry.get("seeds", 1) if isinstance(entry, dict) else 1
    if (
        isinstance(entry, dict)
        and isinstance(entry.get("config"), str)
        and set(entry) <= {"config", "overrides", "seeds"}
        and isinstance(entry.get("overrides", {}), dict)
        and isinstance(seeds, int)
        and not isinstance(seeds, bool)
        and seeds >= 1
    ):
        return entry["config"], entry.get("overrides", {})
    raise ValueError(
        f"compare: `runs.{name}` must be a config path or {{config: PATH, overrides: {{...}}, "
        f"seeds: N >= 1}}, got {entry!r}"
    )


def run_seeds(entry: str | dict[str, Any], seeds: int) -> int:
    """How many of the study's ``seeds`` a ``runs`` entry runs on (its ``seeds``, at most all)."""
    return min(entry.get("seeds", seeds), seeds) if isinstance(entry, dict) else seeds


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``over`` merged in (dicts merge; anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
