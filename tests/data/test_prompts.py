"""PromptDataModule: prompts and held-out text through ``datasets``."""

from __future__ import annotations

import json
import warnings

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from rlkl_lightning.data.prompts import PromptDataModule, collate_dicts
from rlkl_lightning.texts import first_words, load_texts

TEXTS = [f"review number {i} says the film was fine" for i in range(10)]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _write(tmp_path, kind: str, texts=TEXTS, column: str = "text"):
    import datasets

    path = tmp_path / f"prompts.{kind}"
    if kind == "txt":
        path.write_text("\n".join(texts) + "\n\n")  # a trailing blank line is dropped
    elif kind == "csv":
        datasets.Dataset.from_dict({column: texts, "label": [1] * len(texts)}).to_csv(path)
    elif kind == "tsv":
        lines = [f"{column}\tlabel"] + [f"{t}\t1" for t in texts]
        path.write_text("\n".join(lines) + "\n")
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({column: t, "label": 1}) + "\n" for t in texts))
    elif kind == "json":
        path.write_text(json.dumps([{column: t, "label": 1} for t in texts]))
    elif kind == "parquet":
        datasets.Dataset.from_dict({column: texts, "label": [1] * len(texts)}).to_parquet(path)
    return path


def _setup(**kwargs) -> PromptDataModule:
    dm = PromptDataModule(**kwargs)
    dm.setup("fit")
    return dm


def _all(loader) -> list:
    return [x for batch in loader for x in next(iter(batch.values()))]


@pytest.mark.parametrize("kind", ["txt", "csv", "tsv", "json", "jsonl", "parquet"])
def test_local_files_give_prompt_and_text_batches(tmp_path, kind):
    path = _write(tmp_path, kind)
    dm = _setup(prompts=str(path), heldout=str(path), batch_size=4, shuffle=False, num_heldout=None)
    batches = list(dm.train_dataloader())
    assert [len(b["prompt"]) for b in batches] == [4, 4, 2]
    assert set(batches[0]) == {"prompt"}
    assert _all(dm.train_dataloader()) == TEXTS
    val = list(dm.val_dataloader())
    assert set(val[0]) == {"text"}
    assert _all(dm.val_dataloader()) == TEXTS


def test_named_column_several_files_and_word_truncation(tmp_path):
    first = _write(tmp_path, "csv", TEXTS[:5], column="review")
    second = tmp_path / "more.csv"
    second.write_text("review,label\n" + "\n".join(f"{t},0" for t in TEXTS[5:]) + "\n")
    dm = _setup(
        prompts=[str(first), str(second)],
        prompt_column="review",
        prompt_words=3,
        heldout=str(first),
        heldout_column="review",
        heldout_words=2,
        shuffle=False,
        batch_size=3,
    )
    assert _all(dm.train_dataloader()) == [first_words(t, 3) for t in TEXTS]
    assert _all(dm.train_dataloader())[0] == "review number 0"
    assert _all(dm.val_dataloader()) == [first_words(t, 2) for t in TEXTS[:5]]


def test_caps_are_seeded_random_subsets(tmp_path):
    path = _write(tmp_path, "jsonl")

    def prompts(seed: int) -> list[str]:
        dm = _setup(prompts=str(path), heldout=None, num_prompts=4, seed=seed, shuffle=False)
        return _all(dm.train_dataloader())

    a, b, c = prompts(1), prompts(1), prompts(2)
    assert a == b and len(a) == 4 and set(a) <= set(TEXTS)
    assert a == sorted(a, key=TEXTS.index)  # file order is kept
    assert a != c
    held = _setup(prompts=str(path), heldout=str(path), num_heldout=3)
    assert len(_all(held.val_dataloader())) == 3


def test_shuffle_is_seeded_and_covers_every_prompt(tmp_path):
    path = _write(tmp_path, "txt")
    dm = _setup(prompts=str(path), heldout=None, batch_size=4, shuffle=True, seed=3)
    first, again = _all(dm.train_dataloader()), _all(dm.train_dataloader())
    assert sorted(first) == sorted(TEXTS) and first != TEXTS
    assert _all(_setup(prompts=str(path), heldout=None, seed=3).train_dataloader()) == first
    assert sorted(again) == sorted(TEXTS)


