"""Exact resume: a run interrupted after N batches and resumed equals the uninterrupted run.

Everything runs on the CPU with fixed seeds, and the comparisons are bit-for-bit (``==`` on
floats, ``torch.equal`` on tensors): the same prompts in every batch, the same beta sequence,
losses and KLs, the same drift-monitor window, and the same final weights and optimizer state.
This holds because checkpoints carry the controller and monitor state, the sample counters, the
optimizer, the torch RNG state (rollouts and minibatch order) and the data loader's position in
its epoch, and the prompt order depends only on (seed, epoch).
"""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers.cli_runs import law
from helpers.trainers import fit_on_prompts
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from rlkl_lightning import (
    AdaptiveKLController,
    KLControllerCallback,
    KLDriftMonitor,
    PPOModule,
    RLOOModule,
)
from rlkl_lightning.checkpoints import AtomicCheckpointIO
from rlkl_lightning.data import PromptDataModule

WORDS = "the film was good bad this book is very not a story food nice dull plot".split()
# 12 prompts, 4 per batch: 3 batches per epoch; 2 epochs = 6 batches, interrupted after 4.
PROMPTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 3)) for i in range(12)]
BATCH = 4
PPO_EPOCHS, MINIBATCHES = 1, 2
STEPS_PER_BATCH = PPO_EPOCHS * MINIBATCHES  # trainer.global_step counts optimizer steps


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


#: Responses per prompt of the RLOO runs (RLOO with the KL in the loss: the other code paths).
RLOO = {"group": {"responses_per_prompt": 2}, "penalty": {"placement": "loss"}}


def module(policy_dir, algorithm: str = "ppo") -> PPOModule | RLOOModule:
    rloo = algorithm == "rloo"
    cls, group = (RLOOModule, RLOO["group"]) if rloo else (PPOModule, None)
    return cls(
        policy=str(policy_dir),
        penalty={"init_coef": 0.2, **(RLOO["penalty"] if rloo else {})},
        sampling={"max_prompt_tokens": 8, "max_new_tokens": 6},
        optimization={"ppo_epochs": PPO_EPOCHS, "num_minibatches": MINIBATCHES, "lr": 3e-3},
        logging={"log_samples_every": 0},
        **({"group": group} if rloo else {}),
    )


