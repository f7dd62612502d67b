"""LoRA policies: the reference is the policy with its adapters off, and the three known traps.

* peft#850 (``modules_to_save`` originals lost on reload): the reference's log-probs equal
  the base model's bit for bit, after training and after a resume;
* peft#3447 (``disable_adapter`` unfreezes adapters): no adapter weight is trainable, or used,
  in the reference pass, and every ``requires_grad`` flag is as before afterwards;
* ms-swift #9934 (an adapter that silently failed to load stays freshly initialised): a
  checkpoint whose adapter weights are missing or renamed stops the resume and the export.
"""

from __future__ import annotations

import pytest
import torch
from helpers.trainers import fit_on_prompts
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint

from rlkl_lightning import PPOModule
from rlkl_lightning.data import PromptDataModule
from rlkl_lightning.export import export_checkpoint, export_module
from rlkl_lightning.models.loading import load_causal_lm
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.models.lora import AdaptersOff
from rlkl_lightning.rewards import FunctionReward

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
# ln_f's copy trains; its original must stay the reference's (peft#850).
LORA_SAVE = {**LORA, "modules_to_save": ["ln_f"]}
PROMPTS = ["the film was", "this book is", "the food", "it was really", "a story", "not a"]


def good_fraction(prompt: str, response: str) -> float:
    words = response.split()
    return sum(w == "good" for w in words) / max(len(words), 1)


def lora_module(path, peft=LORA, **overrides) -> PPOModule:
    args = dict(
        policy=str(path),
        models={"peft": peft},
        reward=FunctionReward(good_fraction),
        penalty={"init_coef": 0.1},
        sampling={"max_prompt_tokens": 8, "max_new_tokens": 6},
        optimization={"ppo_epochs": 1, "num_minibatches": 2, "lr": 3e-2},
        logging={"log_samples_every": 0},
    )
    args.update(overrides)
    return PPOModule(**args)


def data(tmp_path) -> PromptDataModule:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS * 2) + "\n")
    return PromptDataModule(prompts=str(path), heldout=None, batch_size=4, seed=1)


def fit(module, tmp_path, batches: int, callbacks=(), ckpt_path=None):
    """``batches`` batches of 2 optimizer steps each over ``data(tmp_path)``."""
    return fit_on_prompts(
        module, data(tmp_path), callbacks=callbacks, ckpt_path=ckpt_path, max_steps=batches * 2
    )


def a_batch(module):
    seed_everything(5)
    traj, _ = module.rollout(PROMPTS[:4])
    return traj


def trainable(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def test_only_adapters_and_value_head_train_and_no_copy_is_held(tiny_lm_dir):
    module = lora_module(tiny_lm_dir)
    assert isinstance(module.reference, AdaptersOff)
    assert module.reference.model is module.policy  # the same modules, not a copy
    names = list(trainable(module))
    assert names and all(".lora_" in n or n.startswith("value_head.") for n in names)
    assert any(n.startswith("value_head.") for n in names)
    assert not any(k.startswith("reference.") for k in module.state_dict())
    base = load_causal_lm(str(tiny_lm_dir))
    held = sum(p.numel() for p in module.parameters())
    adapters = sum(p.numel() for n, p in module.named_parameters() if ".lora_" in n)
    head = sum(p.numel() for p in module.value_head.parameters())
    assert held == sum(p.numel() for p in base.parameters()) + adapters + head
    (optimizer,), _ = module.configure_optimizers()
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in module.parameters() if p.requires_grad
    }


@pytest.mark.parametrize("peft", [LORA, LORA_SAVE], ids=["lora", "modules_to_save"])
def test_reference_log_probs_equal_the_base_models_bit_for_bit_after_training(
    tiny_lm_dir, tmp_path, peft
):
    module = lora_module(tiny_lm_dir, peft=peft)
    before = trainable(module)
    fit(module, tmp_path, batches=2)
    moved = [n for n, p in trainable(module).items() if not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in moved)
    if peft is LORA_SAVE:
        assert any("modules_to_save" in n for n in moved)
    base = load_causal_lm(str(tiny_lm_dir))
    module.speed_up(base)  # what the module does to every model it loads
    traj = a_batch(module)
    with torch.inference_mode():
        ref = score_tokens(module.reference, traj, 1.0)
        want = score_tokens(base, traj, 1.0)
        policy = score_tokens(module.policy, traj, 1.0)
    assert torch.equal(ref.logprobs, want.logprobs)
    assert torch.equal(ref.logits, want.logits)
    assert (policy.logprobs - want.logprobs).abs().max() > 1e-3  # the adapters do act


