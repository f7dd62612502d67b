import itertools

import pytest
import torch

from rlkl_lightning.algorithms.advantages import gae, group_advantages, shape_rewards

NAN = float("nan")


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards, values (float64) and a right-padded mask with rows of lengths 6, 1, 3, 5."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 3, 5])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    rewards = torch.randn(4, 6, generator=g, dtype=torch.float64)
    values = torch.randn(4, 6, generator=g, dtype=torch.float64)
    return rewards, values, mask


def test_gae_matches_hand_computed_values():
    # gamma = 0.9, lam = 0.8, so gamma * lam = 0.72.
    # Row 0, three valid tokens: r = [0.5, -1.0, 2.0], V = [1.0, 0.5, -0.5].
    #   delta_2 = 2.0 + 0.9 * 0 - (-0.5)          =  2.5     (episode ends: next value 0)
    #   delta_1 = -1.0 + 0.9 * (-0.5) - 0.5       = -1.95
    #   delta_0 = 0.5 + 0.9 * 0.5 - 1.0           = -0.05
    #   A_2 = 2.5
    #   A_1 = -1.95 + 0.72 * 2.5                  = -0.15
    #   A_0 = -0.05 + 0.72 * (-0.15)              = -0.158
    #   R = A + V = [0.842, 0.35, 2.0]
    # Row 1, two valid tokens then padding: r = [1.0, 3.0, *], V = [2.0, 1.0, *].
    #   delta_1 = 3.0 - 1.0 = 2.0;  delta_0 = 1.0 + 0.9 * 1.0 - 2.0 = -0.1
    #   A_1 = 2.0;  A_0 = -0.1 + 0.72 * 2.0 = 1.34
    #   R = [3.34, 3.0, 0]
    rewards = torch.tensor([[0.5, -1.0, 2.0], [1.0, 3.0, 1e6]], dtype=torch.float64)
    values = torch.tensor([[1.0, 0.5, -0.5], [2.0, 1.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected_adv = torch.tensor([[-0.158, -0.15, 2.5], [1.34, 2.0, 0.0]], dtype=torch.float64)
    expected_ret = torch.tensor([[0.842, 0.35, 2.0], [3.34, 3.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, expected_ret, rtol=0, atol=1e-12)


def test_gamma_lam_one_gives_reward_to_go():
    rewards, values, mask = _batch()
    _, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    clean = rewards * mask
    reward_to_go = clean.flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(ret, reward_to_go, rtol=0, atol=1e-12)


def test_lam_one_gives_discounted_monte_carlo_return():
    # With lam = 1 the values telescope away: R_t = sum_{k >= t} gamma^(k - t) r_k.
    rewards, values, mask = _batch(1)
    gamma = 0.7
    _, ret = gae(rewards, values, mask, gamma=gamma, lam=1.0)
    t = torch.arange(6, dtype=torch.float64)
    discount = torch.triu(gamma ** (t[None, :] - t[:, None]))  # [t, k], 0 for k < t
    expected = (rewards * mask) @ discount.T * mask
    torch.testing.assert_close(ret, expected, rtol=0, atol=1e-12)


def test_lam_zero_gives_one_step_td_errors():
    rewards, values, mask = _batch(2)
    gamma = 0.95
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(4, 1)], dim=1)
    td = (rewards + gamma * next_values - values) * mask
    torch.testing.assert_close(adv, td, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, (td + values) * mask, rtol=0, atol=1e-12)


def test_batched_equals_per_row_on_unpadded_rows_and_ignores_padding():
    rewards, values, mask = _batch(3)
    dirty_r = rewards.masked_fill(~mask, NAN)
    dirty_v = values.masked_fill(~mask, 1e6)
    adv, ret = gae(dirty_r, dirty_v, mask, gamma=0.99, lam=0.95)
    for i, n in enumerate(mask.sum(1).tolist()):
        a_i, r_i = gae(
            rewards[i : i + 1, :n], values[i : i + 1, :n], mask[i : i + 1, :n], 0.99, 0.95
        )
        torch.testing.assert_close(adv[i, :n], a_i[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[i, :n], r_i[0], rtol=0, atol=1e-12)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


def test_gae_outputs_carry_no_gradient():
    rewards, values, mask = _batch()
    adv, ret = gae(rewards, values.requires_grad_(True), mask, 0.9, 0.9)
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_errors():
    rewards, values, mask = _batch()
    for name, kwargs in [("gamma", {"gamma": 1.5}), ("lam", {"lam": -0.1})]:
        args = {"gamma": 0.9, "lam": 0.9} | kwargs
        with pytest.raises(ValueError, match=name):
            gae(rewards, values, mask, **args)
    with pytest.raises(ValueError, match="values"):
        gae(rewards, values[:, :3], mask, 0.9, 0.9)
    gap = mask.clone()
    gap[0, 2] = False
    with pytest.raises(ValueError, match="prefix"):
        gae(rewards, values, gap, 0.9, 0.9)


def test_shape_rewards_puts_the_score_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    kl = torch.tensor(
        [[0.1, 0.2, 0.3, NAN], [0.5, 1e6, 1e6, 1e6], [0.0, -0.1, 0.4, 0.2]], dtype=torch.float64
    )
    scores = torch.tensor([1.0, -2.0, 3.0])
    rewards = shape_rewards(scores, kl, kl_coef=0.5, mask=mask)
    expected = torch.tensor(
        [
            [-0.05, -0.1, -0.15 + 1.0, 0.0],
            [-0.25 - 2.0, 0.0, 0.0, 0.0],
            [0.0, 0.05, -0.2, -0.1 + 3.0],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-12)
    # Sums per row: score minus kl_coef times the sequence KL.
    seq_kl = torch.where(mask.bool(), kl, 0).sum(1)
    torch.testing.assert_close(rewards.sum(1), scores.double() - 0.5 * seq_kl)


def test_shape_rewards_with_zero_kl_coef_is_the_sparse_score():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards = shape_rewards(torch.tensor([2.0, 4.0]), torch.randn(2, 3), 0.0, mask)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 4.0]]))


def test_shape_rewards_errors():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    kl = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        shape_rewards(torch.zeros(2), kl, 0.1, mask)
    with pytest.raises(ValueError, match="kl_coef"):
        shape_rewards(torch.zeros(2), kl, -0.1, torch.ones(2, 3))
    with pytest.raises(ValueError, match="kl_coef"):
        shape_rewards(torch.zeros(2), kl, float("nan"), torch.ones(2, 3))
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(torch.zeros(3), kl, 0.1, torch.ones(2, 3))
    with pytest.raises(ValueError, match="`mask` must have the same shape as `kl`"):
        shape_rewards(torch.zeros(2), kl, 0.1, torch.ones(2, 4))


# ---------------------------------------------------------------- critic-free group advantages
def _returns(groups: int = 3, k: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(groups * k, generator=g, dtype=torch.float64)


def test_rloo_is_the_leave_one_out_baseline():
    k = 4
    r = _returns(k=k)
    adv = group_advantages(r, k, "rloo")
    for i in range(len(r)):
        start = i - i % k
        others = [float(r[j]) for j in range(start, start + k) if j != i]
        assert float(adv[i]) == pytest.approx(float(r[i]) - sum(others) / (k - 1), abs=1e-12)
    torch.testing.assert_close(adv.view(-1, k).sum(1), torch.zeros(3, dtype=torch.float64))


def test_grpo_is_the_group_normalised_return():
    k = 4
    r = _returns(k=k)
    adv = group_advantages(r, k, "grpo", eps=1e-4)
    for group in range(3):
        x = [float(v) for v in r[group * k : (group + 1) * k]]
        mean = sum(x) / k
        std = (sum((v - mean) ** 2 for v in x) / (k - 1)) ** 0.5
        want = torch.tensor([(v - mean) / (std + 1e-4) for v in x], dtype=torch.float64)
        torch.testing.assert_close(adv[group * k : (group + 1) * k], want, rtol=0, atol=1e-12)
    # The std is Bessel-corrected (k - 1): with k = 2 the advantages are +-1/sqrt(2), not +-1.
    pair = group_advantages(torch.tensor([0.0, 3.0, 5.0, 1.0], dtype=torch.float64), 2, "grpo", 0.0)
    half = 0.5**0.5
    torch.testing.assert_close(
        pair, torch.tensor([-half, half, half, -half], dtype=torch.float64), rtol=0, atol=1e-15
    )
    # A group of equal returns has nothing to learn from, whatever the method.
    same = torch.full((4,), 0.7)
    assert torch.equal(group_advantages(same, 4, "grpo"), torch.zeros(4))
    assert torch.equal(group_advantages(same, 4, "rloo"), torch.zeros(4))


def test_the_leave_one_out_gradient_is_unbiased_and_grpo_is_not():
    """Exact expectation over all k-tuples of a 3-armed softmax bandit, k = 2 samples each."""
    k = 2
    theta = torch.tensor([0.3, -0.5, 1.1], dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    logp = theta.log_softmax(-1)
    (exact,) = torch.autograd.grad((logp.exp() * reward).sum(), theta, retain_graph=True)
    expected = {}
    for method in ("rloo", "grpo"):
        total = torch.zeros((), dtype=torch.float64)
        for a, b in itertools.product(range(3), repeat=2):
            adv = group_advantages(reward[[a, b]], k, method)
            prob = (logp[a] + logp[b]).exp().detach()
            total = total + prob * (adv[0] * logp[a] + adv[1] * logp[b]) / k
        (expected[method],) = torch.autograd.grad(total, theta, retain_graph=True)
    torch.testing.assert_close(expected["rloo"], exact, rtol=0, atol=1e-12)
    assert float((expected["grpo"] - exact).norm()) > 0.1 * float(exact.norm())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(6), 4, "rloo"), r"`returns` must be \[n \* 4\]"),
        ((torch.zeros(6), 1, "rloo"), "`group_size` must be an integer >= 2"),
        ((torch.zeros(6), 3, "mean"), r"`method` must be one of \('rloo', 'grpo'\)"),
    ],
)
def test_group_advantages_reject_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(*args)