def test_fewer_prompts_than_a_batch_are_said_once(tmp_path):
    # 10 prompts, batches of 16: every batch held 10 without a word (a study on a small world).
    dm = _setup(prompts=str(_write(tmp_path, "txt")), heldout=None, batch_size=16)
    with pytest.warns(UserWarning, match=r"`batch_size` is 16 but there are 10 prompts: every"):
        assert [len(b["prompt"]) for b in dm.train_dataloader()] == [10]
    full = _setup(prompts=str(_write(tmp_path, "txt")), heldout=None, batch_size=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.train_dataloader()  # once
        full.train_dataloader()


def test_a_test_text_without_heldout_is_refused_naming_both_options():
    # It is scored at validation beside the held-out text: without one it was dropped silently.
    with pytest.raises(ValueError, match=r"`test_heldout` needs `heldout`") as info:
        PromptDataModule(prompts="default", heldout=None, test_heldout="default:test")
    assert "\n" not in str(info.value)


def test_no_heldout_means_no_validation_batches(tmp_path):
    dm = _setup(prompts=str(_write(tmp_path, "txt")), heldout=None)
    assert dm.val_dataloader() == []


def test_distributed_sampler_shards_prompts_across_ranks(tmp_path):
    dm = _setup(prompts=str(_write(tmp_path, "csv")), heldout=None, batch_size=2, shuffle=False)
    loader = dm.train_dataloader()
    shards = []
    for rank in range(2):
        sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=False)
        shards.append(
            _all(DataLoader(loader.dataset, 2, sampler=sampler, collate_fn=loader.collate_fn))
        )
    assert len(shards[0]) == len(shards[1]) == 5
    assert sorted(shards[0] + shards[1]) == sorted(TEXTS)


def test_collate_dicts_makes_lists():
    assert collate_dicts([{"prompt": "a"}, {"prompt": "b"}]) == {"prompt": ["a", "b"]}


# --- bad input ---------------------------------------------------------------------------


def test_missing_column_names_the_option_and_lists_columns(tmp_path):
    path = _write(tmp_path, "csv")
    with pytest.raises(ValueError) as info:
        _setup(prompts=str(path), prompt_column="txt", heldout=None)
    assert str(info.value) == (
        "PromptDataModule: `prompt_column` 'txt' not found in `prompts` file prompts.csv; "
        "available columns: ['text', 'label']"
    )
    with pytest.raises(ValueError, match="`heldout_column` 'body' not found in `heldout` file"):
        _setup(prompts=str(path), heldout=str(path), heldout_column="body")


def test_missing_file_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="`prompts` file not found: .*nope.jsonl"):
        _setup(prompts=str(tmp_path / "nope.jsonl"), heldout=None)
    path = _write(tmp_path, "txt")
    with pytest.raises(ValueError, match="`heldout` file not found: .*gone.csv"):
        _setup(prompts=str(path), heldout=str(tmp_path / "gone.csv"))


def test_unsupported_and_mixed_file_types(tmp_path):
    odd = tmp_path / "prompts.xml"
    odd.write_text("<a/>")
    with pytest.raises(ValueError, match=r"unsupported file type\(s\) \['.xml'\]; allowed:"):
        _setup(prompts=str(odd), heldout=None)
    csv, txt = _write(tmp_path, "csv"), _write(tmp_path, "txt")
    with pytest.raises(ValueError, match="mixes file types"):
        _setup(prompts=[str(csv), str(txt)], heldout=None)


