"""The fast path against the plain computation, on fixed batches of tiny local models.

Each optimization must give the plain computation's results to float rounding: the sampling
loop that keeps the policy's scores (algorithms/rollout.py), the fused log-prob head and its
chunked form for large vocabularies (models/logprobs.py), the fused tanh-GELU (perf/gelu.py)
and the fused AdamW (PPOModule.configure_optimizers).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.generate_reference import sample as generate_then_score
from helpers.tiny_models import assert_same_loss_and_grads
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rlkl_lightning import PPOModule
from rlkl_lightning.algorithms.rollout import draw, filter_logits, sample_and_score
from rlkl_lightning.models.forward import (
    lm_forward,
    plain_lm_head_weight,
    position_ids_from_mask,
    trunk_forward,
)
from rlkl_lightning.models.loading import disable_dropout, load_causal_lm, load_tokenizer
from rlkl_lightning.models.logprobs import (
    HEAD_CHUNK_ABOVE,
    HEAD_CHUNK_ELEMENTS,
    gather_logprobs,
    head_chunk_rows,
    score_tokens,
    token_logprobs,
)
from rlkl_lightning.perf.gelu import TanhGELU, fuse_tanh_gelu
from rlkl_lightning.rewards import FunctionReward

PROMPTS = ["the film was", "this book is really very", "the food", "a"]
TIGHT = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def policy_and_prompts(tiny_lm_dir):
    policy = load_causal_lm(str(tiny_lm_dir))
    tokenizer = load_tokenizer(str(tiny_lm_dir))
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)  # left padded, 4 lengths
    return policy, tokenizer, enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("stop_at_eos", [True, False])
def test_sampling_loop_scores_equal_a_full_forward(policy_and_prompts, stop_at_eos):
    policy, tokenizer, ids, mask = policy_and_prompts
    torch.manual_seed(0)
    rollout, scores = sample_and_score(
        policy,
        ids,
        mask,
        max_new_tokens=12,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        stop_at_eos=stop_at_eos,
    )
    plain = score_tokens(policy, rollout, 0.7)
    valid = rollout.response_mask.bool()
    assert scores.logits.shape == plain.logits.shape
    torch.testing.assert_close(scores.logits[valid], plain.logits[valid], **TIGHT)
    torch.testing.assert_close(scores.logprobs[valid], plain.logprobs[valid], **TIGHT)
    torch.testing.assert_close(scores.hidden[valid], plain.hidden[valid], **TIGHT)
    if not stop_at_eos:
        assert rollout.response_ids.shape[1] == 12 and bool(valid.all())


def test_sampling_loop_builds_the_rollout_like_generate(policy_and_prompts):
    """Same layout as rollout.sample: pad after the first EOS, masks, prompt kept in front."""
    policy, tokenizer, ids, mask = policy_and_prompts
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    policy_eos = copy.deepcopy(policy)
    with torch.no_grad():  # make EOS likely so that some rows stop early
        policy_eos.lm_head.weight[eos] *= 0
        policy_eos.lm_head.weight[eos] += policy_eos.lm_head.weight.mean(0) * 4
    torch.manual_seed(1)
    kw = dict(
        max_new_tokens=10,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    fast, _ = sample_and_score(policy_eos, ids, mask, **kw)
    plain = generate_then_score(policy_eos, ids, mask, **kw)
    for ro in (fast, plain):
        assert torch.equal(ro.input_ids[:, : ids.shape[1]], ids)
        assert torch.equal(ro.input_ids[:, ids.shape[1] :], ro.response_ids)
        assert torch.equal(ro.attention_mask[:, ids.shape[1] :], ro.response_mask.long())
        assert bool((ro.response_ids[ro.response_mask == 0] == pad).all())
    assert bool((fast.response_mask == 0).any())  # the EOS path is exercised


def test_draw_follows_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.0, 0.0, 1.0, 0.0]]).repeat(20000, 1)
    torch.manual_seed(0)
    tokens = draw(probs).squeeze(1)
    first = torch.bincount(tokens[0::2], minlength=4).double() / 20000
    second = torch.bincount(tokens[1::2], minlength=4)
    assert first[1] == 0 and second[2] == 20000  # probability 0 is never drawn
    # Binomial standard error <= 0.0036; 5 standard errors.
    torch.testing.assert_close(
        first, torch.tensor([0.5, 0.0, 0.2, 0.3]).double(), atol=0.018, rtol=0
    )


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.6), (1, 1.0)])
def test_filter_logits_matches_transformers_warpers(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 30) * 3
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(filter_logits(logits, top_k, top_p).isinf(), expected.isinf())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_values_and_gradients_equal_autograd(temperature):
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    tokens = torch.randint(0, 40, (3, 5))
    upstream = torch.randn(3, 5)
    fused = token_logprobs(hidden, weight, tokens, temperature)
    grads_fused = torch.autograd.grad((fused * upstream).sum(), (hidden, weight))
    plain = gather_logprobs(hidden @ weight.t() / temperature, tokens)
    grads_plain = torch.autograd.grad((plain * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(fused, plain, **TIGHT)
    for gf, gp in zip(grads_fused, grads_plain, strict=True):
        torch.testing.assert_close(gf, gp, **TIGHT)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 14])  # 15 rows: 4 leaves a last chunk of 3
def test_chunked_head_equals_the_unchunked_head_and_autograd(temperature, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    tokens = torch.randint(0, 40, (3, 5))
    upstream = torch.randn(3, 5)
    results = {}
    for name, rows in (("chunked", chunk), ("whole", None)):
        out = token_logprobs(hidden, weight, tokens, temperature, chunk_rows=rows)
        results[name] = (out, *torch.autograd.grad((out * upstream).sum(), (hidden, weight)))
    plain = gather_logprobs(hidden @ weight.t() / temperature, tokens)
    grads = torch.autograd.grad((plain * upstream).sum(), (hidden, weight))
    for chunked, whole, auto in zip(results["chunked"], results["whole"], (plain, *grads)):
        torch.testing.assert_close(chunked, whole, **TIGHT)
        torch.testing.assert_close(chunked, auto, **TIGHT)


def test_chunked_head_under_bf16_autocast_equals_the_unchunked_head():
    """The backward pass recomputes each chunk's logits in the forward's autocast state."""
    torch.manual_seed(1)
    hidden = torch.randn(4, 6, 32, requires_grad=True)
    weight = torch.randn(50, 32, requires_grad=True)
    tokens = torch.randint(0, 50, (4, 6))
    upstream = torch.randn(4, 6)
    results = {}
    for rows in (5, None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = token_logprobs(hidden, weight, tokens, 0.7, chunk_rows=rows)
        # The backward outside autocast, as the whole head's: the recomputation must enter it.
        grads = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
        results[rows] = (out, *grads)
    for chunked, whole in zip(results[5], results[None], strict=True):
        assert chunked.dtype == whole.dtype == torch.float32
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_chunked_head_keeps_no_logits_for_the_backward():
    torch.manual_seed(2)
    hidden = torch.randn(2, 8, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    tokens = torch.randint(0, 300, (2, 8))
    saved = {}
    for rows in (3, None):
        shapes = []

        def pack(tensor, shapes=shapes):
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            token_logprobs(hidden, weight, tokens, 1.0, chunk_rows=rows)
        saved[rows] = shapes
    assert (16, 300) in saved[None]  # the whole head keeps its [N, V] logits
    assert all(300 not in shape or shape == (300, 16) for shape in saved[3])  # only the weight
    assert (16,) in saved[3]  # and logz


def test_only_large_heads_are_chunked():
    assert head_chunk_rows(64 * 24, 4096) is None  # the shipped configs' size: as before
    assert head_chunk_rows(4096, 50257) is None  # the GPU table's 124M update: 0.8 GiB
    rows = head_chunk_rows(2048, 151_936)  # Qwen's vocabulary: 1.2 GiB of float32 logits
    assert rows == HEAD_CHUNK_ELEMENTS // 151_936 == 441
    assert head_chunk_rows(HEAD_CHUNK_ABOVE + 1, 1) == HEAD_CHUNK_ELEMENTS
    assert head_chunk_rows(2, HEAD_CHUNK_ABOVE) == 1  # at least a row


def test_trunk_and_plain_head_reproduce_the_model_logits(policy_and_prompts):
    policy, _, ids, mask = policy_and_prompts
    weight = plain_lm_head_weight(policy)
    assert weight is policy.lm_head.weight
    with torch.no_grad():
        own = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    out = lm_forward(policy, ids, mask, 3)  # trunk + its own matrix product for the head
    torch.testing.assert_close(trunk_forward(policy, ids, mask, 3), out.hidden, **TIGHT)
    torch.testing.assert_close(out.logits, own.logits[:, -3:], **TIGHT)


def test_a_head_with_a_bias_is_not_taken_for_plain(tiny_lm_dir):
    model = load_causal_lm(str(tiny_lm_dir))
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    assert plain_lm_head_weight(model) is None


def test_fused_gelu_gives_the_same_losses_and_gradients(tiny_lm_dir):
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir))
    disable_dropout(plain)
    fused = copy.deepcopy(plain)
    assert fuse_tanh_gelu(fused) == plain.config.n_layer
    assert any(isinstance(m, TanhGELU) for m in fused.modules())
    assert_same_loss_and_grads(plain, fused, TIGHT, TIGHT)


def test_reward_classifier_scores_unchanged_by_the_fused_gelu(tiny_lm_dir, tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    from rlkl_lightning.rewards import SequenceClassifierReward

    AutoTokenizer.from_pretrained(str(tiny_lm_dir)).save_pretrained(tmp_path)
    config = GPT2Config.from_pretrained(str(tiny_lm_dir))
    config.num_labels = 2
    torch.manual_seed(0)
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    reward = SequenceClassifierReward(str(tmp_path), label=1)
    assert any(isinstance(m, TanhGELU) for m in reward.model.modules())
    responses = ["good film", "the plot was very dull and the taste poor", "nice"]
    fused = reward(PROMPTS[:3], responses)
    reward.model = GPT2ForSequenceClassification.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(fused, reward(PROMPTS[:3], responses), **TIGHT)


def test_ppo_losses_gradients_and_steps_match_the_plain_computation(tiny_lm_dir):
    """PPOModule's update on a fixed batch: fast models and fused AdamW vs the plain ones."""
    kw = dict(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: float(len(r))),
        sampling={"max_prompt_tokens": 16, "max_new_tokens": 6, "temperature": 0.7},
        optimization={"lr": 1e-3},
        logging={"log_samples_every": 0},
    )
    fast = PPOModule(**kw)
    plain = PPOModule(**kw)
    plain.policy = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir))  # gelu_new as saved
    disable_dropout(plain.policy)
    plain.policy._rlkl_plain_head = False  # the model's own head: logits, then gather
    assert plain_lm_head_weight(fast.policy) is fast.policy.lm_head.weight
    plain.value_head.load_state_dict(fast.value_head.state_dict())

    ids, mask = fast._encode_prompts(PROMPTS)
    torch.manual_seed(0)
    rollout, scores = sample_and_score(
        fast.policy,
        ids,
        mask,
        max_new_tokens=6,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
        stop_at_eos=False,
    )
    old = score_tokens(plain.policy, rollout, 0.7)
    torch.testing.assert_close(scores.logprobs, old.logprobs, **TIGHT)
    old_values = plain.value_head(old.hidden).detach()
    advantages = torch.randn_like(old.logprobs)
    returns = old_values + torch.randn_like(old_values)
    idx = torch.tensor([0, 2, 3])

    optimizer = torch.optim.AdamW([p for p in fast.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        results = {}
        for module in (fast, plain):
            # Old log-probs from the sampling loop for both; after the first step the ratios
            # move away from 1 and the clipped branches are exercised.
            traj = rollout._replace(values=old_values, advantages=advantages, returns=returns)
            loss, stats = module.loss(traj.select(idx))
            module.zero_grad()
            loss.backward()
            results[module] = (
                loss,
                stats,
                [p.grad for p in module.parameters() if p.requires_grad],
            )
        (loss_f, stats_f, grads_f), (loss_p, stats_p, grads_p) = results[fast], results[plain]
        torch.testing.assert_close(loss_f, loss_p, **TIGHT, msg=f"loss at step {step}")
        for key in stats_p:
            torch.testing.assert_close(stats_f[key], stats_p[key], **TIGHT, msg=key)
        for gf, gp in zip(grads_f, grads_p, strict=True):
            torch.testing.assert_close(gf, gp, rtol=1e-4, atol=1e-6)
        optimizer.step()
        with torch.no_grad():  # both continue from the same weights
            for pf, pp in zip(fast.parameters(), plain.parameters(), strict=True):
                pp.copy_(pf)
    assert float(stats_f["policy/clipfrac"]) > 0


def test_fused_adamw_steps_like_the_plain_one():
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    fused = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    opts = [
        torch.optim.AdamW(fused, lr=1e-2, weight_decay=0.1, fused=True),
        torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1, foreach=False),
    ]
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for params, opt in zip((fused, plain), opts, strict=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for pf, pp in zip(fused, plain, strict=True):
        torch.testing.assert_close(pf, pp, rtol=1e-6, atol=1e-7)


def test_configure_optimizers_uses_fused_adamw(tiny_lm_dir):
    module = PPOModule(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: 0.0),
        sampling={"max_prompt_tokens": 16, "max_new_tokens": 4},
        logging={"log_samples_every": 0},
    )
    [optimizer], _ = module.configure_optimizers()
    assert optimizer.defaults["fused"] is True
