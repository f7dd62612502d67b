"""KL control for your own LightningModule: log a KL, expose `kl_coef`, add the callbacks."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from rlkl_lightning import AdaptiveKLController, KLControllerCallback, KLDriftMonitor


class Bandit(pl.LightningModule):
    """A softmax policy over 4 actions: maximize reward - kl_coef * KL(policy || reference)."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(4))
        self.register_buffer("ref_logprobs", torch.full((4,), 0.25).log())
        self.register_buffer("rewards", torch.tensor([0.0, 0.0, 0.0, 1.0]))
        self.kl_coef = 0.0  # beta: KLControllerCallback sets it at fit start and after each batch
        self.betas = []

    def training_step(self, batch, batch_idx):
        """Log the KL to the reference; the loss uses the current beta."""
        logprobs = self.logits.log_softmax(-1)
        probs = logprobs.exp()
        kl = (probs * (logprobs - self.ref_logprobs)).sum()  # nats per (one-token) sequence
        self.log("objective/kl", kl)  # the callbacks read trainer.callback_metrics
        self.betas.append(self.kl_coef)
        return -((probs * self.rewards).sum() - self.kl_coef * kl)

    def configure_optimizers(self):
        """Plain SGD on the logits."""
        return torch.optim.SGD(self.parameters(), lr=1.0)


prompts = DataLoader(TensorDataset(torch.zeros(256, 1)), batch_size=16)  # 16 samples per batch
controller = AdaptiveKLController(init_kl_coef=0.2, target=0.5, horizon=160)  # horizon in samples
callbacks = [
    KLControllerCallback(controller),  # monitor="objective/kl", attribute="kl_coef"
    KLDriftMonitor(target=0.5, window=8),  # warns once per excursion outside [0.25, 1]
]
model = Bandit()
trainer = pl.Trainer(
    max_epochs=6, accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=callbacks
)
trainer.fit(model, prompts)
print("beta every 12 batches:", " ".join(f"{b:.3f}" for b in model.betas[::12]))
print(f"final beta {model.kl_coef:.3f}, KL {float(trainer.callback_metrics['objective/kl']):.3f}")
