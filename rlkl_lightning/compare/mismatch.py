"""What each mismatch correction does to the expected policy gradient, by enumeration.

On the exact world (:mod:`rlkl_lightning.world.exact`) every response can be listed, so the
expected gradient of the surrogate at the behaviour point is a sum, not an estimate. The trainer
is the world's GPT-2 ``pi``; the sampler ``mu`` is ``pi`` deliberately perturbed (another
temperature, or seeded noise on its logits). With ``A`` the advantage the pipeline's group
baseline gives in expectation (``R(y) - E_mu[R]``: the other samples of a group come from
``mu`` too), each correction's expected gradient in ``pi``'s parameters is::

    g = sum_y mu(y) A(y) sum_t w_t(y) grad log pi(y_t | s_t)

with ``w = 1`` (no correction), ``token_tis`` or ``sequence_mis``'s weights
(:mod:`rlkl_lightning.algorithms.mismatch`), against the on-policy gradient
``g_true = sum_y pi(y) (R(y) - E_pi[R]) grad log pi(y)``. The table gives the relative bias
``|g - g_true| / |g_true|``, the cosine of ``g`` and ``g_true``, and the relative standard
deviation of a batch of 64 responses' estimate (``sqrt(tr Cov / 64) / |g_true|``).

    python -m rlkl_lightning.compare.mismatch          # the table of docs/mismatch.md
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlkl_lightning.algorithms.mismatch import sequence_mis_weights, token_tis_weights
from rlkl_lightning.world.exact import ExactWorld, prefix_rows

#: The sampler's perturbations of the table: (name, temperature, logit noise std).
PERTURBATIONS = (
    ("temperature 0.8", 0.8, 0.0),
    ("temperature 1.2", 1.2, 0.0),
    ("logit noise 0.05", 1.0, 0.05),
    ("logit noise 0.3", 1.0, 0.3),
)
#: The corrections of the table: (correction, threshold C).
CORRECTIONS = (
    ("none", math.inf),
    ("token_tis", 2.0),
    ("token_tis", 5.0),
    ("token_tis", math.inf),
    ("sequence_mis", 2.0),
    ("sequence_mis", 5.0),
    ("sequence_mis", math.inf),
)
#: Responses per batch of the standard-deviation column.
BATCH = 64


def token_logprobs(
    model: nn.Module,
    world: ExactWorld,
    temperature: float = 1.0,
    noise: Tensor | None = None,
) -> Tensor:
    """``[N, L]`` log-probs of every response's tokens, in the model's dtype, with its graph.

    Args:
        model: A causal LM over the world's vocabulary.
        world: The exact world (its responses and prompt).
        temperature: The temperature the logits are divided by.
        noise: ``[prefixes, V]`` added to the logits after each prefix (:func:`prefix_rows`).
    """
    ys = world.responses
    n, length = ys.shape
    ids = torch.cat([world.prompt_ids.expand(n, 1), ys], dim=1)
    logits = model(input_ids=ids).logits[:, :length] / temperature
    if noise is not None:
        logits = logits + noise[prefix_rows(ys, world.config.vocab_size)]
    return torch.log_softmax(logits, dim=-1).gather(-1, ys[..., None]).squeeze(-1)


def logit_noise(world: ExactWorld, std: float, seed: int = 0) -> Tensor:
    """``[prefixes, V]`` float64 Gaussian noise of standard deviation ``std``, seeded."""
    v, length = world.config.vocab_size, world.config.length
    prefixes = (v**length - 1) // (v - 1)
    gen = torch.Generator().manual_seed(seed)
    return std * torch.randn(prefixes, v, generator=gen, dtype=torch.float64)


def correction_weights(delta: Tensor, correction: str, threshold: float) -> Tensor:
    """``[N, L]`` the library's weights of ``correction`` (1 for ``none``)."""
    mask = torch.ones_like(delta)
    if correction == "none":
        return mask
    if correction == "token_tis":
        return token_tis_weights(delta, mask, threshold)[0]
    if correction == "sequence_mis":
        return sequence_mis_weights(delta, mask, threshold)[0]
    raise ValueError(f"correction_weights: unknown `correction` {correction!r}")


def corrected_mass(delta: Tensor, mu: Tensor, correction: str, threshold: float) -> float:
    """``E_mu`` of the share of tokens capped (``token_tis``) or of sequences masked."""
    mask = torch.ones_like(delta)
    if correction == "token_tis":
        cut = token_tis_weights(delta, mask, threshold)[1].double().mean(dim=1)
    elif correction == "sequence_mis":
        cut = sequence_mis_weights(delta, mask, threshold)[1].double()
    else:
        return 0.0
    return float((mu * cut).sum())


@dataclass
class Enumerated:
    """The trainer's per-token log-probs and their gradients, for every response.

    Attributes:
        logp: ``[N, L]`` float64 ``log pi(y_t | s_t)``.
        grads: ``[N, L, P]`` float64 ``grad log pi(y_t | s_t)`` in the model's ``P`` parameters.
        rewards: ``[N]`` the world's rewards.
    """

    logp: Tensor
    grads: Tensor
    rewards: Tensor

    def per_sample(self, mu: Tensor, weights: Tensor) -> Tensor:
        """``[N, P]`` one response's estimate ``A(y) sum_t w_t grad log pi(y_t|s_t)``."""
        advantages = self.rewards - (mu * self.rewards).sum()
        return torch.einsum("n,nl,nlp->np", advantages, weights, self.grads)


