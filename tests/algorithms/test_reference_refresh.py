"""Reference refreshes: the weights they make, and runs that refresh, resume and stay anchored.

* the weights: a hard reset copies the policy; a mix is ``alpha x policy + (1 - alpha) x ref``
  weight by weight, for a frozen copy and for a LoRA policy (whose policy stays the same);
* resume: a run interrupted after a refresh and resumed equals the uninterrupted run bit for bit
  (every KL, beta and loss, the final weights and the reference), full and LoRA, and without the
  refreshed weights in the checkpoint it would not;
* anchoring: the first KL after a resume is the uninterrupted run's, not zero;
* the KL callbacks: beta holds for ``hold_after_refresh`` batches, the monitor counts the
  batches since the refresh.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.trainers import fit_on_prompts
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from rlkl_lightning import (
    AdaptiveKLController,
    KLControllerCallback,
    KLDriftMonitor,
    PPOModule,
    ReferenceRefresh,
)
from rlkl_lightning.algorithms.reference_refresh import mix_into_reference
from rlkl_lightning.checkpoints import AtomicCheckpointIO
from rlkl_lightning.data import PromptDataModule
from rlkl_lightning.models.logprobs import score_tokens

WORDS = "the film was good bad this book is very not a story food nice dull plot".split()
PROMPTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 3)) for i in range(12)]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
LORA_SAVE = {**LORA, "modules_to_save": ["ln_f"]}  # ln_f's copy trains; the reference's is
STEPS_PER_BATCH = 2  # ppo_epochs 1 x num_minibatches 2


def module(policy_dir, peft=None) -> PPOModule:
    return PPOModule(
        policy=str(policy_dir),
        penalty={"init_coef": 0.2},
        sampling={"max_prompt_tokens": 8, "max_new_tokens": 6},
        optimization={"ppo_epochs": 1, "num_minibatches": 2, "lr": 3e-3},
        logging={"log_samples_every": 0},
        models={"peft": peft},
    )


class Recorder(Callback):
    def __init__(self):
        self.rows: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append({"beta_used": pl_module.kl_coef})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        for key in ("objective/kl", "objective/kl_coef", "loss/policy", "reference/refreshes"):
            if key in m:
                self.rows[-1][key] = float(m[key])


class SimulatedCrash(RuntimeError):
    pass


class Crash(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at * STEPS_PER_BATCH:
            raise SimulatedCrash(f"crash at batch {self.at}")


def run(policy_dir, tmp_path, ckpt_dir, extra=(), ckpt_path=None, hold=0, every=2, **overrides):
    seed_everything(0)
    model = module(policy_dir, **overrides)
    controller = KLControllerCallback(
        AdaptiveKLController(0.2, target=0.35, horizon=40), hold_after_refresh=hold
    )
    monitor = KLDriftMonitor(target=0.35, window=2, min_batches=2, verbose=False)
    recorder = Recorder()
    every_batch = dict(save_last=True, save_top_k=-1, every_n_train_steps=STEPS_PER_BATCH)
    callbacks = [controller, monitor, recorder, *extra]
    callbacks += [ReferenceRefresh(every=every)] if every else []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, **every_batch))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    data = PromptDataModule(prompts=str(prompts), heldout=None, batch_size=4, seed=5)
    plugins = [AtomicCheckpointIO()]
    fit_on_prompts(
        model, data, callbacks=callbacks, ckpt_path=ckpt_path, max_epochs=2, plugins=plugins
    )
    return model, controller, monitor, recorder


@pytest.fixture(scope="module")
def refreshed_run(tiny_lm_dir, tmp_path_factory):
    """The uninterrupted run with hard resets every 2 batches, and its checkpoints of a run cut at
    batch 3: trained once for the two tests that resume from that cut."""
    tmp = tmp_path_factory.mktemp("refreshed_run")
    full = run(tiny_lm_dir, tmp, tmp / "full")
    with pytest.raises(SimulatedCrash):  # the last checkpoint is after batch 3: one refresh
        run(tiny_lm_dir, tmp, tmp / "cut", extra=[Crash(at=3)])
    return full, tmp / "cut"


def cut_run(tiny_lm_dir, tmp_path, request, **settings):
    """The uninterrupted run and the cut one's checkpoints in ``tmp_path / "cut"``."""
    if not settings:  # the shared run, its checkpoints copied: a resume writes beside them
        full, cut = request.getfixturevalue("refreshed_run")
        shutil.copytree(cut, tmp_path / "cut")
        return full
    full = run(tiny_lm_dir, tmp_path, tmp_path / "full", **settings)
    with pytest.raises(SimulatedCrash):
        run(tiny_lm_dir, tmp_path, tmp_path / "cut", extra=[Crash(at=3)], **settings)
    return full


