"""The study's command line: parse the settings, run every run, write the report."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlkl_lightning.compare.config import StudyConfig


def parse_args(argv: list[str] | None = None) -> tuple[StudyConfig, bool]:
    """Parse ``--config FILE`` and the :class:`StudyConfig` flags; returns (settings, quick)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="rlkl-compare",
        description="Run training configs side by side over seeds and report the curves.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML of the settings below")
    parser.add_class_arguments(StudyConfig, as_group=True)
    parser.add_argument("--quick", action="store_true", help="use the `quick_settings`")
    args = parser.parse_args(argv).as_dict()
    quick = bool(args.pop("quick"))
    args.pop("config", None)
    study = StudyConfig(**args)
    if not quick:
        return study, False
    # --quick replaces settings from the YAML, but a flag on the command line still wins.
    given = [a.partition("=")[0][2:] for a in (sys.argv[1:] if argv is None else argv)]
    flags = {name: args[name] for name in StudyConfig.__dataclass_fields__ if name in given}
    return replace(study.as_quick(), **flags), True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the study; returns the summary that is also written to ``summary.json``.

    The runs are ``multiprocessing`` processes: a script calls this under
    ``if __name__ == "__main__":``.
    """
    from rlkl_lightning.compare.report import write_report
    from rlkl_lightning.compare.runs import plan_runs, run_all

    study, quick = parse_args(argv)
    out = Path(study.out)
    start = time.perf_counter()
    runs = plan_runs(study, out)
    if study.report == "exact":
        from rlkl_lightning.compare.exact import write_exact_report
        from rlkl_lightning.world.exact import exact_model_dir

        exact_model_dir()  # once, before the runs race for it (a second)
        kept = run_all(runs, study)
        summary = write_exact_report(runs, study, out, elapsed=time.perf_counter() - start)
        files = "frontier.png, report.md, summary.json"
    elif study.report == "budget":
        from rlkl_lightning.compare.budget import write_budget_report

        kept = run_all(runs, study)
        summary = write_budget_report(runs, study, out, elapsed=time.perf_counter() - start)
        files = "frontier.png, curves.png, report.md, summary.json"
    else:
        kept = run_all(runs, study)
        summary = write_report(runs, study, out, elapsed=time.perf_counter() - start)
        files = "curves.png, report.md, summary.json"
    if kept or quick:  # said in the report and in the summary
        summary = _say_kept_and_quick(summary, kept, len(runs), study if quick else None, out)
    print(f"study written to {out}/: {files}")
    return summary


def _say_kept_and_quick(
    summary: dict[str, Any], kept: list, total: int, quick: StudyConfig | None, out: Path
) -> dict[str, Any]:
    """Name the runs an earlier study finished, and say that a ``--quick`` run is no result.

    The runs kept are named at the report's end and in ``runs_kept``; a quick study says so
    under the report's title and as ``quick``.
    """
    title, _, rest = (out / "report.md").read_text().partition("\n")
    if kept:
        names = [run.name for run in kept]
        summary = {**summary, "runs_kept": names}
        rest += (
            f"\n{len(kept)} of {total} runs were kept from an earlier study in this directory "
            f"(the same configs and versions): {', '.join(names)}. The time above is this "
            "study's alone.\n"
        )
    if quick is not None:
        summary = {**summary, "quick": True}
        note = (
            f"> A `--quick` study ({quick.seeds} seed(s) x {quick.batches} batches): a check "
            "that the pipeline runs end to end. Its numbers are too few to be a result."
        )
        rest = f"\n{note}\n{rest}"
    (out / "report.md").write_text(f"{title}\n{rest}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
