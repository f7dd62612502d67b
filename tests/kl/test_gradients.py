"""Which KL placement and estimator follow the gradient of KL(pi‖ref): proven by enumeration.

A policy over responses of ``T = 3`` tokens from a vocabulary of ``V = 3`` has 27 responses, so
every expectation ``E_{y~pi}[g(y)] = sum_y pi(y) g(y)`` is computed exactly, and so is the
expected gradient of every loss: ``sum_y sg(pi(y)) grad f_y`` (``sg``: detached; the samples'
distribution is not differentiated, as in training). With ``l_t = log pi(y_t|s_t) - log
ref(y_t|s_t)``, ``L(y) = sum_t l_t = log pi(y)/ref(y)`` and ``KL_t(s) = KL(pi(.|s)‖ref(.|s))``:

**The target.** ``KL(pi‖ref) = sum_y pi(y) L(y)``, differentiated by autograd through both
``pi(y)`` and ``L(y)``: ``G_seq``. By the product rule and ``grad pi = pi grad log pi``::

    G_seq = E[L(y) grad log pi(y)] + E[grad L(y)]
          = E[sum_t grad log pi(y_t|s_t) * sum_t' l_t'] + 0

since ``E[grad L] = E[sum_t grad log pi(y_t|s_t)] = sum_t E_s[sum_a grad pi(a|s)] = 0``.
Terms with ``t' < t`` vanish too (``l_t'`` is fixed by the prefix ``s_t`` and
``E[grad log pi(y_t|s_t) | s_t] = 0``), leaving the reward-to-go form
``E[sum_t grad log pi(y_t|s_t) * sum_{t'>=t} l_t']``. Splitting off ``t' = t``, where
``E[l_t grad log pi(y_t|s_t) | s_t] = grad KL_t(s_t)`` with the state held fixed::

    G_seq = G_tok + G_future,  G_tok = E[sum_t grad KL_t(s_t)]  (states not differentiated),
                               G_future = E[sum_t grad log pi(y_t|s_t) * sum_{t'>t} l_t']

``G_future`` is how early tokens change the KL of later ones (Tang & Munos 2025, arXiv
2506.09477); it vanishes for a policy whose tokens do not depend on their prefix.

**Each placement x estimator**, with the library's own functions:

* KL in the reward: ``shape_rewards(0, kl, 1, mask)`` -> ``gae(gamma=1, lam=1, values=0)`` (the
  reward-to-go) -> ``policy_loss`` at ratio 1, whose gradient is
  ``-mean_t A_t grad log pi(y_t|s_t)``. With k1 its expectation is exactly ``G_seq`` (above);
  with k2 or k3 it is the score-function gradient of a different reward (their values are
  not ``l``), so it misses; with the exact per-token KL it is ``G_future`` (the state's own
  KL does not depend on its token).
* KL in the loss: ``kl_loss`` on-policy (``w = 1``). k2's gradient per sample is
  ``l_t grad log pi(y_t|s_t)``: in expectation ``G_tok``, which is ``G_seq`` for a prefix-free
  policy (Liu et al. 2025, arXiv 2510.01555: k2 as loss = k1 in the reward on-policy, a
  response being one action) and misses ``G_future`` otherwise. k1's is
  ``grad log pi(y_t|s_t)``: in expectation 0. k3's is ``(1 - ref/pi) grad log pi``: in
  expectation ``E[sum_t grad KL(ref(.|s_t)‖pi(.|s_t))]``, the *forward* KL's gradient.

Off-policy (samples from ``pi_old``), ``w_t = pi/pi_old`` restores k2's on-policy expectation
at each state; without it the gradient misses.

The tolerances: the matches hold to 1e-6 relative (float64 enumeration); the misses are off by
a relative error of at least 0.1 here. ``test_gradients_through_a_tiny_gpt2`` repeats the
placements through a GPT-2 with a 3-token vocabulary and the library's fused log-prob head.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from rlkl_lightning.algorithms.advantages import gae, shape_rewards
from rlkl_lightning.algorithms.losses import policy_loss
from rlkl_lightning.kl.estimators import exact_kl, per_token_kl
from rlkl_lightning.kl.loss import kl_loss, within_trust_region

V, T = 3, 3
RESPONSES = torch.tensor(list(itertools.product(range(V), repeat=T)))  # [27, 3]
MATCH = 1e-6  # relative error of the pairings that must match
MISS = 0.1  # relative error the others exceed


def relative_error(got: Tensor, want: Tensor) -> float:
    return float((got - want).norm() / want.norm())


# ------------------------------------------------------------------ a tabular policy
def state_index(prefix_free: bool) -> Tensor:
    """``[27, T]`` row of the logit table each token is drawn from.

    Autoregressive: one row per prefix (1 + 3 + 9 = 13 states). Prefix-free: one per position.
    """
    if prefix_free:
        return torch.arange(T).expand(len(RESPONSES), T)
    rows = torch.zeros(len(RESPONSES), T, dtype=torch.long)
    offset, code = 0, torch.zeros(len(RESPONSES), dtype=torch.long)
    for t in range(T):
        rows[:, t] = offset + code
        offset += V**t
        code = code * V + RESPONSES[:, t]
    return rows


class Tabular:
    """``pi(.|s) = softmax(theta[s])`` and a fixed ``ref(.|s) = softmax(ref_logits[s])``."""

    def __init__(self, prefix_free: bool, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        rows = state_index(prefix_free)
        n_states = int(rows.max()) + 1
        self.rows = rows
        self.theta = (
            1.5 * torch.randn(n_states, V, generator=g, dtype=torch.float64)
        ).requires_grad_()
        self.ref_logits = 1.5 * torch.randn(n_states, V, generator=g, dtype=torch.float64)
        self.mask = torch.ones(len(RESPONSES), T)

    def logits(self, theta: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Policy and reference logits ``[27, T, V]`` at every response position."""
        theta = self.theta if theta is None else theta
        return theta[self.rows], self.ref_logits[self.rows]

    def logprobs(self, theta: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``log pi(y_t|s_t)`` (with grad) and ``log ref(y_t|s_t)``, ``[27, T]``."""
        logits, ref = self.logits(theta)
        pick = RESPONSES.unsqueeze(-1)
        return (
            logits.log_softmax(-1).gather(-1, pick).squeeze(-1),
            ref.log_softmax(-1).gather(-1, pick).squeeze(-1),
        )

    def grad(self, objective: Tensor) -> Tensor:
        (g,) = torch.autograd.grad(objective, self.theta, retain_graph=True)
        return g


def targets(model) -> dict[str, Tensor]:
    """``G_seq``, ``G_tok``, ``G_future`` and the forward-KL gradient, by autograd."""
    logprobs, ref = model.logprobs()
    logits, ref_logits = model.logits()
    weight = logprobs.sum(-1).exp()  # pi(y)
    assert float(weight.sum().detach()) == pytest.approx(1.0, abs=1e-12)  # every response is here
    g_seq = model.grad((weight * (logprobs - ref).sum(-1)).sum())
    g_tok = model.grad((weight.detach() * exact_kl(logits, ref_logits).sum(-1)).sum())
    g_fwd = model.grad((weight.detach() * exact_kl(ref_logits, logits).sum(-1)).sum())
    return {"seq": g_seq, "tok": g_tok, "future": g_seq - g_tok, "forward": g_fwd}


def expected_gradient(model, per_sequence_loss) -> Tensor:
    """``sum_y sg(pi(y)) grad f_y`` for ``f_y = per_sequence_loss(row y)``."""
    logprobs, ref = model.logprobs()
    weight = logprobs.sum(-1).exp().detach()
    total = sum(
        weight[y] * per_sequence_loss(logprobs[y : y + 1], ref[y : y + 1], y)
        for y in range(len(RESPONSES))
    )
    return model.grad(total)


def in_the_reward(model, estimator: str):
    """The policy-gradient loss of one response with ``-kl`` as its reward (sum over tokens)."""
    logits, ref_logits = (x.detach() for x in model.logits())

    def loss(logprobs: Tensor, ref: Tensor, y: int) -> Tensor:
        old = logprobs.detach()
        mask = torch.ones_like(old)
        if estimator == "exact":
            kl = exact_kl(logits[y : y + 1], ref_logits[y : y + 1])
        else:
            kl = per_token_kl(old, ref, estimator)
        rewards = shape_rewards(torch.zeros(1, dtype=kl.dtype), kl, 1.0, mask)
        advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
        pg, _ = policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
        return T * pg  # policy_loss is a token mean; the gradient above is a token sum

    return loss


def in_the_loss(estimator: str, old_logprobs: Tensor | None = None, weight_clip=None):
    """``T x kl_loss`` of one response; ``old_logprobs [27, T]``: off-policy samples."""

    def loss(logprobs: Tensor, ref: Tensor, y: int) -> Tensor:
        old = logprobs.detach() if old_logprobs is None else old_logprobs[y : y + 1]
        mask = torch.ones_like(logprobs)
        return T * kl_loss(logprobs, old, ref, mask, estimator, weight_clip)

    return loss


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def autoregressive():
    model = Tabular(prefix_free=False)
    return model, targets(model)


@pytest.fixture(scope="module")
def prefix_free():
    model = Tabular(prefix_free=True)
    return model, targets(model)


def test_the_decomposition_is_not_trivial(autoregressive, prefix_free):
    """Early tokens change later KL in the autoregressive policy, never in the prefix-free one."""
    _, g = autoregressive
    assert relative_error(g["tok"], g["seq"]) > MISS  # G_future is a large part of G_seq
    _, g = prefix_free
    assert relative_error(g["tok"], g["seq"]) < MATCH


def test_k1_in_the_reward_follows_the_sequence_kl_gradient(autoregressive, prefix_free):
    for model, g in (autoregressive, prefix_free):
        got = expected_gradient(model, in_the_reward(model, "k1"))
        assert relative_error(got, g["seq"]) < MATCH


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_k2_or_k3_in_the_reward_does_not(autoregressive, estimator):
    model, g = autoregressive
    got = expected_gradient(model, in_the_reward(model, estimator))
    assert relative_error(got, g["seq"]) > MISS


def test_the_exact_kl_in_the_reward_follows_only_the_future_term(autoregressive):
    model, g = autoregressive
    got = expected_gradient(model, in_the_reward(model, "exact"))
    assert relative_error(got, g["future"]) < MATCH
    assert relative_error(got, g["seq"]) > MISS


def test_k2_in_the_loss_follows_the_per_token_kl_gradient(autoregressive, prefix_free):
    """= the sequence gradient without prefixes (Liu et al.); misses G_future with them."""
    model, g = prefix_free
    assert relative_error(expected_gradient(model, in_the_loss("k2")), g["seq"]) < MATCH
    model, g = autoregressive
    got = expected_gradient(model, in_the_loss("k2"))
    assert relative_error(got, g["tok"]) < MATCH
    assert relative_error(got, g["seq"]) > MISS


def test_k1_in_the_loss_has_no_expected_gradient(autoregressive):
    model, g = autoregressive
    got = expected_gradient(model, in_the_loss("k1"))
    assert float(got.norm()) < MATCH * float(g["seq"].norm())
    assert relative_error(got, g["seq"]) == pytest.approx(1.0, abs=MATCH)


def test_k3_in_the_loss_follows_the_forward_kl_gradient(autoregressive, prefix_free):
    for model, g in (autoregressive, prefix_free):
        got = expected_gradient(model, in_the_loss("k3"))
        assert relative_error(got, g["forward"]) < MATCH
        assert relative_error(got, g["seq"]) > MISS
        assert relative_error(got, g["tok"]) > MISS


def test_off_policy_importance_weights_restore_the_k2_gradient(prefix_free):
    """Samples from pi_old: with w = pi/pi_old, k2 in the loss follows G_seq again."""
    model, g = prefix_free
    old_theta = model.theta.detach() + 0.5 * torch.randn(
        model.theta.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    old_logprobs = model.logprobs(old_theta)[0].detach()
    sample_weight = old_logprobs.sum(-1).exp()  # the responses are drawn from pi_old

    def expected(loss) -> Tensor:
        logprobs, ref = model.logprobs()
        total = sum(
            sample_weight[y] * loss(logprobs[y : y + 1], ref[y : y + 1], y)
            for y in range(len(RESPONSES))
        )
        return model.grad(total)

    weighted = expected(in_the_loss("k2", old_logprobs))
    assert relative_error(weighted, g["seq"]) < MATCH
    unweighted = expected(in_the_loss("k2"))  # old = new: w = 1, the usual omission
    assert relative_error(unweighted, g["seq"]) > MISS
    ratios = (model.logprobs()[0] - old_logprobs).exp()
    clip = float(ratios.detach().median())  # a cap that binds on half the tokens: biased
    capped = expected(in_the_loss("k2", old_logprobs, weight_clip=max(clip, 1.0)))
    assert relative_error(capped, g["seq"]) > 10 * MATCH


# ------------------------------------------------------------------ through a causal LM
def test_gradients_through_a_tiny_gpt2():
    """The same pairings through a GPT-2 with a 3-token vocabulary, scored by the library.

    The targets come from the model's plain forward (``model(ids).logits``); the placements
    use ``score_tokens`` (the fused log-prob head the update uses), ``shape_rewards``, ``gae``,
    ``policy_loss`` and ``kl_loss``. Float32 log-probs: the matches hold to 5e-6 relative
    (measured: 3e-7 to 7e-7).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlkl_lightning.models.logprobs import score_tokens
    from rlkl_lightning.trajectory import Trajectory

    # A large initialisation: a KL of about 0.5 nats, and tokens that depend on their prefix.
    config = GPT2Config(
        vocab_size=V, n_positions=8, n_embd=16, n_layer=1, n_head=2, initializer_range=0.5
    )
    config.bos_token_id = config.eos_token_id = None  # GPT-2's 50256 is not in this vocabulary
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(config).eval()
    torch.manual_seed(1)
    reference = GPT2LMHeadModel(config).eval()
    ids = torch.cat([torch.zeros(len(RESPONSES), 1, dtype=torch.long), RESPONSES], dim=1)
    ones = torch.ones_like(ids)
    traj = Trajectory(ids, ones, RESPONSES, torch.ones(len(RESPONSES), T))
    params = [p for p in policy.parameters() if p.requires_grad]

    def grad(objective: Tensor) -> Tensor:
        return torch.cat(
            [g.flatten() for g in torch.autograd.grad(objective, params, retain_graph=True)]
        )

    # Targets, from the plain forward.
    logits = policy(ids).logits[:, :-1].float()
    with torch.no_grad():
        ref_logits = reference(ids).logits[:, :-1].float()
    pick = RESPONSES.unsqueeze(-1)
    plain = logits.log_softmax(-1).gather(-1, pick).squeeze(-1)
    ref = ref_logits.log_softmax(-1).gather(-1, pick).squeeze(-1)
    weight = plain.sum(-1).exp()
    assert float(weight.sum().detach()) == pytest.approx(1.0, abs=1e-5)
    g_seq = grad((weight * (plain - ref).sum(-1)).sum())
    g_tok = grad((weight.detach() * exact_kl(logits, ref_logits).sum(-1)).sum())
    g_fwd = grad((weight.detach() * exact_kl(ref_logits, logits).sum(-1)).sum())
    assert relative_error(g_tok, g_seq) > MISS

    def expected(per_row) -> Tensor:
        logprobs = score_tokens(policy, traj, 1.0, logits=False).logprobs
        old = logprobs.detach()
        kl = per_token_kl(old, ref, "k1")
        return grad(sum(weight[y].detach() * per_row(logprobs, old, kl, y) for y in range(27)))

    def k1_reward(logprobs, old, kl, y):
        row, mask = slice(y, y + 1), torch.ones(1, T)
        rewards = shape_rewards(torch.zeros(1), kl[row], 1.0, mask)
        advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
        return T * policy_loss(logprobs[row], old[row], advantages, mask, cliprange=0.2)[0]

    def loss_of(estimator):
        def per_row(logprobs, old, kl, y):
            row = slice(y, y + 1)
            mask = torch.ones(1, T)
            return T * kl_loss(logprobs[row], old[row], ref[row], mask, estimator, None)

        return per_row

    assert relative_error(expected(k1_reward), g_seq) < 5e-6
    k2 = expected(loss_of("k2"))
    assert relative_error(k2, g_tok) < 5e-6
    assert relative_error(k2, g_seq) > MISS
    k3 = expected(loss_of("k3"))
    assert relative_error(k3, g_fwd) < 5e-6
    assert relative_error(k3, g_seq) > MISS
    k1 = expected(loss_of("k1"))
    assert float(k1.norm()) < 5e-6 * float(g_seq.norm())


# ------------------------------------------------------------------ TRL's forms (issue 26)
def bias_corrected_k3(old_logprobs: Tensor | None = None):
    """TRL 1.16's ``use_bias_correction_kl``: ``T x mean_t(ratio_t * k3_t)`` with the ratio
    ``pi/pi_old`` **not** detached (written here from TRL's description, not its code)."""

    def loss(logprobs: Tensor, ref: Tensor, y: int) -> Tensor:
        old = logprobs.detach() if old_logprobs is None else old_logprobs[y : y + 1]
        ratio = (logprobs - old).exp()  # 1 on-policy, with the gradient of pi
        return (ratio * per_token_kl(logprobs, ref, "k3")).sum()

    return loss


def in_the_sequence_reward(estimator: str):
    """RLOO's return ``-sum_t kl_t`` (no baseline: the leave-one-out one does not move the
    expectation) on every token of the response, through ``policy_loss`` at ratio 1."""

    def loss(logprobs: Tensor, ref: Tensor, y: int) -> Tensor:
        old = logprobs.detach()
        mask = torch.ones_like(old)
        kl = per_token_kl(old, ref, estimator)
        advantages = -kl.sum(-1, keepdim=True) * mask
        return T * policy_loss(logprobs, old, advantages, mask, cliprange=0.2)[0]

    return loss


def test_bias_corrected_k3_has_k2s_gradient_sample_by_sample(autoregressive):
    """d(w k3)/d theta = w (k3 + 1 - ref/pi) grad log pi = w l grad log pi: k2's with w
    detached, for every response, on-policy and off-policy alike."""
    model, _ = autoregressive
    old_theta = model.theta.detach() + 0.3 * torch.randn(
        model.theta.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    for old in (None, model.logprobs(old_theta)[0].detach()):
        trl, ours = bias_corrected_k3(old), in_the_loss("k2", old)
        logprobs, ref = model.logprobs()
        for y in (0, 13, 26):
            row = slice(y, y + 1)
            got = model.grad(trl(logprobs[row], ref[row], y))
            want = model.grad(ours(logprobs[row], ref[row], y))
            assert relative_error(got, want) < 1e-12


def test_bias_corrected_k3_follows_the_per_token_gradient_on_policy(autoregressive, prefix_free):
    """On-policy: G_tok, as k2 in the loss; so G_seq only without prefixes."""
    model, g = prefix_free
    assert relative_error(expected_gradient(model, bias_corrected_k3()), g["seq"]) < MATCH
    model, g = autoregressive
    got = expected_gradient(model, bias_corrected_k3())
    assert relative_error(got, g["tok"]) < MATCH
    assert relative_error(got, g["seq"]) > MISS


def off_policy(model, old_theta: Tensor):
    """Samples from ``pi_old``: the expectation under them, and the per-token target with
    the states drawn from ``pi_old`` and the current policy's KL at each of them."""
    old_logprobs = model.logprobs(old_theta)[0].detach()
    sample_weight = old_logprobs.sum(-1).exp()

    def expected(loss) -> Tensor:
        logprobs, ref = model.logprobs()
        total = sum(
            sample_weight[y] * loss(logprobs[y : y + 1], ref[y : y + 1], y)
            for y in range(len(RESPONSES))
        )
        return model.grad(total)

    logits, ref_logits = model.logits()
    tok_old_states = model.grad((sample_weight * exact_kl(logits, ref_logits).sum(-1)).sum())
    return old_logprobs, expected, tok_old_states


def test_on_a_later_epoch_bias_corrected_k3_and_weighted_k2_follow_the_old_states_kl(
    autoregressive, prefix_free
):
    """Off-policy, TRL's form and our k2 with uncapped detached weights both follow the
    per-token KL gradient at the states ``pi_old`` visits: G_seq without prefixes, and
    neither G_seq nor the current policy's G_tok with them. Our k3 with detached weights
    follows the forward KL's (missing both)."""
    for (model, g), prefixes in ((prefix_free, False), (autoregressive, True)):
        old_theta = model.theta.detach() + 0.5 * torch.randn(
            model.theta.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
        )
        old_logprobs, expected, tok_old_states = off_policy(model, old_theta)
        trl = expected(bias_corrected_k3(old_logprobs))
        k2 = expected(in_the_loss("k2", old_logprobs))
        k3 = expected(in_the_loss("k3", old_logprobs))
        assert relative_error(trl, k2) < 1e-12
        assert relative_error(trl, tok_old_states) < MATCH
        assert relative_error(k3, g["seq"]) > MISS
        if prefixes:
            assert relative_error(trl, g["seq"]) > MISS
            # Only the states' distribution differs from the current G_tok (measured 0.033).
            assert relative_error(trl, g["tok"]) > 0.01
        else:
            assert relative_error(trl, g["seq"]) < MATCH


def test_k1_summed_in_rloos_reward_follows_the_sequence_gradient_and_k3_does_not(autoregressive):
    """TRL's RLOO (k1 summed per sequence in the reward) follows G_seq; swapping in k3 (its
    value has the same expectation) changes the gradient."""
    model, g = autoregressive
    assert relative_error(expected_gradient(model, in_the_sequence_reward("k1")), g["seq"]) < MATCH
    got = expected_gradient(model, in_the_sequence_reward("k3"))
    assert relative_error(got, g["seq"]) > MISS


# ------------------------------------------------------------------ a per-token trust region
def in_the_reward_within(model, trust_region: float):
    """k1 in the reward with the tokens beyond ``trust_region`` left out, as the pipeline does."""

    def loss(logprobs: Tensor, ref: Tensor, y: int) -> Tensor:
        old = logprobs.detach()
        mask = torch.ones_like(old)
        kl = per_token_kl(old, ref, "k1") * within_trust_region(old - ref, trust_region)
        rewards = shape_rewards(torch.zeros(1, dtype=kl.dtype), kl, 1.0, mask)
        advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
        pg, _ = policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
        return T * pg

    return loss


def in_the_loss_within(estimator: str, trust_region: float):
    def loss(logprobs: Tensor, ref: Tensor, y: int) -> Tensor:
        mask = torch.ones_like(logprobs)
        return T * kl_loss(
            logprobs, logprobs.detach(), ref, mask, estimator, None, trust_region=trust_region
        )

    return loss


def _median_abs_log_ratio(model) -> float:
    logprobs, ref = model.logprobs()
    return float((logprobs - ref).detach().abs().median())


def test_a_trust_region_wider_than_every_token_changes_nothing(autoregressive):
    model, g = autoregressive
    logprobs, ref = model.logprobs()
    wide = float((logprobs - ref).detach().abs().max()) + 1e-9
    got = expected_gradient(model, in_the_reward_within(model, wide))
    assert relative_error(got, g["seq"]) < MATCH
    got = expected_gradient(model, in_the_loss_within("k2", wide))
    assert relative_error(got, g["tok"]) < MATCH


def test_a_trust_region_biases_the_kl_gradient(autoregressive, prefix_free):
    """Leaving the extreme tokens out is the score-function gradient of a truncated KL.

    In the reward, the gradient is ``E[R_c(y) grad log pi(y)]`` with
    ``R_c(y) = sum_t l_t 1[|l_t| <= c]`` (computed here a second way: through ``pi(y)`` with
    the whole return, not the reward-to-go), and it misses ``G_seq``: the truncation drops the
    tokens that pull hardest towards the reference. In the loss, k2's gradient becomes
    ``E[sum_t 1[|l_t| <= c] l_t grad log pi(y_t|s_t)]`` and misses ``G_tok``.
    """
    for model, g in (autoregressive, prefix_free):
        c = _median_abs_log_ratio(model)  # about half the tokens are left out
        logprobs, ref = model.logprobs()
        ratio = logprobs - ref
        truncated = (ratio * within_trust_region(ratio, c)).sum(-1).detach()
        weight = logprobs.sum(-1).exp()
        second_way = model.grad((weight * truncated).sum())
        got = expected_gradient(model, in_the_reward_within(model, c))
        assert relative_error(got, second_way) < MATCH
        assert relative_error(got, g["seq"]) > MISS
        in_loss = expected_gradient(model, in_the_loss_within("k2", c))
        kept = (ratio * within_trust_region(ratio, c)).detach()
        second_way = model.grad((weight.detach() * (kept * logprobs).sum(-1)).sum())
        assert relative_error(in_loss, second_way) < MATCH
        assert relative_error(in_loss, g["tok"]) > MISS


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_ppos_whitening_scales_the_kl_term_of_its_loss_alike(estimator):
    """PPO's whitened objective is its raw one divided by one number, the KL term included.

    Issue 37: PPO with k2 in the loss ran away on the exact world because its advantages were
    divided by their standard deviation ``s`` and its KL term was not, so beta weighed
    ``beta x s`` of KL against the raw reward, and ``s`` shrinks as the policy sharpens. The
    gradient of the library's PPO loss (``gae_advantages``, then ``PolicyObjective``) through a
    tiny GPT-2 must be the raw objective's (GAE advantages centred but not divided, the KL term
    unscaled) divided by ``s``, to 1e-5 relative (measured 2e-7 and 4e-7); before the fix it
    missed by 0.75 (its KL term was not divided).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlkl_lightning.algorithms.advantage_estimators import gae_advantages
    from rlkl_lightning.algorithms.objective import PolicyObjective
    from rlkl_lightning.algorithms.options import KLPenalty, Objective, PPOOptions
    from rlkl_lightning.models.logprobs import score_tokens
    from rlkl_lightning.trajectory import Trajectory

    config = GPT2Config(
        vocab_size=V, n_positions=8, n_embd=16, n_layer=1, n_head=2, initializer_range=0.5
    )
    config.bos_token_id = config.eos_token_id = None
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(config).eval()
    torch.manual_seed(1)
    reference = GPT2LMHeadModel(config).eval()
    ids = torch.cat([torch.zeros(len(RESPONSES), 1, dtype=torch.long), RESPONSES], dim=1)
    mask = torch.ones(len(RESPONSES), T)
    traj = Trajectory(ids, torch.ones_like(ids), RESPONSES, mask)
    with torch.no_grad():
        old = score_tokens(policy, traj, 1.0, logits=False).logprobs
        ref = score_tokens(reference, traj, 1.0, logits=False).logprobs
    gen = torch.Generator().manual_seed(2)
    scores = 0.3 * torch.randn(len(RESPONSES), generator=gen)  # a small spread: s well below 1
    values = 0.1 * torch.randn(len(RESPONSES), T, generator=gen)
    traj = traj._replace(
        logprobs=old,
        ref_logprobs=ref,
        kl=per_token_kl(old, ref, "k1"),
        scores=scores,
        values=values,
    )
    beta, options = 0.5, PPOOptions()
    kl = KLPenalty(placement="loss", loss_estimator=estimator)
    objective = PolicyObjective(Objective(), kl, 1.0)
    params = [p for p in policy.parameters() if p.requires_grad]

    def gradient(batch: Trajectory) -> Tensor:
        loss, _ = objective(policy, batch, beta)
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    whitened = gae_advantages(traj, 0.0, options, lambda x: x)  # beta is in the loss
    rewards = shape_rewards(scores, traj.kl, 0.0, mask)
    raw, _ = gae(rewards, values, mask, options.gamma, options.lam)
    s = float((raw.var() + 1e-8).sqrt())
    assert s < 0.5  # the case the fix is about: an unscaled KL term would weigh beta x s
    assert relative_error(whitened.advantages, (raw - raw.mean()) / s) < 1e-5
    centred = traj._replace(advantages=raw - raw.mean())  # whitening's shift: a baseline
    want = gradient(centred) / s  # the raw objective, scaled as a whole
    assert relative_error(gradient(whitened), want) < 1e-5
