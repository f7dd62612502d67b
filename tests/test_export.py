"""``python -m rlkl_lightning.export``: a mistake ends in one line, in the command's own words."""

from __future__ import annotations

import pytest
import torch

from rlkl_lightning.export import main


def export_error(args: list[str], capfd) -> str:
    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    captured = capfd.readouterr()
    assert captured.out == ""
    lines = captured.err.rstrip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    message = lines[0].removeprefix("error: ")
    # train.py's words for --ckpt_path were printed here, in a 13-27-line traceback.
    assert "'last'" not in message and "new run" not in message and "resume" not in message
    return message


ALLOWED = (
    "allowed: a checkpoint file written by Lightning (ModelCheckpoint, Trainer.save_checkpoint)"
)


def test_a_missing_or_damaged_checkpoint_is_one_line(tmp_path, capfd):
    missing = tmp_path / "no.ckpt"
    out = str(tmp_path / "out")
    assert export_error([str(missing), out], capfd) == (
        f"`checkpoint` {str(missing)!r} does not exist; {ALLOWED}"
    )
    (tmp_path / "last.ckpt").write_bytes(b"not a checkpoint")
    message = export_error([str(tmp_path / "last.ckpt"), out], capfd)
    assert message.startswith(f"`checkpoint` {str(tmp_path / 'last.ckpt')!r} cannot be read: ")
    assert export_error([str(tmp_path), out], capfd) == (
        f"`checkpoint` {str(tmp_path)!r} is a directory, not a checkpoint file; {ALLOWED}; the "
        f"checkpoints in {str(tmp_path)!r}: last.ckpt"
    )


def test_a_checkpoint_without_a_policy_and_a_file_for_the_directory_are_named(tmp_path, capfd):
    foreign = tmp_path / "sft.ckpt"
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0"}, foreign)
    assert export_error([str(foreign), str(tmp_path / "out")], capfd) == (
        f"`checkpoint` {str(foreign)!r} names no policy in its hyperparameters; allowed: a "
        "checkpoint of a run of PPOModule, RLOOModule or another RLPipeline module"
    )
    a_file = tmp_path / "taken"
    a_file.write_text("")
    assert export_error([str(foreign), str(a_file)], capfd) == (
        f"`directory` {str(a_file)!r} is a file; allowed: a directory (new or existing) for the "
        "model and its tokenizer"
    )


def test_verbose_keeps_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        main([str(tmp_path / "no.ckpt"), str(tmp_path / "out"), "--verbose"])


def test_the_checkpoint_is_read_once_and_only_as_weights(tmp_path, monkeypatch):
    """The file checked is the file used: export read it again with ``weights_only=False``
    after the check, so a file replaced in between was unpickled, code and all."""
    from rlkl_lightning import export

    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0"}, path)
    loads = []
    load = torch.load

    def spy(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    with pytest.raises(ValueError, match="names no policy"):
        export.export_checkpoint(path, tmp_path / "out")
    assert loads == [True]
