"""The throughput benchmarks' compiled sides at a tiny size, so their flags cannot rot."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_ppo_throughput_runs_a_compiled_side_beside_the_eager_one(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ppo_throughput

    args = ["--tiny", "--threads", "1", "--iters", "1", "--warmup", "1", "--no-separate-value"]
    results = ppo_throughput.main(args + ["--compiled-update", "--world", str(tmp_path / "w")])
    assert {"ours", "ours_compiled"} <= set(results)
    for side in ("ours", "ours_compiled"):
        assert results[side]["optimizer_steps_per_iter"] == [4]  # the same work on both sides
    assert results["compiled_speedup_ours_compiled"] > 0
    printed = capsys.readouterr().out
    assert "optimization.compile" in printed and "compiled update (eager median" in printed


def test_grpo_throughput_compiles_update_and_decode_on_one_side(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import grpo_throughput

    args = ["--tiny", "--threads", "1", "--iters", "1", "--warmup", "1", "--batch", "8"]
    args += ["--compiled-update", "--compiled-decode", "--world", str(tmp_path / "w")]
    results = grpo_throughput.main(args)
    assert {"ours_grpo", "ours_grpo_compiled"} <= set(results)
    assert (
        results["ours_grpo_compiled"]["sampled_tokens_per_iter"]
        == (results["ours_grpo"]["sampled_tokens_per_iter"])
    )
    printed = capsys.readouterr().out
    assert "optimization.compile, engine.compiled_decode" in printed
    assert "optimization.compile + engine.compiled_decode (eager median" in printed


def test_profile_phases_profiles_the_compiled_update(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import profile_phases

    args = ["--algorithm", "grpo", "--tiny", "--threads", "1", "--warmup", "1", "--iters", "1"]
    args += ["--profiled", "1", "--compiled-update", "--world", str(tmp_path / "w")]
    profile_phases.main(args)
    printed = capsys.readouterr().out
    assert "optimization.compile, 1 threads" in printed
    update = printed.split("\nupdate: operators by self time")[1]
    assert "CompiledFxGraph" in update  # the profiled update ran the compiled graphs
