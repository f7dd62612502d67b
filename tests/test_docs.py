"""The docs say what the code does.

* every logged metric is defined in docs/metrics.md;
* ``group.drop_zero_std_groups``: a group of equal scores has advantages 0 only without the KL
  in the reward; with it, GRPO's are of unit scale whatever beta (docs/pipeline.md says so).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from rlkl_lightning import metric_keys
from rlkl_lightning.algorithms import options, rloo
from rlkl_lightning.algorithms.advantages import group_advantages

ROOT = Path(__file__).resolve().parents[1]
#: Logged by the world's SFT (docs/worlds.md), not by a training run.
NOT_A_RUNS_METRIC = {metric_keys.VAL_LOSS}


def test_every_metric_key_is_defined_in_the_metrics_page():
    page = (ROOT / "docs" / "metrics.md").read_text()
    names = {
        value
        for name, value in vars(metric_keys).items()
        if name.isupper() and isinstance(value, str)
    }
    assert metric_keys.TRUST_REGION_MASKED in names
    assert sorted(k for k in names - NOT_A_RUNS_METRIC if f"`{k}`" not in page) == []


def test_a_flat_group_has_kl_advantages_with_the_kl_in_the_reward_and_the_docs_say_so():
    k, kl = 4, torch.tensor([0.5, 1.5, 3.0, 7.0], dtype=torch.float64)  # one group, equal scores
    for beta in (0.01, 0.1, 1.0):
        returns = 0.7 - beta * kl  # the score, then the KL in the reward
        centred = kl - kl.mean()
        want = -beta * k / (k - 1) * centred
        assert torch.allclose(group_advantages(returns, k, "rloo"), want)
        grpo = group_advantages(returns, k, "grpo")
        assert torch.allclose(grpo, -centred / kl.std(), rtol=1e-2)  # eps: 1e-4 on the std
        assert grpo.std() == pytest.approx(1.0, rel=1e-2)  # unit scale, not beta's
    assert torch.equal(group_advantages(torch.full((k,), 0.7), k, "grpo"), torch.zeros(k))
    pipeline = (ROOT / "docs" / "pipeline.md").read_text()
    texts = {
        "docs/pipeline.md": pipeline.split("`group.drop_zero_std_groups`")[1].split("\n- ")[0],
        "GroupOptions": inspect.getdoc(options.GroupOptions),
        "zero_std_groups": inspect.getdoc(rloo.zero_std_groups),
    }
    for where, text in texts.items():
        flat = " ".join(text.split())
        assert "0 anyway" not in flat and "0 whatever the method" not in flat, where
        assert "c - beta" in flat, where  # the returns of a flat group, said


def test_the_aggregation_docs_agree_on_ddp_and_name_gspos_aggregation():
    from rlkl_lightning.algorithms import aggregation

    module = " ".join(inspect.getdoc(aggregation).split())
    page = " ".join((ROOT / "docs" / "pipeline.md").read_text().split())
    for text in (module, page):  # token_mean under DDP: the mean of the ranks' token means
        assert "the mean of the ranks' token means" in text
    assert "the formula over the global minibatch: ``token_mean``" not in module
    assert "| GSPO (Zheng et al. 2025) | `sequence_mean` |" in page
