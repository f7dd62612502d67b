r"""GRPO throughput: seconds per GRPO iteration of rlkl_lightning, optionally against TRL.

One iteration samples ``batch`` completions (``batch / generations`` prompts x ``generations``
completions each), scores them with the reward model and the reference, and takes ``epochs x
minibatches`` optimizer steps. Ours: ``RLOOModule`` with ``group={"advantage": "grpo",
"scale_rewards": "group"}``, ``objective={"aggregation": "batch_token_mean"}`` and
``penalty={"placement": "loss", "loss_estimator": "k3"}``, beta fixed. TRL 1.16.0:
``GRPOTrainer`` with ``use_vllm=False`` (transformers' ``generate``), ``beta`` the same,
``use_bias_correction_kl=False``, ``loss_type="bnpo"``, ``scale_rewards="group"``,
``num_generations`` = generations, ``steps_per_generation`` = minibatches,
``num_iterations`` = epochs, ``epsilon=0.2``, no gradient checkpointing, the same sampling
settings and exactly ``response`` sampled tokens (no early stop). TRL also computes the
full-vocabulary entropy in every loss pass: that is its work, counted in its time.

The presets are ``ppo_throughput.py``'s (``bench_world.py``): ``gpt2-4x256`` (the CPU
benchmark: 8 prompts x 4 completions x 32 tokens, 4 epochs x 4 minibatches = 16 optimizer
steps), ``gpt2-124m`` and ``qwen2-0.5b`` (for a GPU). Each side runs in its own worker process,
paced one iteration at a time in alternating order (``harness.py``); the script counts each
side's optimizer steps and sampled tokens per iteration and prints them.

TRL 1.16.0 cannot share an environment with the TRL 1.12.0 that ``ppo_throughput.py`` needs,
so its worker runs under another interpreter: ``--trl-python`` (default: ``.venv-trl/bin/python``
of the repository, which ``make trl-env`` builds).

Usage::

    python benchmarks/grpo_throughput.py                                 # ours only
    python benchmarks/grpo_throughput.py --vs-trl --json grpo.json       # + TRL, and the ratio
    python benchmarks/grpo_throughput.py --compiled-update               # + optimization.compile
    python benchmarks/grpo_throughput.py --vs-trl --device cuda --preset gpt2-124m \
        --precision bf16-mixed
    python benchmarks/grpo_throughput.py --ragged    # EOS stops: packing off against on

With ``--ragged`` every response ends after a number of tokens drawn uniformly from 1 to the
preset's length with a fixed seed (``workers.cut_responses``: the benchmark's random policy
almost never samples EOS), and our side runs twice, ``optimization.packing`` ``none``
(``ours_grpo``) and ``packed`` (``ours_grpo_packed``); the JSON adds ``ragged``
(``harness.ragged_summary``). The FLOP counts and MFU assume full-length responses.

The JSON holds ``{"ours_grpo": {...}, "trl_grpo": {...}, "speedup": TRL median / ours median,
"machine": {...}, "config": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flops  # noqa: E402
from bench_world import PRESETS, build, preset  # noqa: E402
from harness import (  # noqa: E402
    BF16_FLAGS,
    add_common_arguments,
    check_common_arguments,
    collect,
    cpu_flags,
    measure,
    phase_line,
    ragged_line,
    ragged_summary,
)

DEFAULT_TRL_PYTHON = HERE.parent / ".venv-trl" / "bin" / "python"
TRL_VERSION = "1.16.0"


def trl_version(python: Path) -> str | None:
    """The TRL version that ``python`` imports (None: it cannot)."""
    if not Path(python).exists():
        return None
    code = "import datasets, trl; print(trl.__version__)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vs-trl", action="store_true", help="also run TRL's GRPOTrainer")
    parser.add_argument(
        "--trl-python",
        type=Path,
        default=DEFAULT_TRL_PYTHON,
        help=f"the interpreter with TRL {TRL_VERSION} (default: %(default)s, `make trl-env`)",
    )
    add_common_arguments(parser, sorted(PRESETS))
    parser.add_argument(
        "--batch", type=int, help="completions per iteration instead of the preset's"
    )
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument(
        "--compiled-update",
        action="store_true",
        help="also run our side with optimization.compile (side ours_grpo_compiled); its first "
        "warm-up iteration includes the compilation",
    )
    parser.add_argument(
        "--compiled-decode",
        action="store_true",
        help="also run our side with engine.compiled_decode (side ours_grpo_compiled, with "
        "--compiled-update: both); its first warm-up iteration includes the compilation",
    )
    parser.add_argument(
        "--cpu-matmul",
        choices=("auto", "default", "onednn"),
        help="our side's models.cpu_matmul option (default: the library's own default)",
    )
    args = parser.parse_args(argv)
    check_common_arguments(parser, args)
    if args.generations < 2:
        parser.error("--generations must be >= 2")
    p = preset(args.preset, args.tiny, args.batch)
    if p.batch % args.generations or p.batch % p.minibatches:
        parser.error(
            f"--batch ({p.batch}) must be a multiple of --generations ({args.generations}) and "
            f"of the {p.minibatches} minibatches"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the results that ``--json`` writes ({} when skipped)."""
    args = parse(argv)
    flags = sorted(cpu_flags() & set(BF16_FLAGS))
    if args.precision == "bf16-mixed" and args.device == "cpu" and not flags:
        print("skipped: --precision bf16-mixed on a CPU without bfloat16 matrix units")
        return {}
    sides = {"ours_grpo": sys.executable}
    if args.ragged:
        sides["ours_grpo_packed"] = sys.executable
    if args.compiled_update or args.compiled_decode:
        sides["ours_grpo_compiled"] = sys.executable
    if args.vs_trl:
        version = trl_version(args.trl_python)
        if version is None:
            print(f"TRL cannot be imported by {args.trl_python} (make trl-env): ours only")
        else:
            if version != TRL_VERSION:
                print(f"warning: {args.trl_python} has TRL {version}, not {TRL_VERSION}")
            sides["trl_grpo"] = str(args.trl_python)

    chosen = preset(args.preset, args.tiny, args.batch)
    shape = flops.Shape.of(chosen)
    settings = {
        "preset": args.preset,
        "tiny": args.tiny,
        "batch": args.batch,
        "generations": args.generations,
        "device": args.device,
        "precision": args.precision,
        "threads": args.threads,
        "omp_wait_policy": args.omp_wait_policy,
        "cpu_matmul": args.cpu_matmul,
        "ragged": args.ragged,
        "compiled_update": args.compiled_update,
        "compiled_decode": args.compiled_decode,
    }
    tmp = Path(tempfile.mkdtemp(prefix="rlkl-grpo-bench-"))
    world = build(args.world or tmp / "world", chosen)
    runs, peak, load_before = measure(sides, world, tmp, settings, args)
    tokens = shape.batch * shape.response
    results, precision = collect(
        runs,
        lambda side: flops.grpo_phases(shape, side, args.device),
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
        "prompts": chosen.batch // args.generations,
        "generations": args.generations,
        "completions": chosen.batch,
        "prompt_tokens": chosen.prompt,
        "generated_tokens": chosen.response,
        "epochs": chosen.epochs,
        "minibatches": chosen.minibatches,
        "warmup_iters": args.warmup,
        "timed_iters": args.iters,
    }
    for side in sides:  # the same work on both sides, counted here
        r = results[side]
        if r["optimizer_steps_per_iter"] != [chosen.epochs * chosen.minibatches]:
            raise RuntimeError(f"{side}: optimizer steps {r['optimizer_steps_per_iter']}")
        if not args.ragged and r.get("sampled_tokens_per_iter") != [tokens]:
            raise RuntimeError(f"{side}: sampled tokens {r.get('sampled_tokens_per_iter')}")
    labels = {
        "ours_grpo": f"rlkl_lightning RLOOModule(advantage='grpo'), cpu_matmul="
        f"{args.cpu_matmul or 'library default'}",
        "trl_grpo": f"TRL {TRL_VERSION} GRPOTrainer (transformers generate)",
    }
    labels["ours_grpo_packed"] = labels["ours_grpo"] + ", optimization.packing=packed"
    compiled = ["optimization.compile"] * args.compiled_update
    compiled += ["engine.compiled_decode"] * args.compiled_decode
    labels["ours_grpo_compiled"] = ", ".join([labels["ours_grpo"], *compiled])
    print(
        f"\nmachine: {results['machine']['device']}, {args.threads} threads, OMP_WAIT_POLICY "
        f"{args.omp_wait_policy}; preset {chosen.name}, {args.precision}; "
        f"{chosen.batch // args.generations} prompts x {args.generations} completions x "
        f"{chosen.response} tokens, {chosen.epochs * chosen.minibatches} optimizer steps per "
        f"iteration (counted on both sides); measured {precision} matmul peak {peak:.1f} "
        f"GFLOP/s; load average before {load_before}, after "
        f"{results['machine']['load_average_after']}"
    )
    for side in sides:
        print(f"{labels[side]}\n{phase_line(results[side])}")
    if args.ragged:
        results["ragged"] = ragged_summary(runs, "ours_grpo", "ours_grpo_packed")
        print(ragged_line(results["ragged"]))
    if "trl_grpo" in sides:
        trl_median = results["trl_grpo"]["median_s_per_iter"]
        results["speedup"] = trl_median / results["ours_grpo"]["median_s_per_iter"]
        print(f"speedup (TRL median / ours median): {results['speedup']:.2f}x")
    if "ours_grpo_compiled" in sides:
        eager = results["ours_grpo"]["median_s_per_iter"]
        results["compiled_speedup"] = eager / results["ours_grpo_compiled"]["median_s_per_iter"]
        print(
            f"{' + '.join(compiled)} (eager median / compiled median): "
            f"{results['compiled_speedup']:.2f}x"
        )
        if "trl_grpo" in sides:
            compiled_median = results["ours_grpo_compiled"]["median_s_per_iter"]
            results["compiled_speedup_vs_trl"] = trl_median / compiled_median
            print(
                "speedup, compiled (TRL median / compiled median): "
                f"{results['compiled_speedup_vs_trl']:.2f}x"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
