"""The per-token KL diagnostics: against a per-sample loop, and logged by a module that asks.

``token_kl_stats`` reads only the response tokens (garbage in the padding changes nothing), and
equals plain Python over the valid tokens; ``top_kl_tokens`` names the right tokens; a module
with ``logging.kl_token_threshold`` logs every ``kl_tokens/*`` key, and ``penalty.trust_region``
leaves the extreme tokens out of the penalty while ``objective/kl`` still measures them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tiny_ppo import fit, module_args

from rlkl_lightning import PPOModule
from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.metrics import samples_table, token_kl_stats, top_kl_tokens
from rlkl_lightning.kl.estimators import per_token_kl


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3
    lengths = [7, 3, 5, 1, 6]
    mask = torch.zeros(5, 7)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    log_ratio[mask == 0] = 1e6  # padding garbage: must not show
    return log_ratio, mask, lengths


def test_token_stats_equal_a_loop_over_the_valid_tokens():
    log_ratio, mask, lengths = _batch()
    kl = per_token_kl(log_ratio, torch.zeros_like(log_ratio), "k3")
    ident = lambda x: x  # noqa: E731
    stats = token_kl_stats(log_ratio, kl * mask, mask, 4.0, ident, ident)
    ratios = [abs(float(log_ratio[r, t])) for r, n in enumerate(lengths) for t in range(n)]
    kls = [float(kl[r, t]) for r, n in enumerate(lengths) for t in range(n)]
    per_sequence = [sum(float(kl[r, t]) for t in range(n)) for r, n in enumerate(lengths)]
    assert float(stats[keys.TOKENS_MAX_LOG_RATIO]) == pytest.approx(max(ratios), rel=1e-6)
    assert float(stats[keys.TOKENS_MAX_KL]) == pytest.approx(max(kls), rel=1e-6)
    assert float(stats[keys.TOKENS_MAX_SEQUENCE_KL]) == pytest.approx(max(per_sequence), rel=1e-6)
    assert float(stats[keys.TOKENS_BEYOND]) == sum(r > 4.0 for r in ratios)
    assert 0 < sum(r > 4.0 for r in ratios) < len(ratios)  # the threshold splits the tokens
    want = np.quantile(np.array(kls, dtype=np.float32), [0.99, 0.999])
    assert float(stats[keys.TOKENS_KL_Q99]) == pytest.approx(want[0], rel=1e-5)
    assert float(stats[keys.TOKENS_KL_Q999]) == pytest.approx(want[1], rel=1e-5)


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("empty", [False, True])
def test_token_stats_do_not_depend_on_the_default_dtype(default, empty):
    """A ``*-true`` precision makes its dtype the default: the quantiles must not mind (also on
    a rank with no response token, whose stand-in zeros are made here)."""
    log_ratio, mask, _ = _batch()
    log_ratio = log_ratio.float()
    mask = torch.zeros_like(mask) if empty else mask
    kl = per_token_kl(log_ratio, torch.zeros_like(log_ratio), "k3") * mask
    ident = lambda x: x  # noqa: E731
    want = token_kl_stats(log_ratio, kl, mask, 4.0, ident, ident)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = token_kl_stats(log_ratio, kl, mask, 4.0, ident, ident)
    finally:
        torch.set_default_dtype(before)
    assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}


def test_top_kl_tokens_names_the_largest_in_order():
    class Tok:
        def decode(self, ids):
            return f"w{ids[0]}"

    ids = torch.tensor([[10, 11, 12, 13], [20, 21, 0, 0]])
    kl = torch.tensor([[0.1, 3.0, -1.0, 2.0], [0.5, 0.2, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert top_kl_tokens(Tok(), ids, kl, mask, rows=2, k=2) == [
        "'w11' 3, 'w13' 2",
        "'w20' 0.5, 'w21' 0.2",  # padding (kl 9) is not a token of the response
    ]
    table = samples_table(["p"], ["r"], torch.tensor([1.0]), 1, top_kl=["'w11' 3"])
    assert table.splitlines()[0] == "| prompt | response | score | largest per-token KL |"
    assert table.splitlines()[2] == "| p | r | 1.000 | 'w11' 3 |"


def test_a_module_logs_the_diagnostics_and_the_trust_region_cuts_the_penalty(tiny_lm_dir):
    torch.manual_seed(0)
    model = PPOModule(
        **module_args(tiny_lm_dir, logging={"kl_token_threshold": 0.02}, penalty={"init_coef": 0.1})
    )
    seen = {}
    trainer = fit(model, batches=3, batch_size=8)
    metrics = trainer.callback_metrics
    for key in (
        keys.TOKENS_MAX_LOG_RATIO,
        keys.TOKENS_MAX_KL,
        keys.TOKENS_KL_Q99,
        keys.TOKENS_KL_Q999,
        keys.TOKENS_BEYOND,
        keys.TOKENS_MAX_SEQUENCE_KL,
    ):
        seen[key] = float(metrics[key])
    assert seen[keys.TOKENS_MAX_KL] >= seen[keys.TOKENS_KL_Q999] >= seen[keys.TOKENS_KL_Q99]
    assert seen[keys.TOKENS_MAX_SEQUENCE_KL] >= float(metrics[keys.KL])
    assert seen[keys.TOKENS_MAX_LOG_RATIO] > 0.02 and seen[keys.TOKENS_BEYOND] > 0

    # The trust region: the penalty of the tokens beyond it is 0, objective/kl is unchanged.
    torch.manual_seed(0)
    cut = PPOModule(**module_args(tiny_lm_dir, penalty={"trust_region": 0.5, "init_coef": 0.1}))
    torch.manual_seed(0)
    whole = PPOModule(**module_args(tiny_lm_dir, penalty={"init_coef": 0.1}))
    for m in (cut, whole):  # a policy away from its reference
        torch.manual_seed(1)
        with torch.no_grad():
            for p in m.policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    prompts = ["the film was", "this book is", "the food", "a story"]
    results = []
    for m in (cut, whole):
        torch.manual_seed(2)
        traj, scores = m.rollout(prompts)
        results.append(m.score(prompts, traj, scores))
    (traj_cut, _, diag_cut), (traj_whole, _, diag_whole) = results
    assert torch.equal(diag_cut["kl_k1"], diag_whole["kl_k1"])  # the measured KL is whole
    ratio = (traj_whole.logprobs - traj_whole.ref_logprobs) * traj_whole.response_mask
    beyond = ratio.abs() > 0.5
    assert 0 < int(beyond.sum()) < int(traj_whole.response_mask.sum())
    assert torch.equal(traj_cut.kl[beyond], torch.zeros(int(beyond.sum())))
    assert torch.equal(traj_cut.kl[~beyond], traj_whole.kl[~beyond])


class ScoreCapture(PPOModule):
    """Keeps the last scored trajectory and diagnostics."""

    def score(self, prompts, traj, policy_scores):
        self.scored = super().score(prompts, traj, policy_scores)
        return self.scored


@pytest.mark.parametrize("trust_region", [None, 0.5])
def test_the_trust_region_logs_what_it_left_out_and_the_penalty_it_applied(
    tiny_lm_dir, trust_region
):
    """``objective/trust_region_masked`` is the fraction of response tokens left out of the
    penalty, and ``objective/non_score_reward`` the penalty applied (the tokens inside); without
    a trust region neither changes (no new key, ``-kl_coef * objective/kl`` as before)."""
    torch.manual_seed(0)
    kl = {"init_coef": 0.1, "trust_region": trust_region}
    model = ScoreCapture(**module_args(tiny_lm_dir, penalty=kl))
    torch.manual_seed(1)
    with torch.no_grad():  # a policy away from its reference
        for p in model.policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    metrics = fit(model, batches=1, batch_size=8).callback_metrics
    traj, _, _ = model.scored
    mask = traj.response_mask.bool()
    whole = float(metrics[keys.KL])
    nsr = float(metrics[keys.NON_SCORE_REWARD])
    if trust_region is None:
        assert keys.TRUST_REGION_MASKED not in metrics
        assert nsr == pytest.approx(-0.1 * whole, rel=1e-6)
        return
    outside = ((traj.logprobs - traj.ref_logprobs).abs() > trust_region) & mask
    assert 0 < int(outside.sum()) < int(mask.sum())
    masked = float(metrics[keys.TRUST_REGION_MASKED])
    assert masked == pytest.approx(float(outside.sum() / mask.sum()), rel=1e-6)
    applied = -0.1 * float((traj.kl * mask).sum(1).mean())  # traj.kl: inside tokens only
    assert nsr == pytest.approx(applied, rel=1e-5)
    assert abs(nsr - (-0.1 * whole)) > 1e-3  # the unmasked penalty is another number
