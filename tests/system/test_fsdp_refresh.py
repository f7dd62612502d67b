"""A reference refresh under FSDP: every rank's reference is the mix of the gathered weights.

Through ``train.py``: PPO under ``FSDPStrategy`` on 2 CPU processes (gloo) with
``ReferenceRefresh(every=1, mode="mix")`` equals one process on the same global batches (the KL
of every batch after the first is measured against a refreshed reference), and its checkpoint
holds the refreshed reference weights under the names one process saves.

Two gloo processes shard a tiny GPT-2 policy and its frozen-copy reference (another random
GPT-2 of the same shape) as ``rlkl_lightning/models/sharding.py`` does, or a LoRA policy whose
reference is its adapters off, and refresh the reference (``mix_into_reference``) hard and as
a mix: on both ranks the gathered reference afterwards equals the same refresh of the
unsharded models (to float rounding: the LoRA update ``s B A`` is computed with other blocks),
the policy is unchanged, and the changed keys are the unsharded model's names.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from helpers.ddp_runs import PROMPTS, STEPS, TESTS, config, records, train_py

from rlkl_lightning.algorithms.reference_refresh import mix_into_reference
from rlkl_lightning.models.lora import AdaptersOff

pytestmark = pytest.mark.dist  # two processes

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}


def _models(lora: bool) -> tuple[torch.nn.Module, object]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=3, n_head=2)
    config.bos_token_id = config.eos_token_id = 1
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(config)
    if not lora:
        torch.manual_seed(1)
        return policy, GPT2LMHeadModel(config).requires_grad_(False)
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(policy, LoraConfig(**LORA))
    with torch.no_grad():  # adapters that change the weights (B starts at zero)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return policy, AdaptersOff(policy)


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference_weights(policy, reference) -> dict[str, torch.Tensor]:
    """The reference's weights, unsharded names: the frozen copy's, or the policy's base."""
    if isinstance(reference, AdaptersOff):
        return {k: v for k, v in _full(policy).items() if "lora_" not in k}
    return _full(reference)


def _refresh_worker(rank: int, init_file: str, out_dir: str, lora: bool, alpha: float) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.api import FullStateDictConfig

    from rlkl_lightning.models.sharding import layer_wrap_policy

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        policy, reference = _models(lora)
        units = []
        for model in (policy, reference):
            if isinstance(model, torch.nn.Module):
                units.append(
                    FullyShardedDataParallel(
                        model,
                        auto_wrap_policy=layer_wrap_policy(model),
                        device_id=torch.device("cpu"),
                        use_orig_params=True,
                    )
                )
        policy = units[0]
        if lora:
            reference.model = policy  # as the pipeline's configure_model does
        else:
            reference = units[1]
        changed = mix_into_reference(policy, reference, alpha)
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FullyShardedDataParallel.state_dict_type(
            policy, StateDictType.FULL_STATE_DICT, config
        ):
            policy_after = _full(policy)
        if lora:
            reference_after = {k: v for k, v in policy_after.items() if "lora_" not in k}
        else:
            with FullyShardedDataParallel.state_dict_type(
                reference, StateDictType.FULL_STATE_DICT, config
            ):
                reference_after = _full(reference)
        local = next(p for n, p in policy.named_parameters() if n.endswith("c_fc.weight"))
        torch.save(
            {
                "changed": changed,
                "policy": policy_after,
                "reference": reference_after,
                "local_dims": local.dim(),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("alpha", [1.0, 0.25], ids=["hard", "mix"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_refresh_of_a_sharded_reference_equals_the_unsharded_refresh(tmp_path, lora, alpha):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _refresh_worker,
        args=(str(tmp_path / "init"), str(tmp_path), lora, alpha),
        nprocs=2,
        join=True,
        start_method=method,
    )
    policy, reference = _models(lora)
    before = _reference_weights(policy, reference)
    changed = mix_into_reference(policy, reference, alpha)
    want_policy, want_reference = _full(policy), _reference_weights(policy, reference)
    tolerance = 1e-6 if lora else 0.0  # s B A in blocks of another size: float rounding
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["local_dims"] == 1  # the weights were sharded again after the refresh
        assert got["changed"] == changed, rank
        assert got["reference"].keys() == want_reference.keys()
        for key, value in want_reference.items():
            torch.testing.assert_close(got["reference"][key], value, rtol=0, atol=tolerance)
        for key, value in want_policy.items():
            torch.testing.assert_close(got["policy"][key], value, rtol=0, atol=tolerance)
    moved = max(float((want_reference[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-2  # the refresh changed the reference: the comparison is not vacuous
    if alpha == 1.0 and not lora:
        assert all(torch.equal(want_reference[k], want_policy[k]) for k in want_policy)


REFRESH = {
    "class_path": "rlkl_lightning.ReferenceRefresh",
    "init_args": {"every": 1, "mode": "mix", "alpha": 0.5},
}


def _refresh_config(tmp_path, lms, prompts, name, devices):
    path = config(tmp_path, lms, prompts, name, "", 4 // devices)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["devices"] = devices
    cfg["trainer"]["callbacks"].append(REFRESH)
    cfg["model"]["init_args"]["cut_batch"] = -1  # equal lengths: the last update is compared
    if devices > 1:
        cfg["trainer"]["strategy"] = {"class_path": "helpers.cpu_fsdp.CPUFSDPStrategy"}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_ppo_refreshing_its_reference_under_fsdp_equals_one_process(tmp_path, tiny_lm_dir):
    import sys

    from helpers.tiny_models import make_tiny_lm

    from rlkl_lightning.cli import main

    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    train_py(_refresh_config(tmp_path, lms, prompts, "fsdp", 2), tmp_path)
    sys.path.insert(0, str(TESTS))
    try:
        main(["fit", "--config", str(_refresh_config(tmp_path, lms, prompts, "single", 1))])
    finally:
        sys.path.remove(str(TESTS))

    ranks, _ = records(tmp_path / "fsdp", 2)
    (one,), _ = records(tmp_path / "single", 1)
    kls = [b["metrics"]["objective/kl"] for b in one["batches"]]
    assert len(kls) == STEPS and min(abs(k) for k in kls[1:]) > 1e-4  # a reference that moved
    for rank in ranks:
        assert rank["world_size"] == 2
        for step in range(STEPS):
            got, want = rank["batches"][step]["metrics"], one["batches"][step]["metrics"]
            for key in ("objective/kl", "objective/score", "reference/refreshes"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step, key)
    assert ranks[0]["batches"][-1]["metrics"]["reference/refreshes"] == STEPS - 1

    sharded = torch.load(tmp_path / "fsdp" / "ckpt" / "last.ckpt", weights_only=False)
    plain = torch.load(tmp_path / "single" / "ckpt" / "last.ckpt", weights_only=False)
    assert sharded["rlkl_reference"].keys() == plain["rlkl_reference"].keys()
    assert len(plain["rlkl_reference"]) > 10
    for key, value in plain["rlkl_reference"].items():
        torch.testing.assert_close(
            sharded["rlkl_reference"][key], value, rtol=0, atol=1e-5, msg=key
        )