def reference_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k in model.refreshed_keys}


# ---------------------------------------------------------------- the weights of a refresh
def test_a_mix_is_the_weighted_mean_and_a_hard_reset_a_copy(tiny_lm_dir):
    model = module(tiny_lm_dir)
    with torch.no_grad():
        for p in model.policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    pol = {k: v.clone() for k, v in model.policy.state_dict().items()}
    ref0 = {k: v.clone() for k, v in model.reference.state_dict().items()}
    keys = mix_into_reference(model.policy, model.reference, 0.25)
    assert set(keys) == {f"reference.{n}" for n, _ in model.reference.named_parameters()} | {
        "reference.lm_head.weight"  # tied to the embedding: named, and mixed once
    }
    ref = model.reference.state_dict()
    for name, p0 in ref0.items():
        if p0.is_floating_point():
            expected = (0.25 * pol[name].double() + 0.75 * p0.double()).float()
            torch.testing.assert_close(ref[name], expected, rtol=0, atol=1e-6)
    mix_into_reference(model.policy, model.reference, 1.0)
    for name, p in model.reference.state_dict().items():
        assert torch.equal(p, pol[name]), name


@pytest.mark.parametrize("peft", [LORA, LORA_SAVE], ids=["lora", "modules_to_save"])
@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_a_lora_refresh_moves_the_reference_and_leaves_the_policy(tiny_lm_dir, alpha, peft):
    model = module(tiny_lm_dir, peft=peft)
    with torch.no_grad():  # trained weights that do something (B starts at zero)
        for p in model.policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    seed_everything(5)
    traj, _ = model.rollout(PROMPTS[:4])
    policy_before = score_tokens(model.policy, traj, 1.0).logprobs
    ref_before = score_tokens(model.reference, traj, 1.0).logprobs
    model.refresh_reference(alpha)
    keys = model.refreshed_keys
    assert keys and all(k.startswith("policy.") for k in keys)
    assert sum(k.endswith("base_layer.weight") for k in keys) == 4  # c_attn, c_fc x 2 layers
    assert len(keys) == 4 + 2 * ("modules_to_save" in peft)  # ln_f's weight and bias
    policy_after = score_tokens(model.policy, traj, 1.0).logprobs
    ref_after = score_tokens(model.reference, traj, 1.0).logprobs
    valid = traj.response_mask.bool()
    torch.testing.assert_close(policy_after[valid], policy_before[valid], rtol=0, atol=1e-5)
    if alpha == 1.0:  # the reference is the policy now
        torch.testing.assert_close(ref_after[valid], policy_before[valid], rtol=0, atol=1e-5)
        assert all(
            not p.any() for n, p in model.policy.named_parameters() if "lora_B" in n
        )  # fresh adapters: B = 0
    else:  # between the two, away from both
        assert (ref_after - ref_before)[valid].abs().max() > 1e-3
        assert (ref_after - policy_before)[valid].abs().max() > 1e-3
    assert model.reference_refreshes == 1


