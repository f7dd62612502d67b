"""``optimization.compile``: the compiled update's gradients against the eager pass's, on the CPU.

Each training run is one batch, run twice from one seed, eagerly and compiled: the rollout is
the same (no update has run yet), so every optimizer step's gradient over all parameters must
agree within 1e-5 relative (``|g_c - g_e| / |g_e|``), for PPO and GRPO, with oneDNN's products
and with LoRA adapters. The micro-batches are ragged (prompts of 1-4 words, responses stopped at
EOS, micro-batches of 1 and 2 rows), so the compiled pass pads them. Then: 20 ragged micro-batches
compile once per bucket, whatever beta does; a second process finds the compiled code in the
library's cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.trainers import fit_on_prompts
from lightning.pytorch import seed_everything
from torch._dynamo.utils import counters
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rlkl_lightning import PPOModule, RLOOModule
from rlkl_lightning.algorithms.compiled_update import (
    INDUCTOR_CACHE_ENV,
    CompiledUpdate,
    bucket,
    pad_micro_batch,
    row_bucket,
)
from rlkl_lightning.models.packing import pack
from rlkl_lightning.perf.onednn import available as onednn_available
from rlkl_lightning.perf.value_thread import ValueThread
from rlkl_lightning.rewards import FunctionReward
from rlkl_lightning.trajectory import Trajectory

PROMPTS = ["the film was", "this book is really", "the food", "a", "not a good"]
GRAD_TOL = 1e-5


def _reward(prompt: str, response: str) -> float:
    return float(len(response.split()))


def _module(cls, path, compiled: bool, **groups):
    optimization = {
        "ppo_epochs": 1,
        "num_minibatches": 2,
        "grad_accum_steps": 2,
        "max_grad_norm": None,
        "lr": 1e-2,
        "compile": compiled,
        "packing": groups.pop("packing", "none"),
    }
    return cls(
        policy=str(path),
        reward=FunctionReward(_reward),
        penalty={"init_coef": 0.05, **groups.pop("penalty", {})},
        sampling={"max_prompt_tokens": 8, "max_new_tokens": 8},
        optimization=optimization,
        logging={"log_samples_every": 0},
        **groups,
    )


def _step_gradients(cls, path, compiled: bool, prompts, **groups) -> list[torch.Tensor]:
    """Every optimizer step's gradient over all parameters, of one batch of ``prompts``."""
    seed_everything(0, verbose=False)
    module = _module(cls, path, compiled, **groups)
    grads: list[torch.Tensor] = []

    def record(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))

    handle = register_optimizer_step_pre_hook(record)
    try:
        fit_on_prompts(module, prompts, batch_size=len(prompts), max_steps=2)
    finally:
        handle.remove()
    assert (module.compiled_update is not None) == compiled
    return grads


def _assert_close_gradients(cls, path, prompts, packing: str = "none", **groups) -> None:
    """The compiled pass (packed rows with ``packing``) against the eager padded pass."""
    eager = _step_gradients(cls, path, False, prompts, **groups)
    before = counters["stats"]["unique_graphs"]
    compiled = _step_gradients(cls, path, True, prompts, packing=packing, **groups)
    assert counters["stats"]["unique_graphs"] > before  # it did compile
    assert len(eager) == len(compiled) == 2  # one per minibatch
    for g_e, g_c in zip(eager, compiled, strict=True):
        assert float(g_e.norm()) > 0
        assert float((g_c - g_e).norm() / g_e.norm()) < GRAD_TOL


def test_ppo_gradients_are_the_eager_passes(tiny_lm_dir):
    # 5 rows: minibatches of 3 and 2, micro-batches of 2 and 1 (padded to 2); the KL in the loss
    _assert_close_gradients(PPOModule, tiny_lm_dir, PROMPTS, penalty={"placement": "loss"})


def test_grpo_gradients_are_the_eager_passes(tiny_lm_dir):
    # 3 prompts x 2 responses: minibatches of 3 rows, micro-batches of 2 and 1 (padded to 2)
    group = {"advantage": "grpo", "responses_per_prompt": 2}
    objective = {"aggregation": "batch_token_mean", "cliprange_high": 0.28}
    _assert_close_gradients(RLOOModule, tiny_lm_dir, PROMPTS[:3], group=group, objective=objective)


def test_packed_and_compiled_ppo_gradients_are_the_eager_padded_passes(tiny_lm_dir):
    # the KL in the reward, the value head on the policy's packed trunk
    _assert_close_gradients(PPOModule, tiny_lm_dir, PROMPTS, packing="packed")