def test_no_adapter_weight_is_trainable_or_used_in_the_reference_pass(tiny_lm_dir):
    module = lora_module(tiny_lm_dir, peft=LORA_SAVE)
    traj = a_batch(module)
    adapters = {n: p for n, p in module.policy.named_parameters() if ".lora_" in n}
    # Stand in for an adapter loaded with inference_mode=True: one adapter weight is frozen.
    frozen = next(n for n in adapters if "lora_A" in n)
    adapters[frozen].requires_grad_(False)
    flags = {n: p.requires_grad for n, p in module.named_parameters()}

    seen: list[bool] = []
    layer = module.policy.transformer.h[0].attn.c_attn
    hook = layer.register_forward_pre_hook(
        lambda mod, args: seen.append(any(p.requires_grad for p in mod.lora_A.parameters()))
    )
    with torch.enable_grad():  # so that a used adapter would get a gradient
        ref = score_tokens(module.reference, traj, 1.0)
    hook.remove()
    assert seen and not any(seen)  # the plain-head check, then the scoring pass
    # No weight that requires a gradient took part: the adapters were not in the graph.
    assert not ref.logprobs.requires_grad
    with torch.enable_grad():
        assert score_tokens(module.policy, traj, 1.0).logprobs.requires_grad
    assert {n: p.requires_grad for n, p in module.named_parameters()} == flags  # peft#3447

    # Without the guard, peft's own context marks the frozen adapter weight trainable again:
    # this is the trap, present in the pinned peft version.
    with module.reference.peft_model.disable_adapter():
        pass
    assert adapters[frozen].requires_grad


def _checkpoint(module, tmp_path, batches: int):
    t = fit(module, tmp_path, batches)
    path = tmp_path / f"after{batches}.ckpt"
    t.save_checkpoint(path)
    return path


class SimulatedCrash(RuntimeError):
    """A failure in the middle of training."""


