"""Memory and time of the reference: a frozen copy against the LoRA policy with adapters off.

Three runs of ``PPOModule`` on one randomly initialised GPT-2 (built offline from a config,
``save_pretrained`` to a temporary directory, with a word-level tokenizer of the same
vocabulary), each in its own process so its peak memory is its own:

* ``full+copy``: every policy weight trains, the reference is a frozen copy (the default);
* ``lora+copy``: LoRA adapters train, the reference is a frozen copy of the base (``reference``
  set to the policy's directory);
* ``lora+off``: LoRA adapters train, the reference is the policy with its adapters off.

Each run trains ``--batches`` PPO batches (``--batch`` prompts of 16 tokens, exactly
``--new-tokens`` sampled tokens, 1 PPO epoch x 2 minibatches, a reward that counts words) with
Lightning's ``trainer.precision``, after one warm-up batch, and prints: seconds per batch
(median), parameters held by the module (policy, reference, value head) and their bytes,
trainable parameters, and the peak memory: ``torch.cuda.max_memory_allocated`` on CUDA; on the
CPU the peak resident set size of the process and that peak minus the resident size before the
model was loaded (both through ``process_peak_bytes``, which the module's per-phase resets of
the peaks do not lower).

    python benchmarks/lora_reference.py                      # CPU, fp32, GPT-2 124M shape
    python benchmarks/lora_reference.py --device cuda --precision bf16-true
    python benchmarks/lora_reference.py --device cpu --tiny  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import in_fresh_process, result_line

VARIANTS = ("full+copy", "lora+copy", "lora+off")
GPT2_124M = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512}
LORA = {
    "r": 16,
    "lora_alpha": 32,
    "target_modules": ["c_attn", "c_proj", "c_fc"],
    "fan_in_fan_out": True,
}
PROMPT_TOKENS = 16


def build_model(directory: Path, shape: dict) -> Path:
    """A random-weights GPT-2 of ``shape`` and a word-level tokenizer of its vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1}
    vocab.update({f"w{i}": i for i in range(2, shape["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = GPT2Config(n_positions=256, bos_token_id=0, eos_token_id=0, **shape)
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def rss_bytes() -> int:
    """Current resident set size of this process (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(args: argparse.Namespace) -> dict:
    """One run in this process; returns its figures."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from rlkl_lightning import PPOModule
    from rlkl_lightning.algorithms.memory import process_peak_bytes
    from rlkl_lightning.rewards import FunctionReward

    torch.set_num_threads(args.threads)
    base_rss = rss_bytes()
    seed_everything(0)
    lora = args.variant.startswith("lora")
    module = PPOModule(
        policy=args.model_dir,
        reference=args.model_dir if args.variant.endswith("copy") and lora else None,
        reward=FunctionReward(lambda prompt, response: float(len(response.split()))),
        sampling={
            "max_prompt_tokens": PROMPT_TOKENS,
            "max_new_tokens": args.new_tokens,
            "stop_at_eos": False,
        },
        optimization={"ppo_epochs": 1, "num_minibatches": 2, "lr": 1e-4},
        logging={"log_samples_every": 0},
        models={
            "peft": LORA if lora else None,
            "gradient_checkpointing": args.gradient_checkpointing,
        },
    )
    params = list(module.parameters())
    reference = getattr(module.reference, "parameters", lambda: [])
    held = {
        "params_held": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "reference_params": sum(p.numel() for p in reference()),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
    }

    class Clock(Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    prompts = [
        " ".join(f"w{2 + (i * 7 + j) % 400}" for j in range(PROMPT_TOKENS))
        for i in range(args.batch * (args.batches + 1))
    ]
    loader = torch.utils.data.DataLoader(
        prompts, batch_size=args.batch, collate_fn=lambda rows: {"prompt": rows}
    )
    trainer = Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        precision=args.precision,
        max_steps=2 * (args.batches + 1),
        logger=False,
        callbacks=[clock],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, loader)
    out = {
        "variant": args.variant,
        "device": args.device,
        "precision": args.precision,
        "s_per_batch": statistics.median(clock.times[1:]) if len(clock.times) > 1 else None,
        **held,
        "skipped_batches": module.skipped_batches,
    }
    # The process's peaks, which the module's per-phase resets do not lower.
    if args.device == "cuda":
        out["peak_gpu_bytes"] = process_peak_bytes("cuda", "allocated")
    else:
        out["peak_rss_bytes"] = process_peak_bytes("cpu")
        out["peak_rss_added_bytes"] = out["peak_rss_bytes"] - base_rss
    return out


def table(rows: list[dict]) -> str:
    mib = 2**20
    peak = "peak_gpu_bytes" if "peak_gpu_bytes" in rows[0] else "peak_rss_added_bytes"
    head = "| run | params held | of which reference | trainable | weights MiB | "
    head += "peak GPU MiB |" if peak == "peak_gpu_bytes" else "peak RSS MiB (added) |"
    lines = [head + " s/batch |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = "" if peak == "peak_gpu_bytes" else f" ({r[peak] / mib:.0f})"
        total = r.get("peak_gpu_bytes", r.get("peak_rss_bytes"))
        counts = [r[k] / 1e6 for k in ("params_held", "reference_params", "trainable_params")]
        lines.append(
            f"| {r['variant']} | {counts[0]:.2f}M | {counts[1]:.2f}M | {counts[2]:.2f}M "
            f"| {r['param_bytes'] / mib:.0f} | {total / mib:.0f}{extra} | {r['s_per_batch']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", default="32-true", help="Lightning's trainer.precision")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: a smoke test")
    parser.add_argument("--batch", type=int, default=8, help="prompts per batch")
    parser.add_argument("--new-tokens", type=int, default=32, help="sampled tokens per response")
    parser.add_argument("--batches", type=int, default=3, help="timed batches (after 1 warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        result_line(run_variant(args))
        return []

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", TINY if args.tiny else GPT2_124M)
        root = Path(__file__).resolve().parents[1]
        path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
        for variant in args.variants.split(","):
            command = [sys.executable, __file__, "--variant", variant, "--model-dir", model_dir]
            for name in ("device", "precision", "batch", "new_tokens", "batches", "threads"):
                command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            command += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
            rows.append(in_fresh_process(command, env))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
