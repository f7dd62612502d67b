"""Lightning's FSDPStrategy in CPU processes (gloo), for tests.

Two things in Lightning keep FSDP off the CPU, neither part of the sharding: its accelerator
check refuses ``strategy="fsdp"`` without CUDA (it compares the strategy's exact type, so a
subclass passes), and full checkpoints are gathered with ``offload_to_cpu=True``, with which
torch's FSDP frees the gathered storage that the state dict's views still point to when the
weights already live on the CPU (a segmentation fault); here they are gathered without the
offload. The modules shard their models themselves (``rlkl_lightning/models/sharding.py``) and give
FSDP the CPU device. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
from unittest import mock

from lightning.pytorch.strategies import FSDPStrategy


@contextlib.contextmanager
def _gather_without_offload():
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    def context(module, world_size, rank0_only=True):
        return FSDP.state_dict_type(
            module=module,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            optim_state_dict_config=FullOptimStateDictConfig(
                offload_to_cpu=False, rank0_only=rank0_only
            ),
        )

    with mock.patch("lightning.pytorch.strategies.fsdp._get_full_state_dict_context", context):
        yield


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` on the CPU (gloo); full checkpoints gathered without CPU offload."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(**kwargs)

    def lightning_module_state_dict(self):
        with _gather_without_offload():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer):
        with _gather_without_offload():
            return super().optimizer_state(optimizer)
