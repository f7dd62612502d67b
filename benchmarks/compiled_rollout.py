r"""The rollout phase alone, eager loop against the compiled decode step (engine.compiled_decode).

Both run in this process on the same policy, prompts and seed, one after the other, the order
reversed every iteration so that both meet the same machine conditions; the first iterations
(``--warmup``, where the compiled step is compiled) are not timed. Both sides should sample the
same tokens (in float32 on a CPU the tests show they do; in bfloat16 a rounding difference can
flip a draw): the script prints the share of tokens that differ. Shapes (``--shape``):

- ``study``: the study's rollout: the default world's SFT GPT-2 (built on first use), 32 of its
  prompts per iteration (a new batch each time, at most 16 tokens), 24 new tokens at
  temperature 1 with EOS stopping, the logits kept (``keep_rollout_logits`` on a CPU);
- ``grpo``: ``grpo_throughput.py``'s rollout at ``--preset`` (default ``gpt2-4x256``): the
  preset's prompts, each repeated ``--generations`` times, exactly ``response`` new tokens.

The policy gets the pipeline's speed-ups (``RLPipeline.speed_up``: the fused tanh GELU, and
oneDNN products where ``cpu_matmul="auto"`` picks them). Prints per shape the median seconds per
rollout of each side, the ratio, sampled tokens per second, the compilation's seconds and, for
a preset, the rollout's FLOPs as a fraction of the device's measured matmul peak. With
``--profile``, one more compiled rollout runs under ``torch.profiler``: its wall time against
the time the device was busy (on CUDA) and the operators that took the most time, which say
whether the compiled loop is bound by the device or by what the host does between steps.
``--every-guard`` adds a third side: the compiled loop with dynamo's guards checked at every
step, as before they were checked once per rollout (the tokens must be the compiled side's).

Usage::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/compiled_rollout.py          # both shapes, CPU
    python benchmarks/compiled_rollout.py --shape grpo --device cuda --preset gpt2-124m \
        --precision bf16-mixed --json compiled_rollout.json
    python benchmarks/compiled_rollout.py --tiny --iters 1 --warmup 1      # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flops  # noqa: E402
from bench_world import PRESETS, build, preset, prompts  # noqa: E402
from harness import device_name, load_average  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", nargs="+", choices=("study", "grpo"), default=["study", "grpo"])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-4x256")
    parser.add_argument("--tiny", action="store_true", help="the preset at smoke-test size")
    parser.add_argument("--generations", type=int, default=4, help="grpo: completions per prompt")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per side")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--world", type=Path, help="where to build the preset (default: temp)")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument(
        "--profile", action="store_true", help="profile one more compiled rollout per shape"
    )
    parser.add_argument(
        "--every-guard",
        action="store_true",
        help="a third side: the compiled loop checking every guard at every step",
    )
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 1 or args.threads < 1:
        parser.error("--iters, --warmup and --threads must be >= 1 (the warm-up compiles)")
    return args


def _policy(path: str, device):
    """The policy as the pipeline prepares it."""
    from rlkl_lightning.models.loading import load_causal_lm
    from rlkl_lightning.perf.gelu import fuse_tanh_gelu
    from rlkl_lightning.perf.onednn import resolve, use_onednn

    policy = load_causal_lm(path).to(device)
    fuse_tanh_gelu(policy)
    if resolve("auto") == "onednn":
        use_onednn(policy)
    return policy


def _study(args, device):
    """(policy, tokenizer, prompt batches, sampling settings, FLOP shape or None)."""
    from rlkl_lightning.models.loading import load_tokenizer
    from rlkl_lightning.world import build_world

    world = build_world()
    texts = world.prompts()
    rows = 32
    batches = [texts[i * rows : (i + 1) * rows] for i in range(args.warmup + args.iters)]
    sampling = dict(max_new_tokens=24, max_prompt_tokens=16, stop_at_eos=True)
    tokenizer = load_tokenizer(str(world.model_dir))
    return _policy(str(world.model_dir), device), tokenizer, batches, sampling, None


def _grpo(args, device):
    """The same for grpo_throughput.py's rollout at the preset."""
    from rlkl_lightning.models.loading import load_tokenizer

    chosen = preset(args.preset, args.tiny)
    root = build(args.world or Path(tempfile.mkdtemp(prefix="rlkl-compiled-bench-")), chosen)
    rows = chosen.batch // args.generations
    batch = [p for p in prompts(chosen, rows) for _ in range(args.generations)]
    sampling = dict(
        max_new_tokens=chosen.response, max_prompt_tokens=chosen.prompt, stop_at_eos=False
    )
    shape = flops.Shape.of(chosen)
    tokenizer = load_tokenizer(str(root / "tokenizer"))
    policy = _policy(str(root / "policy"), device)
    return policy, tokenizer, [batch] * (args.warmup + args.iters), sampling, shape


