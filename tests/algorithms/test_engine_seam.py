"""The rollout-engine seam, without vLLM: an engine's samples give the native loop's trajectory.

A fake engine samples with the native loop itself and hands back only what vLLM hands back
(tokens and the engine's log-probs). The pipeline then builds the trajectory and scores the
samples with the policy: it must be the native loop's trajectory, tensor for tensor (masks and
ids exactly, log-probs, logits and hidden states to float rounding), with the engine's
log-probs kept beside the trainer's. ``engine.kind="native"`` stays the native loop bit for
bit, with no engine log-probs. The weights an engine gets are the policy's under Hugging Face
names, tied ones once, and a LoRA policy's merged out of place. The real engine is tested in
``tests/vllm/`` (``make test-vllm``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from rlkl_lightning import PPOModule, RLOOModule
from rlkl_lightning.algorithms import pipeline as pipeline_module
from rlkl_lightning.algorithms.engines import NativeEngine
from rlkl_lightning.algorithms.engines.vllm import (
    MISSING_VLLM,
    engine_weights,
    request_seed,
)
from rlkl_lightning.algorithms.rollout import sample_and_score
from rlkl_lightning.models.forward import trunk_forward
from rlkl_lightning.models.lora import attach_adapters
from rlkl_lightning.rewards import FunctionReward

PROMPTS = ["the film was", "this book is really very", "the food", "a"]  # left padding
SAMPLING = {"max_prompt_tokens": 8, "max_new_tokens": 10, "temperature": 0.7}


class NativeAsEngine:
    """vLLM's ``LLM`` stand-in: samples with the native loop, returns only tokens and log-probs."""

    def __init__(self, policy, seed: int = 0):
        self.policy, self.seed = policy, seed
        self.push_enabled, self.weights_of, self.pushed = True, None, []
        self.seeds: list[list[int]] = []

    def push(self, weights, owner):
        self.pushed.append({name: w.clone() for name, w in weights})
        self.weights_of = owner

    def sample(self, prompt_ids, prompt_mask, seeds, sampling, eos_token_id, pad_token_id, rows):
        assert rows == slice(None)  # one rank's engine: every row is its own
        self.seeds.append(seeds)
        torch.manual_seed(self.seed)
        traj, _ = sample_and_score(
            self.policy,
            prompt_ids,
            prompt_mask,
            max_new_tokens=sampling["max_new_tokens"],
            temperature=sampling["temperature"],
            top_k=sampling["top_k"],
            top_p=sampling["top_p"],
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        return traj.response_ids, traj.logprobs * traj.response_mask


def reward(prompt: str, response: str) -> float:
    return float(len(response.split()))


def stop_early(module) -> None:
    """Make EOS likely after any hidden state near the mean one: rows end at different lengths."""
    ids, mask = module._encode_prompts(PROMPTS)
    policy, eos = module.policy, module.tokenizer.eos_token_id
    with torch.no_grad():
        mean = trunk_forward(policy, ids, mask, ids.shape[1]).reshape(-1, policy.config.n_embd)
        mean = mean.mean(0)
        policy.lm_head.weight[eos] = 3 * mean / mean.norm() ** 2


def module(path, kind: str, cls=PPOModule, **options):
    args = dict(policy=str(path), reward=FunctionReward(reward), sampling=SAMPLING)
    return cls(**args, engine={"kind": kind}, logging={"log_samples_every": 0}, **options)


@pytest.mark.parametrize("keep_logits", [True, False], ids=["logits kept", "logits dropped"])
def test_an_engines_samples_give_the_native_trajectory(tiny_lm_dir, keep_logits, monkeypatch):
    if not keep_logits:
        monkeypatch.setattr(pipeline_module, "CPU_KEPT_LOGITS_BYTES", 0)
    native = module(tiny_lm_dir, "native")
    stop_early(native)
    torch.manual_seed(0)
    traj, scores = native.rollout(PROMPTS)
    engined = module(tiny_lm_dir, "vllm")
    engined.policy.load_state_dict(native.policy.state_dict())
    engined.rollout_engine.llm_engine = NativeAsEngine(copy.deepcopy(native.policy))
    traj_e, scores_e = engined.rollout(PROMPTS)
    assert traj.response_mask.sum() > len(PROMPTS) and not traj.response_mask.all()  # EOS seen
    for name in ("input_ids", "attention_mask", "response_ids", "response_mask"):
        assert torch.equal(getattr(traj_e, name), getattr(traj, name)), name
    mask = traj.response_mask
    # Where the mask counts them (after EOS the loop saw its own draws, the trainer pad).
    torch.testing.assert_close(traj_e.logprobs * mask, traj.logprobs * mask, rtol=0, atol=2e-6)
    assert torch.equal(traj_e.sampler_logprobs, traj.logprobs * mask)  # the engine's, kept
    assert traj.sampler_logprobs is None  # the native loop has no second set
    assert (scores_e.logits is None) == (scores.logits is None) == (not keep_logits)
    valid = mask.bool()
    if keep_logits:
        torch.testing.assert_close(scores_e.logits[valid], scores.logits[valid], rtol=0, atol=2e-5)
    torch.testing.assert_close(scores_e.hidden[valid], scores.hidden[valid], rtol=0, atol=2e-5)
    filled = {"logprobs", "sampler_logprobs", *traj_e._fields[:4]}
    assert all(getattr(traj_e, f) is None for f in traj_e._fields if f not in filled)


def test_native_is_the_native_loop_bit_for_bit(tiny_lm_dir):
    native = module(tiny_lm_dir, "native")
    assert type(native.rollout_engine) is NativeEngine
    torch.manual_seed(3)
    traj, scores = native.rollout(PROMPTS)
    torch.manual_seed(3)
    ids, mask = native._encode_prompts(PROMPTS)
    direct, direct_scores = sample_and_score(
        native.policy,
        ids,
        mask,
        max_new_tokens=10,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        eos_token_id=native.tokenizer.eos_token_id,
        pad_token_id=native.tokenizer.pad_token_id,
    )
    for a, b in zip((*traj, *scores), (*direct, *direct_scores), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("cls", [PPOModule, RLOOModule])
def test_training_through_an_engine_pushes_the_updated_weights_once_per_batch(tiny_lm_dir, cls):
    from helpers.trainers import fit_on_prompts

    engined = module(tiny_lm_dir, "vllm", cls, optimization={"ppo_epochs": 1, "lr": 1e-2})
    fake = engined.rollout_engine.llm_engine = NativeAsEngine(engined.policy)
    trainer = fit_on_prompts(engined, PROMPTS * 3, batch_size=4)
    assert engined.batches_seen == 3 and len(fake.pushed) == 3  # before each rollout
    names = [name for name, _ in engined.policy.named_parameters()]  # tied weights once
    assert list(fake.pushed[0]) == names and "lm_head.weight" not in names
    assert not torch.equal(fake.pushed[0][names[0]], fake.pushed[-1][names[0]])  # updated
    final = dict(engined.policy.named_parameters())
    assert not torch.equal(fake.pushed[-1][names[0]], final[names[0]])  # trained after it
    # One seed per response, from (seed, batch, rank, row): distinct within and across batches.
    seeds = [s for batch in fake.seeds for s in batch]
    assert len(set(seeds)) == len(seeds) == 3 * 4 * (4 if cls is RLOOModule else 1)
    assert fake.seeds[1][2] == request_seed(0, 1, 0, 2)
    assert "objective/kl" in trainer.callback_metrics


def test_a_lora_policy_is_pushed_merged_and_its_base_weights_stay(tiny_lm_dir):
    from peft import PeftModel

    from rlkl_lightning.models.loading import load_causal_lm

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
    policy = load_causal_lm(str(tiny_lm_dir))
    peft_model = attach_adapters(policy, {**lora, "modules_to_save": ["ln_f"]})
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.requires_grad:  # adapters (B starts at 0) and ln_f's copy move
                param.add_(torch.randn_like(param) * 0.05)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    pushed = dict(engine_weights(policy))
    after = policy.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing written
    merged = copy.deepcopy(peft_model)
    assert isinstance(merged, PeftModel)
    plain = merged.merge_and_unload()
    expected = dict(plain.named_parameters())
    assert list(pushed) == list(expected)  # the plain model's names, tied ones once
    for name, weight in expected.items():
        torch.testing.assert_close(pushed[name], weight, rtol=0, atol=1e-6)
    assert not torch.equal(
        pushed["transformer.h.0.attn.c_attn.weight"],
        before["transformer.h.0.attn.c_attn.base_layer.weight"],
    )


def test_without_vllm_the_engine_is_refused_in_one_line_naming_make_vllm_env(tiny_lm_dir):
    from rlkl_lightning.algorithms.engines.vllm import import_vllm

    try:
        import_vllm()
    except RuntimeError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    engined = module(tiny_lm_dir, "vllm")
    with pytest.raises(RuntimeError) as info:
        engined.rollout(PROMPTS)
    assert str(info.value) == MISSING_VLLM
    assert "make vllm-env" in MISSING_VLLM and "engine.kind" in MISSING_VLLM
    assert "\n" not in MISSING_VLLM


@pytest.mark.parametrize(
    "settings, device, world_size, strategy, message",
    [
        ({"sleep_mode": True}, "cpu", 1, "ddp", r"`engine.sleep_mode`=True .* needs CUDA"),
        (
            {},
            "cpu",
            2,
            "ModelParallelStrategy",
            r"`engine.kind='vllm'` runs in one process, under DDP or under FSDPStrategy .* 2 "
            r"processes under ModelParallelStrategy.*`trainer.strategy=ddp`",
        ),
    ],
)
def test_settings_the_vllm_engine_does_not_run_with_are_refused_by_name(
    settings, device, world_size, strategy, message
):
    from rlkl_lightning.algorithms.engines.vllm import check_vllm_settings
    from rlkl_lightning.algorithms.options import Engine

    engine = Engine(kind="vllm", **settings)
    with pytest.raises(ValueError, match=message):
        check_vllm_settings(engine, torch.device(device), world_size, strategy)
    check_vllm_settings(Engine(kind="vllm"), torch.device("cpu"), 1)  # the default runs
    check_vllm_settings(Engine(kind="vllm"), torch.device("cpu"), 2, "ddp")  # DDP runs
    check_vllm_settings(Engine(kind="vllm"), torch.device("cpu"), 2, "fsdp")  # so does FSDP


def test_under_ddp_the_engine_gets_the_trainers_rank_variables_and_the_external_launcher(
    monkeypatch,
):
    from types import SimpleNamespace

    from rlkl_lightning.algorithms.engines.vllm import launcher_arguments, set_rank_variables

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "7")  # left from another launch: the trainer's win
    trainer = SimpleNamespace(global_rank=3, local_rank=1, world_size=4, strategy=None)
    set_rank_variables(trainer)  # srun and torchrun: tests/system/test_launchers.py
    assert [os.environ[n] for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")] == ["3", "1", "4"]
    assert launcher_arguments(1) == {}
    assert launcher_arguments(2) == {
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": 1,
    }


def test_a_vllm_config_without_vllm_stops_with_one_line_naming_make_vllm_env(
    tiny_lm_dir, tmp_path, monkeypatch, capfd
):
    from pathlib import Path

    from helpers.cli_runs import cli_error

    from rlkl_lightning.algorithms.engines.vllm import import_vllm

    try:
        import_vllm()
    except RuntimeError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 2))
    config = Path(__file__).resolve().parents[2] / "configs" / "grpo_vllm.yaml"
    message = cli_error(
        ["fit", "--config", str(config), f"--model.policy={tiny_lm_dir}"]
        + [f"--data.prompts={prompts}", f"--data.heldout={prompts}", "--data.batch_size=2"]
        + ["--trainer.max_steps=16", "--model.sampling.max_prompt_tokens=8"],
        capfd,
    )
    assert message.strip() == MISSING_VLLM


