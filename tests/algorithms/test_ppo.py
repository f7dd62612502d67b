"""PPOModule on tiny local models: masking, batching, learning, KL penalty, metrics."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.generate_reference import sample as generate_then_score
from helpers.tiny_ppo import PROMPTS, fit, module_args, text_loader
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from rlkl_lightning import AdaptiveKLController, KLControllerCallback, KLDriftMonitor, PPOModule
from rlkl_lightning.algorithms.rollout import response_mask_after_eos
from rlkl_lightning.kl.estimators import sequence_kl
from rlkl_lightning.models.loading import load_causal_lm, load_tokenizer
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.trajectory import Trajectory


def tiny_module(path, **overrides) -> PPOModule:
    return PPOModule(**module_args(path, **overrides))


class Recorder(PPOModule):
    """Records the beta and the logged metrics each batch sees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.betas_used: list[float] = []
        self.history: list[dict[str, float]] = []

    def training_step(self, batch, batch_idx):
        self.betas_used.append(self.kl_coef)
        super().training_step(batch, batch_idx)
        self.history.append({k: float(v) for k, v in self.trainer.callback_metrics.items()})


# ---------------------------------------------------------------- masking and batching
def test_response_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 5, 5, 5]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(response_mask_after_eos(ids, eos_token_id=2), expected)
    assert torch.equal(response_mask_after_eos(ids, eos_token_id=None), torch.ones(3, 4))


def test_tokens_after_eos_change_nothing(tiny_lm_dir):
    """Filler after EOS never reaches the valid positions' log-probs or the sequence KL."""
    model = load_causal_lm(str(tiny_lm_dir)).eval()
    ref = load_causal_lm(str(tiny_lm_dir)).eval()
    torch.nn.init.normal_(ref.lm_head.weight)  # a reference that differs from the policy
    eos = model.config.eos_token_id
    prompt = torch.tensor([[4, 5, 6], [7, 8, 9]])
    response = torch.tensor([[10, eos, 11, 12], [13, 14, 15, 16]])
    mask = response_mask_after_eos(response, eos)

    def rollout(resp):
        am = torch.cat([torch.ones_like(prompt), mask.long()], 1)
        return Trajectory(torch.cat([prompt, resp], 1), am, resp, mask)

    other = response.clone()
    other[0, 2:] = torch.tensor([20, 21])  # different filler after the EOS of row 0
    with torch.no_grad():
        a, b = score_tokens(model, rollout(response), 1.0), score_tokens(model, rollout(other), 1.0)
        ra, rb = score_tokens(ref, rollout(response), 1.0), score_tokens(ref, rollout(other), 1.0)
    assert torch.allclose(a.logprobs * mask, b.logprobs * mask, atol=1e-6)
    kl_a = sequence_kl(a.logprobs - ra.logprobs, mask)
    kl_b = sequence_kl(b.logprobs - rb.logprobs, mask)
    assert torch.allclose(kl_a, kl_b, atol=1e-6)
    assert kl_a.abs().min() > 1e-3  # the test is not vacuous: the KL is not zero


