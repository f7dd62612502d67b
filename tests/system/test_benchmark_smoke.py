"""The benchmarks at a tiny size on the CPU, so the GPU benchmarks cannot rot.

benchmarks/lora_reference.py, benchmarks/rollout_memory.py, benchmarks/head_memory.py, and
benchmarks/ppo_throughput.py with a GPU preset's architecture, the precision flag and its skip,
in seconds (TRL is not needed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow  # a benchmark smoke run: make test-slow
def test_lora_reference_benchmark_runs_tiny_on_cpu(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import lora_reference

    args = ["--device", "cpu", "--tiny", "--batches", "1", "--batch", "2", "--new-tokens", "4"]
    rows = lora_reference.main(args + ["--threads", "1", "--variants", "full+copy,lora+off"])
    copy, off = rows
    assert (copy["variant"], off["variant"]) == ("full+copy", "lora+off")
    head = 64 + 1  # the value head: Linear(64, 1)
    base = copy["trainable_params"] - head  # every policy weight trains with a frozen copy
    assert copy["reference_params"] == base and copy["params_held"] == 2 * base + head
    assert off["reference_params"] == 0  # the reference is the policy, adapters off
    assert off["params_held"] == base + off["trainable_params"]  # base + adapters + head
    assert all(r["skipped_batches"] == 0 and r["s_per_batch"] > 0 for r in rows)
    assert all(r["peak_rss_bytes"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "| full+copy |" in printed and "| lora+off |" in printed
    assert "lora_reference" in sys.modules


@pytest.mark.slow  # a benchmark smoke run: make test-slow
def test_rollout_memory_benchmark_runs_tiny_on_cpu(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import rollout_memory

    rows = rollout_memory.main(["--tiny", "--threads", "1"])
    assert [(r["way"], r["logits_kept"]) for r in rows] == [("kept", True), ("recomputed", False)]
    assert rows[0]["kl_exact"] == rows[1]["kl_exact"] and rows[0]["peak_mib"] > 0
    assert "exact KL and entropy equal in every run" in capsys.readouterr().out


@pytest.mark.slow  # a benchmark smoke run: make test-slow
def test_head_memory_benchmark_runs_tiny_on_cpu(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import head_memory

    flags = ["--tokens", "40", "--vocab", "3000", "--width", "8", "--small-chunk", "16"]
    rows = head_memory.main([*flags, "--repeats", "1", "--threads", "1"])
    assert [(r["way"], r["chunk_rows"]) for r in rows] == [
        ("whole", 40),
        ("library chunks", 2**26 // 3000),
        ("small chunks", 16),
    ]
    assert all(r["added_peak_mib"] >= 0 for r in rows)
    for r in rows[1:]:
        assert r["out"] == pytest.approx(rows[0]["out"], rel=1e-6)
        assert r["grads"] == pytest.approx(rows[0]["grads"], rel=1e-5)
    assert "of the whole head's" in capsys.readouterr().out


@pytest.fixture
def throughput(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ppo_throughput

    return ppo_throughput


@pytest.mark.parametrize("name", ["gpt2-4x256", "gpt2-124m", "qwen2-0.5b"])
def test_preset_flop_counts_follow_the_models(throughput, name):
    """The FLOP formula's weights per layer, width and vocabulary are those of the real models."""
    import bench_world
    from transformers import AutoModelForCausalLM

    for p in (bench_world.preset(name), bench_world.preset(name, tiny=True)):
        with torch.device("meta"):  # full-size shapes, no memory
            model = AutoModelForCausalLM.from_config(bench_world.model_config(p))
        layers = model.base_model.h if p.arch == "gpt2" else model.base_model.layers
        matrices = [w for w in layers[0].parameters() if w.dim() == 2]
        assert sum(w.numel() for w in matrices) == p.layer_weights
        assert len(layers) == p.layers and model.config.vocab_size == p.vocab
        assert model.get_output_embeddings().weight.shape == (p.vocab, p.width)


