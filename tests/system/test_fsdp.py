"""PPOModule under Lightning's FSDPStrategy: 2 processes against 1 on the global batches.

Lightning allows FSDP only with CUDA, and torch's FSDP needs to be told a CPU device; the
module shards its own models (``rlkl_lightning/models/sharding.py``: policy, reference and value
head each an FSDP unit, every GPT-2 block a unit of its own) and passes the device, and
``tests/helpers/cpu_fsdp.py`` lets Lightning's strategy run in CPU processes (gloo). The same test
runs with ``strategy: fsdp`` on CUDA devices where there are any (skipped here): 2 processes, or 1
against a plain single-device run on a machine with one GPU.

The set-up is ``tests/system/test_ddp_ppo.py``'s: per-sample seeded rollouts, so both runs sample
the same responses; a batch whose reward is ``nan`` on rank 1 only; a batch of unequal
response lengths. Each rank holds half of every weight, gathered for each forward and
backward; FSDP averages the gradients like DDP, so the 2-process run equals the 1-process run
up to float32 rounding (tolerances as in the DDP test: 1e-5 relative plus 1e-6 absolute on
metrics, 1e-5 absolute on the weights; measured 1.2e-6 on the weights). The gradient norm that
is clipped and logged is that of all shards together: a rank's own shard gives about 1/sqrt(2)
of it, and each rank would clip differently.
"""

from __future__ import annotations

import sys

import pytest
import torch
import yaml
from helpers.ddp_runs import PROMPTS, SEED, STEPS, TESTS, config, records, train_py

from rlkl_lightning.data.samplers import EpochShuffleSampler
from rlkl_lightning.models.loading import load_causal_lm

pytestmark = pytest.mark.dist  # several processes: make test-dist

GLOBAL_BATCH = 4
COMPARED = ("objective/kl", "objective/kl_per_token", "objective/score", "objective/entropy")


def fsdp_config(tmp_path, lms, prompts, name, poison, devices, accelerator, strategy, peft):
    path = config(tmp_path, lms, prompts, name, poison, GLOBAL_BATCH // devices)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"].update(accelerator=accelerator, devices=devices)
    if peft is not None:  # the reference is the policy with its adapters off
        cfg["model"]["init_args"]["models"] = {"peft": peft}
        del cfg["model"]["init_args"]["reference"]
    if strategy is not None:
        cfg["trainer"]["strategy"] = strategy
    path.write_text(yaml.safe_dump(cfg))
    return path


def cuda_devices() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0


CPU_FSDP = {"class_path": "helpers.cpu_fsdp.CPUFSDPStrategy"}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}
# Left out of `make test-dist` (marker `gpu`); benchmarks/gpu_table.sh runs them on a GPU.
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not cuda_devices(), reason="needs a CUDA device")]


@pytest.mark.parametrize(
    "accelerator, devices, strategy, peft",
    [
        ("cpu", 2, CPU_FSDP, None),
        ("cpu", 2, CPU_FSDP, LORA),
        # One process: torch's FSDP shards nothing (NO_SHARD). Both failures first seen on one
        # H100 (another batch order than the plain run; a LoRA policy's embeddings dropping
        # out of the state dict after a backward pass) happened here too; see models/sharding.py.
        ("cpu", 1, CPU_FSDP, LORA),
        pytest.param("gpu", max(cuda_devices(), 1), "fsdp", None, marks=ON_CUDA),
        pytest.param("gpu", max(cuda_devices(), 1), "fsdp", LORA, marks=ON_CUDA),
    ],
    ids=["cpu-gloo", "cpu-gloo-lora", "cpu-gloo-1-process-lora", "cuda", "cuda-lora"],
)
def test_fsdp_run_equals_one_process_on_the_global_batches(
    tmp_path, tiny_lm_dir, accelerator, devices, strategy, peft
):
    from helpers.tiny_models import make_tiny_lm

    from rlkl_lightning.cli import main

    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    order = [PROMPTS[i] for i in EpochShuffleSampler(len(PROMPTS), SEED)]
    poison = order[GLOBAL_BATCH + 1]  # second batch; dealt to rank 1 of 2

    cfg = fsdp_config(
        tmp_path, lms, prompts_file, "fsdp", poison, devices, accelerator, strategy, peft
    )
    train_py(cfg, tmp_path)
    sys.path.insert(0, str(TESTS))
    try:
        single = fsdp_config(
            tmp_path, lms, prompts_file, "single", poison, 1, accelerator, None, peft
        )
        main(["fit", "--config", str(single)])
    finally:
        sys.path.remove(str(TESTS))

    ranks, weights = records(tmp_path / "fsdp", devices)
    (one,), (w_one,) = records(tmp_path / "single", 1)
    assert ranks[0]["world_size"] == devices
    for other in ranks[1:]:
        assert [b["metrics"] for b in other["batches"]] == [
            b["metrics"] for b in ranks[0]["batches"]
        ]
    assert ranks[0]["skipped_batches"] == one["skipped_batches"] == 1
    assert ranks[0]["kl_coef"] == pytest.approx(one["kl_coef"], rel=1e-5, abs=1e-6)
    for step in range(STEPS):
        got, want = ranks[0]["batches"][step]["metrics"], one["batches"][step]["metrics"]
        # The gradient norm is that of all shards together (not of this rank's shard).
        keys = COMPARED + (("loss/policy", "loss/value", "policy/grad_norm") if step == 0 else ())
        for key in keys if step != 1 else ("progress/skipped_batches",):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step, key)
    # The full weights every rank gathered before the third batch's update, against 1 process.
    before, want = weights[0]["before_cut"], w_one["before_cut"]
    assert before.keys() == want.keys()
    diffs = {k: float((before[k] - want[k]).abs().max()) for k in want}
    assert max(diffs.values()) < 1e-5
    initial = {f"policy.{k}": v for k, v in load_causal_lm(str(tiny_lm_dir)).state_dict().items()}
    if peft is not None:
        initial = {k: torch.zeros_like(v) for k, v in before.items() if ".lora_B." in k}
    moved = max(float((before[k] - v.to(before[k])).abs().max()) for k, v in initial.items())
    assert moved > 1e-3  # the weights did change: the comparison above is not vacuous

    # The checkpoint holds the gathered (full) weights, under the same names as 1 process's;
    # the frozen ones too (FSDPStrategy loads a checkpoint's weights strictly, before the
    # module could put them back), which one process leaves out.
    sharded = torch.load(tmp_path / "fsdp" / "ckpt" / "last.ckpt", weights_only=False)
    plain = torch.load(tmp_path / "single" / "ckpt" / "last.ckpt", weights_only=False)
    assert plain["state_dict"].keys() < sharded["state_dict"].keys()
    if peft is None:  # a frozen copy (with LoRA the frozen ones are the policy's base weights)
        assert any(key.startswith("reference.") for key in sharded["state_dict"])
    assert not any(key.startswith("reference.") for key in plain["state_dict"])
    for key, value in plain["state_dict"].items():
        assert sharded["state_dict"][key].shape == value.shape, key