class Crash(Callback):
    """Stop the run with an error when batch ``at`` starts (a kill, an OOM)."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.batches_seen == self.at:
            raise SimulatedCrash


def checkpointed_run(policy_dir, tmp_path, batches, crash_at=None, ckpt_path=None, ran=None):
    """``ran``: a list that gets the index of every batch this run trains on."""
    seed_everything(0)
    module = lora_module(policy_dir, peft=LORA_SAVE)
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)]
    if crash_at is not None:
        callbacks.append(Crash(crash_at))
    if ran is not None:
        callbacks.append(LambdaCallback(on_train_batch_start=lambda *a: ran.append(a[-1])))
    fit(module, tmp_path, batches, callbacks, ckpt_path)
    return module


def test_checkpoint_holds_the_trainable_weights_only_and_resumes_exactly(tiny_lm_dir, tmp_path):
    full = checkpointed_run(tiny_lm_dir, tmp_path / "full", batches=3)
    with pytest.raises(SimulatedCrash):
        checkpointed_run(tiny_lm_dir, tmp_path / "cut", batches=3, crash_at=1)
    last = tmp_path / "cut" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["rlkl_counters"]["batches_seen"] == 1
    assert set(saved["state_dict"]) == set(trainable(full))  # no frozen base weight
    assert not any("base_layer" in k or "original_module" in k for k in saved["state_dict"])
    ran = []
    resumed = checkpointed_run(tiny_lm_dir, tmp_path / "cut", batches=3, ckpt_path=last, ran=ran)

    assert ran == [1, 2]  # it went on from the checkpoint: batch 0 was not trained again
    assert resumed.batches_seen == full.batches_seen == 3
    want, got = trainable(full), trainable(resumed)
    assert all(torch.equal(got[n], want[n]) for n in want)
    # The reload kept the reference intact: it is still the base model, bit for bit.
    traj = a_batch(resumed)
    with torch.inference_mode():
        ref = score_tokens(resumed.reference, traj, 1.0)
        base_model = load_causal_lm(str(tiny_lm_dir))
        resumed.speed_up(base_model)  # what the module does to every model it loads
        base = score_tokens(base_model, traj, 1.0)
    assert torch.equal(ref.logprobs, base.logprobs)


@pytest.mark.parametrize("fault", ["renamed", "missing"])
def test_adapter_weights_that_do_not_load_stop_the_resume_and_the_export(
    tiny_lm_dir, tmp_path, fault
):
    path = _checkpoint(lora_module(tiny_lm_dir), tmp_path, batches=1)
    ckpt = torch.load(path, weights_only=False)
    state = ckpt["state_dict"]
    for key in [k for k in state if ".lora_A." in k]:
        value = state.pop(key)
        if fault == "renamed":  # e.g. saved under another adapter name
            state[key.replace(".default.", ".reference.")] = value
    broken = tmp_path / "broken.ckpt"
    torch.save(ckpt, broken)
    with pytest.raises(ValueError, match="lora_A.default"):
        fit(lora_module(tiny_lm_dir), tmp_path, batches=2, ckpt_path=broken)
    with pytest.raises(ValueError, match="export: .*missing: .*lora_A.default"):
        export_checkpoint(broken, tmp_path / "export")


def test_export_writes_a_merged_model_that_automodel_loads(tiny_lm_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = lora_module(tiny_lm_dir, peft=LORA_SAVE)
    path = _checkpoint(module, tmp_path, batches=2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    export_module(module, tmp_path / "from_module")
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # untouched
    export_checkpoint(path, tmp_path / "from_ckpt")
    traj = a_batch(module)
    with torch.inference_mode():
        want = score_tokens(module.policy, traj, 1.0).logprobs
        for out in ("from_module", "from_ckpt"):
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / out)
            assert not any("lora" in n or "modules_to_save" in n for n, _ in merged.named_modules())
            got = score_tokens(merged.eval(), traj, 1.0).logprobs
            assert (got - want).abs().max() < 1e-5, out
    assert AutoTokenizer.from_pretrained(tmp_path / "from_ckpt").eos_token == "<eos>"


def test_an_explicit_reference_is_kept_with_peft(tiny_lm_dir, tmp_path):
    from helpers.tiny_models import make_tiny_lm

    other = make_tiny_lm(tmp_path / "other", seed=1)
    module = lora_module(tiny_lm_dir, reference=str(other))
    assert isinstance(module.reference, torch.nn.Module)
    assert not any(p.requires_grad for p in module.reference.parameters())


@pytest.mark.parametrize(
    "peft, message",
    [
        ({"r": 4, "no_such_field": 1}, "`models.peft`: not a valid LORA config"),
        ({"r": 4, "inference_mode": True}, "`models.peft.inference_mode` must be false"),
        ({"peft_type": "NOPE"}, r"`models.peft.peft_type` must be one of \[.*'LORA'"),
        ({"r": 4, "target_modules": ["no_such_layer"]}, "`models.peft`: could not add adapters"),
        ("lora", "`models.peft` must be a mapping of LoraConfig fields"),
    ],
)
def test_bad_peft_settings_name_the_option(tiny_lm_dir, peft, message):
    with pytest.raises(ValueError, match=message):
        lora_module(tiny_lm_dir, peft=peft)


def test_held_out_perplexity_of_the_reference_is_the_base_models(tiny_lm_dir, tmp_path):
    texts = tmp_path / "heldout.txt"
    texts.write_text("\n".join(["the film was good", "this book is very dull"] * 3) + "\n")
    found = []
    for peft in (LORA, None):  # None: the default frozen copy of the base
        module = lora_module(tiny_lm_dir, peft=peft)
        data = PromptDataModule(str(texts), heldout=str(texts), batch_size=4)
        t = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
        t.validate(module, datamodule=data, verbose=False)
        found.append(
            (module.heldout.reference_perplexity, float(t.callback_metrics["val/perplexity"]))
        )
    (lora_ref, lora_policy), (copy_ref, copy_policy) = found
    assert lora_ref == copy_ref  # bit for bit: the adapters-off pass is the base model's
    assert lora_policy == copy_policy  # fresh adapters (lora_B = 0) do not change the policy


def test_lora_on_a_16_bit_base_exports_the_adapters_update_in_float32(tiny_lm_dir, tmp_path):
    # Merged into bfloat16 weights and saved so, an update below the base's resolution was
    # rounded away: the export was not the trained policy.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(tiny_lm_dir).save_pretrained(bf16)
    module = lora_module(bf16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an update as training leaves it: small, in the float32 adapters
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-5)
    want, base = {}, {}  # a second way: W + scaling * (B @ A), transposed for GPT-2's Conv1D
    for name, layer in module.policy.named_modules():
        if hasattr(layer, "lora_A") and "default" in layer.lora_A:
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            w = layer.base_layer.weight
            key = name.removeprefix("base_model.model.") + ".weight"
            base[key] = w.detach().float()
            want[key] = base[key] + layer.scaling["default"] * (b @ a).T.detach()
    assert len(want) == 4 and all(
        w.dtype == torch.bfloat16
        for w in module.policy.parameters()
        if not w.requires_grad and w.ndim == 2
    )
    export_module(module, tmp_path / "auto")
    export_module(module, tmp_path / "small", dtype="bfloat16")
    auto = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "auto").named_parameters())
    small = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "small").named_parameters())
    for key, w in want.items():
        assert auto[key].dtype == torch.float32 and small[key].dtype == torch.bfloat16
        assert (auto[key] - w).abs().max() < 1e-6, key  # the update kept whole
        kept = (auto[key] != base[key]).float().mean()
        rounded_away = (small[key].float() == base[key]).float().mean()
        assert kept > 0.99 and rounded_away > 0.5, (key, kept, rounded_away)
    with pytest.raises(ValueError, match=r"`dtype` must be one of \('auto', 'float32'"):
        export_module(module, tmp_path / "x", dtype="fp8")