def measure(name: str, args) -> dict:
    """Time both sides on one shape; returns its summary."""
    import torch

    from rlkl_lightning.algorithms.pipeline import keep_rollout_logits
    from rlkl_lightning.models.loading import encode

    device = torch.device(args.device)
    policy, tokenizer, batches, sampling, shape = (_study if name == "study" else _grpo)(
        args, device
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    autocast = args.precision == "bf16-mixed"
    sides = ["eager", "compiled"] + (["every_guard"] if args.every_guard else [])
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    steps, mismatch, first_compiled = [], [], None
    for i, texts in enumerate(batches):
        ids, mask = encode(tokenizer, texts, "left", sampling["max_prompt_tokens"])
        ids, mask = ids.to(device), mask.to(device)
        kw = dict(
            max_new_tokens=sampling["max_new_tokens"],
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            stop_at_eos=sampling["stop_at_eos"],
            keep_logits=keep_rollout_logits(
                policy, device, ids.shape[0], sampling["max_new_tokens"]
            ),
        )
        tokens = {}
        for side in sides if i % 2 == 0 else sides[::-1]:
            guards = every_guard() if side == "every_guard" else nullcontext()
            with guards:
                traj, took = timed_rollout(
                    policy, ids, mask, kw, device, autocast, sync, i, side != "eager"
                )
            tokens[side] = traj.response_ids.cpu()
            if i >= args.warmup:
                seconds[side].append(took)
            elif side == "compiled" and first_compiled is None:
                first_compiled = took
        same = tokens["eager"].shape == tokens["compiled"].shape
        differ = (tokens["eager"] != tokens["compiled"]).float().mean() if same else 1.0
        mismatch.append(float(differ))
        if args.every_guard and not torch.equal(tokens["every_guard"], tokens["compiled"]):
            raise SystemExit("compiled_rollout: checking every guard changed the tokens")
        print(
            f"{name} iteration {i + 1}/{len(batches)} "
            f"({'warm-up' if i < args.warmup else 'timed'}): "
            f"eager {seconds['eager'][-1] if i >= args.warmup else float('nan'):.3f} s, "
            f"compiled {seconds['compiled'][-1] if i >= args.warmup else float('nan'):.3f} s, "
            f"tokens that differ: {mismatch[-1]:.2%}",
            flush=True,
        )
        if i >= args.warmup:
            steps.append(tokens["eager"].shape[1])
    rows = len(batches[0])
    median = {side: statistics.median(s) for side, s in seconds.items()}
    summary = {
        "rows": rows,
        "new_tokens": sampling["max_new_tokens"],
        "stop_at_eos": sampling["stop_at_eos"],
        "median_steps": statistics.median(steps),
        "eager_median_s": median["eager"],
        "compiled_median_s": median["compiled"],
        "eager_min_max_s": [min(seconds["eager"]), max(seconds["eager"])],
        "compiled_min_max_s": [min(seconds["compiled"]), max(seconds["compiled"])],
        "speedup": median["eager"] / median["compiled"],
        "eager_tokens_per_s": rows * statistics.median(steps) / median["eager"],
        "compiled_tokens_per_s": rows * statistics.median(steps) / median["compiled"],
        "first_compiled_rollout_s": first_compiled,
        "token_mismatch_fraction": max(mismatch),
    }
    if args.every_guard:
        summary["every_guard_median_s"] = median["every_guard"]
        summary["every_guard_min_max_s"] = [
            min(seconds["every_guard"]),
            max(seconds["every_guard"]),
        ]
    if args.profile:
        summary["profile"] = profile_compiled(policy, ids, mask, kw, device, autocast, sync)
    if shape is not None and not args.tiny:  # a smoke test's MFU would mean nothing
        dtype = torch.bfloat16 if autocast else torch.float32
        peak = flops.matmul_peak(args.threads, device=args.device, dtype=dtype)
        gflop = flops.rollout(shape) / 1e9
        summary["rollout_gflop"] = gflop
        summary["matmul_peak_gflops"] = peak
        summary["eager_mfu"] = gflop / median["eager"] / peak
        summary["compiled_mfu"] = gflop / median["compiled"] / peak
    return summary


def timed_rollout(policy, ids, mask, kw: dict, device, autocast: bool, sync, seed, compiled):
    """One rollout from ``seed``, eager or compiled: (trajectory, seconds, device included)."""
    import torch

    from rlkl_lightning.algorithms.rollout import sample_and_score

    torch.manual_seed(seed)
    context = torch.autocast(device.type, torch.bfloat16, cache_enabled=False)
    sync()
    start = time.perf_counter()
    with context if autocast else nullcontext():
        traj, _ = sample_and_score(policy, ids, mask, compiled=compiled, **kw)
    sync()
    return traj, time.perf_counter() - start


@contextmanager
def every_guard():
    """The compiled loop as before its guards were checked once per rollout: at every step."""
    from rlkl_lightning.algorithms import compiled_decode

    once = compiled_decode.guards_checked
    compiled_decode.guards_checked = nullcontext
    try:
        yield
    finally:
        compiled_decode.guards_checked = once


def profile_compiled(policy, ids, mask, kw: dict, device, autocast: bool, sync) -> dict:
    """One compiled rollout under ``torch.profiler``: wall, device-busy time, top operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync()
    with profile(activities=activities) as prof:
        _, wall = timed_rollout(policy, ids, mask, kw, device, autocast, sync, 0, True)

    def device_us(event) -> float:  # the attribute's name changed in torch 2.4
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))

    events = prof.key_averages()
    busy = sum(device_us(e) for e in events) / 1e6
    key = device_us if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    top = sorted(events, key=key, reverse=True)[:12]
    ops = [
        {
            "name": e.key,
            "calls": e.count,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "self_device_ms": device_us(e) / 1e3,
        }
        for e in top
    ]
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaGraphLaunch"))
    return {"wall_s": wall, "device_busy_s": busy, "launches": launches, "top": ops}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns what ``--json`` writes."""
    import torch

    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(args.threads)
    load_before = load_average()
    results: dict = {}
    for name in args.shape:
        results[name] = measure(name, args)
    results["machine"] = {
        "device": device_name(args.device),
        "threads": args.threads,
        "precision": args.precision,
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }
    results["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(f"machine: {results['machine']['device']}, {args.threads} threads, {args.precision}")
    for name in args.shape:
        r = results[name]
        what = "study" if name == "study" else f"grpo {args.preset}{' tiny' if args.tiny else ''}"
        line = (
            f"  {what} ({r['rows']} rows, {r['median_steps']:g} of {r['new_tokens']} tokens): "
            f"eager {r['eager_median_s']:.3f} s, compiled {r['compiled_median_s']:.3f} s "
            f"(x{r['speedup']:.2f}); {r['eager_tokens_per_s']:.0f} -> "
            f"{r['compiled_tokens_per_s']:.0f} tokens/s; compiling: first compiled rollout "
            f"{r['first_compiled_rollout_s']:.1f} s; tokens that differ: "
            f"{r['token_mismatch_fraction']:.2%}"
        )
        if "compiled_mfu" in r:
            line += f"; MFU {r['eager_mfu']:.1%} -> {r['compiled_mfu']:.1%}"
        print(line)
        if "every_guard_median_s" in r:
            every = r["every_guard_median_s"]
            print(
                f"  compiled, every guard checked at every step: {every:.3f} s (guards once per "
                f"rollout: x{every / r['compiled_median_s']:.2f}; the same tokens)"
            )
        if "profile" in r:
            p = r["profile"]
            print(
                f"  profiled compiled rollout: wall {p['wall_s']:.3f} s, device busy "
                f"{p['device_busy_s']:.3f} s, {p['launches']} kernel or graph launches; top:"
            )
            for op in p["top"]:
                print(
                    f"    {op['name'][:60]:60s} calls {op['calls']:6d}  self cpu "
                    f"{op['self_cpu_ms']:9.2f} ms  self device {op['self_device_ms']:9.2f} ms"
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
