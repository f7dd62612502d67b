"""benchmarks/lora_reference.py at a tiny size on the CPU, so the GPU benchmark cannot rot."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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
