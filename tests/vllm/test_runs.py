"""``configs/ppo_vllm.yaml`` and ``configs/grpo_vllm.yaml`` train 10 batches through vLLM.

Each run goes through the command line's own entry point, on the default world, with beta
moving; afterwards the engine, given the trained weights, samples with the trainer's
log-probs (a per-token mean gap below 1e-3 nats in float32, as the issue asks; it is about
1e-6 here). Bad settings stop the run with one line naming the option.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PROMPTS
from helpers.cli_runs import cli_error

from rlkl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]
BATCHES = 10


@pytest.mark.parametrize("name", ["ppo_vllm.yaml", "grpo_vllm.yaml"])
def test_a_vllm_config_trains_ten_batches_with_beta_moving(name, world_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ["--trainer.max_steps", str(BATCHES * 16), "--trainer.val_check_interval", "5"]
    overrides += ["--trainer.limit_val_batches", "2"]
    if name.startswith("grpo"):
        overrides += ["--data.batch_size", "4"]  # 16 responses a batch: the test's time
    cli = main(["fit", "--config", str(ROOT / "configs" / name), *overrides])
    module = cli.model
    assert module.engine.kind == "vllm" and module.batches_seen == BATCHES
    assert module.kl_coef != module.penalty.init_coef  # beta moved
    metrics = cli.trainer.callback_metrics
    assert float(metrics["objective/kl"]) > 0  # the policy left its reference
    logged = float(metrics["mismatch/token_abs_mean"])  # the last batch's, as logged
    assert 0 < logged < 1e-3, logged
    traj, _ = module.rollout(PROMPTS)  # the engine gets the last update's weights first
    gap = (traj.logprobs - traj.sampler_logprobs).abs() * traj.response_mask
    mean_gap = float(gap.sum() / traj.response_mask.sum())  # nats
    print(f"{name}: per-token gap after {BATCHES} batches: {mean_gap:.1e}, top {gap.max():.1e}")
    assert mean_gap < 1e-3
    assert torch.isfinite(traj.logprobs).all()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.engine.sleep_mode=true"], r"engine.sleep_mode`=True .* needs CUDA"),
        (["--trainer.precision=64-true"], r"`engine.kind='vllm'` runs with precision"),
    ],
)
def test_bad_engine_settings_stop_the_run_by_name(args, message, tmp_path, monkeypatch, capfd):
    import re

    monkeypatch.chdir(tmp_path)
    config = ["fit", "--config", str(ROOT / "configs" / "grpo_vllm.yaml")]
    found = cli_error([*config, "--trainer.max_steps=16", *args], capfd)
    assert re.search(message, found), found
    assert "\n" not in found.strip()
