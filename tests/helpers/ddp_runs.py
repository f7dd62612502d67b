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

import torch
import yaml

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