def test_empty_prompt_set_and_non_text_column(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\n")
    with pytest.raises(ValueError, match="no non-empty texts in column 'text'"):
        _setup(prompts=str(blank), heldout=None)
    path = _write(tmp_path, "csv")
    with pytest.raises(ValueError, match="`prompt_column` 'label' in .* holds int values"):
        _setup(prompts=str(path), prompt_column="label", heldout=None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "`batch_size` must be >= 1"),
        ({"num_heldout": 0}, "`num_heldout` must be >= 1 or None"),
        ({"prompt_words": -2}, "`prompt_words` must be >= 1 or None"),
        ({"num_workers": -1}, "`num_workers` must be >= 0"),
        ({"prompt_column": ""}, "`prompt_column` must be a non-empty"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptDataModule(**kwargs)


def test_dataloader_before_setup_is_an_error():
    with pytest.raises(RuntimeError, match="call setup"):
        PromptDataModule().train_dataloader()


def test_hub_names_go_through_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, split=None, **kwargs):
        calls.append((name, split))
        return datasets.Dataset.from_dict({"text": ["a fine film", "dull"], "label": [1, 0]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert load_texts("imdb", "text", split="test") == ["a fine film", "dull"]
    assert calls == [("imdb", "test")]

    def offline(name, split=None, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="`prompts` 'imdb' is not a local file.*no network"):
        load_texts("imdb", "text")


def test_default_world_prompts_and_heldout(tmp_path, monkeypatch):
    from rlkl_lightning.world import WorldConfig, build_world

    monkeypatch.setenv("RLKL_CACHE", str(tmp_path / "cache"))
    config = WorldConfig.tiny(sft_steps=2)
    build_world(config, progress=False, num_threads=1)  # what prepare_data does
    dm = PromptDataModule(world=config, batch_size=8, num_heldout=20)
    dm.prepare_data()
    dm.setup("fit")
    world = build_world(config, progress=False)
    prompts = _all(dm.train_dataloader())
    assert sorted(prompts) == sorted(world.prompts())
    held = _all(dm.val_dataloader())
    assert len(held) == 20 and set(held) <= set(world.texts("test"))


def test_default_world_splits_and_a_test_loader_beside_the_heldout(tmp_path, monkeypatch):
    from rlkl_lightning.world import WorldConfig, build_world

    monkeypatch.setenv("RLKL_CACHE", str(tmp_path / "cache"))
    config = WorldConfig.tiny(sft_steps=2)
    world = build_world(config, progress=False, num_threads=1)
    dm = PromptDataModule(
        prompts="default:train",
        prompt_words=2,
        heldout="default:validation",
        test_heldout="default:test",
        world=config,
        batch_size=8,
        num_heldout=6,
        num_test=5,
        shuffle=False,
    )
    dm.setup("fit")
    train = world.texts("train")
    assert _all(dm.train_dataloader()) == [first_words(t, 2) for t in train]
    steer, test = dm.val_dataloader()  # two loaders: the steered text, then the test text
    assert len(_all(steer)) == 6 and set(_all(steer)) <= set(world.texts("validation"))
    assert len(_all(test)) == 5 and set(_all(test)) <= set(world.texts("test"))
    with pytest.raises(ValueError, match=r"`test_heldout` names a split.*'default:validation'"):
        _setup(prompts="default", heldout="default", test_heldout="default:dev", world=config)


def test_arguments_parse_with_jsonargparse_including_the_world_config():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(PromptDataModule, "data")
    cfg = parser.parse_args(["--data.prompts=imdb", "--data.prompt_words=4", "--data.world.seed=3"])
    assert cfg.data.prompts == "imdb" and cfg.data.prompt_words == 4
    assert cfg.data.world == {"seed": 3} and cfg.data.heldout == "default"
    from rlkl_lightning.world import WorldConfig

    dm = PromptDataModule(**cfg.data.as_dict())  # the world's settings, checked here
    assert dm.named == {"default": WorldConfig(seed=3)}


def test_a_bad_world_option_is_refused_in_one_line_when_the_module_is_made():
    with pytest.raises(ValueError, match=r"^PromptDataModule: `world` has no option 'sede'; its"):
        PromptDataModule(world={"sede": 3})
    with pytest.raises(ValueError, match=r"^WorldConfig: `num_reviews` must be an integer >= 1"):
        PromptDataModule(world={"num_reviews": 0})
    assert PromptDataModule(prompts="x.txt", heldout=None, world={"sede": 3}).named == {}


def test_a_source_registered_from_outside_is_read_by_name(tmp_path, monkeypatch):
    """A name registered from outside (as the world registers ``default``) reads its files."""
    from rlkl_lightning.data import sources

    monkeypatch.setattr(sources, "_SOURCES", dict(sources._SOURCES))
    (tmp_path / "openings.txt").write_text("a\nb\nc\n")
    (tmp_path / "long.txt").write_text("a long text\nanother long text\n")
    (tmp_path / "dev.txt").write_text("dev text\n")
    built = []

    def build(settings, progress):
        built.append((settings, progress))
        files = {"long": str(tmp_path / "long.txt"), "dev": str(tmp_path / "dev.txt")}
        return sources.SourceFiles(
            str(tmp_path / "openings.txt"), files["long"], files, "a file of mine"
        )

    sources.register_text_source("mine", build, settings=lambda given: {"size": given})
    assert sources.text_source_names() == ["default", "mine"]
    dm = PromptDataModule(
        prompts="mine", heldout="mine", test_heldout="mine:dev", world=2, shuffle=False
    )
    dm.prepare_data()
    dm.setup("fit")
    assert built == [({"size": 2}, True), ({"size": 2}, False)]
    assert _all(dm.train_dataloader()) == ["a", "b", "c"]
    steer, test = dm.val_dataloader()
    assert _all(steer) == ["a long text", "another long text"] and _all(test) == ["dev text"]
    words = _setup(prompts="mine:long", prompt_words=2, heldout=None, world=2)
    assert sorted(_all(words.train_dataloader())) == ["a long", "another long"]
    with pytest.raises(ValueError, match=r"`heldout` names a file of mine: one of \('mine:long'"):
        _setup(prompts="mine", heldout="mine:test")
