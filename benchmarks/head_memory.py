"""Peak memory of the update's log-prob head on a large vocabulary, whole against chunked.

The fused head (``token_logprobs`` in ``rlkl_lightning/models/logprobs.py``) keeps its
``[N, V]`` float32 logits for the backward pass; above ``HEAD_CHUNK_ABOVE`` elements it keeps
none and computes them a chunk of rows at a time, twice. This script runs one forward and
backward pass of the head, ``--tokens`` rows against Qwen's 151,936-word vocabulary at a small
width, each way in its own process (so its peak is its own), alternating ``--repeats`` times:
the whole head, chunks of the library's size (``HEAD_CHUNK_ELEMENTS // V`` rows) and chunks of
``--small-chunk`` rows. It prints the peak memory the pass added (on the CPU the peak resident
set during the pass minus the resident set before it, the peak reset through
``/proc/self/clear_refs``; on CUDA ``torch.cuda.max_memory_allocated`` minus the memory
allocated before), the seconds, and the largest difference of the gradients from the whole
head's.

    python benchmarks/head_memory.py                      # CPU: 768 tokens x 151,936 words
    python benchmarks/head_memory.py --device cuda --tokens 4096
    python benchmarks/head_memory.py --tokens 64          # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time

from harness import in_fresh_process, result_line

WAYS = ("whole", "library chunks", "small chunks")


def run_once(args: argparse.Namespace) -> dict:
    """One forward and backward pass of the head in this process; returns its figures."""
    import torch

    from rlkl_lightning.algorithms.memory import PhasePeaks
    from rlkl_lightning.models.logprobs import HEAD_CHUNK_ELEMENTS, token_logprobs

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    chunk = {
        "whole": args.tokens,
        "library chunks": max(1, HEAD_CHUNK_ELEMENTS // args.vocab),
        "small chunks": args.small_chunk,
    }[args.way]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, generator=g).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.width, generator=g) / args.width**0.5).to(device)
    weight.requires_grad_()
    tokens = torch.randint(args.vocab, (args.tokens,), generator=g).to(device)
    upstream = torch.randn(args.tokens, generator=g).to(device)
    small = token_logprobs(hidden[:2], weight, tokens[:2], 0.7, chunk_rows=1)  # load the kernels
    torch.autograd.grad(small.sum(), (hidden, weight))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    peaks = PhasePeaks(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_bytes()
    peaks.enter("head")
    start = time.perf_counter()
    out = token_logprobs(hidden, weight, tokens, 0.7, chunk_rows=chunk)
    grad_hidden, grad_weight = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
    sync()
    seconds = time.perf_counter() - start
    peak = peaks.stop()["head"]
    return {
        "way": args.way,
        "chunk_rows": chunk,
        "logits_mib": args.tokens * args.vocab * 4 / 2**20,
        "added_peak_mib": (peak - before) / 2**20,
        "seconds": seconds,
        "grads": [float(grad_hidden.double().sum()), float(grad_weight.double().abs().sum())],
        "out": float(out.double().sum()),
    }


def _rss_bytes() -> int:
    """The resident set of this process now (Linux)."""
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, default=768, help="rows N of the head")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size V")
    parser.add_argument("--width", type=int, default=64, help="hidden size H")
    parser.add_argument("--small-chunk", type=int, default=64, help="rows of a small chunk")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # worker mode
    args = parser.parse_args(argv)
    if args.way:
        result_line(run_once(args))
        return []
    rows = []
    for _ in range(args.repeats):
        for way in WAYS:
            flags = ["--way", way, "--device", args.device, "--tokens", str(args.tokens)]
            flags += ["--vocab", str(args.vocab), "--width", str(args.width)]
            flags += ["--small-chunk", str(args.small_chunk), "--threads", str(args.threads)]
            rows.append(in_fresh_process([sys.executable, __file__, *flags]))
            r = rows[-1]
            print(
                f"{way:>14} ({r['chunk_rows']} rows): added peak {r['added_peak_mib']:,.0f} MiB, "
                f"{r['seconds']:.2f} s ({r['logits_mib']:,.0f} MiB of float32 logits)",
                flush=True,
            )
    whole = next(r for r in rows if r["way"] == "whole")
    worst = max(
        abs(a - b) / max(abs(b), 1e-30)
        for r in rows
        for a, b in zip([r["out"], *r["grads"]], [whole["out"], *whole["grads"]], strict=True)
    )
    print(f"log-probs and gradients (sums) within {worst:.1e} relative of the whole head's")
    return rows


if __name__ == "__main__":
    main()