@pytest.mark.slow  # a benchmark smoke run: make test-slow
def test_ppo_throughput_runs_tiny_presets_on_cpu(throughput, capsys, tmp_path):
    """Our side in a worker process, at a GPU preset's architecture, tiny."""
    # One worker: each costs an interpreter with torch, Lightning and transformers; a PPO
    # batch with a separate value model runs in tests/perf/test_onednn.py.
    from rlkl_lightning.perf import onednn as matmul

    bf16 = bool(throughput.cpu_flags() & set(throughput.BF16_FLAGS))
    args = ["--preset", "qwen2-0.5b", "--tiny", "--device", "cpu", "--threads", "1"]
    args += ["--cpu-matmul", "onednn" if matmul.available() else "default"]
    args += ["--precision", "bf16-mixed" if bf16 else "32-true", "--iters", "1", "--warmup", "0"]
    args += ["--no-separate-value", "--batch", "6", "--world", str(tmp_path / "world")]
    results = throughput.main(args)
    printed = capsys.readouterr().out
    assert "CPU bfloat16 flags:" in printed and "preset qwen2-0.5b-tiny" in printed
    r = results["ours"]
    assert r["optimizer_steps_per_iter"] == [4]  # 2 epochs x 2 minibatches
    assert r["timed_iters"] == 1 and r["tokens_per_s"] > 0
    assert results["config"]["prompts"] == 6  # --batch, instead of the tiny preset's 4
    assert all(r["phase_median_s"][p] > 0 and r["phase_mfu"][p] > 0 for p in throughput.PHASES)
    assert results["config"]["precision"] == ("bf16-mixed" if bf16 else "32-true")
    assert set(results) == {"ours", "machine", "config"}
    # The FLOPs of a separate value model: one more trunk in scoring and in the update.
    shape = throughput.flops.Shape.of(throughput.preset("qwen2-0.5b", tiny=True, batch=6))
    own, sep = (throughput.flops.phases(shape, s) for s in ("ours", "ours_separate_value"))
    trunk = throughput.flops.trunk(shape, shape.batch, shape.seq)
    assert sep["score"] - own["score"] == pytest.approx(trunk)
    assert sep["update"] - own["update"] == pytest.approx(3 * shape.epochs * trunk)


def test_bf16_is_skipped_where_the_cpu_has_no_bf16_units(throughput, capsys, monkeypatch):
    monkeypatch.setattr(throughput, "cpu_flags", lambda: {"avx2", "fma"})
    assert throughput.main(["--precision", "bf16-mixed", "--tiny"]) == {}
    printed = capsys.readouterr().out
    assert "CPU bfloat16 flags: none" in printed and "skipped:" in printed