def enumerate_trainer(model: nn.Module, world: ExactWorld) -> Enumerated:
    """``model``'s per-token log-probs of every response and each one's gradient (float64)."""
    model = model.double().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    ys = world.responses
    n, length = ys.shape
    ids = torch.cat([world.prompt_ids.expand(n, 1), ys], dim=1)
    logps, rows = [], []
    for i in range(n):  # a response at a time: one small graph, one backward per token
        logits = model(input_ids=ids[i : i + 1]).logits[0, :length]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ys[i, :, None]).squeeze(-1)
        for t in range(length):
            grads = torch.autograd.grad(logp[t], params, retain_graph=t < length - 1)
            rows.append(torch.cat([g.flatten() for g in grads]))
        logps.append(logp.detach())
    grads = torch.stack(rows).view(n, length, -1)
    return Enumerated(torch.stack(logps), grads, world.rewards.double())


def sampler_logprobs(model: nn.Module, world: ExactWorld, temperature: float, std: float) -> Tensor:
    """``[N, L]`` float64 log-probs of the perturbed sampler ``mu``."""
    noise = logit_noise(world, std) if std else None
    with torch.no_grad():
        return token_logprobs(model.double(), world, temperature, noise)


def expected_gradient(
    model: nn.Module, world: ExactWorld, mu_tokens: Tensor | None, weights: Tensor | None
) -> Tensor:
    """``[P]`` the surrogate's expected gradient at the behaviour point, by enumeration.

    ``sum_y mu(y) (R(y) - E_mu[R]) sum_t w_t(y) grad log pi(y_t|s_t)`` in one backward pass
    over every response; with ``mu_tokens`` None, ``mu = pi`` and ``w = 1`` (the true gradient).

    Args:
        model: The trainer ``pi`` (float64: its parameters' gradient is returned).
        world: The exact world.
        mu_tokens: ``[N, L]`` the sampler's per-token log-probs (None: on-policy).
        weights: ``[N, L]`` the correction's weights (None: 1).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    logp = token_logprobs(model, world)
    mu = (logp if mu_tokens is None else mu_tokens).detach().sum(-1).exp()
    rewards = world.rewards.to(logp.dtype)
    advantages = rewards - (mu * rewards).sum()
    w = torch.ones_like(logp) if weights is None else weights
    surrogate = (mu * advantages * (w * logp).sum(-1)).sum()
    return torch.cat([g.flatten() for g in torch.autograd.grad(surrogate, params)])


def table_rows(model: nn.Module, world: ExactWorld) -> list[dict]:
    """Every (perturbation, correction, threshold) row of the table."""
    model = model.double().eval()
    g_true = expected_gradient(model, world, None, None)
    norm = g_true.norm()
    trainer = enumerate_trainer(model, world)  # per-response gradients: the std column
    rows = []
    for name, temperature, std in PERTURBATIONS:
        mu_tokens = sampler_logprobs(model, world, temperature, std)
        mu = mu_tokens.sum(-1).exp()
        delta = trainer.logp - mu_tokens
        gap = float((mu * delta.abs().mean(dim=1)).sum())
        for correction, threshold in CORRECTIONS:
            weights = correction_weights(delta, correction, threshold)
            g = expected_gradient(model, world, mu_tokens, weights)
            x = trainer.per_sample(mu, weights)  # [N, P]
            second = float((mu * (x * x).sum(-1)).sum())
            rows.append(
                {
                    "sampler": name,
                    "gap": gap,
                    "correction": correction,
                    "threshold": threshold,
                    "corrected": corrected_mass(delta, mu, correction, threshold),
                    "bias": float((g - g_true).norm() / norm),
                    "cosine": float(g @ g_true / (g.norm() * norm)),
                    "std": math.sqrt(max(second - float(g @ g), 0.0) / BATCH) / float(norm),
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as the table of docs/mismatch.md."""
    head = "| sampler mu | E_mu mean abs(delta) | correction | C | corrected | bias | cosine |"
    head += f" std (n={BATCH}) |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = (
            "-"
            if r["correction"] == "none"
            else ("inf" if math.isinf(r["threshold"]) else f"{r['threshold']:g}")
        )
        corrected = "-" if r["correction"] == "none" else f"{r['corrected']:.3f}"
        lines.append(
            f"| {r['sampler']} | {r['gap']:.4f} | {r['correction']} | {c} | {corrected} | "
            f"{r['bias']:.4f} | {r['cosine']:.4f} | {r['std']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Print the table for the standard exact world's reference as the trainer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    from transformers import AutoModelForCausalLM

    world = ExactWorld()
    model = AutoModelForCausalLM.from_pretrained(world.model_dir, weights_only=True)
    print(markdown(table_rows(model, world)))


if __name__ == "__main__":
    main()
