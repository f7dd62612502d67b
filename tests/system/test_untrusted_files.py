"""Files from elsewhere cannot run code or take a run down (docs, "Security").

Checkpoints are opened with ``torch.load(weights_only=True)`` by our check, by the CLI and by
Lightning's restore under the CLI, and everything rlkl_lightning stores loads that way. Model
directories run no shipped code unless ``trust_remote_code`` is set, and their weights come
from safetensors where present. Hostile text files (invalid UTF-8, NUL bytes, a 50 MB line,
100k empty lines, ragged CSV rows, JSON lines of the wrong types, a directory of mixed file
types) give an error naming the option and the file, or a bounded, warned handling. Every
hostile file is made here, in ``tmp_path``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from helpers.cli_runs import cli_error, tiny_cli_config
from helpers.trainers import cpu_trainer
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from rlkl_lightning import PPOModule
from rlkl_lightning.checkpoints import check_checkpoint, plain
from rlkl_lightning.data import PromptDataModule
from rlkl_lightning.models.loading import load_causal_lm
from rlkl_lightning.rewards import FunctionReward
from rlkl_lightning.texts import MAX_TEXT_CHARS, load_texts
from rlkl_lightning.world.config import WorldConfig
from rlkl_lightning.world.sft import SFTDataModule, SFTModule

PROMPTS = ["the film was", "this book is", "the food", "it was really"]
BATCH = 4


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def ppo_args(policy, **overrides) -> dict:
    """The module's arguments; a group's override (a dict) is merged into its fields."""
    args = dict(
        policy=str(policy),
        penalty={"init_coef": 0.2},
        sampling={"max_prompt_tokens": 8, "max_new_tokens": 4},
        optimization={"ppo_epochs": 1, "num_minibatches": 1},
        logging={"log_samples_every": 0},
    )
    for key, value in overrides.items():
        merge = isinstance(value, dict) and isinstance(args.get(key), dict)
        args[key] = {**args[key], **value} if merge else value
    return args


def reward(prompt: str, response: str) -> float:
    return float(len(response.split()))


def trainer(out: Path | None = None, steps: int = 1) -> Trainer:
    """A Trainer for ``steps`` optimizer steps that saves ``last.ckpt`` in ``out`` where given."""
    callbacks = [ModelCheckpoint(dirpath=out, save_last=True)] if out else []
    return cpu_trainer(callbacks, max_steps=steps, max_epochs=None, limit_val_batches=None)


def loader() -> DataLoader:
    return DataLoader(PROMPTS, batch_size=BATCH, collate_fn=lambda xs: {"prompt": xs})


class MakeDirectory:
    """Pickles as a call of ``os.mkdir(marker)``: loading it with full unpickling runs code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def good_checkpoint(tiny_lm_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good")
    seed_everything(0)
    module = PPOModule(**ppo_args(tiny_lm_dir, reward=FunctionReward(reward)))
    trainer(out).fit(module, loader())
    return out / "last.ckpt"


def poisoned(good: Path, path: Path, marker: Path) -> Path:
    """A copy of a real checkpoint with one more entry whose unpickling would run code."""
    checkpoint = torch.load(good, weights_only=True)
    checkpoint["payload"] = MakeDirectory(marker)
    torch.save(checkpoint, path)
    return path


# ---- checkpoints -------------------------------------------------------------------------------


def test_a_checkpoint_whose_pickle_runs_code_is_refused_and_the_code_never_runs(
    tiny_lm_dir, good_checkpoint, tmp_path
):
    # The payload is live: full unpickling of a copy runs it.
    live = tmp_path / "live_marker"
    torch.load(poisoned(good_checkpoint, tmp_path / "live.ckpt", live), weights_only=False)
    assert live.is_dir()

    marker = tmp_path / "marker"
    bad = poisoned(good_checkpoint, tmp_path / "bad.ckpt", marker)
    with pytest.raises(
        ValueError,
        match=r"`ckpt_path` '.*bad.ckpt' holds a pickled object \(posix.mkdir\) that only running "
        r"code could rebuild: checkpoints are opened with torch.load\(weights_only=True\)",
    ):
        check_checkpoint(bad)
    # A plain Trainer.fit restores with torch's default, weights_only=True (torch >= 2.6), or
    # with weights_only=True passed explicitly: refused either way.
    for weights_only in (None, True):
        module = PPOModule(**ppo_args(tiny_lm_dir, reward=FunctionReward(reward)))
        with pytest.raises(pickle.UnpicklingError, match="GLOBAL posix.mkdir"):
            trainer(steps=2).fit(module, loader(), ckpt_path=bad, weights_only=weights_only)
        assert module.batches_seen == 0
    assert not marker.exists()


def test_cli_refuses_a_checkpoint_whose_pickle_runs_code(
    tiny_lm_dir, good_checkpoint, tmp_path, monkeypatch, capfd
):
    from rlkl_lightning.cli import app as cli

    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    marker = tmp_path / "marker"
    bad = poisoned(good_checkpoint, tmp_path / "bad.ckpt", marker)
    # The CLI prints the message last and alone (exit status 2); --verbose raises it.
    message = cli_error(["fit", "--config", str(config), "--ckpt_path", str(bad)], capfd)
    assert re.match(r"`ckpt_path` '.*bad.ckpt' holds a pickled object", message)
    with pytest.raises(ValueError, match=r"`ckpt_path` '.*bad.ckpt' holds a pickled object"):
        cli.main(["fit", "--config", str(config), "--ckpt_path", str(bad), "--verbose"])
    message = cli_error(["fit", "--config", str(config), "--weights_only", "false"], capfd)
    assert message.startswith("`weights_only` must be true or unset")
    # Without our check, Lightning's own restore gets weights_only=True from the CLI, which
    # holds even where the environment turns torch's default off.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setattr(cli, "check_checkpoint", lambda path: None)
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL posix.mkdir"):
        cli.main(["fit", "--config", str(config), "--ckpt_path", str(bad)])
    assert not marker.exists()


def test_cli_takes_no_settings_from_a_checkpoint(tiny_lm_dir, good_checkpoint, tmp_path):
    """LightningCLI would rebuild the model from the checkpoint's hyperparameters."""
    from rlkl_lightning.cli import app as cli

    checkpoint = torch.load(good_checkpoint, weights_only=True)
    checkpoint["hyper_parameters"] = {
        "_class_path": "rlkl_lightning.PPOModule",
        **ppo_args(tiny_lm_dir, sampling={"max_new_tokens": 3}, models={"trust_remote_code": True}),
    }
    forged = tmp_path / "forged.ckpt"
    torch.save(checkpoint, forged)
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    run = cli.main(["fit", "--config", str(config), "--ckpt_path", str(forged)])
    assert run.model.sampling.max_new_tokens == 4  # the config's
    assert run.model.models.trust_remote_code is False
    assert run.model.hparams["sampling"]["max_new_tokens"] == 4  # and so is the record
    assert run.model.hparams["models"]["trust_remote_code"] is False
    assert run.model.batches_seen == 2  # resumed after the checkpoint's batch


class Colour(enum.Enum):
    RED = "red"


class Pair(NamedTuple):
    a: int
    b: Path


def test_hyperparameters_of_any_type_are_stored_as_plain_values(tmp_path):
    value = {
        "path": Path("/data/x.txt"),
        "paths": [Path("a"), Path("b")],
        "numbers": (np.float64(0.5), np.int64(3), np.bool_(True), np.arange(2)),
        "colour": Colour.RED,
        "world": WorldConfig(seed=3),
        "pair": Pair(1, Path("p")),
        "words": {"b", "a"},
        "dtype": torch.bfloat16,
        "other": object,
        "tensor": torch.ones(2),
    }
    saved = tmp_path / "hparams.pt"
    torch.save(plain(value), saved)
    loaded = torch.load(saved, weights_only=True)
    assert loaded["path"] == "/data/x.txt" and loaded["paths"] == ["a", "b"]
    assert loaded["numbers"] == (0.5, 3, True, [0, 1])
    assert [type(x) for x in loaded["numbers"][:3]] == [float, int, bool]
    assert loaded["colour"] == "red"
    assert loaded["world"] == dataclasses.asdict(WorldConfig(seed=3))
    assert loaded["pair"] == {"a": 1, "b": "p"} and loaded["words"] == ["a", "b"]
    assert loaded["dtype"] is torch.bfloat16 and loaded["other"] == repr(object)
    assert torch.equal(loaded["tensor"], torch.ones(2))
    with pytest.raises(pickle.UnpicklingError):  # what plain() is for
        torch.save(value, saved)
        torch.load(saved, weights_only=True)


def test_checkpoints_of_modules_given_paths_and_numpy_numbers_load_weights_only(
    tiny_lm_dir, tmp_path
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    module = PPOModule(
        **ppo_args(
            Path(tiny_lm_dir),
            reward=FunctionReward(reward),
            optimization={"lr": np.float64(1e-3)},
        )
    )
    data = PromptDataModule(prompts=prompts, heldout=None, batch_size=BATCH)
    assert data.hparams.prompts == str(prompts)  # plain already: any module's checkpoint loads
    trainer(tmp_path / "ppo").fit(module, data)
    checkpoint = torch.load(tmp_path / "ppo" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["policy"] == str(tiny_lm_dir)
    assert type(checkpoint["hyper_parameters"]["optimization"]["lr"]) is float
    assert checkpoint["datamodule_hyper_parameters"]["prompts"] == str(prompts)

    sft = SFTModule(
        tokenizer=Path(tiny_lm_dir),
        n_layer=1,
        n_head=2,
        n_embd=16,
        n_positions=32,
        lr=np.float64(1e-3),
    )
    texts = SFTDataModule(
        tokenizer=Path(tiny_lm_dir), train_files=[prompts], val_files=prompts, max_length=16
    )
    trainer(tmp_path / "sft").fit(sft, texts)
    checkpoint = torch.load(tmp_path / "sft" / "last.ckpt", weights_only=True)
    assert checkpoint["datamodule_hyper_parameters"]["train_files"] == [str(prompts)]


# ---- model directories -------------------------------------------------------------------------


def custom_code_model(tiny_lm_dir: Path, path: Path, marker: Path) -> Path:
    """A model directory whose config names modelling code shipped in the directory."""
    shutil.copytree(tiny_lm_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "shippedgpt"
    config["auto_map"] = {
        "AutoConfig": "shipped.ShippedConfig",
        "AutoModelForCausalLM": "shipped.ShippedModel",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "shipped.py").write_text(
        "import os\n"
        f"os.mkdir({str(marker)!r})\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "class ShippedConfig(GPT2Config):\n    model_type = 'shippedgpt'\n"
        "class ShippedModel(GPT2LMHeadModel):\n    config_class = ShippedConfig\n"
    )
    return path


def test_code_shipped_with_a_model_does_not_run_by_default(tiny_lm_dir, tmp_path):
    marker = tmp_path / "marker"
    shipped = custom_code_model(tiny_lm_dir, tmp_path / "shipped", marker)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"`policy`: could not load a causal LM .*custom code"):
        PPOModule(**ppo_args(shipped, tokenizer=str(tiny_lm_dir)))
    assert time.perf_counter() - start < 10  # refused at once, no prompt waiting for a "y"
    assert not marker.exists()


def test_trust_remote_code_is_passed_only_when_set(tiny_lm_dir, monkeypatch):
    import transformers

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, path, **kwargs):
        seen.append((kwargs["trust_remote_code"], kwargs["weights_only"]))
        return real(cls, path, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    path = str(tiny_lm_dir)
    PPOModule(**ppo_args(path, reference=path, ppo={"value_model": path}))
    assert seen == [(False, True)] * 3  # policy, reference, value model
    seen.clear()
    PPOModule(
        **ppo_args(
            path, reference=path, ppo={"value_model": path}, models={"trust_remote_code": True}
        )
    )
    assert seen == [(True, True)] * 3
    with pytest.raises(
        ValueError, match=r"`models\.trust_remote_code` must be True or False, got 'no'"
    ):
        PPOModule(**ppo_args(path, models={"trust_remote_code": "no"}))


def test_export_of_a_policy_with_shipped_code_runs_it_only_when_trusted(
    tiny_lm_dir, tmp_path, capfd
):
    """The export loaded the policy with ``trust_remote_code`` off whatever the run's setting:
    a run of a policy that ships its code could not be exported at all."""
    from rlkl_lightning.export import export_module, main

    shipped = custom_code_model(tiny_lm_dir, tmp_path / "shipped", tmp_path / "marker")
    peft = {"r": 2, "target_modules": ["c_attn"], "fan_in_fan_out": True}
    models = {"trust_remote_code": True, "peft": peft}
    module = PPOModule(**ppo_args(shipped, tokenizer=str(tiny_lm_dir), models=models))
    export_module(module, tmp_path / "from_module")  # the module's own setting
    checkpoint = tmp_path / "run.ckpt"
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": "2.6.0",
        },
        checkpoint,
    )
    # A checkpoint is not trusted: its `models.trust_remote_code` is not read.
    capfd.readouterr()
    with pytest.raises(SystemExit):
        main([str(checkpoint), str(tmp_path / "refused")])
    assert "`policy`: could not load a causal LM" in capfd.readouterr().err
    main([str(checkpoint), str(tmp_path / "from_ckpt"), "--trust_remote_code"])
    for out in ("from_module", "from_ckpt"):
        assert (tmp_path / out / "model.safetensors").exists(), out


def test_weights_come_from_safetensors_and_a_pickled_bin_runs_no_code(tiny_lm_dir, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(tiny_lm_dir, both)
    saved = load_causal_lm(str(tiny_lm_dir)).state_dict()
    torch.save({k: torch.zeros_like(v) for k, v in saved.items()}, both / "pytorch_model.bin")
    loaded = load_causal_lm(str(both)).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())  # not the zeros of the .bin

    marker = tmp_path / "marker"
    only_bin = tmp_path / "only_bin"
    shutil.copytree(tiny_lm_dir, only_bin, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save({**saved, "payload": MakeDirectory(marker)}, only_bin / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"`reference`: could not load .*UnpicklingError"):
        load_causal_lm(str(only_bin), option="reference")
    assert not marker.exists()


# ---- hostile text files ------------------------------------------------------------------------

GOOD = "the film was fine\nthe food was good\n"


def ragged_csv(path: Path) -> None:
    path.write_text("text,label\nfine,1\ntoo,many,fields\n")


def hostile(tmp_path: Path, name: str) -> Path:
    """Make the hostile file ``name`` in ``tmp_path``."""
    path = tmp_path / name
    if name == "latin1.txt":
        path.write_bytes("fine\ncaf\xe9 cr\xe8me\n".encode("latin-1"))
    elif name == "nul.txt":
        path.write_bytes(b"fine\nhalf\x00a line\n")
    elif name == "utf16.txt":
        path.write_bytes("fine\n".encode("utf-16"))
    elif name == "ragged.csv":
        ragged_csv(path)
    elif name == "numbers.jsonl":
        path.write_text('{"text": 5}\n{"text": 6}\n')
    elif name == "lists.jsonl":
        path.write_text('{"text": ["a", "b"]}\n')
    elif name == "not_objects.jsonl":
        path.write_text('{"text": "fine"}\n[1, 2]\n"text"\n')
    elif name == "null.jsonl":  # pyarrow's JSON reader crashes the process on it
        path.write_text("null\n")
    elif name == "list_of_nulls.json":
        path.write_text('[{"text": "fine"}, null]')
    elif name == "broken.jsonl":
        path.write_text('{"text": "fine"}\n{broken\n')
    elif name == "surrogate.jsonl":
        path.write_text('{"text": "half a pair: \\ud800"}\n')
    elif name == "mixed_dir":
        path.mkdir()
        (path / "a.txt").write_text(GOOD)
        (path / "b.csv").write_text("text\nfine\n")
        (path / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
        (path / "d.bin").write_bytes(bytes(range(256)))
    elif name == "txt_and_csv_dir":
        path.mkdir()
        (path / "a.txt").write_text(GOOD)
        (path / "b.csv").write_text("text\nfine\n")
        (path / ".hidden.bin").write_bytes(b"\x00")  # hidden files are not data
        (path / "README.md").write_text("# card\n")
    return path


HOSTILE = {
    "latin1.txt": r"file '.*latin1.txt' is not UTF-8 text: byte 0xe9 at line 2 \(byte 8\)",
    "nul.txt": r"file '.*nul.txt' holds a NUL byte \(line 2\): a binary file, or text in UTF-16",
    # its byte-order mark comes before the first NUL: the advice was to convert from Latin-1
    "utf16.txt": r"file '.*utf16.txt' is UTF-16 text .*`iconv -f utf-16 -t utf-8`",
    "ragged.csv": r"could not read `{option}` ragged.csv: ParserError: .*Expected 2 fields in "
    r"line 3, saw 3",
    "numbers.jsonl": r"`{column}` 'text' in `{option}` file numbers.jsonl holds int values, not "
    r"text",
    "lists.jsonl": r"`{column}` 'text' in `{option}` file lists.jsonl holds list values, not "
    r"text",
    "not_objects.jsonl": r"file '.*not_objects.jsonl' line 2 holds a JSON array, not an object; "
    r"allowed: JSON objects, one per line \(JSON lines\) or in one JSON list",
    "null.jsonl": r"file '.*null.jsonl' line 1 holds a JSON null, not an object",
    "list_of_nulls.json": r"file '.*list_of_nulls.json' holds a list of null, object items, not "
    r"only objects",
    "broken.jsonl": r"file '.*broken.jsonl' line 2 is not JSON \(Expecting property name",
    "surrogate.jsonl": r"could not read `{option}` surrogate.jsonl: ArrowInvalid: .*surrogate",
    "mixed_dir": r"`{option}` directory '.*mixed_dir' holds files of unsupported type\(s\) "
    r"\['.bin', '.png'\] \(e.g. 'c.png'\); allowed: \['.csv'",
    "txt_and_csv_dir": r"`{option}` directory '.*txt_and_csv_dir' mixes file types "
    r"\['.csv', '.txt'\]; use one type",
}


def read_prompts(source) -> list[str]:
    dm = PromptDataModule(prompts=source, heldout=None, batch_size=2)
    dm.setup("fit")
    return list(dm.prompt_dataset["prompt"])


def read_sft(tiny_lm_dir, source) -> SFTDataModule:
    good = source.parent / "good.txt"
    good.write_text(GOOD)
    dm = SFTDataModule(
        tokenizer=str(tiny_lm_dir), train_files=str(source), val_files=str(good), max_length=16
    )
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("reader", ["prompts", "train_files"])
def test_hostile_text_files_give_an_error_naming_the_option_and_the_file(
    tiny_lm_dir, tmp_path, name, reader
):
    path = hostile(tmp_path, name)
    column = "prompt_column" if reader == "prompts" else "text_column"
    match = "^" + ("PromptDataModule" if reader == "prompts" else "SFTDataModule") + ": .*"
    with pytest.raises(
        ValueError, match=match + HOSTILE[name].format(option=reader, column=column)
    ):
        if reader == "prompts":
            read_prompts(str(path))
        else:
            read_sft(tiny_lm_dir, path)


def test_empty_lines_are_dropped_and_counted(tmp_path):
    path = tmp_path / "sparse.txt"
    path.write_text("\n" * 50_000 + "one\n" + " \n\t\n" * 25_000 + "two\n")
    with pytest.warns(RuntimeWarning, match=r"dropped 100,000 empty texts of `prompts` file"):
        assert read_prompts(str(path)) == ["one", "two"]
    path.write_text("\n" * 100_000)
    with pytest.raises(ValueError, match=r"no non-empty texts in column 'text' of `prompts` file"):
        read_prompts(str(path))


def test_a_50_mb_line_is_cut_when_read_in_seconds(tiny_lm_dir, tmp_path):
    path = tmp_path / "one_line.txt"
    words = b"good bad " * (50 * 2**20 // 9)  # 50 MB, no newline inside
    path.write_bytes(b"the film was\n" + words + b"end\nthe food\n")
    start = time.perf_counter()
    with pytest.warns(
        RuntimeWarning,
        match=rf"1 texts of `train_files` file one_line.txt are "
        rf"longer than {MAX_TEXT_CHARS:,} characters; each keeps its first",
    ):
        dm = read_sft(tiny_lm_dir, path)
    seconds = time.perf_counter() - start
    assert seconds < 10, f"{seconds:.1f} s"
    assert [len(ids) for ids in dm.train_data] == [5, 16, 4]  # bos, 3 words, eos; cut to 16

    # Prompts keep their end (the pipeline cuts prompts on the left), or their start when only
    # their first words are used.
    long = tmp_path / "long.txt"
    long.write_text("start " + "x" * (2 * MAX_TEXT_CHARS) + " end\nshort\n")
    with pytest.warns(RuntimeWarning, match="each keeps its last 100,000"):
        prompts = load_texts(str(long), "text", keep="end")
    assert [len(p) for p in prompts] == [MAX_TEXT_CHARS, 5] and prompts[0].endswith("x end")
    dm = PromptDataModule(prompts=str(long), heldout=None, prompt_words=1)
    with pytest.warns(RuntimeWarning, match="each keeps its first"):
        dm.setup("fit")
    assert sorted(dm.prompt_dataset["prompt"]) == ["short", "start"]


def test_datasets_cache_keeps_nothing_of_local_files(tmp_path):
    import datasets

    path = tmp_path / "prompts.csv"
    path.write_text("text\nfine\n")
    assert load_texts(str(path), "text") == ["fine"]
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    assert not cache.exists() or not any(cache.rglob("*.arrow"))
