"""Which strategies ``shard_models`` shards under, and the one it refuses by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from rlkl_lightning.models.sharding import is_fsdp, shard_models


def _module(strategy) -> torch.nn.Module:
    module = torch.nn.Module()
    module.policy = torch.nn.Linear(2, 2)
    module._trainer = None if strategy is None else SimpleNamespace(strategy=strategy)
    return module


def test_model_parallel_strategy_is_refused_by_name():
    # Unsharded under it, each rank trained its own replica: the weights drifted apart.
    strategy = ModelParallelStrategy.__new__(ModelParallelStrategy)
    with pytest.raises(ValueError, match=r"`trainer.strategy`: ModelParallelStrategy .*=ddp"):
        shard_models(_module(strategy), ("policy",))


@pytest.mark.parametrize("strategy", [None, DDPStrategy.__new__(DDPStrategy)], ids=["none", "ddp"])
def test_without_fsdp_nothing_is_sharded(strategy):
    module = _module(strategy)
    shard_models(module, ("policy",))
    assert type(module.policy) is torch.nn.Linear and not is_fsdp(module.policy)