def test_batched_scores_equal_per_sample_scores(tiny_lm_dir):
    """Left padding in a batch gives the same log-probs as each prompt on its own."""
    seed_everything(0)
    model = load_causal_lm(str(tiny_lm_dir)).eval()
    tok = load_tokenizer(str(tiny_lm_dir))
    prompts = ["the film", "this book is very", "a"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    ro = generate_then_score(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        max_new_tokens=6,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.no_grad():
        batched = score_tokens(model, ro, 1.0)
        for i, prompt in enumerate(prompts):
            p = tok(prompt, return_tensors="pt")["input_ids"]
            n = int(ro.response_mask[i].sum())
            resp = ro.response_ids[i : i + 1, :n]
            single = Trajectory(
                torch.cat([p, resp], 1),
                torch.ones(1, p.shape[1] + n, dtype=torch.long),
                resp,
                torch.ones(1, n),
            )
            alone = score_tokens(model, single, 1.0)
            assert torch.allclose(batched.logprobs[i, :n], alone.logprobs[0], atol=1e-5)


# ---------------------------------------------------------------- learning and KL penalty
@pytest.mark.slow  # a training run of 25-40 batches: make test-slow
def test_policy_learns_a_trivial_reward(tiny_lm_dir):
    seed_everything(0)
    module = Recorder(**module_args(tiny_lm_dir))
    fit(module, batches=40)
    scores = [h["objective/score"] for h in module.history]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    # A random 30-word policy says "good" ~1/30 of the time; PPO must raise that clearly.
    assert first < 0.15
    assert last > first + 0.3, (first, last)


@pytest.mark.slow  # a training run of 25-40 batches: make test-slow
def test_large_fixed_beta_keeps_kl_near_zero(tiny_lm_dir):
    results = {}
    for beta in (0.0, 20.0):
        seed_everything(1)
        module = Recorder(**module_args(tiny_lm_dir, penalty={"init_coef": beta}))
        fit(module, batches=25)
        results[beta] = [h["objective/kl_k3"] for h in module.history[-5:]]
    free_kl = sum(results[0.0]) / 5
    held_kl = sum(results[20.0]) / 5
    assert free_kl > 1.0, free_kl  # without a penalty the policy runs away from the reference
    assert held_kl < 0.1 * free_kl, (held_kl, free_kl)


def test_controller_callback_sets_the_beta_of_the_next_batch(tiny_lm_dir):
    seed_everything(2)
    controller = AdaptiveKLController(init_kl_coef=0.5, target=0.5, horizon=64)
    module = Recorder(**module_args(tiny_lm_dir, penalty={"init_coef": 123.0}))
    fit(module, batches=6, batch_size=8, callbacks=[KLControllerCallback(controller)])
    # Replay the controller on the logged KLs: batch i uses the beta after batch i - 1.
    replay = AdaptiveKLController(init_kl_coef=0.5, target=0.5, horizon=64)
    expected = [replay.value]
    for h in module.history[:-1]:
        expected.append(replay.update(h["objective/kl"], 8))
    assert module.betas_used == pytest.approx(expected, rel=1e-6)
    assert len(set(module.betas_used)) > 1


# ---------------------------------------------------------------- metrics and validation
DESIGN_KEYS = [
    "objective/kl",
    "objective/kl_per_token",
    "objective/kl_k1",
    "objective/kl_k2",
    "objective/kl_k3",
    "objective/kl_exact",
    "objective/kl_coef",
    "objective/score",
    "objective/non_score_reward",
    "objective/entropy",
    "policy/approx_kl",
    "policy/clipfrac",
    "loss/policy",
    "loss/value",
    "kl_monitor/avg_kl",
    "kl_monitor/state",
    "val/perplexity",
    "val/perplexity_ref",
    "perf/tokens_per_s",
    "perf/throughput",
    "perf/rollout_s",
    "perf/update_s",
    "perf/peak_mem_gb/rollout/rank0",
    "perf/peak_mem_gb/score/rank0",
    "perf/peak_mem_gb/update/rank0",
]


def test_every_metric_reaches_tensorboard(tiny_lm_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seed_everything(3)
    module = tiny_module(tiny_lm_dir, logging={"log_samples_every": 2})
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    callbacks = [
        KLControllerCallback(AdaptiveKLController(init_kl_coef=0.1, target=1.0, horizon=100)),
        KLDriftMonitor(target=1.0, window=2, min_batches=2),  # judged from batch 2 of 4
    ]
    val = text_loader(["the film was very good", "the food was bad but fine"] * 2, 2)
    fit(module, batches=4, batch_size=8, callbacks=callbacks, logger=logger, val=val)
    events = EventAccumulator(str(tmp_path / "run" / "version_0"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    missing = [k for k in DESIGN_KEYS if k not in scalars]
    assert not missing, missing
    assert events.Tags()["tensors"] or events.Tags().get("text"), "no generations were logged"


def test_perplexity_matches_a_direct_computation(tiny_lm_dir):
    seed_everything(4)
    module = tiny_module(tiny_lm_dir)
    texts = ["the film was very good", "bad food", "this book is quite nice and the plot is dull"]
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    (metrics,) = trainer.validate(module, text_loader(texts, 2), verbose=False)
    tok = module.tokenizer
    nll, count = 0.0, 0
    for text in texts:
        ids = tok(f"{tok.bos_token}{text}{tok.eos_token}", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = module.policy(ids).logits[0, :-1]
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    assert metrics["val/perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    # Before any update the policy is the reference.
    assert metrics["val/perplexity_ref"] == pytest.approx(metrics["val/perplexity"], rel=1e-5)


# ---------------------------------------------------------------- ppo.advantage
CALLS: list[str] = []


def sign_advantages(traj, kl_coef, options, global_sum):
    """A token-level estimator of a user's (by dotted path): the sign of GAE's advantages."""
    from rlkl_lightning.algorithms.advantage_estimators import gae_advantages

    CALLS.append(type(options).__name__)
    shaped = gae_advantages(traj, kl_coef, options, global_sum)
    return shaped._replace(advantages=shaped.advantages.sign() * traj.response_mask)


@pytest.fixture
def registered_advantage():
    """``sign``, a token-level estimator registered from outside the package (undone after)."""
    from rlkl_lightning.algorithms.advantage_estimators import ADVANTAGES

    ADVANTAGES["token"].register("sign")(sign_advantages)
    CALLS.clear()
    yield "sign"
    ADVANTAGES["token"].unregister("sign")


@pytest.mark.parametrize("how", ["registered", "dotted path"])
def test_ppo_trains_with_a_plugged_token_level_advantage(tiny_lm_dir, registered_advantage, how):
    """``ppo.advantage`` names the estimator PPO shapes every batch with, before the update."""
    name = registered_advantage if how == "registered" else f"{__name__}.sign_advantages"
    seed_everything(0)
    module = tiny_module(tiny_lm_dir, ppo={"advantage": name})
    assert module.hparams["ppo"]["advantage"] == name
    prompts = PROMPTS[:4] * 2
    traj, policy_scores = module.rollout(prompts)
    traj = module.shape(module.score(prompts, traj, policy_scores)[0])
    assert CALLS == ["PPOOptions"]
    assert set(traj.advantages[traj.response_mask.bool()].tolist()) <= {-1.0, 0.0, 1.0}
    fit(module, batches=2, batch_size=8)
    assert CALLS == ["PPOOptions"] * 3  # once per batch


def test_the_default_advantage_is_gae_bit_for_bit(tiny_lm_dir):
    """``gae`` by name, by default and by its dotted path shape the same trajectory alike."""
    path = "rlkl_lightning.algorithms.advantage_estimators.gae_advantages"
    modules = [tiny_module(tiny_lm_dir, ppo=ppo) for ppo in ({}, {"advantage": "gae"})]
    modules.append(tiny_module(tiny_lm_dir, ppo={"advantage": path}))
    assert [m.ppo.advantage for m in modules] == ["gae", "gae", path]
    seed_everything(0)
    prompts = PROMPTS[:4] * 2
    traj, policy_scores = modules[0].rollout(prompts)
    traj = modules[0].score(prompts, traj, policy_scores)[0]
    shaped = [m.shape(traj) for m in modules]
    for other in shaped[1:]:
        for a, b in zip(shaped[0], other, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            "rloo",  # a group-level estimator
            r"^`ppo\.advantage` must be one of \('gae',\) or the dotted path of a token-level "
            r"advantage estimator .*, got 'rloo'$",
        ),
        (
            "nowhere.gae",
            r"^`ppo\.advantage` must be one of \('gae',\) or the dotted path of a token-level "
            r"advantage estimator .*, got 'nowhere.gae', which does not import: No module named "
            r"'nowhere'$",
        ),
    ],
)
def test_a_bad_advantage_is_refused_in_one_line_before_the_models_load(tiny_lm_dir, bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_module("/nonexistent/policy", ppo={"advantage": bad})


def test_loss_total_adds_the_kl_term_divided_by_the_whitening_scale(tiny_lm_dir):
    """docs/metrics.md's ``loss/total`` with the KL in the loss, PPO's ``kl_scale`` included.

    ``loss/kl`` is the term in nats before the division (docs/kl.md, "What beta means in the
    loss"), so ``loss/total = loss/policy + vf_coef loss/value + kl_coef loss/kl / s``: one
    ``s`` per batch, so the means over the updates keep the sum.
    """

    class Recording(PPOModule):
        def log_batch(self, prompts, responses, traj, diagnostics, stats, clock, peaks=None):
            scale = traj.kl_scale.unique()
            assert scale.numel() == 1  # the batch's one whitening scale
            self.seen.append((self.kl_coef, float(scale), {k: float(v) for k, v in stats.items()}))
            super().log_batch(prompts, responses, traj, diagnostics, stats, clock, peaks)

    seed_everything(0)
    args = module_args(tiny_lm_dir, penalty={"init_coef": 0.5, "placement": "loss"})
    module = Recording(**args)
    module.seen = []
    fit(module, batches=2, batch_size=4)
    assert len(module.seen) == 2
    for beta, s, stats in module.seen:
        assert abs(s - 1) > 0.05  # the division shows
        rest = stats["loss/policy"] + module.ppo.vf_coef * stats["loss/value"]
        kl_term = beta * stats["loss/kl"] / s
        assert stats["loss/total"] == pytest.approx(rest + kl_term, rel=1e-5, abs=1e-6)
        assert abs(kl_term - beta * stats["loss/kl"]) > 1e-4  # the formula without s differs