def test_bad_settings_name_the_option(tiny_lm_dir):
    for kwargs, message in [
        ({"every": 0}, "`every` must be an int >= 1"),
        ({"every": 5, "mode": "ema"}, "`mode` must be one of ('hard', 'mix')"),
        ({"every": 5, "mode": "mix"}, "`alpha` must be a number in (0, 1)"),
        ({"every": 5, "mode": "mix", "alpha": 1.5}, "`alpha` must be a number in (0, 1)"),
        ({"every": 5, "alpha": 0.5}, "`alpha` must be None with mode 'hard'"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ReferenceRefresh(**kwargs)
    from types import SimpleNamespace

    trainer = SimpleNamespace(callbacks=[])
    with pytest.raises(ValueError, match="the module must be an RLPipeline"):
        ReferenceRefresh(every=5).setup(trainer, torch.nn.Linear(1, 1), "fit")
    with pytest.raises(ValueError, match="hold_after_refresh must be an int >= 0"):
        KLControllerCallback(AdaptiveKLController(0.1, 6.0, 100), hold_after_refresh=-1)


# ---------------------------------------------------------------- runs that refresh and resume
@pytest.mark.parametrize("every", [2, None], ids=["refreshed", "fixed"])
@pytest.mark.parametrize("peft", [None, LORA], ids=["full", "lora"])
def test_a_run_interrupted_after_a_refresh_resumes_bit_for_bit(
    tiny_lm_dir, tmp_path, peft, every, request
):
    """With and without refreshes, full and LoRA: the resumed run is the uninterrupted one."""
    settings = {} if (peft, every) == (None, 2) else {"peft": peft, "every": every}
    full, full_ctl, full_mon, full_rec = cut_run(tiny_lm_dir, tmp_path, request, **settings)
    if every:
        assert [r["reference/refreshes"] for r in full_rec.rows] == [0, 0, 1, 1, 2, 2]
        # Right after each hard reset the KL is about zero (rollout and reference passes
        # differ only by float rounding), and it is not before.
        for i in (2, 4):
            assert abs(full_rec.rows[i]["objective/kl"]) < 1e-4
            assert abs(full_rec.rows[i + 1]["objective/kl"]) > 1e-3
    else:
        assert all("reference/refreshes" not in r for r in full_rec.rows)

    last = tmp_path / "cut" / "last.ckpt"  # after batch 3: one refresh
    saved = torch.load(last, weights_only=True)
    assert saved["rlkl_counters"]["reference_refreshes"] == (1 if every else 0)
    assert set(saved.get("rlkl_reference", {})) == set(full.refreshed_keys)
    assert bool(full.refreshed_keys) == bool(every)  # nothing extra is saved without refreshes

    resumed, ctl, mon, rec = run(
        tiny_lm_dir, tmp_path, tmp_path / "cut", ckpt_path=last, peft=peft, every=every
    )
    assert rec.rows == full_rec.rows[3:]  # every beta, KL and loss, bit for bit
    assert abs(rec.rows[0]["objective/kl"]) > 1e-3  # anchored: the KL did not fall to zero
    assert ctl.state_dict() == full_ctl.state_dict()
    assert mon.state_dict() == full_mon.state_dict()
    ours, theirs = resumed.state_dict(), full.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_without_the_refreshed_weights_the_resume_would_differ(tiny_lm_dir, tmp_path, request):
    """The resume test can fail: a checkpoint without its refreshed reference re-anchors."""
    _, _, _, full_rec = cut_run(tiny_lm_dir, tmp_path, request)
    last = tmp_path / "cut" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    del saved["rlkl_reference"]  # what a checkpoint without the refreshed reference holds
    torch.save(saved, tmp_path / "stripped.ckpt")
    stripped = tmp_path / "stripped.ckpt"
    _, _, _, rec = run(tiny_lm_dir, tmp_path, tmp_path / "cut2", ckpt_path=stripped)
    assert rec.rows[0]["objective/kl"] != full_rec.rows[3]["objective/kl"]


def test_beta_holds_after_a_refresh_and_the_monitor_counts_since_it(tiny_lm_dir, tmp_path):
    model, ctl, mon, rec = run(tiny_lm_dir, tmp_path, None, hold=1)
    betas = [r["objective/kl_coef"] for r in rec.rows]
    # Batches 3 and 5 (0-based 2 and 4) come right after a refresh: beta is not updated.
    assert betas[2] == betas[1] and betas[4] == betas[3]
    assert betas[1] != betas[0] and betas[3] != betas[2] and betas[5] != betas[4]
    assert ctl.n_refreshes == mon.n_refreshes == 2
    # The window keeps the last KLs across refreshes ("too high" is judged as usual); the
    # monitor counts those since the last refresh, for "too low".
    assert list(mon.values) == [rec.rows[4]["objective/kl"], rec.rows[5]["objective/kl"]]
    assert mon.since_refresh == 2 and mon.refresh_every == 2


def test_the_optimizer_state_is_cleared_with_reset_optimizer(tiny_lm_dir, tmp_path):
    class Look(Callback):
        sizes: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            state = trainer.optimizers[0].state
            self.sizes.append(len(state))

    look = Look()
    seed_everything(0)
    model = module(tiny_lm_dir)
    refresh = ReferenceRefresh(every=2, reset_optimizer=True)
    fit_on_prompts(model, PROMPTS[:12], batch_size=4, callbacks=[look, refresh], max_epochs=1)
    assert look.sizes[0] == 0 and look.sizes[1] > 0
    assert look.sizes[2] == 0  # cleared after batch 2's refresh


def test_the_export_of_a_refreshed_lora_checkpoint_is_the_policy(tiny_lm_dir, tmp_path):
    """A refresh moved part of the adapters into base weights: the export must take them."""
    from transformers import AutoModelForCausalLM

    from rlkl_lightning.export import export_checkpoint, export_module

    model, *_ = run(tiny_lm_dir, tmp_path, tmp_path / "ckpt", peft=LORA)
    from_module = AutoModelForCausalLM.from_pretrained(export_module(model, tmp_path / "a"))
    last = export_checkpoint(tmp_path / "ckpt" / "last.ckpt", tmp_path / "b")
    from_checkpoint = AutoModelForCausalLM.from_pretrained(last)
    ours, theirs = from_checkpoint.state_dict(), from_module.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
