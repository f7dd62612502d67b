"""The runs of a recording PPOModule that the DDP, LoRA-DDP and FSDP tests compare.

``config`` writes the YAML of one run of ``helpers.ppo_recording.RecordingPPO`` (``train.py``
under DDP or FSDP, or the CLI in-process on the same global batches), ``train_py`` runs
``train.py`` as a process with ``tests/`` on its ``PYTHONPATH``, and ``records`` reads what each
rank recorded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlkl_lightning.data.samplers import EpochShuffleSampler

TESTS = Path(__file__).resolve().parents[1]  # tests/: ``helpers`` is importable from it
ROOT = TESTS.parent
WORDS = "the film was good bad this book is very not a story food nice dull plot".split()
PROMPTS = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(2 + i % 3)) for i in range(12)]
SEED, PER_RANK, STEPS = 3, 2, 3
# The exponential law moves beta by exp(k * (kl - target)): no clip, so every beta depends on
# the exact KL the controller received.
INIT_BETA, TARGET, GAIN = 0.2, 0.05, 2.0


_PORTS: set[int] = set()


def free_port() -> int:
    """A free TCP port for a DDP job's ``MASTER_PORT``, never the same twice in this process.

    Lightning picks one the same way (bind to port 0, release) when ``MASTER_PORT`` is unset,
    so two jobs started at once (two test workers, or one test's two runs) can draw the same.
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def train_py(config: Path, cwd: Path, *args: str, timeout: float = 300) -> str:
    """``python train.py fit --config CONFIG ARGS`` as a process, with ``tests/`` importable.

    Returns its standard error (the warnings shown).

    The run gets a session of its own: past ``timeout`` seconds (a hung DDP collective) the
    whole session is killed, the ranks Lightning started included, and the test fails.
    """
    # the caller's PYTHONPATH after ours (packages installed with --target, say)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), *inherited])}
    env["MASTER_PORT"] = str(free_port())  # used by a DDP run only
    command = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(config), *args]
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: its ranks and nothing else
        _, stderr = proc.communicate()
        raise AssertionError(f"train.py ran past {timeout} s (hung?):\n{stderr[-4000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    return stderr


def config(
    tmp_path: Path, lms: tuple[Path, Path], prompts: Path, name: str, poison: str, batch: int
):
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "default_root_dir": str(tmp_path / name),  # the CLI saves its config.yaml there
            "devices": 1,
            "max_epochs": 1,
            "limit_train_batches": STEPS,  # batches: a skipped batch takes no optimizer step
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(tmp_path / name / "ckpt"), "save_last": True},
                }
            ],
        },
        "model": {
            "class_path": "helpers.ppo_recording.RecordingPPO",
            "init_args": {
                "policy": str(lms[0]),
                "reference": str(lms[1]),
                "record_dir": str(tmp_path / name),
                "poison_prompt": poison,
                "cut_batch": STEPS - 1,
                "penalty": {"init_coef": INIT_BETA},
            },
        },
        "data": {
            "class_path": "rlkl_lightning.data.PromptDataModule",
            "init_args": {
                "prompts": str(prompts),
                "heldout": None,
                "batch_size": batch,
                "seed": SEED,
            },
        },
        "kl": {
            "controller": {"class_path": "ExponentialKLController", "init_args": {"k": GAIN}},
            "target": TARGET,
            "window": 4,
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def records(out: Path, ranks: int):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], [
        torch.load(out / f"rank{r}.pt") for r in range(ranks)
    ]


def close(a, b, rel=1e-5, abs=1e-6):
    """``a`` equals ``b`` to float32 rounding through a run (``pytest.approx``)."""
    return a == pytest.approx(b, rel=rel, abs=abs)


