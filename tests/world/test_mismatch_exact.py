"""The mismatch corrections on the exact world: enumeration against itself, Monte Carlo, the docs.

``rlkl_lightning.compare.mismatch`` gives each correction's expected gradient by enumeration
(docs/mismatch.md's table). Here: sequence importance sampling with no bound is exactly the
on-policy gradient, and so is token importance sampling where a response is one token (and only
there); the library's own objective, fed responses sampled from the perturbed sampler, lands on
the enumerated gradient within its standard error; the docs' rows are the module's numbers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlkl_lightning.algorithms.mismatch import mismatch_weights
from rlkl_lightning.algorithms.objective import PolicyObjective
from rlkl_lightning.algorithms.options import KLPenalty, Objective
from rlkl_lightning.compare.mismatch import (
    CORRECTIONS,
    PERTURBATIONS,
    correction_weights,
    expected_gradient,
    sampler_logprobs,
    token_logprobs,
)
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.trajectory import Trajectory
from rlkl_lightning.world.exact import ExactWorld, ExactWorldConfig

ROOT = Path(__file__).resolve().parents[2]
NOISE = 0.3  # the table's largest perturbation: the corrections differ most there


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return ExactWorld(root=tmp_path_factory.mktemp("exact"))


def trainer(world, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world.model_dir, weights_only=True)
    return model.to(dtype).eval()


def relative(a, b) -> float:
    return float((a - b).norm() / b.norm())


def gradient_of(model, world, mu_tokens, correction, threshold):
    delta = token_logprobs(model, world).detach() - mu_tokens
    weights = correction_weights(delta, correction, threshold)
    return expected_gradient(model, world, mu_tokens, weights)


def test_sequence_importance_sampling_without_a_bound_is_the_on_policy_gradient(world):
    model = trainer(world)
    g_true = expected_gradient(model, world, None, None)
    for _, temperature, std in PERTURBATIONS:
        mu = sampler_logprobs(model, world, temperature, std)
        exact = gradient_of(model, world, mu, "sequence_mis", math.inf)
        assert relative(exact, g_true) < 1e-12
        assert relative(gradient_of(model, world, mu, "none", math.inf), g_true) > 0.02


def test_token_importance_sampling_is_unbiased_for_one_token_responses_only(world, tmp_path):
    short = ExactWorld(ExactWorldConfig(length=1), root=tmp_path)
    model = trainer(short)
    g_true = expected_gradient(model, short, None, None)
    mu = sampler_logprobs(model, short, 0.8, 0.0)
    assert relative(gradient_of(model, short, mu, "token_tis", math.inf), g_true) < 1e-12
    assert relative(gradient_of(model, short, mu, "none", math.inf), g_true) > 0.05
    model = trainer(world)  # 4 tokens: each token's ratio leaves the prefix's and suffix's out
    g_true = expected_gradient(model, world, None, None)
    mu = sampler_logprobs(model, world, 0.8, 0.0)
    assert relative(gradient_of(model, world, mu, "token_tis", math.inf), g_true) > 0.05


def directional_logprobs(model, world, direction, eps=1e-5):
    """``[N, L]`` ``grad log pi(y_t|s_t) . direction`` by central differences (float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    steps = torch.split(direction, [p.numel() for p in params])
    out = []
    with torch.no_grad():
        for sign in (1.0, -1.0):
            for p, step in zip(params, steps, strict=True):
                p.add_(sign * eps * step.view_as(p))
            out.append(token_logprobs(model, world))
            for p, step in zip(params, steps, strict=True):
                p.sub_(sign * eps * step.view_as(p))
    return (out[0] - out[1]) / (2 * eps)


@pytest.mark.parametrize("correction", ["token_tis", "sequence_mis"])
def test_the_objective_on_sampled_responses_lands_on_the_enumerated_gradient(world, correction):
    """Monte Carlo through the library's objective against the enumeration, within 4 SE.

    ``M`` responses drawn from the sampler (``logit noise 0.3``) go through
    ``mismatch_weights`` and ``PolicyObjective`` (token mean, ratio 1 at the behaviour point:
    its gradient is ``-1/(M L) sum w A grad log pi``). Along the enumerated gradient and along
    the direction that separates it from the uncorrected one, the estimate is within 4 standard
    errors of the enumeration, computed exactly from the enumerated per-response projections;
    the uncorrected gradient is more than 10 standard errors away, so the check tells them apart.
    """
    m, threshold = 20_000, 2.0
    model64, policy = trainer(world), trainer(world, torch.float32)
    mu_tokens = sampler_logprobs(model64, world, 1.0, NOISE)
    mu = mu_tokens.sum(-1).exp()
    g = gradient_of(model64, world, mu_tokens, correction, threshold)
    g_none = gradient_of(model64, world, mu_tokens, "none", math.inf)

    gen = torch.Generator().manual_seed(0)
    rows = torch.multinomial(mu, m, replacement=True, generator=gen)
    responses = world.responses[rows]
    n, length = responses.shape
    ids = torch.cat([world.prompt_ids.expand(n, 1), responses], dim=1)
    traj = Trajectory(ids, torch.ones_like(ids), responses, torch.ones(n, length))
    with torch.no_grad():
        old = score_tokens(policy, traj, 1.0, logits=False).logprobs
    advantages = world.rewards - (mu * world.rewards).sum()  # the group baseline's expectation
    traj = traj._replace(
        logprobs=old,
        sampler_logprobs=mu_tokens[rows].float(),
        advantages=advantages[rows, None].expand(n, length).float(),
    )
    traj = traj._replace(mismatch_weights=mismatch_weights(traj, correction, threshold)[0])
    loss, _ = PolicyObjective(Objective(), KLPenalty(), 1.0)(policy, traj, 0.0)
    params = [p for p in policy.parameters() if p.requires_grad]
    estimate = -length * torch.cat([x.flatten() for x in torch.autograd.grad(loss, params)])

    delta = token_logprobs(model64, world).detach() - mu_tokens
    weights = correction_weights(delta, correction, threshold)
    separating = (g - g_none) / (g - g_none).norm()
    for u in (separating, g / g.norm()):
        per_response = advantages * (weights * directional_logprobs(model64, world, u)).sum(-1)
        mean = float((mu * per_response).sum())
        assert mean == pytest.approx(float(g @ u), rel=1e-6)  # differences vs backward
        se = math.sqrt((float((mu * per_response**2).sum()) - mean**2) / m)
        assert abs(float(estimate.double() @ u) - mean) < 4 * se
        if u is separating:  # the uncorrected gradient is far outside: the check has power
            assert abs(float(g_none @ u) - mean) > 10 * se


def test_the_docs_table_rows_are_the_modules_numbers(world):
    """Every row of the ``logit noise 0.3`` sampler in docs/mismatch.md, recomputed."""
    page = (ROOT / "docs" / "mismatch.md").read_text()
    model = trainer(world)
    g_true = expected_gradient(model, world, None, None)
    name, temperature, std = next(p for p in PERTURBATIONS if p[2] == NOISE)
    mu = sampler_logprobs(model, world, temperature, std)
    for correction, threshold in CORRECTIONS:
        g = gradient_of(model, world, mu, correction, threshold)
        c = "-" if correction == "none" else ("inf" if math.isinf(threshold) else f"{threshold:g}")
        bias, cosine = relative(g, g_true), float(g @ g_true / (g.norm() * g_true.norm()))
        line = next(
            line
            for line in page.splitlines()
            if line.startswith(f"| {name} |") and f"| {correction} | {c} |" in line
        )
        assert f"| {bias:.4f} | {cosine:.4f} |" in line, line
