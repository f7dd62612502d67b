r"""PPO throughput: seconds per PPO iteration of rlkl_lightning, optionally against TRL.

Configuration (fixed, offline, seeded; see ``bench_world.py`` and ``workers.py``): a preset
fixes the models and the work of an iteration. The default, ``gpt2-4x256``: GPT-2 policy with
4 layers, width 256, 4 heads, vocabulary 4096, 256 positions; frozen reference copy; a GPT-2
sequence classifier of the same size as reward model; 32 prompts of 16 tokens per iteration;
exactly 32 sampled tokens at temperature 0.7; 4 PPO epochs x 4 minibatches (16 optimizer
steps); 2 threads. ``gpt2-124m`` and ``qwen2-0.5b`` have the shapes of those models (random
weights, built from configs) and a GPU-sized batch.

Each side runs in its own worker process (so its peak memory is its own), paced by this
process one iteration at a time: the sides alternate iteration by iteration, so all of them
meet the same machine conditions. After ``--warmup`` iterations each, ``--iters`` iterations
are timed. The matmul peak of the device in the run's precision is measured by this script
(``flops.py``), and the FLOPs of each phase are counted with the analytic model-FLOPs formula
of ``flops.py``: their ratio is the model FLOPs utilisation (MFU) of the phase.

``--precision bf16-mixed`` runs both sides in bfloat16 autocast (ours: Lightning's
``bf16-mixed``; TRL: its own ``bf16=True``). On a CPU it needs bfloat16 matrix units
(``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``); without them the script says so and
exits 0 without running.

Usage::

    python benchmarks/ppo_throughput.py                              # ours only
    python benchmarks/ppo_throughput.py --vs-trl --json bench.json   # + TRL, and the ratio
    python benchmarks/ppo_throughput.py --vs-trl --precision bf16-mixed
    python benchmarks/ppo_throughput.py --vs-trl --device cuda --preset gpt2-124m \
        --precision bf16-mixed

``--vs-trl`` needs TRL 1.12.0, the last release with a PPOTrainer (``pip install -e
'.[bench]'``); where it cannot be imported the script says so and runs ours only. The JSON
holds ``{"ours": {...}, "ours_separate_value": {...}, "trl": {...}, "speedup": TRL median /
ours median, "machine": {...}, "config": {...}}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flops  # noqa: E402
from bench_world import PRESETS, build, preset  # noqa: E402
from harness import (  # noqa: E402
    BF16_FLAGS,
    PHASES,  # noqa: F401 (read by the smoke test)
    add_common_arguments,
    check_common_arguments,
    collect,
    cpu_flags,
    measure,
    phase_line,
    ragged_line,
    ragged_summary,
)

LABELS = {
    "ours": "rlkl_lightning (value head on the policy trunk)",
    "ours_separate_value": "rlkl_lightning (separate value model)",
    "trl": "TRL 1.12.0 PPOTrainer (separate value model)",
}
for _side in ("ours", "ours_separate_value"):
    LABELS[f"{_side}_packed"] = LABELS[_side] + ", optimization.packing=packed"
    LABELS[f"{_side}_compiled"] = LABELS[_side] + ", optimization.compile"


def report(side: str, s: dict, cpu_matmul: str | None = None, thread: bool | None = None) -> None:
    """Print one side's summary (``None``: the option at the library's default)."""
    matmul = cpu_matmul or "library default (auto)"
    label = LABELS[side] + (f", cpu_matmul={matmul}" if side.startswith("ours") else "")
    if side.startswith("ours_separate_value"):
        label += f", value_model_thread={'library default' if thread is None else thread}"
    print(f"{label}\n{phase_line(s)}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vs-trl", action="store_true", help="also run TRL's PPOTrainer")
    add_common_arguments(parser, sorted(PRESETS))
    parser.add_argument(
        "--batch",
        type=int,
        help="prompts per iteration instead of the preset's (a multiple of its 4 minibatches)",
    )
    parser.add_argument(
        "--cpu-matmul",
        choices=("auto", "default", "onednn"),
        help="our side's models.cpu_matmul option (policy, reference, value models; and the "
        "reward model's cpu_matmul); "
        "unset: the library's default, auto (oneDNN's float32 kernels on AMD, where they are "
        "twice as fast as MKL's)",
    )
    parser.add_argument(
        "--value-model-thread",
        action="store_const",
        const=True,
        help="our separate-value side runs its value model in a second thread beside the "
        "policy (PPOModule's ppo.value_model_thread option; unset: the library's default, which "
        "turns it on with 2+ threads on a CPU)",
    )
    parser.add_argument(
        "--no-value-model-thread",
        dest="value_model_thread",
        action="store_const",
        const=False,
        help="our separate-value side without the second thread",
    )
    parser.add_argument(
        "--compiled-update",
        action="store_true",
        help="also run each of our sides with optimization.compile (sides *_compiled; the "
        "separate value model's thread as on the eager side, each thread its own graph); the "
        "first warm-up iteration includes the compilation",
    )
    parser.add_argument(
        "--no-separate-value",
        action="store_true",
        help="skip our variant with a separate value model",
    )
    args = parser.parse_args(argv)
    check_common_arguments(parser, args)
    if args.ragged and args.compiled_update:
        parser.error("--ragged and --compiled-update: one variant at a time")
    minibatches = preset(args.preset, args.tiny).minibatches
    if args.batch is not None and (args.batch < 1 or args.batch % minibatches):
        parser.error(f"--batch must be a positive multiple of the {minibatches} minibatches")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the results that ``--json`` writes ({} when skipped)."""
    args = parse(argv)
    flags = sorted(cpu_flags() & set(BF16_FLAGS))
    print(f"CPU bfloat16 flags: {', '.join(flags) or 'none'} (of {', '.join(BF16_FLAGS)})")
    if args.precision == "bf16-mixed" and args.device == "cpu" and not flags:
        print(
            "skipped: --precision bf16-mixed on this CPU, which has no bfloat16 matrix units "
            f"({' / '.join(BF16_FLAGS)} not in /proc/cpuinfo): bfloat16 would be emulated, "
            "slower than fp32, and say nothing about either library"
        )
        return {}
    sides = ["ours"] + ([] if args.no_separate_value else ["ours_separate_value"])
    if args.ragged:
        sides += [f"{side}_packed" for side in sides]
    if args.compiled_update:
        sides += [f"{side}_compiled" for side in sides]
    if args.vs_trl:
        if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
            print("TRL cannot be imported here (pip install trl==1.12.0): ours only")
        else:
            sides.append("trl")

    chosen = preset(args.preset, args.tiny, args.batch)
    shape = flops.Shape.of(chosen)
    settings = {
        "preset": args.preset,
        "tiny": args.tiny,
        "batch": args.batch,
        "device": args.device,
        "precision": args.precision,
        "threads": args.threads,
        "omp_wait_policy": args.omp_wait_policy,
        "cpu_matmul": args.cpu_matmul,
        "value_model_thread": args.value_model_thread,
        "ragged": args.ragged,
    }
    tmp = Path(tempfile.mkdtemp(prefix="rlkl-bench-"))
    world = build(args.world or tmp / "world", chosen)
    python = {side: sys.executable for side in sides}
    runs, peak, load_before = measure(python, world, tmp, settings, args)
    tokens = shape.batch * shape.response
    results, precision = collect(
        runs,
        lambda side: flops.phases(shape, side.removesuffix("_packed").removesuffix("_compiled")),
        tokens,
        peak,
        load_before,
        args,
    )
    results["config"] = {
        "preset": chosen.name,
        "device": args.device,
        "precision": args.precision,
        "cpu_matmul": args.cpu_matmul or "library default",
        "value_model_thread": (
            "library default" if args.value_model_thread is None else args.value_model_thread
        ),
        "prompts": chosen.batch,
        "prompt_tokens": chosen.prompt,
        "generated_tokens": chosen.response,
        "ppo_epochs": chosen.epochs,
        "minibatches": chosen.minibatches,
        "warmup_iters": args.warmup,
        "timed_iters": args.iters,
    }
    if "trl" in sides:
        trl_median = results["trl"]["median_s_per_iter"]
        results["speedup"] = trl_median / results["ours"]["median_s_per_iter"]
        if "ours_separate_value" in results:
            sep = results["ours_separate_value"]["median_s_per_iter"]
            results["speedup_separate_value"] = trl_median / sep
    print(
        f"\nmachine: {results['machine']['device']}, {args.threads} threads, OMP_WAIT_POLICY "
        f"{args.omp_wait_policy}; preset {chosen.name}, {args.precision}, our cpu_matmul "
        f"{args.cpu_matmul or 'library default'}; measured {precision} "
        f"matmul peak {peak:.1f} GFLOP/s; load average before {load_before}, after "
        f"{results['machine']['load_average_after']}"
    )
    for side in sides:
        report(side, results[side], args.cpu_matmul, args.value_model_thread)
    if args.ragged:
        results["ragged"] = {
            side: ragged_summary(runs, side, f"{side}_packed")
            for side in sides
            if not side.endswith("_packed")
        }
        for side, summary in results["ragged"].items():
            print(f"{side}: {ragged_line(summary)}")
    if "trl" in sides:
        print(f"speedup (TRL median / ours median): {results['speedup']:.2f}x")
        if "speedup_separate_value" in results:
            print(f"speedup with a separate value model: {results['speedup_separate_value']:.2f}x")
    for side in [s for s in sides if s.endswith("_compiled")]:
        eager = results[side.removesuffix("_compiled")]["median_s_per_iter"]
        compiled = results[side]["median_s_per_iter"]
        results[f"compiled_speedup_{side}"] = eager / compiled
        line = f"{side}: compiled update (eager median / compiled median) {eager / compiled:.2f}x"
        if "trl" in sides:
            line += f"; TRL median / compiled median {trl_median / compiled:.2f}x"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