def test_cuda_without_a_gpu_is_refused(throughput, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--device", "cuda"])
    assert exit_info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_profile_phases_runs_tiny(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import profile_phases

    args = ["--tiny", "--threads", "1", "--warmup", "0", "--iters", "1", "--profiled", "1"]
    args += ["--separate-value", "--value-model-thread"]
    profile_phases.main(args + ["--world", str(tmp_path / "world")])
    printed = capsys.readouterr().out
    assert "CPU seconds per iteration (median of 1): rollout" in printed
    assert "separate value model in a second thread" in printed
    for phase in ("rollout", "score", "update"):
        assert f"\n{phase}: operators by self time" in printed
    assert "calls  aten::" in printed


@pytest.mark.slow  # a benchmark smoke run: make test-slow
def test_grpo_throughput_runs_tiny_on_cpu(monkeypatch, capsys, tmp_path):
    """Our GRPO side in a worker process, tiny; the steps and tokens it counts are the preset's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import grpo_throughput

    args = ["--tiny", "--threads", "1", "--iters", "1", "--warmup", "0", "--batch", "8"]
    args += ["--world", str(tmp_path / "world"), "--trl-python", str(tmp_path / "none")]
    results = grpo_throughput.main(args + ["--vs-trl"])
    printed = capsys.readouterr().out
    assert "TRL cannot be imported" in printed  # no such interpreter: ours only
    r = results["ours_grpo"]
    assert r["optimizer_steps_per_iter"] == [4]  # 2 epochs x 2 minibatches
    assert r["sampled_tokens_per_iter"] == [8 * 8]  # 2 prompts x 4 completions x 8 tokens
    assert results["config"]["prompts"] == 2 and results["config"]["generations"] == 4
    assert set(results) == {"ours_grpo", "machine", "config"}


def test_grpo_flops_charge_trl_its_extra_policy_pass(throughput):
    """TRL's scoring adds a no-grad policy pass (old log-probs) and scores every position."""
    flops = throughput.flops
    shape = flops.Shape.of(throughput.preset("gpt2-4x256"))
    ours, trl = flops.grpo_phases(shape, "ours_grpo"), flops.grpo_phases(shape, "trl_grpo")
    b, t, r, v = shape.batch, shape.seq, shape.response, shape.vocab
    policy_cpu = flops.forward(shape, b, t, t - 1, v)
    assert trl["score"] - ours["score"] == pytest.approx(
        2 * policy_cpu - flops.forward(shape, b, t, r + 1, v)
    )
    assert trl["update"] == pytest.approx(3 * shape.epochs * policy_cpu)
    on_cuda = flops.grpo_phases(shape, "trl_grpo", "cuda")
    assert on_cuda["update"] == pytest.approx(ours["update"])  # the R completion positions
    assert trl["rollout"] == ours["rollout"] == on_cuda["rollout"]


def test_grpo_batch_must_split_into_groups_and_minibatches(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import grpo_throughput

    with pytest.raises(SystemExit) as exit_info:
        grpo_throughput.main(["--tiny", "--batch", "6"])
    assert exit_info.value.code == 2
    assert "must be a multiple of --generations (4)" in capsys.readouterr().err


@pytest.mark.slow  # a benchmark smoke run: make test-slow
def test_grpo_throughput_ragged_runs_packing_off_and_on(monkeypatch, capsys, tmp_path):
    """``--ragged``: our side twice, packing off and on; the padding share is reported."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import grpo_throughput

    args = ["--tiny", "--threads", "1", "--iters", "1", "--warmup", "0", "--batch", "8"]
    results = grpo_throughput.main(args + ["--ragged", "--world", str(tmp_path / "world")])
    r = results["ragged"]
    assert set(results) == {"ours_grpo", "ours_grpo_packed", "ragged", "machine", "config"}
    assert 0 < r["padding_share"] < 1 and r["needed_positions_per_iter"] > 0
    assert r["update_positions_per_iter"]["packed"] <= r["update_positions_per_iter"]["padded"]
    assert "ragged: padding" in capsys.readouterr().out


def test_ragged_refuses_trl(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import grpo_throughput

    with pytest.raises(SystemExit) as exit_info:
        grpo_throughput.main(["--tiny", "--ragged", "--vs-trl"])
    assert exit_info.value.code == 2
    assert "--ragged compares our side with packing off and on" in capsys.readouterr().err


def test_cut_responses_end_every_response_as_an_eos_stop(monkeypatch):
    """Drawn lengths in 1..R; masks, pad tokens and log-probs as the rollout leaves them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import workers

    from rlkl_lightning.trajectory import Trajectory

    ids = torch.arange(4 * 9).view(4, 9) + 5
    attention = torch.ones(4, 9, dtype=torch.long)
    attention[0, :2] = 0
    traj = Trajectory(ids, attention, ids[:, 3:], torch.ones(4, 6), torch.full((4, 6), -1.0))
    cut = workers.cut_responses(traj, torch.Generator().manual_seed(0), pad_token_id=0)
    lengths = cut.response_mask.sum(1)
    assert ((lengths >= 1) & (lengths <= 6)).all() and len(set(lengths.tolist())) > 1
    kept = torch.arange(6) < lengths.unsqueeze(1)
    assert torch.equal(cut.response_mask, kept.float())
    assert torch.equal(cut.attention_mask, torch.cat([attention[:, :3], kept.long()], 1))
    assert torch.equal(cut.response_ids, torch.where(kept, ids[:, 3:], 0))
    assert torch.equal(cut.input_ids[:, 3:], cut.response_ids)
    assert torch.equal(cut.logprobs, -kept.float())
