"""A LoRA policy under DDP (2 CPU processes, gloo) against one process on the global batches.

The set-up is ``tests/system/test_ddp_ppo.py``'s (per-sample seeded rollouts, a batch whose reward
is ``nan`` on rank 1 only, a batch of unequal response lengths), with ``peft`` set and no
``reference``: the reference is the policy with its adapters off. Only the adapters and the
value head train, so only they take part in DDP's gradient all-reduce.
"""

from __future__ import annotations

import sys

import pytest
import torch
import yaml
from helpers.ddp_runs import PER_RANK, PROMPTS, SEED, STEPS, TESTS, config, records, train_py

from rlkl_lightning.data.samplers import EpochShuffleSampler

pytestmark = pytest.mark.dist  # several processes: make test-dist

KL_SCORE = ("objective/kl", "objective/kl_per_token", "objective/score")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}


def lora_config(tmp_path, lm, prompts, name, poison, batch):
    path = config(tmp_path, (lm, lm), prompts, name, poison, batch)
    cfg = yaml.safe_load(path.read_text())
    args = cfg["model"]["init_args"]
    del args["reference"]
    args["models"] = {"peft": LORA}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_lora_policy_under_two_process_ddp_equals_one_process(tmp_path, tiny_lm_dir):
    from rlkl_lightning.cli import main

    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    global_batch = 2 * PER_RANK
    order = [PROMPTS[i] for i in EpochShuffleSampler(len(PROMPTS), SEED)]
    poison = order[global_batch + 1]  # second batch, dealt to rank 1 only

    ddp_cfg = lora_config(tmp_path, tiny_lm_dir, prompts_file, "ddp", poison, PER_RANK)
    train_py(ddp_cfg, tmp_path, "--trainer.strategy", "ddp", "--trainer.devices", "2")
    sys.path.insert(0, str(TESTS))
    try:
        single_cfg = lora_config(tmp_path, tiny_lm_dir, prompts_file, "single", poison, 4)
        main(["fit", "--config", str(single_cfg)])
    finally:
        sys.path.remove(str(TESTS))

    (rank0, rank1), (w0, w1) = records(tmp_path / "ddp", 2)
    (single,), (w_single,) = records(tmp_path / "single", 1)
    trainable = [k for k in w0["final"] if ".lora_" in k or k.startswith("value_head.")]
    assert any(".lora_B." in k for k in trainable)
    # Both ranks hold the same weights, bit for bit; the frozen base never moved.
    assert all(torch.equal(w0["final"][k], w1["final"][k]) for k in w0["final"])
    assert all(
        torch.equal(w0["final"][k], w_single["final"][k]) for k in w0["final"] if k not in trainable
    )
    assert [b["metrics"] for b in rank0["batches"]] == [b["metrics"] for b in rank1["batches"]]
    # Before the first update the adapters are a no-op: policy and reference (adapters off)
    # agree, so the KL of the first batch is 0 up to the rollout's float rounding.
    first = single["batches"][0]["metrics"]
    assert abs(first["objective/kl"]) < 1e-4
    assert rank0["skipped_batches"] == single["skipped_batches"] == 1  # the nan batch, on rank 1
    # The losses of the third batch are normalised per rank (test_ddp_ppo.py): compare
    # what comes before its update there.
    for step, keys in ((0, ("objective/kl", "objective/score", "loss/policy")), (2, KL_SCORE)):
        for key in keys:
            got, want = rank0["batches"][step]["metrics"][key], single["batches"][step]["metrics"]
            assert got == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step, key)
    before, want = w0["before_cut"], w_single["before_cut"]
    assert max(float((before[k] - want[k]).abs().max()) for k in trainable) < 1e-5
    moved = max(float(before[k].abs().max()) for k in trainable if ".lora_B." in k)
    assert moved > 1e-3  # lora_B starts at 0: the adapters did train

    ckpt = torch.load(tmp_path / "ddp" / "ckpt" / "last.ckpt", weights_only=False)
    assert sorted(ckpt["state_dict"]) == sorted(trainable)  # adapters and value head only
    assert STEPS == 3
