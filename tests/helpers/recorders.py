"""PPOModule and RLOOModule that record the beta, the prompts and the metrics of every batch.

``K`` is the number of responses per prompt the RLOO tests use.
"""

from __future__ import annotations

from rlkl_lightning import PPOModule, RLOOModule

K = 4


class Recorder:
    """Mixin: record the beta, the prompts and the logged metrics of every batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.betas_used, self.prompts_seen, self.history = [], [], []

    def training_step(self, batch, batch_idx):
        self.betas_used.append(self.kl_coef)
        self.prompts_seen.append(list(batch["prompt"]))
        super().training_step(batch, batch_idx)
        self.history.append({k: float(v) for k, v in self.trainer.callback_metrics.items()})


class RecordingRLOO(Recorder, RLOOModule):
    pass


class RecordingPPO(Recorder, PPOModule):
    pass