def test_packed_and_compiled_grpo_gradients_are_the_eager_padded_passes(tiny_lm_dir):
    group = {"advantage": "grpo", "responses_per_prompt": 2}
    _assert_close_gradients(
        RLOOModule, tiny_lm_dir, PROMPTS[:3], packing="packed", group=group,
        penalty={"placement": "loss"},
    )  # fmt: skip


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN float32 linear kernel")
def test_onednn_products_are_compiled_with_the_eager_passes_gradients(tiny_lm_dir):
    _assert_close_gradients(PPOModule, tiny_lm_dir, PROMPTS, models={"cpu_matmul": "onednn"})


def test_lora_adapters_are_compiled_with_the_eager_passes_gradients(tiny_lm_dir):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
    _assert_close_gradients(PPOModule, tiny_lm_dir, PROMPTS, models={"peft": lora})


def test_the_value_thread_runs_the_value_models_graph_beside_the_policys(tiny_lm_dir, monkeypatch):
    # a separate value model in the helper thread: two graphs, each compiled in its own thread
    helper_graphs = []
    submit = ValueThread.submit

    def counting(self, fn, *args):
        if fn.__name__ == "_helper_loss":  # the compiled helper graph, not the eager thread's work
            helper_graphs.append(fn)
        return submit(self, fn, *args)

    monkeypatch.setattr(ValueThread, "submit", counting)
    ppo = {"value_model": str(tiny_lm_dir)}
    eager = _step_gradients(
        PPOModule, tiny_lm_dir, False, PROMPTS, ppo={**ppo, "value_model_thread": False}
    )
    threads_eager = _step_gradients(
        PPOModule, tiny_lm_dir, False, PROMPTS, ppo={**ppo, "value_model_thread": True}
    )
    assert not helper_graphs
    for g_e, g_t in zip(eager, threads_eager, strict=True):  # the eager thread: the same numbers
        assert torch.equal(g_e, g_t)
    before = counters["stats"]["unique_graphs"]
    compiled = _step_gradients(
        PPOModule, tiny_lm_dir, True, PROMPTS, ppo={**ppo, "value_model_thread": True}
    )
    assert counters["stats"]["unique_graphs"] >= before + 2  # the policy's and the value model's
    assert len(helper_graphs) == 4  # 2 minibatches x 2 micro-batches, each in the helper
    assert len(eager) == len(compiled) == 2
    for g_e, g_c in zip(eager, compiled, strict=True):
        assert float(g_e.norm()) > 0
        assert float((g_c - g_e).norm() / g_e.norm()) < GRAD_TOL


def _ragged(generator, vocab: int, rows: int, prompt: int, response: int) -> Trajectory:
    """A micro-batch of ``rows`` left-padded prompts and right-padded responses."""
    width = prompt + response
    ids = torch.randint(4, vocab, (rows, width), generator=generator)
    mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(rows):
        mask[row, : int(torch.randint(0, prompt, (1,), generator=generator))] = 0
        ends = int(torch.randint(1, response + 1, (1,), generator=generator))
        mask[row, prompt + ends :] = 0
    shape = (rows, response)
    old = -torch.rand(shape, generator=generator) * 3
    return Trajectory(
        input_ids=ids,
        attention_mask=mask,
        response_ids=ids[:, prompt:],
        response_mask=mask[:, prompt:].float(),
        logprobs=old,
        ref_logprobs=old - 0.1,
        values=torch.randn(shape, generator=generator),
        advantages=torch.randn(shape, generator=generator),
        returns=torch.randn(shape, generator=generator),
    )


def test_twenty_ragged_micro_batches_compile_once_per_bucket(tiny_lm_dir):
    module = PPOModule(
        policy=str(tiny_lm_dir), sampling={"max_prompt_tokens": 16, "max_new_tokens": 8}
    )
    module.penalty = type(module.penalty)(placement="loss", loss_estimator="k3")
    module.policy_objective.penalty = module.penalty
    compiled = CompiledUpdate(prompt_limit=16, response_limit=8)
    generator = torch.Generator().manual_seed(0)
    vocab = module.policy.config.vocab_size
    buckets = set()
    before = counters["stats"]["unique_graphs"]
    for i in range(20):
        rows = 1 + i % 3
        prompt = int(torch.randint(2, 13, (1,), generator=generator))
        response = int(torch.randint(2, 9, (1,), generator=generator))
        part = _ragged(generator, vocab, rows, prompt, response)
        module.kl_coef = 0.01 * (i + 1)  # a controller moving beta every batch
        buckets.add((3, bucket(prompt, 16), bucket(response, 8)))
        loss, stats = compiled(module, part, rows=3)
        eager, eager_stats = module.loss(part)
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats, eager_stats, rtol=1e-5, atol=1e-6)
    assert buckets == {(3, 8, 8), (3, 12, 8)}  # prompts 2-12 tokens, responses 2-8
    assert counters["stats"]["unique_graphs"] - before == len(buckets)