class Recorder(Callback):
    """What every batch used and produced, in training order."""

    def __init__(self):
        self.rows: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append(
            {
                "epoch": trainer.current_epoch,
                "batch_idx": batch_idx,
                "prompts": list(batch["prompt"]),
                "beta_used": pl_module.kl_coef,
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        for key in ("objective/kl", "objective/kl_coef", "loss/policy", "loss/value", "loss/kl"):
            if key in m:
                self.rows[-1][key] = float(m[key])


class SimulatedCrash(RuntimeError):
    """A failure in the middle of training (stands for a kill, an OOM, a node failure)."""


class Crash(Callback):
    """Crash the run when batch ``at`` (0-based, over the whole run) starts."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at * STEPS_PER_BATCH:
            raise SimulatedCrash(f"crash at batch {self.at}")


def run(
    policy_dir, prompts_file, ckpt_dir, extra=(), ckpt_path=None, algorithm="ppo", checkpoint=True
):
    seed_everything(0)
    model = module(policy_dir, algorithm)
    controller = KLControllerCallback(AdaptiveKLController(0.2, target=0.35, horizon=40))
    monitor = KLDriftMonitor(target=0.35, window=10, min_batches=2, verbose=False)
    recorder = Recorder()
    callbacks = [controller, monitor, recorder, *extra]
    if checkpoint:
        every_batch = dict(save_last=True, save_top_k=-1, every_n_train_steps=STEPS_PER_BATCH)
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, **every_batch))
    data = PromptDataModule(prompts=str(prompts_file), heldout=None, batch_size=BATCH, seed=5)
    trainer = fit_on_prompts(
        model,
        data,
        callbacks=callbacks,
        ckpt_path=ckpt_path,
        max_epochs=2,
        plugins=[AtomicCheckpointIO()],
    )
    return trainer, model, controller, monitor, recorder


@pytest.fixture(scope="module")
def full_ppo_run(tiny_lm_dir, tmp_path_factory):
    """The uninterrupted PPO run, a checkpoint after every batch, in ``ckpt_dir``: trained once
    for the module's tests. ``(ckpt_dir, trainer, module, controller, monitor, recorder)``."""
    tmp = tmp_path_factory.mktemp("full_ppo_run")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return tmp / "ckpt", *run(tiny_lm_dir, prompts, tmp / "ckpt")


def _unique_storages(state: dict) -> list:
    seen, out = set(), []
    for tensor in state.values():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            out.append(tensor)
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_interrupted_and_resumed_run_equals_the_uninterrupted_run(
    tiny_lm_dir, prompts_file, tmp_path, algorithm, request
):
    samples = BATCH * (RLOO["group"]["responses_per_prompt"] if algorithm == "rloo" else 1)
    if algorithm == "ppo":
        full_dir, _, full, full_ctl, full_mon, full_rec = request.getfixturevalue("full_ppo_run")
    else:
        full_dir = tmp_path / "full"
        _, full, full_ctl, full_mon, full_rec = run(
            tiny_lm_dir, prompts_file, full_dir, algorithm=algorithm
        )
    assert len(full_rec.rows) == 6
    assert len({r["beta_used"] for r in full_rec.rows}) == 6  # beta moves every batch

    # Crashes when batch 4 (epoch 1, batch 1) starts: the last checkpoint is after batch 3.
    with pytest.raises(SimulatedCrash):
        run(tiny_lm_dir, prompts_file, tmp_path / "cut", extra=[Crash(at=4)], algorithm=algorithm)
    last = tmp_path / "cut" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["rlkl_counters"]["batches_seen"] == 4
    assert saved["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1

    _, resumed, ctl, mon, rec = run(
        tiny_lm_dir, prompts_file, tmp_path / "cut", ckpt_path=last, algorithm=algorithm
    )
    # The resumed run trains exactly the two batches the full run trained after batch 4,
    # on the same prompts, with the same beta, and gets the same losses and KLs, bit for bit.
    assert rec.rows == full_rec.rows[4:]
    assert ctl.state_dict() == full_ctl.state_dict()
    assert mon.state_dict() == full_mon.state_dict()
    assert (ctl.n_batches, ctl.n_samples) == (6, 6 * samples)
    assert resumed.kl_coef == full.kl_coef
    assert (resumed.batches_seen, resumed.samples_seen) == (6, 6 * samples)
    assert_same_tensors(
        {k: v for k, v in resumed.state_dict().items()},
        {k: v for k, v in full.state_dict().items()},
    )
    full_opt = torch.load(full_dir / "last.ckpt", weights_only=True)
    res_opt = torch.load(tmp_path / "cut" / "last.ckpt", weights_only=True)
    for a, b in zip(
        full_opt["optimizer_states"][0]["state"].values(),
        res_opt["optimizer_states"][0]["state"].values(),
        strict=True,
    ):
        assert_same_tensors(a, b)


def test_checkpoints_do_not_change_the_run(tiny_lm_dir, prompts_file, full_ppo_run):
    """Writing a checkpoint after every batch draws no random number and changes nothing."""
    ckpt_dir, _, with_ckpt, *_, rec = full_ppo_run
    _, without, *_, rec_without = run(tiny_lm_dir, prompts_file, None, checkpoint=False)
    assert len(list(ckpt_dir.glob("*.ckpt"))) == 7  # a file per batch, and last.ckpt
    assert rec.rows == rec_without.rows
    assert_same_tensors(with_ckpt.state_dict(), without.state_dict())


def test_rng_states_saved_as_views_restore_each_ranks_stream():
    """A DDP checkpoint of older versions held views into one gathered tensor."""
    from types import SimpleNamespace

    from rlkl_lightning.algorithms.resume import restore_rng_states

    torch.manual_seed(1)
    rank0 = torch.get_rng_state()
    torch.manual_seed(2)
    rank1 = torch.get_rng_state()
    gathered = torch.stack([rank0, rank1])
    views = {"cpu": list(gathered.unbind(0))}
    assert views["cpu"][1].storage_offset() > 0  # what crashed torch.set_rng_state
    trainer = SimpleNamespace(global_rank=1, world_size=2)
    restore_rng_states(views, trainer, torch.device("cpu"), "test")
    assert torch.equal(torch.get_rng_state(), rank1)


def test_checkpoint_contents_and_no_reference_copy(tiny_lm_dir, prompts_file, tmp_path):
    """Everything a resume needs is in the checkpoint; the frozen reference is not."""
    with pytest.raises(SimulatedCrash):
        run(tiny_lm_dir, prompts_file, tmp_path, extra=[Crash(at=1)])
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    weights = ckpt["state_dict"]
    assert not [k for k in weights if k.startswith("reference.")]
    assert any(k.startswith("policy.") for k in weights)
    assert any(k.startswith("value_head.") for k in weights)
    # Adding the reference back makes the file larger by the reference's weights: it holds
    # no hidden copy of them either.
    reference = module(tiny_lm_dir).reference.state_dict()
    ref_bytes = sum(t.untyped_storage().nbytes() for t in _unique_storages(reference))
    torch.save(
        {**ckpt, "state_dict": {**weights, **{f"reference.{k}": v for k, v in reference.items()}}},
        tmp_path / "with_ref.ckpt",
    )
    grown = (tmp_path / "with_ref.ckpt").stat().st_size - (tmp_path / "last.ckpt").stat().st_size
    assert grown >= 0.95 * ref_bytes, (grown, ref_bytes)
    states = ckpt["callbacks"]
    controller = next(v for k, v in states.items() if k.startswith("KLControllerCallback"))
    monitor = next(v for k, v in states.items() if k.startswith("KLDriftMonitor"))
    assert controller["controller"]["law"] == "adaptive" and controller["n_samples"] == BATCH
    assert len(monitor["values"]) == 1
    assert ckpt["rlkl_counters"]["samples_seen"] == BATCH
    assert ckpt["optimizer_states"][0]["state"]  # AdamW moments
    assert len(ckpt["rlkl_rng"]["cpu"]) == 1  # one RNG state per process
    # The data loader's place in its epoch (Lightning stores stateful loaders' states).
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 0, "batches": 1, "prompts": BATCH, "size": len(PROMPTS)}  # the place in its order
    ]


# ---- through the LightningCLI: `fit --ckpt_path last` ---------------------------------------


def cli_config(tmp_path, policy_dir, prompts_file, name: str) -> str:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 3,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(tmp_path / name / "runs"), "name": "run"},
            },
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": str(tmp_path / name / "ckpt"),
                        "save_last": True,
                        "every_n_train_steps": STEPS_PER_BATCH,
                    },
                }
            ],
        },
        "model": {
            "class_path": "rlkl_lightning.PPOModule",
            "init_args": {
                "policy": str(policy_dir),
                "penalty": {"init_coef": 0.2},
                "sampling": {"max_prompt_tokens": 8, "max_new_tokens": 6},
                "optimization": {
                    "ppo_epochs": PPO_EPOCHS,
                    "num_minibatches": MINIBATCHES,
                    "lr": 3e-3,
                },
                "logging": {"log_samples_every": 0},
            },
        },
        "data": {
            "class_path": "rlkl_lightning.data.PromptDataModule",
            "init_args": {
                "prompts": str(prompts_file),
                "heldout": None,
                "batch_size": BATCH,
                "seed": 1,
            },
        },
        "kl": {"controller": law("adaptive", horizon=40.0), "target": 0.35, "window": 10},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def scalars(log_dir, key: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for version in sorted(log_dir.glob("run/version_*")):
        events = EventAccumulator(str(version))
        events.Reload()
        values.update({e.step: e.value for e in events.Scalars(key)})
    return values


def test_cli_fit_ckpt_path_last_continues_exactly(tiny_lm_dir, prompts_file, tmp_path):
    from rlkl_lightning.cli import main

    n = 2  # batches before the stop; 4 in all (crossing the epoch boundary after batch 3)
    full = cli_config(tmp_path, tiny_lm_dir, prompts_file, "full")
    main(["fit", "--config", full, f"--trainer.max_steps={2 * n * STEPS_PER_BATCH}"])
    cut = cli_config(tmp_path, tiny_lm_dir, prompts_file, "cut")
    main(["fit", "--config", cut, f"--trainer.max_steps={n * STEPS_PER_BATCH}"])
    main(
        ["fit", "--config", cut, f"--trainer.max_steps={2 * n * STEPS_PER_BATCH}"]
        + ["--ckpt_path", "last"]
    )
    a = torch.load(tmp_path / "full" / "ckpt" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "ckpt" / "last.ckpt", weights_only=True)
    assert a["rlkl_counters"] == b["rlkl_counters"]
    assert a["rlkl_counters"]["batches_seen"] == 2 * n
    kl_states = [k for k in a["callbacks"] if k.startswith(("KLController", "KLDrift"))]
    assert len(kl_states) == 2
    for key in kl_states:  # controller (beta, counters) and the monitor's window of all KLs
        assert a["callbacks"][key] == b["callbacks"][key]
    assert len(a["callbacks"][kl_states[1]]["values"]) == 2 * n
    assert_same_tensors(a["state_dict"], b["state_dict"])
    for key in ("objective/kl_coef", "objective/kl", "loss/policy", "loss/value"):
        full_log = scalars(tmp_path / "full" / "runs", key)
        cut_log = scalars(tmp_path / "cut" / "runs", key)
        assert len(full_log) == 2 * n
        assert cut_log == full_log, key


@pytest.mark.slow  # a resume case: make test-slow
def test_cli_resume_of_a_finished_run_with_more_epochs_trains_them(
    tiny_lm_dir, prompts_file, tmp_path
):
    """A finished run of 1 epoch (3 batches) resumed with max_epochs=2 trains epoch 1's 3
    batches, and ends where one run of 2 epochs ends, bit for bit.

    File order (``shuffle: false``) and a checkpoint after every batch: the last one is
    written after the epoch's last batch, before Lightning counts the epoch as finished, and
    the resumed run goes straight to epoch 1, whose batches must not be taken as seen.
    """
    from rlkl_lightning.cli import main

    per_epoch = len(PROMPTS) // BATCH
    paths = {}
    for name in ("full", "cut"):
        paths[name] = cli_config(tmp_path, tiny_lm_dir, prompts_file, name)
        config = yaml.safe_load(open(paths[name]))
        config["data"]["init_args"]["shuffle"] = False
        open(paths[name], "w").write(yaml.safe_dump(config))
    main(["fit", "--config", paths["full"], "--trainer.max_epochs=2"])
    main(["fit", "--config", paths["cut"], "--trainer.max_epochs=1"])
    first = torch.load(tmp_path / "cut" / "ckpt" / "last.ckpt", weights_only=True)
    assert first["rlkl_counters"]["batches_seen"] == per_epoch
    main(["fit", "--config", paths["cut"], "--trainer.max_epochs=2", "--ckpt_path", "last"])
    a = torch.load(tmp_path / "full" / "ckpt" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "ckpt" / "last.ckpt", weights_only=True)
    assert b["rlkl_counters"]["batches_seen"] == a["rlkl_counters"]["batches_seen"] == 2 * per_epoch
    assert b["global_step"] == a["global_step"] == 2 * per_epoch * STEPS_PER_BATCH
    assert_same_tensors(a["state_dict"], b["state_dict"])
    for key in (k for k in a["callbacks"] if k.startswith(("KLController", "KLDrift"))):
        assert a["callbacks"][key] == b["callbacks"][key]


@pytest.mark.slow  # a resume case: make test-slow
@pytest.mark.parametrize("written", ["by_the_run", "after_fit"])
def test_extending_a_finished_run_bounded_by_max_steps_trains_the_new_epoch(
    tiny_lm_dir, prompts_file, tmp_path, written
):
    """Every shipped config sets ``max_steps``: a run of 1 epoch extended to 2 trains epoch 1.

    The periodic checkpoints never fire (``every_n_train_steps`` beyond the run), as in
    ``train.py fit --config configs/ppo_adaptive.yaml --trainer.limit_train_batches=4
    --trainer.max_epochs=1``: ``last.ckpt`` is the run's end (``by_the_run``), or a file that
    ``Trainer.save_checkpoint`` wrote after ``fit`` returned (``after_fit``: the epoch counted
    as finished). Lightning took either resume under ``max_steps`` as one inside the finished
    epoch and ended at once, exit status 0, having trained nothing.
    """
    from rlkl_lightning.cli import main

    per_epoch = len(PROMPTS) // BATCH
    paths = {}
    for name in ("full", "cut"):
        paths[name] = cli_config(tmp_path, tiny_lm_dir, prompts_file, name)
        config = yaml.safe_load(open(paths[name]))
        config["trainer"]["max_steps"] = 1000
        config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 1000
        open(paths[name], "w").write(yaml.safe_dump(config))
    main(["fit", "--config", paths["full"], "--trainer.max_epochs=2"])
    cut = main(["fit", "--config", paths["cut"], "--trainer.max_epochs=1"])
    resume_from = tmp_path / "cut" / "ckpt" / "last.ckpt"
    if written == "after_fit":
        resume_from = tmp_path / "cut" / "after_fit.ckpt"
        cut.trainer.save_checkpoint(resume_from)
    first = torch.load(resume_from, weights_only=True)
    assert first["rlkl_counters"]["batches_seen"] == per_epoch
    main(
        ["fit", "--config", paths["cut"], "--trainer.max_epochs=2", "--ckpt_path", str(resume_from)]
    )
    a = torch.load(tmp_path / "full" / "ckpt" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "ckpt" / "last.ckpt", weights_only=True)
    assert b["rlkl_counters"]["batches_seen"] == a["rlkl_counters"]["batches_seen"] == 2 * per_epoch
    assert b["global_step"] == a["global_step"] == 2 * per_epoch * STEPS_PER_BATCH
    assert_same_tensors(a["state_dict"], b["state_dict"])
    for key in (k for k in a["callbacks"] if k.startswith(("KLController", "KLDrift"))):
        assert a["callbacks"][key] == b["callbacks"][key]


@pytest.mark.slow  # a resume case: make test-slow
def test_last_ckpt_is_the_runs_final_batch_and_continues_exactly(
    tiny_lm_dir, prompts_file, tmp_path
):
    """A checkpoint every 2 batches and a run of 3: ``last.ckpt`` is batch 3, not batch 2.

    It was up to ``every_n_train_steps`` old (24 batches in the shipped configs): Lightning
    writes ``last`` at the end of training only when nothing was saved before. Extended to 5
    batches, the run ends where one run of 5 batches ends.
    """
    from rlkl_lightning.cli import main

    paths = {}
    for name in ("full", "cut"):
        paths[name] = cli_config(tmp_path, tiny_lm_dir, prompts_file, name)
        config = yaml.safe_load(open(paths[name]))
        config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2 * STEPS_PER_BATCH
        open(paths[name], "w").write(yaml.safe_dump(config))
    main(["fit", "--config", paths["full"], f"--trainer.max_steps={5 * STEPS_PER_BATCH}"])
    main(["fit", "--config", paths["cut"], f"--trainer.max_steps={3 * STEPS_PER_BATCH}"])
    last = torch.load(tmp_path / "cut" / "ckpt" / "last.ckpt", weights_only=True)
    assert last["rlkl_counters"]["batches_seen"] == 3
    assert last["global_step"] == 3 * STEPS_PER_BATCH
    main(
        ["fit", "--config", paths["cut"], f"--trainer.max_steps={5 * STEPS_PER_BATCH}"]
        + ["--ckpt_path", "last"]
    )
    a = torch.load(tmp_path / "full" / "ckpt" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "ckpt" / "last.ckpt", weights_only=True)
    assert b["rlkl_counters"] == a["rlkl_counters"]
    assert a["rlkl_counters"]["batches_seen"] == 5
    assert_same_tensors(a["state_dict"], b["state_dict"])
    for key in (k for k in a["callbacks"] if k.startswith(("KLController", "KLDrift"))):
        assert a["callbacks"][key] == b["callbacks"][key]


def test_the_end_of_run_save_leaves_the_epoch_checkpoint_in_place(
    tiny_lm_dir, prompts_file, tmp_path
):
    """A ``ModelCheckpoint`` saving at epoch ends still writes the last epoch's file, after the
    final batch's ``last.ckpt`` (which must not count as its save at that step)."""
    from rlkl_lightning.cli import main

    path = cli_config(tmp_path, tiny_lm_dir, prompts_file, "epochs")
    config = yaml.safe_load(open(path))
    config["trainer"]["callbacks"][0]["init_args"].pop("every_n_train_steps")
    open(path, "w").write(yaml.safe_dump(config))
    main(["fit", "--config", path, "--trainer.max_epochs=2"])
    steps = 2 * (len(PROMPTS) // BATCH) * STEPS_PER_BATCH
    names = sorted(p.name for p in (tmp_path / "epochs" / "ckpt").glob("*.ckpt"))
    assert names == [f"epoch=1-step={steps}.ckpt", "last.ckpt"]


@pytest.mark.slow  # three runs of the shipped budget config on the default world: make test-slow
def test_a_finished_budget_run_extended_equals_the_longer_run_in_every_value(tmp_path):
    """``configs/ppo_budget.yaml`` for 10 batches, extended to 15 with ``--ckpt_path last``,
    logs every value a 15-batch run logs. The final batch's ``last.ckpt`` was written before
    that batch's validation (batch 10), and a resume skips the validation of the batch its
    checkpoint ends: the budget's move at batch 10 was lost (15 of 416 values differed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rlkl_lightning.compare.events import read_scalars

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def run(name, batches, *extra):
        args = [sys.executable, str(root / "train.py"), "fit", "--config"]
        args += [str(root / "configs" / "ppo_budget.yaml"), "--seed_everything", "0"]
        args += [f"--trainer.max_steps={16 * batches}", "--trainer.enable_progress_bar=false"]
        args += [f"--trainer.logger.init_args.save_dir={tmp_path}"]
        args += [f"--trainer.logger.init_args.name={name}"]
        args += ["--trainer.logger.init_args.version=0", *extra]
        subprocess.run(args, cwd=tmp_path, env=env, check=True, capture_output=True)

    run("whole", 15)
    run("cut", 10)
    run("cut", 15, "--ckpt_path", "last")
    whole, cut = (read_scalars(tmp_path / name / "version_0") for name in ("whole", "cut"))
    whole = {k: v for k, v in whole.items() if not k.startswith("perf/")}
    cut = {k: v for k, v in cut.items() if not k.startswith("perf/")}
    assert sum(len(v) for v in whole.values()) == 416
    assert cut == whole
    assert whole["budget/ratio"][10] != whole["budget/ratio"][9]  # batch 10's validation


def _gather_rng_worker(rank: int, init_file: str, out_dir: str) -> None:
    import os
    import warnings
    from types import SimpleNamespace

    import torch.distributed as dist

    from rlkl_lightning.algorithms.resume import rng_states

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(10 + rank)
        own = torch.get_rng_state()
        trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(root_device="cpu"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            states = rng_states(trainer, torch.device("cpu"))
        messages = [str(w.message) for w in caught]
        torch.save((own, states, messages), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_every_ranks_rng_state_is_gathered_with_plain_torch_distributed_and_no_warning(tmp_path):
    """``rng_states`` under 2 gloo processes: each rank's own state, in rank order, silently."""
    import torch.multiprocessing as mp

    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _gather_rng_worker,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method=method,
    )
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    owns = [own for own, _, _ in results]
    assert not torch.equal(owns[0], owns[1])
    for _, states, messages in results:
        assert list(states) == ["cpu"] and len(states["cpu"]) == 2
        assert all(torch.equal(got, own) for got, own in zip(states["cpu"], owns, strict=True))
        assert all(t.storage_offset() == 0 for t in states["cpu"])  # no views
        assert messages == []  # Lightning's all_gather warned on every rank
