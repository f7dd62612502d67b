"""The weights a vLLM push reads under FSDP: gathered unit by unit, named as the unsharded model.

Two gloo processes shard a tiny GPT-2 as ``rlkl_lightning/models/sharding.py`` does (every
decoder layer an FSDP unit of its own, ``use_orig_params`` as Lightning sets it), full or with
LoRA adapters, and read ``engine_weights`` of the sharded model: on both ranks the names,
order and values equal those of the same model unsharded (LoRA merged out of place), at most
one decoder layer is gathered at any time, and a forward after the gather gives what it gave
before (the shards are back, unchanged).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlkl_lightning.algorithms.engines.vllm import engine_weights

pytestmark = pytest.mark.dist  # two processes

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}


def _model(lora: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=3, n_head=2)
    config.bos_token_id = config.eos_token_id = 1
    model = GPT2LMHeadModel(config).eval()  # no dropout: two forwards compare
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
        with torch.no_grad():  # adapters that change the weights (B starts at zero)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
    return model


def _gather_worker(rank: int, init_file: str, out_dir: str, lora: bool) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from rlkl_lightning.models.sharding import layer_wrap_policy

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = _model(lora)
        unit = FullyShardedDataParallel(
            model,
            auto_wrap_policy=layer_wrap_policy(model),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        blocks = [m for m in unit.modules() if type(m).__name__ == "GPT2Block"]
        ids = torch.arange(8).reshape(2, 4)
        with torch.no_grad():
            before = unit(input_ids=ids).logits
        gathered, most = [], 0
        for name, tensor in engine_weights(unit):
            gathered.append((name, tensor.clone()))
            most = max(most, sum(b.mlp.c_fc.weight.dim() == 2 for b in blocks))  # full: 2-D
        with torch.no_grad():
            after = unit(input_ids=ids).logits
        sharded = unit.transformer.h[0].mlp.c_fc.weight if not lora else None
        torch.save(
            {
                "gathered": gathered,
                "most_layers_gathered": most,
                "blocks": len(blocks),
                "forward_equal": torch.equal(before, after),
                "sharded_after": None if sharded is None else tuple(sharded.shape),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_engine_weights_of_a_sharded_model_are_the_unsharded_ones(tmp_path, lora):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _gather_worker,
        args=(str(tmp_path / "init"), str(tmp_path), lora),
        nprocs=2,
        join=True,
        start_method=method,
    )
    want = [(name, tensor.clone()) for name, tensor in engine_weights(_model(lora))]
    assert len(want) > 10
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert [n for n, _ in got["gathered"]] == [n for n, _ in want], rank
        for (name, value), (_, expected) in zip(got["gathered"], want, strict=True):
            assert torch.equal(value, expected), (rank, name)
        assert got["blocks"] == 3 and got["most_layers_gathered"] == 1
        assert got["forward_equal"]
        if not lora:
            assert len(got["sharded_after"]) == 1  # a 1-D shard again, not the full matrix
