"""Checkpoint files that survive a kill, and which run ``fit --ckpt_path last`` resumes.

The real kills are in ``system/test_kill.py``; here the pieces: the atomic writer against the
failures a kill stands for, the search across a logger's version directories, the CLI's choice
of run and its error when there is nothing to resume, and the progress bar over a resumed run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli_runs import cli_error
from helpers.kill_runs import BATCHES, STEPS_PER_BATCH, write_config
from lightning.pytorch.plugins.io import TorchCheckpointIO

from rlkl_lightning.checkpoints import AtomicCheckpointIO, newest_last_checkpoint, partial_path
from rlkl_lightning.cli import main
from rlkl_lightning.console import RunProgressBar


class Killed(BaseException):
    """Stands for the process dying at this point (not an Exception: nothing catches it)."""


def test_a_write_that_dies_at_any_point_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    io, target = AtomicCheckpointIO(), tmp_path / "ckpt" / "last.ckpt"
    io.save_checkpoint({"batch": torch.tensor(1)}, target)  # creates the directory
    assert torch.load(target)["batch"] == 1

    real_save = torch.save

    def half_then_die(obj, file, *args, **kwargs):
        real_save(obj, file, *args, **kwargs)
        file.truncate(file.tell() // 2)
        raise Killed

    def die(*args, **kwargs):
        raise Killed

    for where, patch in (("torch", ("save", half_then_die)), ("os", ("replace", die))):
        with monkeypatch.context() as m:
            m.setattr(torch if where == "torch" else os, *patch)
            with pytest.raises(Killed):
                io.save_checkpoint({"batch": torch.tensor(2)}, target)
        assert torch.load(target)["batch"] == 1, where  # never written in place
        assert not partial_path(target).exists()  # a failure (not a kill) cleans up

    io.save_checkpoint({"batch": torch.tensor(3)}, target)
    assert torch.load(target)["batch"] == 3
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_lightnings_writer_moves_a_file_from_the_system_temporary_directory(tmp_path, monkeypatch):
    """Why AtomicCheckpointIO exists: Lightning's temporary file is not next to the target.

    ``shutil.move`` from the system temporary directory is a rename only on one filesystem;
    elsewhere it copies into the target in place (a kill then truncates it).
    """
    made = []
    real_mkstemp = tempfile.mkstemp

    def recording_mkstemp(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        made.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", recording_mkstemp)
    TorchCheckpointIO().save_checkpoint({"batch": torch.tensor(1)}, tmp_path / "last.ckpt")
    assert len(made) == 1 and Path(made[0]).parent == Path(tempfile.gettempdir())
    made.clear()
    AtomicCheckpointIO().save_checkpoint({"batch": torch.tensor(1)}, tmp_path / "last.ckpt")
    assert made == []


def test_the_newest_last_checkpoint_across_version_directories(tmp_path):
    assert newest_last_checkpoint(tmp_path) is None
    files = {
        "version_0/checkpoints/last.ckpt": 100,
        "version_1/checkpoints/last-v1.ckpt": 300,
        "version_1/checkpoints/epoch=0-step=4.ckpt": 900,  # not a "last" file
        "version_2/checkpoints/.last.ckpt.partial": 900,  # a write that was killed
        "version_3/last.ckpt": 900,  # not in a checkpoints directory
        "other/checkpoints/last.ckpt": 900,  # not a version directory
    }
    for name, mtime in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (mtime, mtime))
    assert newest_last_checkpoint(tmp_path) == tmp_path / "version_1/checkpoints/last-v1.ckpt"


def cli(config: Path, *args: str):
    return main(["fit", "--config", str(config), *args])


@pytest.mark.slow  # a resume case: make test-slow
def test_ckpt_path_last_resumes_the_newest_run_in_its_own_version_directory(
    tiny_lm_dir, tmp_path, monkeypatch
):
    config = write_config(tmp_path, tiny_lm_dir, "run")
    monkeypatch.chdir(config.parent)  # the config's `save_dir: runs` is relative
    half = f"--trainer.max_steps={BATCHES // 2 * STEPS_PER_BATCH}"
    cli(config, half)  # version_0: stops after 3 batches, last.ckpt after batch 2
    cli(config, half, "--seed_everything=1")  # version_1: another run of the same config
    runs = config.parent / "runs" / "tiny"
    os.utime(runs / "version_0" / "checkpoints" / "last.ckpt")  # now the newest
    resumed = cli(config, "--ckpt_path", "last")
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]
    assert resumed.trainer.logger.version == 0
    assert resumed.trainer.ckpt_path == str(runs / "version_0" / "checkpoints" / "last.ckpt")
    assert resumed.model.batches_seen == BATCHES
    bar = resumed.trainer.progress_bar_callback
    assert isinstance(bar, RunProgressBar)  # over the run's batches, also across the resume
    task = bar.train_progress_bar
    assert (task.total, task.completed, task.description.strip()) == (BATCHES, BATCHES, "Training")


@pytest.mark.slow  # a resume case: make test-slow
def test_ckpt_path_last_finds_the_run_of_the_first_of_several_loggers(
    tiny_lm_dir, tmp_path, monkeypatch
):
    # With a list of loggers the checkpoints are under the first one's version directory; the
    # CLI looked for none there and stopped with "there is no checkpoint to resume".
    config = write_config(tmp_path, tiny_lm_dir, "run")
    monkeypatch.chdir(config.parent)
    run = yaml.safe_load(config.read_text())
    csv = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "csv"}}
    run["trainer"]["logger"] = [run["trainer"]["logger"], csv]
    config.write_text(yaml.safe_dump(run))
    cli(config, f"--trainer.max_steps={2 * STEPS_PER_BATCH}")  # last.ckpt after batch 2
    resumed = cli(config, "--ckpt_path", "last", f"--trainer.max_steps={3 * STEPS_PER_BATCH}")
    runs = config.parent / "runs" / "tiny"
    assert sorted(p.name for p in runs.iterdir()) == ["version_0"]
    assert resumed.trainer.loggers[0].version == 0
    assert resumed.trainer.ckpt_path == str(runs / "version_0" / "checkpoints" / "last.ckpt")
    assert resumed.model.batches_seen == 3


@pytest.mark.slow  # a resume case: make test-slow
def test_ckpt_path_last_drops_what_a_killed_run_logged_after_its_checkpoint_at_any_version(
    tiny_lm_dir, tmp_path, monkeypatch
):
    # With the logger's version given (as a study's runs give it) TensorBoard's purge_step was
    # left unset, so the events a killed run logged after its checkpoint stayed beside the
    # resumed run's.
    config = write_config(tmp_path, tiny_lm_dir, "run")
    monkeypatch.chdir(config.parent)
    half = f"--trainer.max_steps={BATCHES // 2 * STEPS_PER_BATCH}"
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    runs = config.parent / "runs" / "tiny"
    for version, folder in (
        ([], "version_0"),
        (["--trainer.logger.init_args.version=mine"], "mine"),
    ):
        cli(config, half, *version)  # 3 batches, last.ckpt after batch 2: batch 3 is orphaned
        cli(config, "--ckpt_path", "last", *version)
        purges = [  # TensorBoard's mark: drop this directory's events from this step on
            event.step
            for path in sorted((runs / folder).glob("events.*"))
            for event in EventFileLoader(str(path)).Load()
            if event.HasField("session_log") and event.session_log.status == 1  # START
        ]
        assert purges == [3], (folder, purges)
    assert sorted(p.name for p in runs.iterdir()) == ["mine", "version_0"]


def test_ckpt_path_last_with_nothing_to_resume_says_where_it_looked(
    tiny_lm_dir, tmp_path, monkeypatch, capfd
):
    config = write_config(tmp_path, tiny_lm_dir, "run")
    monkeypatch.chdir(config.parent)
    # The CLI prints the message alone, last (exit status 2).
    assert cli_error(["fit", "--config", str(config), "--ckpt_path", "last"], capfd) == (
        "`--ckpt_path last`: there is no checkpoint to resume: no last*.ckpt in "
        f"{Path('runs', 'tiny', 'version_*', 'checkpoints')}. Start a new run without "
        "`--ckpt_path`, or pass a checkpoint file as `--ckpt_path PATH`"
    )
    with pytest.raises(ValueError, match="this run saves no checkpoints"):
        cli(config, "--ckpt_path", "last", "--trainer.enable_checkpointing=false", "--verbose")
    assert not list(config.parent.rglob("*.ckpt"))  # stopped before training


def test_ckpt_path_best_is_refused_in_one_line_before_the_model_loads(
    tiny_lm_dir, tmp_path, monkeypatch, capfd
):
    # Lightning's `best` is the best checkpoint of a fit earlier in the same process: a new run
    # has none, and Lightning stopped with a traceback saying `ModelCheckpoint` was not
    # configured to save the best model (the config's is, `monitor: step`).
    config = write_config(tmp_path, tiny_lm_dir, "run")
    monkeypatch.chdir(config.parent)
    message = cli_error(["fit", "--config", str(config), "--ckpt_path", "best"], capfd)
    assert message.startswith("`--ckpt_path best` names the best checkpoint of an earlier `fit`")
    assert "allowed: `last`" in message and "\n" not in message
    assert not (config.parent / "runs").exists()  # stopped before the trainer and the model
