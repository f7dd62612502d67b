"""models.cpu_matmul="onednn": the same products as PyTorch's own, to float32 rounding.

The float32 products of linear layers and of the fused log-prob head go through oneDNN
(rlkl_lightning/perf/onednn.py). Values and gradients are compared with float64 computations: the
oneDNN results must be as close to them as PyTorch's default float32 results are (a tolerance
from the float32 rounding of the sums, not a loose one), the parameters and state dicts stay
the same, and anything that is not a float32 CPU product takes PyTorch's own path.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from helpers.tiny_models import assert_same_loss_and_grads
from helpers.trainers import fit_on_prompts
from transformers import AutoModelForCausalLM

from rlkl_lightning import PPOModule
from rlkl_lightning.models.forward import plain_lm_head_weight
from rlkl_lightning.models.logprobs import gather_logprobs, token_logprobs
from rlkl_lightning.perf.onednn import (
    OneDNNConv1D,
    OneDNNHeadProducts,
    OneDNNLinear,
    available,
    linear,
    use_onednn,
)
from rlkl_lightning.rewards import FunctionReward, SequenceClassifierReward

pytestmark = pytest.mark.skipif(not available(), reason="this PyTorch has no oneDNN kernel")


def _error(value: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.detach()
    return float((value.detach().double() - exact).abs().max() / exact.abs().max())


def test_linear_values_and_gradients_are_float32_exact():
    torch.manual_seed(0)
    x = torch.randn(2, 37, 64, requires_grad=True)
    weight = torch.randn(48, 64, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    upstream = torch.randn(2, 37, 48)
    results = {}
    for name, fn in (("onednn", linear), ("default", torch.nn.functional.linear)):
        out = fn(x, weight, bias)
        results[name] = (out, *torch.autograd.grad((out * upstream).sum(), (x, weight, bias)))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    out64 = torch.nn.functional.linear(x64, w64, b64)
    exact = (out64, *torch.autograd.grad((out64 * upstream.double()).sum(), (x64, w64, b64)))
    for onednn, default, truth in zip(results["onednn"], results["default"], exact, strict=True):
        assert onednn.dtype == torch.float32 and onednn.shape == truth.shape
        # float32 sums of 64-74 terms: relative errors of a few 1e-7 either way
        assert _error(onednn, truth) < 4 * max(_error(default, truth), 1e-7)
        assert _error(onednn, truth) < 2e-6


@pytest.mark.parametrize("chunk", [None, 4])  # 4: the chunked head (large vocabularies)
def test_log_prob_head_values_and_gradients(chunk):
    torch.manual_seed(1)
    hidden = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    tokens = torch.randint(0, 40, (3, 5))
    upstream = torch.randn(3, 5)
    onednn = token_logprobs(hidden, weight, tokens, 0.7, OneDNNHeadProducts, chunk_rows=chunk)
    grads = torch.autograd.grad((onednn * upstream).sum(), (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = gather_logprobs(h64 @ w64.t() / 0.7, tokens)
    exact_grads = torch.autograd.grad((exact * upstream.double()).sum(), (h64, w64))
    torch.testing.assert_close(onednn.double(), exact, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, exact_grads, strict=True):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)


def test_models_keep_their_parameters_and_train_alike(tiny_lm_dir):
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir))
    fast = copy.deepcopy(plain)
    # GPT-2: 4 Conv1D per layer and the LM head
    assert use_onednn(fast) == 4 * plain.config.n_layer + 1
    assert isinstance(fast.transformer.h[0].attn.c_attn, OneDNNConv1D)
    assert isinstance(fast.lm_head, OneDNNLinear)
    assert fast.lm_head.weight is fast.transformer.wte.weight  # still tied
    assert fast.state_dict().keys() == plain.state_dict().keys()
    for model in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert isinstance(model.lm_head, OneDNNLinear)
    assert_same_loss_and_grads(plain, fast, dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-4, atol=1e-6))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: PyTorch's own bf16 path
        assert fast.lm_head(torch.randn(2, plain.config.n_embd)).dtype == torch.bfloat16


def test_ppo_module_and_reward_option(tiny_lm_dir, tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    kw = dict(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: 0.0),
        sampling={"max_prompt_tokens": 16},
    )
    module = PPOModule(ppo={"value_model": str(tiny_lm_dir)}, models={"cpu_matmul": "onednn"}, **kw)
    for model in (module.policy, module.reference, module.value_trunk):
        assert isinstance(model.lm_head, OneDNNLinear)
        assert plain_lm_head_weight(model) is model.lm_head.weight  # the fused head's path
    assert module.models.cpu_matmul == "onednn"
    plain_head = PPOModule(models={"cpu_matmul": "default"}, **kw).policy.lm_head
    assert isinstance(plain_head, torch.nn.Linear) and not isinstance(plain_head, OneDNNLinear)
    with pytest.raises(ValueError, match=r"^`models\.cpu_matmul` must be one of"):
        PPOModule(models={"cpu_matmul": "mkl"}, **kw)

    AutoTokenizer.from_pretrained(str(tiny_lm_dir)).save_pretrained(tmp_path)
    config = GPT2Config.from_pretrained(str(tiny_lm_dir))
    config.num_labels = 2
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    plain = SequenceClassifierReward(str(tmp_path), label=1)
    fast = SequenceClassifierReward(str(tmp_path), label=1, cpu_matmul="onednn")
    assert isinstance(fast.model.score, OneDNNLinear)
    pairs = (["the film", "a"], ["was good", "dull plot and poor taste"])
    torch.testing.assert_close(fast(*pairs), plain(*pairs), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="^`cpu_matmul` must be one of"):
        SequenceClassifierReward(str(tmp_path), label=1, cpu_matmul="fast")


@pytest.mark.parametrize(
    "vendor, avx512, wanted",
    [
        ("AuthenticAMD", True, "onednn"),
        ("AuthenticAMD", False, "default"),  # AVX2 alone (Zen 3): no faster kernels to take
        ("GenuineIntel", True, "default"),
        ("", False, "default"),
    ],
)
def test_auto_takes_onednn_on_amd_processors_alone(
    monkeypatch, tiny_lm_dir, vendor, avx512, wanted
):
    """The default, auto: oneDNN where MKL skips its AVX-512 kernels (AMD), else PyTorch's."""
    from rlkl_lightning.perf import onednn

    monkeypatch.setattr(onednn, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(onednn, "has_avx512", lambda: avx512)
    assert onednn.resolve("auto") == wanted
    assert onednn.resolve("default") == "default" and onednn.resolve("onednn") == "onednn"
    reward = FunctionReward(lambda p, r: 0.0)
    module = PPOModule(policy=str(tiny_lm_dir), reward=reward, sampling={"max_prompt_tokens": 16})
    assert module.models.cpu_matmul == "auto"
    assert isinstance(module.policy.lm_head, OneDNNLinear) == (wanted == "onednn")
    monkeypatch.setattr(onednn, "available", lambda: False)  # a PyTorch without the kernel
    assert onednn.resolve("auto") == "default"


def test_the_vendor_and_flags_are_read_from_cpuinfo():
    from rlkl_lightning.perf.onednn import cpu_vendor, has_avx512

    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    lines = text.splitlines()
    vendor = next((x for x in lines if x.startswith("vendor_id")), None)
    flags = next((x for x in lines if x.startswith("flags")), "flags :")
    assert cpu_vendor() == ("" if vendor is None else vendor.split(":", 1)[1].strip())
    assert has_avx512() == ("avx512f" in flags.split(":", 1)[-1].split())


def test_a_training_batch_logs_what_the_default_logs(tiny_lm_dir):
    """One PPO batch (separate value model) with and without oneDNN: the same numbers."""
    from lightning.pytorch import seed_everything

    metrics = {}
    for cpu_matmul in ("default", "onednn"):
        seed_everything(0, verbose=False)
        module = PPOModule(
            policy=str(tiny_lm_dir),
            reward=FunctionReward(lambda p, r: float(len(r.split()))),
            sampling={"max_prompt_tokens": 16, "max_new_tokens": 6},
            optimization={"ppo_epochs": 2, "num_minibatches": 2, "lr": 1e-3},
            logging={"log_samples_every": 0},
            models={"cpu_matmul": cpu_matmul},
            ppo={"value_model": str(tiny_lm_dir)},
        )
        prompts = ["the film was", "this book is", "the food", "a story"] * 2
        trainer = fit_on_prompts(module, prompts)
        metrics[cpu_matmul] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    default, onednn = metrics["default"], metrics["onednn"]
    assert default["progress/skipped_batches"] == onednn["progress/skipped_batches"] == 0
    for key in ("loss/policy", "loss/value", "objective/kl", "objective/score", "policy/grad_norm"):
        assert onednn[key] == pytest.approx(default[key], rel=1e-4, abs=1e-6), key
