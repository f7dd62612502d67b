"""An RLOOModule that records, per rank, the prompts, returns and advantages of each batch.

Used by ``tests/system/test_ddp_rloo.py`` in the processes a DDP run starts (they import this file
by its ``class_path``; the test puts ``tests/`` on ``PYTHONPATH``). Not collected by pytest.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlkl_lightning import RLOOModule
from rlkl_lightning.kl.callback_base import KLCallbackBase
from rlkl_lightning.kl.estimators import sequence_kl
from rlkl_lightning.rewards import FunctionReward
from rlkl_lightning.trajectory import Trajectory


def good_fraction(prompt: str, response: str) -> float:
    """The fraction of response words that are 'good'."""
    words = response.split()
    return sum(w == "good" for w in words) / max(len(words), 1)


class RecordingRLOO(RLOOModule):
    """RLOOModule that writes ``rank<r>.json`` into ``record_dir`` at the end of training."""

    def __init__(self, record_dir: str, **kwargs) -> None:
        super().__init__(reward=FunctionReward(good_fraction), **kwargs)
        self.record_dir = record_dir
        self.batches: list[dict] = []

    def training_step(self, batch, batch_idx):
        """Record the prompts as training_step receives them."""
        self.batches.append({"prompts": list(batch["prompt"]), "beta_used": self.kl_coef})
        return super().training_step(batch, batch_idx)

    def shape(self, traj: Trajectory) -> Trajectory:
        """RLOOModule's shaping; records its returns and advantages."""
        shaped = super().shape(traj)
        kl = sequence_kl(traj.kl, traj.response_mask)
        self.batches[-1]["returns"] = (traj.scores - self.reward_kl_coef * kl).tolist()
        self.batches[-1]["advantages"] = shaped.advantages[:, 0].tolist()
        return shaped

    def on_train_end(self):
        """Write this rank's record."""
        callbacks = [c for c in self.trainer.callbacks if isinstance(c, KLCallbackBase)]
        record = {
            "world_size": self.trainer.world_size,
            "batches": self.batches,
            "kl_coef": self.kl_coef,
            "callback_samples": [c.n_samples for c in callbacks],
            "samples_seen": self.samples_seen,
        }
        out = Path(self.record_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{self.global_rank}.json").write_text(json.dumps(record))
