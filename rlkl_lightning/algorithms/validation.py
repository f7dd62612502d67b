"""Held-out perplexity of the policy and of the reference, as a LightningModule's validation.

The reference's perplexity is computed once per run (it never changes); the policy's at every
validation. Both are ``exp`` of the mean next-token negative log-likelihood over the held-out
tokens (:mod:`rlkl_lightning.perplexity`, the same metric the default world's SFT reports),
logged as ``val/perplexity`` and ``val/perplexity_ref``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from rlkl_lightning.algorithms.checks import context_of
from rlkl_lightning.models.forward import lm_forward, no_grad
from rlkl_lightning.perplexity import NextTokenNLL


class HeldoutPerplexity(LightningModule):
    """Validation of a module with ``policy``, ``reference``, ``tokenizer``, ``samples_seen``.

    The metrics ``val_nll`` and ``ref_nll`` and the attribute
    ``reference_perplexity`` are created here; validation batches are ``{"text": list[str]}``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.val_nll = NextTokenNLL()
        self.ref_nll = NextTokenNLL()
        self.reference_perplexity: float | None = None

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Accumulate held-out perplexity of the policy (and of the reference, once)."""
        ids, mask = self._encode_texts(list(batch["text"]))
        keep = ids.shape[1]
        self.val_nll.update(lm_forward(self.policy, ids, mask, keep).logits, ids, mask)
        if self.reference_perplexity is None and not self.trainer.sanity_checking:
            with no_grad(self.reference):
                ref_logits = lm_forward(self.reference, ids, mask, keep).logits
            self.ref_nll.update(ref_logits.clone(), ids, mask)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/perplexity`` and ``val/perplexity_ref`` (the reference's is computed once)."""
        policy_ppl = self.val_nll.compute().exp()
        self.val_nll.reset()
        if self.trainer.sanity_checking:
            return
        if self.reference_perplexity is None:
            self.reference_perplexity = float(self.ref_nll.compute().exp())
            self.ref_nll.reset()
        self.log("val/perplexity", policy_ppl, on_epoch=True)
        self.log("val/perplexity_ref", torch.tensor(self.reference_perplexity), on_epoch=True)
        self.log("progress/samples_at_val", torch.tensor(float(self.samples_seen)), on_epoch=True)

    def _encode_texts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """BOS + text + EOS per row, right-truncated to the policy's context, left padded."""
        tok = self.tokenizer
        wrapped = [f"{tok.bos_token or ''}{t}{tok.eos_token or ''}" for t in texts]
        tok.truncation_side = "right"
        enc = tok(
            wrapped,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=context_of(self.policy) or 1024,
            add_special_tokens=False,
        )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