def test_ragged_packed_micro_batches_compile_once_per_shape(tiny_lm_dir):
    """Packed rows of the padded width: one graph per (width buckets, packed-row bucket)."""
    module = PPOModule(
        policy=str(tiny_lm_dir),
        sampling={"max_prompt_tokens": 16, "max_new_tokens": 8},
        optimization={"packing": "packed"},
    )
    compiled = CompiledUpdate(prompt_limit=16, response_limit=8)
    generator = torch.Generator().manual_seed(1)
    vocab = module.policy.config.vocab_size
    shapes, saved = set(), []
    before = counters["stats"]["unique_graphs"]
    for i in range(12):
        rows = 4 + i % 5
        prompt = int(torch.randint(2, 13, (1,), generator=generator))
        response = int(torch.randint(2, 9, (1,), generator=generator))
        part = _ragged(generator, vocab, rows, prompt, response)
        module.kl_coef = 0.01 * (i + 1)
        padded = pad_micro_batch(part, 8, bucket(prompt, 16), bucket(response, 8))
        packed = pack(padded.attention_mask, padded.response_mask, padded.input_ids, None)
        n = pack(*(padded.attention_mask, padded.response_mask, padded.input_ids),
                 padded.input_ids.shape[1]).input_ids.shape[0]  # fmt: skip
        shapes.add((bucket(prompt, 16), bucket(response, 8), row_bucket(n, 8)))
        saved.append(1 - n / 8)
        assert packed.positions <= padded.attention_mask.numel()
        loss, stats = compiled(module, part, rows=8)
        assert module.policy_objective.given_rows is None  # not left for an eager pass
        module.policy_objective.packing = "none"  # the eager padded pass
        eager, eager_stats = module.loss(part)
        module.policy_objective.packing = "packed"
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats, eager_stats, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == len(shapes)
    assert max(saved) >= 0.25  # some micro-batches did run on fewer rows


CACHE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch._dynamo.utils import counters
    from rlkl_lightning import PPOModule
    from rlkl_lightning.algorithms.compiled_update import CompiledUpdate, use_inductor_cache
    from rlkl_lightning.trajectory import Trajectory

    where = use_inductor_cache()
    module = PPOModule(policy=sys.argv[1], sampling={"max_prompt_tokens": 8, "max_new_tokens": 8})
    ids = torch.arange(4, 16).remainder(module.policy.config.vocab_size).view(1, 12)
    mask = torch.ones_like(ids)
    zeros = torch.zeros(1, 8)
    part = Trajectory(ids, mask, ids[:, 4:], mask[:, 4:].float(), zeros, zeros, values=zeros,
                      advantages=zeros + 1, returns=zeros)
    start = time.perf_counter()
    loss, _ = CompiledUpdate(8, 8)(module, part, rows=1)
    loss.backward()
    print(json.dumps({"dir": str(where), "seconds": time.perf_counter() - start,
                      **{k: v for k, v in counters["inductor"].items() if "fxgraph" in k}}))
    """
)


def test_a_second_process_finds_the_compiled_code_in_the_librarys_cache(tiny_lm_dir, tmp_path):
    import json

    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_CACHE_ENV}
    env["RLKL_CACHE"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", CACHE_SCRIPT, str(tiny_lm_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["dir"] == second["dir"] == str(tmp_path / "cache" / "inductor")
    assert first["fxgraph_cache_miss"] == 2 and first.get("fxgraph_cache_hit", 0) == 0  # fwd+bwd
    assert second["fxgraph_cache_hit"] == 2 and second.get("fxgraph_cache_miss", 0) == 0
    assert any((tmp_path / "cache" / "inductor").iterdir())


class _ReadsALoss(PPOModule):
    """A loss of one's own that reads a number off a tensor: a graph break."""

    def loss(self, minibatch):
        loss, stats = super().loss(minibatch)
        return loss * (2.0 if float(loss) > 0 else 1.0), stats


def test_a_loss_that_breaks_the_graph_is_refused_by_name(tiny_lm_dir):
    module = _ReadsALoss(
        policy=str(tiny_lm_dir), sampling={"max_prompt_tokens": 8, "max_new_tokens": 8}
    )
    part = _ragged(torch.Generator().manual_seed(0), module.policy.config.vocab_size, 2, 4, 6)
    with pytest.raises(ValueError, match=r"^`optimization.compile`: _ReadsALoss.loss does not co"):
        CompiledUpdate(8, 8)(module, part, rows=2)
