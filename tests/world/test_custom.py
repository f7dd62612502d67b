"""A world from the user's texts: every format, cleaning, cache, determinism, errors, the study.

One tiny world (a 1-layer model, 3 SFT steps) is built from a corpus in every format at once
and shared by the tests; a second build checks determinism.
"""

from __future__ import annotations

import json
import random
import warnings
import zipfile
from pathlib import Path

import pytest
import yaml

from rlkl_lightning.world import build as build_module
from rlkl_lightning.world.custom import (
    DEFAULT_TRAIN_CHARS,
    CustomWorldConfig,
    build_custom_world,
    openings,
    resolve,
    sft_schedule,
    subsample,
    warn_if_no_better_than_unigram,
    world_key,
)
from rlkl_lightning.world.read import clean_text, read_corpus

# The tiny worlds here learn next to nothing, and say so (tested where it is the point).
pytestmark = pytest.mark.filterwarnings("ignore:.*does not beat the unigram:RuntimeWarning")
ROOT = Path(__file__).resolve().parents[2]
WORDS = (
    "river stone quiet garden lamp window morning paper coffee train winter harbour "
    "letter music field cloud bridge market candle forest"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tiny(**overrides) -> CustomWorldConfig:
    """A world that builds in a few seconds (its model learns next to nothing)."""
    settings = dict(
        vocab_size=300, n_layer=1, n_head=2, n_embd=16, n_positions=64, sft_steps=3, batch_size=8
    )
    return CustomWorldConfig(**(settings | overrides))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """The same kind of text in every format, with the mess real files have."""
    import datasets

    rng = random.Random(0)
    tmp = tmp_path_factory.mktemp("corpus")
    lines = [f"line {i}: {sentence(rng, 6)}" for i in range(30)]
    lines[3] = "Crème brûlée ☕ and 東京 " + lines[3]  # unicode survives
    lines[4] = lines[5]  # a duplicate
    lines[6] = "long " * 400  # 2,000 characters: cut to max_chars
    body = "\r\n".join(lines[:10]) + "\r\n\r\n" + "\r\n".join(lines[10:])  # CRLF, a blank line
    (tmp / "lines.txt").write_bytes(body.encode())
    paragraphs = [f"para {i} {sentence(rng, 5)}\n{sentence(rng, 5)}\n" for i in range(15)]
    (tmp / "paragraphs.txt").write_text("\n".join(paragraphs))  # hard-wrapped prose
    rows = [{"id": i, "review": f"csv {i} {sentence(rng, 7)}", "stars": i % 5} for i in range(15)]
    rows[0]["review"] = 'a "quoted"\nmultiline field ' + rows[0]["review"]
    datasets.Dataset.from_list(rows).to_csv(tmp / "table.csv", index=False)
    with open(tmp / "rows.jsonl", "w") as handle:
        for i in range(15):
            row = {"meta": "x", "content": f"json {i} {sentence(rng, 7)}"}
            handle.write(json.dumps(row) + "\n")
    handle_rows = [{"sentence": f"arrow {i} {sentence(rng, 7)}", "n": i} for i in range(10)]
    data = datasets.Dataset.from_list(handle_rows)
    datasets.DatasetDict({"train": data, "test": data.select(range(2))}).save_to_disk(
        str(tmp / "saved")
    )
    return {p.name: p for p in tmp.iterdir()}


@pytest.fixture(scope="module")
def sources(corpus) -> list[str]:
    return [str(corpus[n]) for n in ("lines.txt", "paragraphs.txt", "table.csv", "rows.jsonl")] + [
        str(corpus["saved"])
    ]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rlkl_cache")


@pytest.fixture(scope="module")
def world(sources, cache):
    return build_custom_world(sources, tiny(), cache_dir=cache, progress=False, num_threads=1)


# --- reading -------------------------------------------------------------------------------


def test_every_format_is_read_and_cleaned(corpus, sources):
    texts, stats = read_corpus(sources, max_chars=1000)
    assert stats["units"] == {
        str(corpus["lines.txt"]): "line",
        str(corpus["paragraphs.txt"]): "paragraph",
    }
    by_kind = {k: [t for t in texts if t.startswith(k)] for k in ("line", "para", "csv", "json")}
    assert len(by_kind["line"]) == 27  # 30 lines: a duplicate, "Crème ...", "long ..."
    assert len(by_kind["para"]) == 15 and all(len(t.split()) == 12 for t in by_kind["para"])
    assert len(by_kind["csv"]) == 14 and len(by_kind["json"]) == 15  # by column name
    assert sum(t.startswith("arrow") for t in texts) == 10  # the DatasetDict's train split
    assert any(t.startswith("Crème brûlée ☕ and 東京") for t in texts)
    assert 'a "quoted" multiline field csv 0' in " ".join(texts)  # newline in a field: a space
    assert all("\r" not in t and "\n" not in t and t == t.strip() for t in texts)
    assert stats["duplicates"] == 1 and stats["truncated"] == 1
    assert stats["kept"] == len(texts) == stats["read"] - 1 == 29 + 15 + 15 + 15 + 10
    assert max(len(t) for t in texts) == 999  # "long long ... long": cut at a space


def test_units_and_cleaning(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one two\nthree four\n\nfive six\n")
    assert read_corpus(str(path), unit="line")[0] == ["one two", "three four", "five six"]
    assert read_corpus(str(path), unit="paragraph")[0] == ["one two three four", "five six"]
    # one text per line with a stray blank line among many lines: lines
    path.write_text("\n".join(f"text {i}" for i in range(50)) + "\n\ntext 50\n")
    assert len(read_corpus(str(path))[0]) == 51
    assert clean_text("Cafe\u0301\x07 \t tab\x1b[0m", 100) == ("Café tab [0m", False)  # NFC
    assert clean_text("aaaa bbbb cccc", 11) == ("aaaa bbbb", True)  # at a space
    assert clean_text("a" * 30, 10) == ("a" * 10, True)  # no space near the end: hard cut


def test_openings_leave_words_to_write():
    texts = [
        "one two three four five six seven",
        "short text",
        "a b c",
        "東京は今日も晴れです。" * 3,
    ]
    prompts = openings(texts, 2, 5, seed=0)
    assert prompts[0] in {" ".join(texts[0].split()[:k]) for k in range(2, 6)}
    assert prompts[1] == "a b"  # "short text" has too few words; "a b c" keeps "c" to write
    assert len(prompts) == 3 and texts[3].startswith(prompts[2]) and 4 <= len(prompts[2]) <= 10


def test_sizes_scale_with_the_corpus():
    config = CustomWorldConfig()
    small, default, large = (
        resolve(config, n, int(DEFAULT_TRAIN_CHARS * r))
        for n, r in ((3_000, 0.1), (20_000, 1.0), (20_000, 8.0))
    )
    assert (small.vocab_size, default.vocab_size, large.vocab_size) == (640, 2048, 4096)
    assert (small.n_layer, default.n_layer, large.n_layer) == (3, 3, 4)
    assert small.n_embd == large.n_embd == 128
    assert (small.num_validation, small.num_test) == (150, 300)
    assert (default.num_validation, default.num_test) == (500, 1_000)
    # 4 epochs of a small corpus; the token budget for a large one; never above 800 steps
    assert sft_schedule(small, 2_550, 2_550 * 40).sft_steps == 319
    assert sft_schedule(small, 18_500, 18_500 * 120).sft_steps == 261
    assert sft_schedule(small, 18_500, 18_500 * 5).sft_steps == 800
    assert sft_schedule(small, 50, 500).sft_steps == 100
    given = sft_schedule(CustomWorldConfig(sft_steps=7, warmup_steps=0), 50, 500)
    assert (given.sft_steps, given.warmup_steps, given.val_check_interval) == (7, 0, 3)


# --- the built world -----------------------------------------------------------------------


def test_world_holds_splits_prompts_tokenizer_model_and_study_settings(world, sources):
    texts = set(read_corpus(sources)[0])
    splits = {s: world.texts(s) for s in ("train", "validation", "test")}
    assert {len(v) for k, v in splits.items() if k != "train"} == {10}
    assert set().union(*map(set, splits.values())) == texts  # every text in one split
    assert sum(map(len, splits.values())) == len(texts)
    assert all(any(t.startswith(p) for t in splits["test"]) for p in world.prompts())
    assert world.report["sft_steps"] == 3 and world.config.vocab_size == 300
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(world.model_dir).config.n_embd == 16
    assert len(AutoTokenizer.from_pretrained(world.model_dir)) == 300
    study = yaml.safe_load((world.root / "study.yaml").read_text())
    assert study["model"]["init_args"]["policy"] == "./model"
    assert study["data"]["init_args"] == {"prompts": "./prompts.jsonl", "heldout": "./test.jsonl"}
    assert 3 <= study["model"]["init_args"]["sampling"]["max_prompt_tokens"] <= 32


@pytest.mark.parametrize(
    ("reward", "said"),
    [
        (
            {"class_path": "subprocess.Popen", "init_args": {"args": "true"}},
            "sets `model.init_args.reward.class_path: subprocess.Popen`",
        ),
        (
            {
                "class_path": "rlkl_lightning.rewards.SequenceClassifierReward",
                "init_args": {"model": "./rm", "trust_remote_code": True},
            },
            "sets `model.init_args.reward.init_args.trust_remote_code: True`",
        ),
    ],
)
def test_a_worlds_study_file_that_would_run_code_is_refused(world, tmp_path, reward, said):
    """A world from elsewhere is data: its study.yaml may set a reward of the library's own,
    not a class from anywhere or a model directory's own code (either ran at the study)."""
    import shutil

    from rlkl_lightning.compare.custom_world import study_overrides

    copy = tmp_path / "shared_world"
    shutil.copytree(world.root, copy)
    study = yaml.safe_load((copy / "study.yaml").read_text())
    study["model"]["init_args"]["reward"] = reward
    (copy / "study.yaml").write_text(yaml.safe_dump(study))
    with pytest.raises(ValueError, match="a world's study.yaml may name only") as err:
        study_overrides(copy)
    assert said in str(err.value) and str(copy / "study.yaml") in str(err.value)
    own = {"class_path": "rlkl_lightning.rewards.VaderSentimentReward"}
    study["model"]["init_args"]["reward"] = own
    (copy / "study.yaml").write_text(yaml.safe_dump(study))
    assert study_overrides(copy)["model"]["init_args"]["reward"] == own


def test_second_build_is_a_cache_hit(world, sources, cache, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached world")

    monkeypatch.setattr(build_module, "_train_and_evaluate", fail)
    again = build_custom_world(sources, tiny(), cache_dir=cache, progress=False)
    assert again.root == world.root and world.root.parent == cache
    assert again.report == world.report


def test_same_seed_same_world_and_another_seed_another_world(world, sources, tmp_path):
    from safetensors.torch import load_file

    twin = build_custom_world(sources, tiny(), out=tmp_path / "twin", progress=False, num_threads=1)
    assert twin.root == tmp_path / "twin"
    for name in ("train.jsonl", "validation.jsonl", "test.jsonl", "prompts.jsonl"):
        assert (twin.root / name).read_bytes() == (world.root / name).read_bytes(), name
    tokenizer = "tokenizer/tokenizer.json"
    assert (twin.root / tokenizer).read_bytes() == (world.root / tokenizer).read_bytes()
    weights = [load_file(w.model_dir / "model.safetensors") for w in (world, twin)]
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])
    # another seed into the same --out: that world is replaced by another split of the texts
    other = build_custom_world(
        sources, tiny(seed=1), out=tmp_path / "twin", progress=False, num_threads=1
    )
    assert other.root == twin.root and set(other.texts("test")) != set(world.texts("test"))
    assert json.loads((other.root / "world.json").read_text())["settings"]["seed"] == 1
    texts = read_corpus(sources)[0]
    settings = resolve(tiny(), len(texts), 10_000)
    assert world_key(texts, settings) != world_key(texts, resolve(tiny(seed=1), len(texts), 10_000))
    assert world_key(texts, settings) != world_key(texts[1:], settings)


def test_the_command_prints_the_world_and_the_study_command(
    world, sources, cache, monkeypatch, capsys
):
    from rlkl_lightning.world.__main__ import main

    monkeypatch.setenv("RLKL_CACHE", str(cache))
    flags = ["--vocab_size=300", "--n_layer=1", "--n_head=2", "--n_embd=16", "--n_positions=64"]
    flags += ["--sft_steps=3", "--batch_size=8", "--quiet"]
    assert main(["--texts", *sources, *flags]).root == world.root  # cached: built by the fixture
    printed = capsys.readouterr().out
    assert f"world: {world.root}" in printed
    assert "texts: 85 read (line, paragraph), 0 empty, 1 duplicates, 1 cut" in printed
    assert "splits: train 64, validation 10, test 10" in printed
    assert (
        f"python -m rlkl_lightning.compare --config configs/compare.yaml --world {world.root}"
        in printed
    )


def test_the_printed_study_command_quotes_a_world_path_with_spaces(world):
    import dataclasses
    import shlex

    from rlkl_lightning.world.__main__ import describe

    spaced = dataclasses.replace(world, root=Path("/data/my worlds/films"))
    command = describe(spaced).splitlines()[-1]
    assert shlex.split(command)[-2:] == ["--world", "/data/my worlds/films"]


def test_an_out_under_a_file_is_named_in_one_line(tmp_path, sources):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(
        ValueError, match=f"`--out` '{a_file}/world' cannot be made: '{a_file}' is a file"
    ):
        build_custom_world(sources, tiny(), out=a_file / "world", progress=False)
    assert a_file.read_text() == "mine"


# --- bad input -----------------------------------------------------------------------------


def test_bad_input_names_the_option_and_the_allowed_values(tmp_path, corpus):
    def fails(sources, match, config=None, **kwargs):
        with pytest.raises(ValueError, match=match):
            build_custom_world(sources, config or tiny(), cache_dir=tmp_path, **kwargs)

    with zipfile.ZipFile(tmp_path / "notes.docx", "w") as docx:  # a zip, as .docx files are
        docx.writestr("word/document.xml", "<w:document/>")
    fails(
        [str(tmp_path / "notes.docx")],
        r"`--texts` file '.*notes.docx' is not plain text \(holds a NUL byte \(line 1\).*\); "
        r"allowed: UTF-8 text of any suffix .*\['.csv', '.json', '.jsonl', '.parquet', '.tsv'\]",
    )
    fails([str(tmp_path / "missing.txt")], "`--texts` file not found")
    (tmp_path / "blank.txt").write_text("\n \r\n\t\n")
    fails([str(tmp_path / "blank.txt")], "hold no non-empty text")
    (tmp_path / "few.txt").write_text("\n".join(f"text number {i}" for i in range(30)))
    fails([str(tmp_path / "few.txt")], r"too few texts .*`--num_validation`.*`--num_test`")
    (tmp_path / "words.txt").write_text("\n".join(f"word{i}" for i in range(60)))
    fails([str(tmp_path / "words.txt")], "`--prompt_min_words`")
    (tmp_path / "two.csv").write_text("title,author\n" + "a b,c d\n" * 5)
    fails(
        [str(tmp_path / "two.csv")], r"no column named like text .*\['title', 'author'\].*--column"
    )
    fails([str(corpus["table.csv"])], r"`--column` 'body' not found", tiny(column="body"))
    fails(
        [str(corpus["saved"])],
        r"no split 'validation'; allowed: \['test', 'train'\]",
        tiny(split="validation"),
    )
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("not a world")
    mixed = [str(corpus[n]) for n in ("lines.txt", "rows.jsonl", "table.csv")]
    fails(mixed, "`--out` .* is not a world", out=tmp_path / "mine")
    assert (tmp_path / "mine" / "keep.txt").read_text() == "not a world"
    fails(mixed, "`--out` .* is not a world", out=tmp_path / "mine" / "keep.txt")
    with pytest.raises(
        ValueError, match=r"`--unit` must be one of \['auto', 'line', 'paragraph'\]"
    ):
        CustomWorldConfig(unit="word")
    with pytest.raises(ValueError, match="`--max_texts` must be an integer >= 1"):
        CustomWorldConfig(max_texts=0)
    with pytest.raises(ValueError, match="`--n_embd` \\(128\\) must be divisible by `--n_head`"):
        CustomWorldConfig(n_head=3)
    with pytest.raises(ValueError, match="`--n_positions` must be >= 48"):
        CustomWorldConfig(n_positions=32)


def test_a_large_corpus_is_subsampled_to_max_texts():
    texts = [f"text {i}" for i in range(200)]
    chosen = subsample(texts, 50, seed=0)
    assert len(chosen) == 50 and chosen == sorted(chosen, key=texts.index)  # order kept
    assert chosen == subsample(texts, 50, seed=0) != subsample(texts, 50, seed=1)
    assert subsample(texts, 200, seed=0) is texts


# --- the study on a world ------------------------------------------------------------------


def test_study_runs_point_at_the_world(world, tmp_path):
    from rlkl_lightning.compare import StudyConfig, parse_args
    from rlkl_lightning.compare.runs import plan_runs

    stale = {
        "model": {
            "init_args": {
                "reference": "/elsewhere",
                "tokenizer": "/elsewhere",
                "gold_reward": {"class_path": "the.default.worlds.GoldReward"},
            }
        },
        "data": {"init_args": {"prompt_words": 3, "prompt_column": "review", "num_heldout": 8}},
    }
    runs = {g: str(ROOT / "configs" / f"ppo_{g}.yaml") for g in ("fixed", "adaptive")}
    study = StudyConfig(runs=runs, seeds=2, batches=2, overrides=stale, world=str(world.root))
    planned = plan_runs(study, tmp_path)
    assert len(planned) == 4
    for run in planned:
        config = yaml.safe_load(run.config.read_text())
        model, data = config["model"]["init_args"], config["data"]["init_args"]
        assert model["policy"] == str(world.model_dir.resolve())
        assert not {"reference", "tokenizer", "gold_reward"} & model.keys()
        assert data["prompts"] == str((world.root / "prompts.jsonl").resolve())
        assert data["heldout"] == str((world.root / "test.jsonl").resolve())
        assert "prompt_words" not in data and "prompt_column" not in data
        assert data["num_heldout"] == 8  # the study's other overrides stay
    with pytest.raises(ValueError, match="compare: `world` .* is not a world built by"):
        plan_runs(StudyConfig(runs=runs, world=str(tmp_path)), tmp_path)
    argv = ["--config", str(ROOT / "configs" / "compare.yaml"), "--world", str(world.root)]
    assert parse_args(argv + ["--quick"])[0].world == str(world.root)  # the flag, also --quick


def test_a_study_run_on_the_world_trains(world, tmp_path, monkeypatch):
    from rlkl_lightning.cli import main
    from rlkl_lightning.compare import StudyConfig
    from rlkl_lightning.compare.runs import plan_runs

    monkeypatch.chdir(tmp_path)
    runs = {"adaptive": str(ROOT / "configs" / "ppo_adaptive.yaml")}
    (run,) = plan_runs(StudyConfig(runs=runs, seeds=1, batches=1, world=str(world.root)), tmp_path)
    cli = main(
        ["fit", "--config", str(run.config), "--model.sampling.max_new_tokens=4"]
        + ["--model.optimization.ppo_epochs=1", "--model.optimization.num_minibatches=1"]
        + ["--data.batch_size=4", "--data.num_heldout=4"]
        + ["--trainer.max_steps=1", "--trainer.val_check_interval=1"]
    )
    assert cli.model.batches_seen == 1
    assert cli.model.policy.config.n_embd == 16  # the world's model
    prompts = set(world.prompts())
    assert set(cli.datamodule.prompt_dataset["prompt"]) == prompts


# --- text as it comes ----------------------------------------------------------------------


def test_plain_text_of_any_suffix_builds_a_world_and_a_rebuild_says_so(tmp_path, capsys):
    """rt-polarity ships as `rt-polarity.pos` and `rt-polarity.neg`: one review per line."""
    rng = random.Random(1)
    for name in ("rt-polarity.pos", "rt-polarity.neg"):
        lines = [f"{name[12:]} {i} {sentence(rng, 8)} ." for i in range(60)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    files = [str(tmp_path / "rt-polarity.pos"), str(tmp_path / "rt-polarity.neg")]
    texts, stats = read_corpus(files)
    assert len(texts) == 120 and texts[0] == "pos 0 " + texts[0][6:] and texts[60][:5] == "neg 0"
    assert set(stats["units"].values()) == {"line"}
    out = tmp_path / "rt"
    # 3 SFT steps teach the tiny model nothing: it is worse than word frequencies, and says so.
    unigram = r"the reference of the world in '.*rt' does not beat the unigram baseline"
    with pytest.warns(RuntimeWarning, match=unigram):
        world = build_custom_world(files, tiny(), out=out, progress=False, num_threads=1)
    assert sum(world.corpus.stats["num_texts"].values()) == 120  # every review, in a split
    assert world.report["test_perplexity"] > world.report["unigram_test_perplexity"]
    assert "replacing" not in capsys.readouterr().err  # a new world replaces nothing
    with pytest.warns(RuntimeWarning, match=unigram):  # the same world: cached, not rebuilt
        build_custom_world(files, tiny(), out=out, progress=False, num_threads=1)
    assert "replacing" not in capsys.readouterr().err
    with pytest.warns(RuntimeWarning, match=unigram):
        build_custom_world(files, tiny(seed=1), out=out, progress=False, num_threads=1)
    assert capsys.readouterr().err == (
        f"rlkl_lightning.world: replacing the world in {str(out)!r}: it was built from other "
        "texts or settings\n"
    )


def test_a_label_column_is_not_guessed_as_the_corpus(tmp_path):
    rows = "".join(f"{'pos' if i % 2 else 'neg'},{i % 5}\n" for i in range(40))
    (tmp_path / "labels.csv").write_text("label,stars\n" + rows)
    with pytest.raises(
        ValueError,
        match=r"only text column 'label' does not look like prose \(2 distinct values in 40 rows, "
        r"1.0 words on average\); name the text column with `--column` \(columns: "
        r"\['label', 'stars'\]\)",
    ):
        read_corpus([str(tmp_path / "labels.csv")])
    # Prose in a column of any name is still found alone, and a named column is taken as it is.
    prose = "".join(f"{i},the {i} quiet garden by the river\n" for i in range(40))
    (tmp_path / "prose.csv").write_text("id,words\n" + prose)
    assert len(read_corpus([str(tmp_path / "prose.csv")])[0]) == 40
    assert read_corpus([str(tmp_path / "labels.csv")], column="label")[0] == ["neg", "pos"]


def test_a_column_for_plain_text_only_is_refused_naming_it(tmp_path):
    # It was ignored, so a misspelt `--column` still built a world from every line.
    (tmp_path / "a.txt").write_text("the quiet garden by the river\nthe loud street\n")
    with pytest.raises(ValueError, match=r"`--column` 'txt' picks a column of a table \(.csv, "):
        read_corpus([str(tmp_path / "a.txt")], column="txt")
    (tmp_path / "b.csv").write_text("words\nthe small boat\n")
    both = read_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.csv")], column="words")[0]
    assert both == ["the quiet garden by the river", "the loud street", "the small boat"]


def test_a_reference_no_better_than_unigram_warns():
    with pytest.warns(RuntimeWarning, match=r"does not beat the unigram baseline \(held-out "):
        warn_if_no_better_than_unigram(
            {"test_perplexity": 90.0, "unigram_test_perplexity": 80.0}, "w"
        )
    with pytest.warns(RuntimeWarning, match=r"perplexity 80.00, unigram 80.00\)"):
        warn_if_no_better_than_unigram(
            {"test_perplexity": 80.0, "unigram_test_perplexity": 80.0}, "w"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_no_better_than_unigram(
            {"test_perplexity": 79.9, "unigram_test_perplexity": 80.0}, "w"
        )


def test_the_command_prints_a_bad_option_alone(tmp_path, capsys):
    from rlkl_lightning.world.__main__ import main

    for flag, message in [
        ("--sft_steps=nan", "`sft_steps` must be an integer (NaN and inf are refused), got nan"),
        ("--lr=inf", "`lr` must be a finite number (NaN and inf are refused), got inf"),
        ("--bogus", "unrecognized arguments: --bogus"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["--texts", str(tmp_path / "a.txt"), flag])
        assert info.value.code == f"error: {message}"  # printed alone, exit status 1
        assert "usage:" not in capsys.readouterr().err


def test_single_byte_text_is_read_with_a_warning_and_binary_is_still_refused(tmp_path):
    """rt-polarity's files are Latin-1, not UTF-8: taken as they come, decoded right, said so."""
    pos, neg = tmp_path / "rt-polarity.pos", tmp_path / "rt-polarity.neg"
    pos.write_bytes("a caf\xe9 of a film .\nit\x92s fine .\n".encode("latin-1"))
    neg.write_bytes("na\xefve and dull .\n".encode("latin-1"))
    with pytest.warns(RuntimeWarning) as record:
        texts, stats = read_corpus([str(pos), str(neg)])
    assert [str(w.message).split(f"{tmp_path}/")[1] for w in record] == [
        "rt-polarity.pos' is not UTF-8 throughout: 2 of 2 lines (the first: line 1) read as "
        "cp1252, the others as UTF-8",
        "rt-polarity.neg' is not UTF-8 throughout: 1 of 1 lines (the first: line 1) read as "
        "cp1252, the others as UTF-8",
    ]
    assert texts == ["a café of a film .", "it’s fine .", "naïve and dull ."]
    assert stats["not_utf8_lines"] == {str(pos): 2, str(neg): 1}
    undefined = tmp_path / "odd.txt"  # 0x81 has no character in cp1252: Latin-1 then
    undefined.write_bytes(b"caf\xe9 \x81 ok\n")
    with pytest.warns(RuntimeWarning, match="read as latin-1"):
        assert read_corpus([str(undefined)])[0] == ["café ok"]  # a control character: a space
    binary = tmp_path / "model.pos"
    binary.write_bytes(b"\xe9\x00\x01\x02 weights")
    with pytest.raises(ValueError, match=r"model.pos' is not plain text"):
        read_corpus([str(binary)])


def test_a_directory_of_plain_text_of_any_suffix_reads_as_its_files_alone(tmp_path):
    """rt-polarity's directory: `rt-polarity.pos` and `.neg`, Latin-1, as they ship."""
    rng = random.Random(2)
    for name in ("rt-polarity.pos", "rt-polarity.neg"):
        lines = [f"caf\xe9 {name[12:]} {i} {sentence(rng, 6)}" for i in range(20)]
        (tmp_path / name).write_bytes("\n".join(lines).encode("latin-1"))
    files = [str(tmp_path / "rt-polarity.neg"), str(tmp_path / "rt-polarity.pos")]
    with pytest.warns(RuntimeWarning, match="not UTF-8 throughout"):
        alone = read_corpus(files)
    with pytest.warns(RuntimeWarning, match="not UTF-8 throughout"):
        texts, stats = read_corpus(str(tmp_path))
    assert texts == alone[0] and len(texts) == 40 and texts[0].startswith("café neg 0")
    assert stats["not_utf8_lines"] == dict.fromkeys(files, 20)


def test_one_latin1_line_in_a_utf8_file_costs_that_line_only(tmp_path):
    """A UTF-8 file with one Latin-1 line: every other line is read as UTF-8, the count said.

    The whole file used to be read as Windows-1252, so each UTF-8 ``é`` became ``Ã©``.
    """
    lines = [f"review {i}: un café très épicé, naïve et réussi" for i in range(400)]
    path = tmp_path / "mixed.txt"
    encoded = [line.encode("utf-8") for line in lines]
    encoded[137] = lines[137].encode("latin-1")  # one line pasted from a Latin-1 file
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(encoded) + b"\r\n")  # BOM, CRLF
    with pytest.warns(
        RuntimeWarning, match=r"1 of 400 lines \(the first: line 138\) read as cp1252"
    ):
        texts, stats = read_corpus([str(path)], unit="line")
    assert texts == lines  # the Latin-1 line decoded right too
    assert not any("Ã" in text for text in texts)
    assert stats["not_utf8_lines"] == {str(path): 1}


def test_the_progress_names_the_worlds_directory_and_ctrl_c_says_what_was_kept(
    sources, tmp_path, monkeypatch, capfd
):
    """The line named the parent of `--out`; Ctrl-C in the SFT ended with no word (status 1)."""
    import signal

    from rlkl_lightning.world.sft import SFTModule

    def interrupted(self, batch, batch_idx):
        raise KeyboardInterrupt

    monkeypatch.setattr(SFTModule, "training_step", interrupted)
    said = []
    monkeypatch.setattr(build_module, "info", said.append)  # the builder's progress lines
    out = tmp_path / "worlds" / "mine"
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:  # Lightning's answer to Ctrl-C in a fit
            build_custom_world(sources, tiny(), out=out, progress=True, num_threads=1)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores a second Ctrl-C from then on
    assert stopped.value.code == 1
    assert said == [
        f"Custom world: training the reference model (3 steps; 64 training texts, once) into "
        f"{out} ..."  # was the parent of `out`
    ]
    err = capfd.readouterr().err
    assert err.rstrip("\n").splitlines()[-1] == (
        f"Custom world: interrupted while building {out}; nothing was written. The same command "
        "builds it again"
    )
    assert not out.exists() and not list(out.parent.glob(".tmp-*"))


def test_the_summary_gives_the_tokenizers_own_size(world, tmp_path):
    """On a small corpus the tokenizer stops short of `vocab_size`: the summary said the
    setting, not the size the model and tokenizer have."""
    from types import SimpleNamespace

    from rlkl_lightning.world.__main__ import describe

    assert "tokenizer 300 tokens; model" in describe(world)  # the setting, reached
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 251}))
    short = SimpleNamespace(
        **{k: getattr(world, k) for k in ("corpus", "report", "config", "root")}
    )
    short.model_dir = tmp_path
    assert "tokenizer 251 tokens (of 300 asked); model" in describe(short)


def test_the_study_command_says_a_mistake_in_one_line(tmp_path, capsys):
    """``python -m rlkl_lightning.compare --world DIR`` on a directory that is not a world: one
    line and status 2 (it was a traceback); ``--verbose`` keeps the traceback."""
    from rlkl_lightning.compare.__main__ import command

    argv = ["--config", str(ROOT / "configs" / "compare.yaml"), "--world", str(tmp_path)]
    with pytest.raises(SystemExit) as done:
        command([*argv, "--quick", "--out", str(tmp_path / "out")])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: compare: `world` ")
    with pytest.raises(ValueError, match="is not a world built by"):
        command([*argv, "--verbose"])