def test_a_separate_vllm_engine_process_is_refused_by_name(monkeypatch):
    from rlkl_lightning.algorithms.engines.vllm import IN_PROCESS, import_vllm

    monkeypatch.setenv(IN_PROCESS, "1")
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING='1' asks for a sep"):
        import_vllm()
    monkeypatch.delenv(IN_PROCESS)
    try:
        import_vllm()
    except RuntimeError as error:  # vLLM missing here: the usual line, not the variable's
        assert str(error) == MISSING_VLLM
    assert os.environ[IN_PROCESS] == "0"  # unset: the engine stays in this process


class CountingEngine(NativeEngine):
    """A user's engine (named by its dotted path): the native loop, counting the calls."""

    def __init__(self, label: str = "none"):
        self.label, self.calls = label, []

    def start(self, module):
        self.calls.append("start")

    def push(self, module):
        self.calls.append(f"push {module.weights_version}")

    def sample(self, module, prompt_ids, prompt_mask, keep_logits):
        self.calls.append("sample")
        return super().sample(module, prompt_ids, prompt_mask, keep_logits)

    def close(self):
        self.calls.append("close")


@pytest.mark.parametrize(
    ("engine", "built"),
    [
        ({}, "NativeEngine"),
        ({"kind": "compiled"}, "CompiledEngine"),
        ({"compiled_decode": True}, "CompiledEngine"),
        ({"kind": "vllm"}, "VLLMRolloutEngine"),
        ({"kind": {"class_path": "vllm"}}, "VLLMRolloutEngine"),
    ],
)
def test_the_engine_is_picked_once_from_engine_kind(engine, built):
    from rlkl_lightning.algorithms.options import Engine

    assert type(Engine(**engine).build()).__name__ == built


def test_a_users_engine_by_dotted_path_samples_and_is_started_pushed_and_closed(tiny_lm_dir):
    from helpers.trainers import fit_on_prompts

    kind = {"class_path": f"{__name__}.CountingEngine", "init_args": {"label": "mine"}}
    ppo = PPOModule(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(reward),
        sampling=SAMPLING,
        engine={"kind": kind},
        logging={"log_samples_every": 0},
        optimization={"ppo_epochs": 1},
    )
    engine = ppo.rollout_engine
    assert type(engine) is CountingEngine and engine.label == "mine"
    assert ppo.hparams["engine"]["kind"] == kind  # a plain spec in the checkpoint
    fit_on_prompts(ppo, PROMPTS * 2, batch_size=4)
    assert engine.calls == ["start", "push 0", "sample", "push 1", "sample", "close"]
    with pytest.raises(ValueError, match=r"`engine.kind.init_args` has no argument 'colour'"):
        PPOModule(policy=str(tiny_lm_dir), engine={"kind": {**kind, "init_args": {"colour": 1}}})
    with pytest.raises(ValueError, match=r"`engine.kind` must be one of .* names function"):
        PPOModule(policy=str(tiny_lm_dir), engine={"kind": f"{__name__}.reward"})
