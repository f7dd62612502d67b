"""``optimization.packing="packed"``: the update's forward passes on packed rows, no padding.

On ragged batches (left-padded prompts, responses stopped at EOS) the packed pass's per-token
log-probs, values, losses, statistics and gradients equal the padded pass's, for PPO (value
head on the policy trunk, a separate value model, LoRA) and GRPO, the KL in the reward and in
the loss. Tolerances, float32 on a CPU with SDPA: per-token values within 1e-5 absolute, losses
and statistics within 1e-5 relative, and per parameter ``|g_packed - g_padded| / |g_padded|``
at most 1e-5 (the two passes' products sum in other orders).
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_ppo import module_args
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from rlkl_lightning import PPOModule, RLOOModule
from rlkl_lightning.algorithms.options import Optimization
from rlkl_lightning.models.forward import trunk_forward
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.models.packing import BUCKETS, check_packable, pack, pad_rows
from rlkl_lightning.trajectory import Trajectory

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}


def ragged(module, rows: int = 8, prompt: int = 5, steps: int = 7, seed: int = 0) -> Trajectory:
    """A shaped batch of left-padded prompts and responses of 1..steps tokens (EOS-stopped)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = module.policy.config.vocab_size
    eos, pad = module.tokenizer.eos_token_id, module.tokenizer.pad_token_id
    prompt_len = torch.randint(1, prompt + 1, (rows,), generator=gen)
    response_len = torch.randint(1, steps + 1, (rows,), generator=gen)
    response_len[0] = steps  # one response runs to the end (truncated)
    ids = torch.randint(4, vocab, (rows, prompt + steps), generator=gen)
    attention = torch.zeros(rows, prompt + steps, dtype=torch.long)
    for b in range(rows):
        attention[b, prompt - prompt_len[b] : prompt + response_len[b]] = 1
        if b and response_len[b] < steps:
            ids[b, prompt + response_len[b] - 1] = eos
    ids = torch.where(attention.bool(), ids, torch.full_like(ids, pad))
    response_mask = attention[:, prompt:].float()
    traj = Trajectory(ids, attention, ids[:, prompt:], response_mask)
    with torch.no_grad():
        old = score_tokens(module.policy, traj, module.sampling.temperature)
    noise = torch.randn(old.logprobs.shape, generator=gen)
    logprobs = (old.logprobs + 0.05 * noise) * response_mask
    ref = (old.logprobs - 0.1 * noise.roll(1, 0)) * response_mask
    traj = traj._replace(
        logprobs=logprobs,
        ref_logprobs=ref,
        kl=(logprobs - ref) * response_mask,
        scores=torch.randn(rows, generator=gen),
    )
    if isinstance(module, PPOModule):
        traj = traj._replace(values=torch.randn(traj.logprobs.shape, generator=gen) * 0.1)
    return module.shape(traj)


def loss_and_grads(module, traj: Trajectory, packing: str):
    module.policy_objective.packing = packing
    module.zero_grad(set_to_none=True)
    loss, stats = module.loss(traj)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


def assert_same_update(module, traj: Trajectory) -> None:
    loss, stats, grads = loss_and_grads(module, traj, "none")
    packed_loss, packed_stats, packed_grads = loss_and_grads(module, traj, "packed")
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-7)
    assert stats.keys() == packed_stats.keys()
    for key in stats:
        torch.testing.assert_close(packed_stats[key], stats[key], rtol=1e-5, atol=1e-7, msg=key)
    assert grads.keys() == packed_grads.keys() and len(grads) > 4
    for name, grad in grads.items():
        error = float((packed_grads[name] - grad).norm() / grad.norm().clamp(min=1e-30))
        assert error <= 1e-5, f"{name}: relative gradient error {error:.2e}"


def ppo(path, **overrides) -> PPOModule:
    overrides.setdefault("penalty", {})
    overrides["penalty"] = {"init_coef": 0.2, **overrides["penalty"]}
    return PPOModule(**module_args(path, **overrides))


def grpo(path, **overrides) -> RLOOModule:
    overrides.setdefault("penalty", {})
    overrides["penalty"] = {"init_coef": 0.2, **overrides["penalty"]}
    group = {"responses_per_prompt": 2, "advantage": "grpo"}
    return RLOOModule(**module_args(path, group=group, **overrides))