def assert_two_processes_equal_one(tmp_path: Path, tiny_lm_dir: Path, optimization: str | None):
    """A 2-process DDP run of ``RecordingPPO`` against one process on the same global batches.

    Both ranks bit for bit, the 1-process run to float32 rounding, the skipped batch, the
    checkpoint; ``optimization``: the ``optimization`` group of both runs (None: defaults).
    tests/system/test_ddp_ppo.py and tests/compiled/test_compiled_ddp.py assert it.
    """
    from helpers.tiny_models import make_tiny_lm
    from rlkl_lightning.cli import main
    from rlkl_lightning.models.loading import load_causal_lm

    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    global_batch = 2 * PER_RANK
    order = [PROMPTS[i] for i in EpochShuffleSampler(len(PROMPTS), SEED)]
    batches = [order[i * global_batch : (i + 1) * global_batch] for i in range(STEPS)]
    poison = batches[1][1]  # position 5 of the epoch: dealt to rank 1 only

    ddp_cfg = config(tmp_path, lms, prompts_file, "ddp", poison, PER_RANK)
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    options = ["--model.init_args.optimization", optimization] if optimization else []
    train_py(ddp_cfg, tmp_path, *ddp, *options)

    sys.path.insert(0, str(TESTS))
    try:
        single_cfg = config(tmp_path, lms, prompts_file, "single", poison, global_batch)
        main(["fit", "--config", str(single_cfg), *options])
    finally:
        sys.path.remove(str(TESTS))

    (rank0, rank1), (w0, w1) = records(tmp_path / "ddp", 2)
    (single,), (w_single,) = records(tmp_path / "single", 1)
    assert rank0["world_size"] == 2 and single["world_size"] == 1

    # ---- both ranks agree, bit for bit
    assert len(rank0["batches"]) == len(rank1["batches"]) == STEPS
    for b0, b1, expected in zip(rank0["batches"], rank1["batches"], batches, strict=True):
        assert b0["beta_used"] == b1["beta_used"]
        assert b0["metrics"] == b1["metrics"]  # logged metrics are global (sync_dist)
        for r in (0, 1):  # each rank's phase peaks, gathered: in both ranks' records
            assert b0["metrics"].get(f"perf/peak_mem_gb/update/rank{r}", 0) > 0.05
        # Each rank takes every second prompt of the one shared order (RankShardSampler).
        assert (b0["prompts"], b1["prompts"]) == (expected[0::2], expected[1::2])
    assert rank0["controller"] == rank1["controller"]
    assert rank0["kl_coef"] == rank1["kl_coef"]
    assert w0["final"].keys() == w1["final"].keys()
    assert all(torch.equal(w0["final"][k], w1["final"][k]) for k in w0["final"])

    # ---- the controller saw the global batch: 4 samples in each of the 3 batches (the
    # skipped one included; it updated beta on 2); the module counts the 8 it trained on.
    assert rank0["controller"]["n_samples"] == single["controller"]["n_samples"] == 12
    assert rank0["controller"]["n_skipped"] == single["controller"]["n_skipped"] == 1
    assert rank0["samples_seen"] == single["samples_seen"] == 8
    assert rank0["skipped_batches"] == rank1["skipped_batches"] == single["skipped_batches"] == 1

    # ---- the 2-process run equals the 1-process run on the same global batches
    def by_prompt(batch_records, key):
        return {
            p: v
            for rec in batch_records
            if key in rec
            for p, v in zip(rec["prompts"], rec[key], strict=True)
        }

    compared = ["objective/kl", "objective/kl_per_token", "objective/entropy", "objective/score"]
    for step in range(STEPS):
        ranks = [rank0["batches"][step], rank1["batches"][step]]
        one = single["batches"][step]
        assert one["prompts"] == batches[step]
        assert close(ranks[0]["beta_used"], one["beta_used"])
        if step == 1:  # the poisoned batch: skipped everywhere, nothing scored
            assert all("kl_seq" not in r for r in ranks + [one])
            assert ranks[0]["metrics"]["progress/skipped_batches"] == 1.0
            assert ranks[0]["beta_used"] == rank0["batches"][2]["beta_used"]
            continue
        for key in ("responses", "tokens", "kl_seq", "scores", "advantages"):
            got, want = by_prompt(ranks, key), by_prompt([one], key)
            assert got.keys() == want.keys() == set(batches[step])
            if key in ("responses", "tokens"):
                assert got == want
            else:
                # Whitened advantages have unit spread: their absolute error is relative to
                # it (float32 rounding through the whitening reached 1.5e-6 with oneDNN's
                # products, cpu_matmul="auto" on an AMD processor).
                tol = {"abs": 1e-5} if key == "advantages" else {}
                assert all(close(got[p], want[p], **tol) for p in want), key
        # Whitening each rank's rows on their own gives clearly different numbers.
        for r in ranks:
            flat = torch.tensor(sum(r["advantages_raw"], []))
            local = (flat - flat.mean()) / flat.std()
            assert (local - torch.tensor(sum(r["advantages"], []))).abs().max() > 0.05
        for key in compared + ["objective/kl_coef"] + (["loss/policy"] if step == 0 else []):
            assert close(ranks[0]["metrics"][key], one["metrics"][key]), key
        # Per-token KL over the tokens of the global batch.
        kl = [sum(r["kl_seq"]) for r in ranks]
        tokens = [sum(r["tokens"]) for r in ranks]
        pooled = sum(kl) / sum(tokens)
        assert close(ranks[0]["metrics"]["objective/kl_per_token"], pooled)
        if step == STEPS - 1:
            assert tokens[0] != tokens[1]
            mean_of_means = (kl[0] / tokens[0] + kl[1] / tokens[1]) / 2
            assert abs(mean_of_means - pooled) > 1e-3 * abs(pooled)
    assert abs(single["batches"][0]["metrics"]["objective/kl"]) > 0.1  # reference != policy
    betas = [b["beta_used"] for b in rank0["batches"]] + [rank0["kl_coef"]]
    assert len(set(betas)) == 3  # beta moved after batches 1 and 3, not after the skipped one
    assert close(rank0["kl_coef"], single["kl_coef"])
    before = w0["before_cut"]
    assert max(float((before[k] - w_single["before_cut"][k]).abs().max()) for k in before) < 1e-5
    initial = load_causal_lm(str(tiny_lm_dir)).state_dict()
    moved = max(float((before[f"policy.{k}"] - v).abs().max()) for k, v in initial.items())
    assert moved > 1e-3  # the weights did change: the comparison above is not vacuous

    # ---- the DDP checkpoint: one RNG state per rank, and the controller state
    ckpt = torch.load(tmp_path / "ddp" / "ckpt" / "last.ckpt", weights_only=True)
    rng = ckpt["rlkl_rng"]["cpu"]
    assert len(rng) == 2
    assert not torch.equal(rng[0], rng[1])  # each rank has its own random stream
    controller = next(v for k, v in ckpt["callbacks"].items() if k.startswith("KLController"))
    assert controller == rank0["controller"]
