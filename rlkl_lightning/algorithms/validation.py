"""Held-out perplexity of the policy and of the reference: the pipeline's validation.

The reference's perplexity is computed once per run (it never changes); the policy's at every
validation. Both are ``exp`` of the mean next-token negative log-likelihood over the held-out
tokens (:mod:`rlkl_lightning.perplexity`, the same metric the default world's SFT reports),
logged as ``val/perplexity`` and ``val/perplexity_ref``.
"""

from __future__ import annotations

from torch import Tensor, nn

from rlkl_lightning.models.forward import lm_forward, no_grad
from rlkl_lightning.models.loading import encode
from rlkl_lightning.perplexity import NextTokenNLL


class HeldoutPerplexity(nn.Module):
    """Accumulates the held-out NLL of a policy (and once of its reference); a module part.

    Attributes:
        reference_perplexity: The reference's perplexity once computed (None before), kept in
            checkpoints so a resumed run does not compute it again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.policy_nll = NextTokenNLL()
        self.reference_nll = NextTokenNLL()
        self.reference_perplexity: float | None = None

    def update(self, policy: nn.Module, reference, ids: Tensor, mask: Tensor, sanity: bool) -> None:
        """Add a batch of held-out texts (``ids``, ``mask``: left padded) to the sums.

        The reference is scored until its perplexity is known, and not in Lightning's sanity
        check (whose batches are not the whole validation set).
        """
        keep = ids.shape[1]
        self.policy_nll.update(lm_forward(policy, ids, mask, keep).logits, ids, mask)
        if self.reference_perplexity is None and not sanity:
            with no_grad(reference):
                ref_logits = lm_forward(reference, ids, mask, keep).logits
            self.reference_nll.update(ref_logits.clone(), ids, mask)

    def compute(self, sanity: bool) -> tuple[Tensor, float] | None:
        """The policy's and the reference's perplexity, and a reset; None in the sanity check."""
        policy_ppl = self.policy_nll.compute().exp()
        self.policy_nll.reset()
        if sanity:
            return None
        if self.reference_perplexity is None:
            self.reference_perplexity = float(self.reference_nll.compute().exp())
            self.reference_nll.reset()
        return policy_ppl, self.reference_perplexity


def encode_texts(tokenizer, texts: list[str], max_length: int) -> tuple[Tensor, Tensor]:
    """BOS + text + EOS per row, cut on the right to ``max_length`` tokens, left padded."""
    wrapped = [f"{tokenizer.bos_token or ''}{t}{tokenizer.eos_token or ''}" for t in texts]
    return encode(tokenizer, wrapped, "right", max_length, add_special_tokens=False)
