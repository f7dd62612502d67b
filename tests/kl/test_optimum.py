"""The exact optimum pi* ∝ ref exp(R / beta): closed forms, and training with exact gradients.

The response space is enumerated: every sequence of ``L`` tokens over ``V`` tokens, under
autoregressive tabular policies (one row of logits per prefix), which can represent any
distribution over sequences. Expected gradients are exact sums over all sequences, so a test
that fails here fails for the math, not for sampling noise.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlkl_lightning.kl.optimum import (
    beta_for_kl,
    expected,
    frontier,
    kl,
    max_kl,
    optimum,
)

V, L = 3, 3
SEQUENCES = torch.tensor(list(itertools.product(range(V), repeat=L)))  # [V^L, L]
PREFIXES = {
    p: i for i, p in enumerate(q for n in range(L) for q in itertools.product(range(V), repeat=n))
}
# Row of each (sequence, position) in the prefix table: the prefix before that position.
ROWS = torch.tensor([[PREFIXES[tuple(s[:t].tolist())] for t in range(L)] for s in SEQUENCES])


def sequence_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``[P, V]`` logits per prefix -> ``[V^L]`` log-probabilities of every sequence."""
    logp = torch.log_softmax(logits, dim=-1)[ROWS, SEQUENCES]  # [V^L, L]
    return logp.sum(-1)


def token_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``[V^L, L]`` log-probability of each token of every sequence."""
    return torch.log_softmax(logits, dim=-1)[ROWS, SEQUENCES]


@pytest.fixture
def world():
    gen = torch.Generator().manual_seed(0)
    ref_logits = torch.randn(len(PREFIXES), V, generator=gen, dtype=torch.float64)
    rewards = torch.randn(len(SEQUENCES), generator=gen, dtype=torch.float64)
    return ref_logits, rewards


def test_the_optimum_maximises_the_regularised_objective_and_its_kl_has_a_closed_form(world):
    ref_logits, rewards = world
    ref = sequence_logprobs(ref_logits)
    assert float(ref.exp().sum()) == pytest.approx(1.0, abs=1e-12)
    beta = 0.7
    best = optimum(ref, rewards, beta)
    assert float(best.logprobs.exp().sum()) == pytest.approx(1.0, abs=1e-12)
    # KL = E[R] / beta - log Z, against the KL summed directly.
    assert best.kl == pytest.approx(kl(best.logprobs, ref), rel=1e-12, abs=1e-14)
    assert best.reward == pytest.approx(expected(best.logprobs, rewards), rel=1e-12)
    value = best.reward - beta * best.kl
    assert value == pytest.approx(beta * best.log_z, rel=1e-12)  # the objective's maximum
    gen = torch.Generator().manual_seed(1)
    for scale in (1e-3, 1e-1, 1.0):  # every other policy does worse
        other = torch.log_softmax(
            best.logprobs + scale * torch.randn(ref.shape, generator=gen, dtype=ref.dtype), 0
        )
        assert expected(other, rewards) - beta * kl(other, ref) < value


def test_beta_for_a_kl_target_inverts_the_optimum_and_the_frontier_is_concave(world):
    ref_logits, rewards = world
    ref = sequence_logprobs(ref_logits)
    top = max_kl(ref, rewards)
    assert optimum(ref, rewards, 1e-4).kl == pytest.approx(top, rel=1e-6)
    for target in (0.05, 0.5, 0.9 * top):
        beta = beta_for_kl(ref, rewards, target)
        assert optimum(ref, rewards, beta).kl == pytest.approx(target, rel=1e-9)
    with pytest.raises(ValueError, match="`target` must be in"):
        beta_for_kl(ref, rewards, top * 1.01)
    points = frontier(ref, rewards, [10.0, 3.0, 1.0, 0.3, 0.1])
    kls, gains = zip(*points, strict=True)
    assert all(a < b for a, b in zip(kls, kls[1:], strict=False))  # smaller beta, more KL
    assert all(a < b for a, b in zip(gains, gains[1:], strict=False))  # and more reward
    slopes = [(g2 - g1) / (k2 - k1) for (k1, g1), (k2, g2) in zip(points, points[1:], strict=False)]
    assert all(a > b for a, b in zip(slopes, slopes[1:], strict=False))  # concave


def _train(world, beta: float, penalty, steps: int = 1000, lr: float = 0.1) -> torch.Tensor:
    """Gradient ascent with the exact expected policy gradient of ``E[R - beta * penalty]``.

    ``penalty(policy_token_logprobs, ref_token_logprobs) -> [V^L]`` is the per-sequence KL
    estimate put in the reward (detached, like a reward), as the pipeline's reward placement
    does. Returns the final policy's sequence log-probs.
    """
    ref_logits, rewards = world
    ref_tokens = token_logprobs(ref_logits)
    logits = ref_logits.clone().requires_grad_()  # the policy starts at the reference
    opt = torch.optim.Adam([logits], lr=lr)
    for _ in range(steps):
        tokens = token_logprobs(logits)
        logp = tokens.sum(-1)
        with torch.no_grad():
            returns = rewards - beta * penalty(tokens, ref_tokens)
        # E_pi[grad log pi(y) * G(y)], summed exactly over every sequence.
        surrogate = (logp.exp().detach() * logp * returns).sum()
        opt.zero_grad()
        (-surrogate).backward()
        opt.step()
    return sequence_logprobs(logits.detach())


def _k1(tokens, ref_tokens):
    return (tokens - ref_tokens).sum(-1)


def test_k1_in_the_reward_with_exact_gradients_converges_to_the_optimum(world):
    ref_logits, rewards = world
    beta = 0.5
    target = optimum(sequence_logprobs(ref_logits), rewards, beta).logprobs
    trained = _train(world, beta, _k1)
    assert kl(trained, target) < 1e-12
    assert torch.allclose(trained.exp(), target.exp(), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "penalty",
    [
        pytest.param(lambda t, r: -_k1(t, r), id="wrong sign"),
        pytest.param(lambda t, r: (torch.exp(r - t) - 1 + (t - r)).sum(-1), id="k3 in the reward"),
        pytest.param(lambda t, r: 0.5 * ((t - r) ** 2).sum(-1), id="k2 in the reward"),
    ],
)
def test_a_wrong_sign_or_estimator_in_the_reward_ends_away_from_the_optimum(world, penalty):
    ref_logits, rewards = world
    beta = 0.5
    target = optimum(sequence_logprobs(ref_logits), rewards, beta).logprobs
    trained = _train(world, beta, penalty)
    assert kl(trained, target) > 0.5  # k1: below 1e-12


def test_bad_beta_is_refused():
    ref = torch.log(torch.full((4,), 0.25, dtype=torch.float64))
    for beta in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="`beta` must be a finite number > 0"):
            optimum(ref, torch.zeros(4, dtype=torch.float64), beta)
