"""Peak memory of a rollout and its scoring, with the policy's ``[B, R, V]`` logits kept or not.

Where a plain head's logits would be large (always off the CPU; on a CPU above 32 MiB), the
rollout keeps only the hidden states and scoring computes the logits again one step at a time
(``keep_rollout_logits`` in ``rlkl_lightning/algorithms/pipeline.py``). This script forces
each way in turn, each run in its own process (so its peak
is its own), alternating ``--repeats`` times: one PPO rollout of ``--batch`` prompts and
exactly ``--new-tokens`` sampled tokens on a random-weights GPT-2 (``--vocab`` words), then the
scoring phase (reference pass, exact KL, entropy). It prints, per run, the peak memory
(``torch.cuda.max_memory_allocated`` on CUDA; on the CPU the peak resident set size) and the
seconds of the two phases, and checks that both ways log the same exact KL and entropy.

    python benchmarks/rollout_memory.py                       # CPU: 64 x 48 tokens, 50,257 words
    python benchmarks/rollout_memory.py --device cuda --batch 256 --new-tokens 64
    python benchmarks/rollout_memory.py --tiny                # smoke test
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from harness import in_fresh_process, result_line
from lora_reference import build_model, rss_bytes

WAYS = ("kept", "recomputed")
PROMPT_TOKENS = 8


def run_once(args: argparse.Namespace) -> dict:
    """One rollout and scoring in this process, the logits kept or not; returns its figures."""
    import torch

    import rlkl_lightning.algorithms.pipeline as pipeline
    from rlkl_lightning import PPOModule
    from rlkl_lightning.rewards import FunctionReward

    torch.set_num_threads(args.threads)
    pipeline.keep_rollout_logits = lambda *where: args.way == "kept"
    module = PPOModule(
        policy=args.model_dir,
        reward=FunctionReward(lambda prompt, response: float(len(response.split()))),
        sampling={
            "max_prompt_tokens": PROMPT_TOKENS,
            "max_new_tokens": args.new_tokens,
            "stop_at_eos": False,
        },
        logging={"log_samples_every": 0},
    ).to(args.device)
    prompts = [" ".join(f"w{2 + (i * 7 + j) % 400}" for j in range(6)) for i in range(args.batch)]
    base_rss = rss_bytes()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def clock() -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    torch.manual_seed(0)
    start = clock()
    traj, scores = module.rollout(prompts)
    middle = clock()
    _, _, diagnostics = module.score(prompts, traj, scores)
    end = clock()
    out = {
        "way": args.way,
        "logits_kept": scores.logits is not None,
        "logits_mib": args.batch * traj.response_ids.shape[1] * args.vocab * 4 / 2**20,
        "rollout_s": middle - start,
        "scoring_s": end - middle,
        "kl_exact": float(diagnostics["kl_exact"].sum()),
        "entropy_sum": float(diagnostics["entropy_sum"].sum()),
    }
    if args.device == "cuda":
        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["rss_before_mib"] = base_rss / 2**20
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tiny", action="store_true", help="a small vocabulary: a smoke test")
    parser.add_argument("--batch", type=int, default=64, help="prompts")
    parser.add_argument("--new-tokens", type=int, default=48, help="sampled tokens per response")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.way:
        result_line(run_once(args))
        return []
    if args.tiny:
        args.batch, args.new_tokens, args.vocab, args.repeats = 4, 6, 512, 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": args.vocab}
        model_dir = build_model(Path(tmp), shape)
        for _ in range(args.repeats):
            for way in WAYS:
                flags = ["--way", way, "--model-dir", str(model_dir), "--device", args.device]
                flags += ["--batch", str(args.batch), "--new-tokens", str(args.new_tokens)]
                flags += ["--vocab", str(args.vocab), "--threads", str(args.threads)]
                rows.append(in_fresh_process([sys.executable, __file__, *flags]))
                r = rows[-1]
                print(
                    f"{way:>10}: peak {r['peak_mib']:,.0f} MiB, rollout {r['rollout_s']:.2f} s, "
                    f"scoring {r['scoring_s']:.2f} s ({r['logits_mib']:,.0f} MiB of logits)",
                    flush=True,
                )
    same = {(r["kl_exact"], r["entropy_sum"]) for r in rows}
    print("exact KL and entropy equal in every run" if len(same) == 1 else f"differ: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
