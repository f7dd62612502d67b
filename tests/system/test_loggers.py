"""The loggers users pick: every KL metric and beta reach MLflow (file store) and CSV alike.

One CLI run logs to a ``CSVLogger`` and an ``MLFlowLogger`` at once; the KL keys, beta and the
drift monitor's keys of every batch must be the same numbers in both, and beta must be the value
the controller callback set. A logger whose package is missing stops the run with one line
naming the extra to install.
"""

from __future__ import annotations

import csv
import math
import sys

import pytest
from helpers.cli_runs import cli_error, tiny_cli_config

from rlkl_lightning import KLControllerCallback
from rlkl_lightning import metric_keys as keys
from rlkl_lightning.cli import main

KL_KEYS = [
    keys.KL,
    keys.KL_PER_TOKEN,
    keys.KL_COEF,
    *(keys.kl_of(e) for e in ("k1", "k2", "k3")),
    keys.MONITOR_AVG_KL,
    keys.MONITOR_TARGET,
    keys.MONITOR_STATE,
    keys.MONITOR_WARNINGS,
]
BATCHES = 3


def csv_series(path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value != "":
                    series.setdefault(key, {})[int(row["step"])] = float(value)
    return series


def test_kl_metrics_and_beta_reach_mlflow_and_csv(tiny_lm_dir, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient  # the `mlflow` extra; `make setup` installs it

    # MLflow 3 refuses its file store unless asked (it prefers a database or a server).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    loggers = [
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(tmp_path / "csv")},
        },
        {
            "class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {"experiment_name": "rlkl", "tracking_uri": uri},
        },
    ]
    config = tiny_cli_config(
        tiny_lm_dir,
        tmp_path,
        trainer={"logger": loggers, "max_steps": BATCHES, "default_root_dir": str(tmp_path)},
        kl={"window": 1, "min_batches": 1},  # the monitor judges (logs its state) from batch 1
    )
    run = main(["fit", "--config", str(config)])
    csv_logger, mlflow_logger = run.trainer.loggers
    from_csv = csv_series(f"{csv_logger.log_dir}/metrics.csv")
    client = MlflowClient(uri)
    for key in KL_KEYS:
        history = client.get_metric_history(mlflow_logger.run_id, key)
        from_mlflow = {m.step: m.value for m in history}
        assert len(from_mlflow) == BATCHES, key  # one value per batch
        assert from_mlflow.keys() == from_csv[key].keys(), key
        for step, value in from_mlflow.items():
            # CSV writes floats with repr: both carry the float32 the module logged.
            logged = from_csv[key][step]
            assert value == logged or (math.isnan(value) and math.isnan(logged)), key
    controller = next(c for c in run.trainer.callbacks if isinstance(c, KLControllerCallback))
    last = max(from_csv[keys.KL_COEF])
    assert from_csv[keys.KL_COEF][last] == pytest.approx(controller.value, rel=1e-6)
    assert len(set(from_csv[keys.KL_COEF].values())) > 1  # beta moved: the adaptive law ran


@pytest.mark.parametrize(
    ("logger", "message"),
    [
        (
            "lightning.pytorch.loggers.MLFlowLogger",
            "`trainer.logger`: MLFlowLogger needs the `mlflow` package, which is not installed: "
            "pip install 'rlkl_lightning[mlflow]'",
        ),
        (
            "lightning.pytorch.loggers.WandbLogger",
            "`trainer.logger`: WandbLogger needs the `wandb` package, which is not installed: "
            "pip install 'rlkl_lightning[wandb]'",
        ),
    ],
)
def test_a_logger_without_its_package_names_the_extra(
    logger, message, tiny_lm_dir, tmp_path, capfd, monkeypatch
):
    module = message.split("`")[3]
    monkeypatch.setitem(sys.modules, module, None)  # `import mlflow` raises ImportError
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    assert cli_error(["fit", "--config", str(config), f"--trainer.logger={logger}"], capfd) == (
        message
    )


def test_a_logger_that_refuses_its_arguments_says_why_in_one_line(tiny_lm_dir, tmp_path, capfd):
    """MLflow's refusal of a tracking URI ended 104 lines of traceback; now it is the message."""
    pytest.importorskip("mlflow")
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    message = cli_error(
        ["fit", "--config", str(config), "--trainer.logger=lightning.pytorch.loggers.MLFlowLogger"]
        + ["--trainer.logger.init_args.tracking_uri=bogus://nowhere"],
        capfd,
    )
    assert message.startswith("`trainer.logger` (MLFlowLogger): "), message
    assert "'bogus://nowhere'" in message and "\n" not in message