@pytest.mark.parametrize("placement", ["reward", "loss"])
@pytest.mark.parametrize("make", [ppo, grpo], ids=["ppo", "grpo"])
def test_packed_update_equals_padded(tiny_lm_dir, make, placement):
    module = make(tiny_lm_dir, penalty={"placement": placement})
    traj = ragged(module)
    rows = pack(traj.attention_mask, traj.response_mask, traj.input_ids)
    assert rows.positions < rows.padded_positions  # the batch is ragged: padding went
    assert_same_update(module, traj)


@pytest.mark.parametrize(
    "overrides",
    [
        {"ppo": {"value_model": "TINY"}},
        {"objective": {"ent_coef": 0.1}},  # the logits path
        {"models": {"peft": LORA}},
        {"objective": {"aggregation": "sequence_mean", "importance_ratio": "sequence"}},
    ],
    ids=["value_model", "entropy_bonus", "lora", "sequence_mean"],
)
def test_packed_update_equals_padded_with(tiny_lm_dir, overrides):
    if "ppo" in overrides:
        overrides = {"ppo": {"value_model": str(tiny_lm_dir)}}
    module = ppo(tiny_lm_dir, **overrides)
    assert_same_update(module, ragged(module, seed=1))


def test_packed_log_probs_and_values_equal_padded(tiny_lm_dir):
    """Per token, where the response mask is 1; zeros off it."""
    module = ppo(tiny_lm_dir, ppo={"value_model": str(tiny_lm_dir)})
    traj = ragged(module, seed=2)
    rows = pack(traj.attention_mask, traj.response_mask, traj.input_ids)
    mask = traj.response_mask.bool()
    with torch.no_grad():
        padded = score_tokens(module.policy, traj, 1.0, logits=False)
        packed = score_tokens(module.policy, traj, 1.0, logits=False, rows=rows)
        values = module.values(traj, padded.hidden)
        packed_values = module.values(traj, packed.hidden, rows)
    torch.testing.assert_close(packed.logprobs[mask], padded.logprobs[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_values[mask], values[mask], rtol=0, atol=1e-5)
    assert not packed.hidden[~mask].any()


def test_pack_restarts_positions_and_fits_the_budget():
    """Closed form: kept tokens in order, positions from 0 per sequence, filler restarting."""
    attention = torch.tensor(
        [  # P = 3, R = 4
            [0, 1, 1, 1, 1, 1, 0],  # prompt 2, response 3 (its last token predicts nothing)
            [1, 1, 1, 1, 0, 0, 0],  # prompt 3, response 1
            [0, 0, 1, 1, 1, 1, 1],  # prompt 1, response 4
        ]
    )
    ids = torch.arange(10, 31).view(3, 7) * attention
    rows = pack(attention, attention[:, 3:].float(), ids)
    # lengths 4, 3, 4 in rows of 7 (16 x 16 > 3 x 7 x 7): [0 | 1] first fit by length, [2].
    assert rows.input_ids.tolist() == [[11, 12, 13, 14, 17, 18, 19], [26, 27, 28, 29, 0, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2]]
    fill = 14  # n x L: the zero row
    assert rows.source.tolist() == [[1, 2, 3, fill], [6, fill, fill, fill], [7, 8, 9, 10]]
    assert (rows.positions, rows.padded_positions) == (14, 21)
    assert BUCKETS[:6] == (16, 24, 32, 48, 64, 96)


def test_filler_rows_change_no_packed_value(tiny_lm_dir):
    """``pad_rows`` (the compiled update's fixed row counts): the same per-token values."""
    module = ppo(tiny_lm_dir)
    traj = ragged(module, seed=3)
    width = traj.input_ids.shape[1]
    rows = pack(traj.attention_mask, traj.response_mask, traj.input_ids, width)
    assert rows.input_ids.shape[1] == width  # the row length asked for
    more = pad_rows(rows, rows.input_ids.shape[0] + 3)
    assert more.input_ids.shape == (rows.input_ids.shape[0] + 3, width)
    assert not more.input_ids[-3:].any()
    assert more.position_ids[-1].tolist() == list(range(width))
    with torch.no_grad():
        packed = score_tokens(module.policy, traj, 1.0, logits=False, rows=rows)
        padded_rows = score_tokens(module.policy, traj, 1.0, logits=False, rows=more)
    torch.testing.assert_close(padded_rows.logprobs, packed.logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(padded_rows.hidden, packed.hidden, rtol=0, atol=1e-6)
    assert pad_rows(rows, rows.input_ids.shape[0]) is rows
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows(rows, rows.input_ids.shape[0] - 1)


def test_the_row_length_packs_best_within_the_padded_attention():
    """Eight sequences of 3 tokens in rows of 10: one row of 24 (576 <= 8 x 10^2 attention)."""
    attention = torch.zeros(8, 10, dtype=torch.long)
    attention[:, 1:5] = 1  # P = 2: 1 prompt token, 3 response tokens (the last predicts none)
    rows = pack(attention, attention[:, 2:].float(), attention * 7)
    assert rows.input_ids.shape == (1, 24)  # 10: 3 rows (30); 16: 2 rows (32); 24: 1 row
    assert rows.position_ids.tolist() == [[0, 1, 2] * 8]
    attention[:, 1:10] = 1  # 8 tokens each: 8 rows of 10 (4 rows of 16 attend over 1024)
    rows = pack(attention, attention[:, 2:].float(), attention * 7)
    assert rows.input_ids.shape == (8, 10)
    attention[1:, 6:] = 0  # 8 and 7 x 4 tokens: 3 rows of 16 (48) beat 5 rows of 10 (50)
    rows = pack(attention, attention[:, 2:].float(), attention * 7)
    assert rows.input_ids.shape == (3, 16)  # 2 rows of 24: 1152 > 800
    assert rows.position_ids[2].tolist() == [0, 1, 2, 3, *range(10), 0, 1]  # filler < 10


def tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=40, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("make", [tiny_gpt2, tiny_qwen2], ids=["gpt2", "qwen2"])
def test_no_token_attends_across_sequences(make, attention):
    """Changing one packed sequence leaves its row-mate's hidden states exactly as they were."""
    torch.manual_seed(0)
    model = make()
    model.config._attn_implementation = attention
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0]])
    ids = torch.randint(4, 40, (2, 7)) * attention_mask
    response_mask = attention_mask[:, 3:].float()
    rows = pack(attention_mask, response_mask, ids)
    assert rows.input_ids.shape == (1, 7)  # 4 + 3 tokens: both sequences in one row
    traj = Trajectory(ids, attention_mask, ids[:, 3:], response_mask)
    other = ids.clone()
    other[1, :5] = torch.randint(4, 40, (5,))
    changed = traj._replace(input_ids=other, response_ids=other[:, 3:])
    with torch.no_grad():
        hidden = score_tokens(model, traj, 1.0, False, rows=rows).hidden
        changed_rows = pack(attention_mask, response_mask, other)
        hidden_changed = score_tokens(model, changed, 1.0, False, rows=changed_rows).hidden
        padded = trunk_forward(model, ids, attention_mask, 5)[:, :-1]
    assert torch.equal(hidden[0], hidden_changed[0])
    assert not torch.equal(hidden[1], hidden_changed[1])
    mask = response_mask.bool()
    torch.testing.assert_close(hidden[mask], padded[mask], rtol=0, atol=1e-5)


def test_bad_packing_and_unpackable_models_are_refused(tiny_lm_dir):
    allowed = r"`optimization.packing` must be one of \('none', 'packed'\), got 'yes'"
    with pytest.raises(ValueError, match=allowed):
        Optimization(packing="yes")
    model = tiny_gpt2()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"`optimization.packing`='packed' needs an attention"):
        check_packable(model)
    model.config._attn_implementation = "sdpa"
    model._fsdp_wrapped_module = model.transformer  # what models.sharding.is_fsdp looks for
    with pytest.raises(
        ValueError, match=r"`optimization.packing`='packed' is not supported under FSDP"
    ):
        check_packable(model)
    module = ppo(tiny_lm_dir, optimization={"packing": "packed"})
    assert module.policy_objective.packing == "packed"  # the option reaches the objective


def test_an_unpackable_policy_is_refused_when_the_run_starts(tiny_lm_dir):
    module = ppo(tiny_lm_dir, optimization={"packing": "packed"})
    module.policy.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"`optimization.packing`='packed' needs an attention"):
        module.on_fit_start()  # before any rollout, not at the first loss
