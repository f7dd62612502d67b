"""``optimization.compile`` without compiling: its buckets, its padding, its option and refusals.

The padding is what gives the compiled pass static shapes; here, eagerly, a padded micro-batch
(more prompt and response columns, fully masked rows) has the loss, the statistics and the
gradients of the micro-batch itself, for every per-token term the objective has. The compiled
pass itself is tested in tests/compiled/test_compiled_update.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy

from rlkl_lightning import PPOModule
from rlkl_lightning.algorithms.compiled_update import (
    INDUCTOR_CACHE_ENV,
    OPTION,
    bucket,
    check,
    largest_micro_batch,
    pad_micro_batch,
    use_inductor_cache,
)
from rlkl_lightning.algorithms.options import Optimization
from rlkl_lightning.algorithms.update import split
from rlkl_lightning.trajectory import Trajectory


@pytest.mark.parametrize(
    "width, limit, padded",
    [(1, 64, 8), (8, 64, 8), (9, 64, 12), (13, 64, 16), (17, 64, 24), (25, 64, 32), (33, 64, 48)]
    + [(49, 64, 64), (9, 10, 10), (13, 12, 13), (100, 200, 128)],
)
def test_widths_round_up_to_a_few_buckets_within_the_limit(width, limit, padded):
    assert bucket(width, limit) == padded


def test_every_width_up_to_1024_meets_one_of_15_buckets():
    sizes = {bucket(w, 1024) for w in range(1, 1025)}
    assert len(sizes) == 15 and max(sizes) == 1024
    assert all(bucket(w, 1024) < 1.5 * w + 8 for w in range(1, 1025))


@pytest.mark.parametrize("minibatches, accum", [(1, 1), (2, 2), (4, 1), (3, 2), (4, 3)])
def test_the_largest_micro_batch_is_the_updates(minibatches, accum):
    for rows in range(1, 40):
        sizes = [len(m) for mb in split(torch.arange(rows), minibatches) for m in split(mb, accum)]
        assert largest_micro_batch(rows, minibatches, accum) == max(sizes), rows


def _micro_batch(vocab: int, loss_weights: bool) -> Trajectory:
    """3 rows, prompts of 2-4 tokens (width 4), responses of 2-5 tokens (width 5)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (3, 9), generator=generator)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, :1] = 0
    mask[0, 7:] = 0
    mask[2, 6:] = 0
    response_mask = mask[:, 4:].float()
    shape = (3, 5)
    old = -torch.rand(shape, generator=generator) * 3
    return Trajectory(
        input_ids=ids,
        attention_mask=mask,
        response_ids=ids[:, 4:],
        response_mask=response_mask,
        logprobs=old,
        ref_logprobs=old - 0.2,
        values=torch.randn(shape, generator=generator),
        advantages=torch.randn(shape, generator=generator),
        returns=torch.randn(shape, generator=generator),
        kl_scale=torch.rand(3, generator=generator) + 0.5,
        loss_weights=response_mask / 7.0 if loss_weights else None,
    )


def _loss_and_grads(module, part):
    module.zero_grad(set_to_none=True)
    loss, stats = module.loss(part)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


@pytest.mark.parametrize(
    "objective",
    [
        {},
        {"importance_ratio": "sequence", "ent_coef": 0.01},
        {"aggregation": "sequence_mean", "cliprange_high": 0.28},
    ],
    ids=["token-mean", "gspo-entropy", "weights"],
)
def test_padding_adds_nothing_to_the_loss_its_statistics_or_its_gradients(tiny_lm_dir, objective):
    module = PPOModule(
        policy=str(tiny_lm_dir),
        sampling={"max_prompt_tokens": 16, "max_new_tokens": 16},
        penalty={"placement": "loss", "loss_estimator": "k3", "init_coef": 0.3},
        objective=objective,
    )
    vocab = module.policy.config.vocab_size
    part = _micro_batch(vocab, loss_weights=bool(objective.get("aggregation")))
    padded = pad_micro_batch(part, rows=5, prompt_width=8, response_width=12)
    assert padded.input_ids.shape == (5, 20) and padded.response_ids.shape == (5, 12)
    # the added rows: fully masked; the real ones: the same tokens where the masks are 1
    assert not padded.attention_mask[3:].any() and not padded.response_mask[3:].any()
    assert torch.equal(padded.attention_mask[:3].sum(1), part.attention_mask.sum(1))
    real = padded.attention_mask[:3].bool()
    assert torch.equal(padded.input_ids[:3][real], part.input_ids[part.attention_mask.bool()])
    loss, stats, grads = _loss_and_grads(module, part)
    padded_loss, padded_stats, padded_grads = _loss_and_grads(module, padded)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(padded_stats, stats, rtol=1e-6, atol=1e-7)
    assert grads.keys() == padded_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_micro_batch_that_already_fits_is_left_as_it_is(tiny_lm_dir):
    part = _micro_batch(30, loss_weights=False)
    assert pad_micro_batch(part, 3, 4, 5) is part
    with pytest.raises(ValueError, match="does not fit"):
        pad_micro_batch(part, 2, 4, 5)


def test_the_option_takes_true_or_false():
    assert Optimization().compile is False
    with pytest.raises(ValueError, match=r"^`optimization.compile` must be True or False, got 1$"):
        Optimization(compile=1)


def test_fsdp_is_refused_by_name_and_packing_runs_compiled():
    def stub(strategy, packing="none"):
        return SimpleNamespace(
            trainer=SimpleNamespace(strategy=strategy),
            device=torch.device("cpu"),
            optimization=Optimization(packing=packing),
        )

    with pytest.raises(ValueError, match=f"^`{OPTION}` does not run under FSDPStrategy"):
        check(stub(FSDPStrategy()))
    single = SingleDeviceStrategy(device="cpu")
    check(stub(single, packing="packed"))  # packed outside the graph (tests/compiled)
    check(stub(single))  # one process, padded rows: runs


def test_inductors_cache_goes_under_the_librarys_unless_the_user_named_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    monkeypatch.setenv("RLKL_CACHE", str(tmp_path / "rlkl"))
    ours = tmp_path / "rlkl" / "inductor"
    for before in (None, inductor_default()):  # unset, or set by importing dynamo
        if before is None:
            monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
        else:
            monkeypatch.setenv(INDUCTOR_CACHE_ENV, before)
        assert use_inductor_cache() == ours
        assert os.environ[INDUCTOR_CACHE_ENV] == str(ours)
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert use_inductor_cache() == tmp_path / "mine"
