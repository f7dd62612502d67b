"""The offline default world: corpus, lexicon, tokenizer, SFT model, cache."""

from __future__ import annotations

import inspect
import json
import math
import re
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from rlkl_lightning.world import (
    CACHE_ENV,
    WorldConfig,
    build_corpus,
    build_world,
    default_cache_dir,
    default_model_dir,
)
from rlkl_lightning.world import build as build_module
from rlkl_lightning.world import cache as cache_module
from rlkl_lightning.world import lexicon as lx
from rlkl_lightning.world.corpus import (
    Review,
    ReviewGenerator,
    _ReviewWriter,
    generate_reviews,
    make_prompt,
    make_prompts,
    split_reviews,
)
from rlkl_lightning.world.evaluate import perplexity, unigram_perplexity
from rlkl_lightning.world.patterns import KINDS, PATTERNS
from rlkl_lightning.world.sft import LMCollator, SFTDataModule, SFTModule, encode_texts
from rlkl_lightning.world.tokenizer import BOS, EOS, PAD, train_tokenizer

SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


@pytest.fixture(scope="module")
def reviews() -> list[Review]:
    return generate_reviews(3000, seed=11)


# --- lexicon and patterns --------------------------------------------------------------


def test_lexicon_has_at_least_400_distinct_words_with_polarity_and_strength():
    entries = lx.all_words()
    assert len(lx.vocabulary()) >= 400
    polar = lx.polar_vocabulary()
    assert len(polar) >= 400  # opinion words alone
    assert {e.polarity for e in entries} == {-1, 0, 1}
    for entry in entries:
        assert entry.strength in (0, 1, 2, 3)
        assert (entry.polarity == 0) or entry.strength >= 1, entry
    # no opinion word is listed as positive in one place and negative in another
    signs: dict[str, set[int]] = {}
    for entry in entries:
        if entry.polarity:
            signs.setdefault(entry.text, set()).add(entry.polarity)
    assert [w for w, s in signs.items() if len(s) > 1] == []


def test_every_graded_slot_of_every_domain_has_words():
    assert len(lx.DOMAINS) >= 5
    for domain in lx.DOMAINS:
        for pool in (domain.overall, *(g.adjectives for g in domain.aspects)):
            levels = {(w.polarity, w.strength) for w in pool}
            for polarity in (-1, 1):
                assert {(polarity, s) for s in (1, 2, 3)} <= levels, domain.name
        assert all(g.participles and g.nouns for g in domain.aspects)


def test_at_least_60_patterns_of_known_kinds():
    assert len(PATTERNS) >= 60
    assert {p.kind for p in PATTERNS} == set(KINDS)
    assert len({p.text for p in PATTERNS if p.domain is None}) >= 60
    assert {p.domain for p in PATTERNS} - {None} == {d.name for d in lx.DOMAINS}


@pytest.mark.parametrize("polarity", [1, -1])
def test_every_pattern_renders_in_every_domain(polarity):
    import random

    for domain in lx.DOMAINS:
        for pattern in PATTERNS:
            if pattern.domain not in (None, domain.name) or pattern.polarity not in (
                None,
                polarity,
            ):
                continue
            for strength in (1, 2, 3):
                writer = _ReviewWriter(random.Random(strength), domain, 4, {})
                text = writer.render(pattern, (polarity, strength), (-polarity, 1))
                assert "{" not in text and "}" not in text and "  " not in text, text
                assert text[0].isupper() and text[-1] in ".!", text


def test_most_opinion_words_are_in_vaders_lexicon_with_the_same_sign():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    vader = SentimentIntensityAnalyzer().lexicon
    polar = lx.polar_vocabulary()
    known = [w for w in polar if w in vader]
    assert len(known) / len(polar) > 0.6
    agree = sum(np.sign(vader[w]) == polar[w] for w in known)
    assert agree / len(known) > 0.97


# --- corpus -----------------------------------------------------------------------------


def test_generation_is_deterministic_for_a_seed():
    assert generate_reviews(300, seed=5) == generate_reviews(300, seed=5)
    assert generate_reviews(300, seed=5) != generate_reviews(300, seed=6)


def test_reviews_are_distinct_with_ratings_domains_and_1_to_4_sentences(reviews):
    assert len({r.text for r in reviews}) == len(reviews) == 3000
    ratings = Counter(r.rating for r in reviews)
    assert set(ratings) == {1, 2, 3, 4, 5}
    assert min(ratings.values()) > 0.15 * len(reviews)  # uniform: 20% each
    assert {r.domain for r in reviews} == {d.name for d in lx.DOMAINS}
    sentences = Counter(len(SENTENCE_END.findall(r.text)) for r in reviews)
    assert set(sentences) == {1, 2, 3, 4}
    for review in reviews:
        assert review.text[0].isupper()
        assert not re.search(r"\ba [aio]", review.text), review.text  # "an", not "a"


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="`rating` must be 1..5"):
        ReviewGenerator().review(rating=6)
    with pytest.raises(ValueError, match="`domain` must be one of"):
        ReviewGenerator().review(domain="cars")
    with pytest.raises(ValueError, match="`n` must be >= 1"):
        generate_reviews(0)


def test_negation_contrast_intensifiers_and_mixed_reviews_occur(reviews):
    texts = [r.text for r in reviews]

    def share(pattern: str) -> float:
        return sum(bool(re.search(pattern, t)) for t in texts) / len(texts)

    # measured on these 3,000 reviews: 0.25, 0.40, 0.21, 0.14; 3-star mixed: 0.74
    assert share(r"\bnot\b|n't\b") > 0.15
    assert share(r", but\b|, yet\b|\bAlthough\b|\bDespite\b|\baside\b") > 0.3
    assert share(r"\b(really|absolutely|truly|extremely|incredibly|utterly)\b") > 0.15
    assert share(r"\b(somewhat|slightly|a bit|fairly|rather)\b") > 0.08
    # a 3-star review usually mixes praise and complaint
    polar = lx.polar_vocabulary()
    mixed = [
        {polar[w] for w in re.findall(r"[a-z]+", r.text.lower()) if w in polar} == {-1, 1}
        for r in reviews
        if r.rating == 3
    ]
    assert np.mean(mixed) > 0.6


def test_rating_drives_the_share_of_positive_words(reviews):
    polar = lx.polar_vocabulary()
    share = {}
    for rating in range(1, 6):
        signs = [
            polar[w]
            for r in reviews
            if r.rating == rating
            for w in re.findall(r"[a-z]+", r.text.lower())
            if w in polar
        ]
        share[rating] = np.mean(np.array(signs) > 0)
    assert share[1] < share[2] < share[3] < share[4] < share[5]
    assert share[1] < 0.2 and share[5] > 0.8


def test_vader_compound_score_correlates_with_rating(reviews):
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    sample = reviews[:1500]
    scores = np.array([analyzer.polarity_scores(r.text)["compound"] for r in sample])
    ratings = np.array([r.rating for r in sample])
    # measured: 0.77 here; 0.74-0.77 on 1,500 reviews of seeds 100-104
    assert np.corrcoef(scores, ratings)[0, 1] > 0.7
    means = [scores[ratings == k].mean() for k in range(1, 6)]
    assert means == sorted(means)
    assert means[0] < -0.3 and means[4] > 0.5


def test_splits_do_not_overlap_and_have_the_requested_sizes(reviews):
    splits = split_reviews(reviews, validation=100, test=200, seed=0)
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [2700, 100, 200]
    texts = {name: {r.text for r in rows} for name, rows in splits.items()}
    assert not texts["train"] & texts["validation"]
    assert not texts["train"] & texts["test"]
    assert not texts["validation"] & texts["test"]
    assert splits == split_reviews(reviews, validation=100, test=200, seed=0)
    with pytest.raises(ValueError, match="distinct texts"):
        split_reviews([reviews[0], reviews[0], reviews[1]], 1, 1)
    with pytest.raises(ValueError, match="validation"):
        split_reviews(reviews[:10], validation=5, test=5)


def test_prompts_are_openings_without_opinion_words(reviews):
    assert make_prompt("The plot was gripping from start to finish.", 5) == "The plot was"
    assert make_prompt("Awful service.", 5) is None
    assert make_prompt("I watched it last week with my wife.", 3) == "I watched it"
    assert make_prompt("The plot was not great.", 5) == "The plot was"
    assert make_prompt("I didn't love it.", 5) is None
    prompts = make_prompts(reviews[:500], 2, 5, seed=0)
    assert len(prompts) > 300
    polar = lx.polar_vocabulary()
    by_text = {r.text: r for r in reviews[:500]}
    for row in prompts:
        words = row["text"].split()
        assert 2 <= len(words) <= 5
        assert not [w for w in words if w.strip(",.!?").lower() in polar]
        assert "not" not in words and not [w for w in words if w.endswith("n't")]
    starts = [t for t in by_text if t.startswith(prompts[0]["text"])]
    assert starts


# --- tokenizer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(reviews):
    return train_tokenizer([r.text for r in reviews[:1000]], vocab_size=500)


def test_tokenizer_round_trips_and_adds_bos(tokenizer, reviews, tmp_path):
    from transformers import AutoTokenizer

    assert len(tokenizer) == 500
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)
    assert tokenizer.padding_side == "left"
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.padding_side == "left"
    texts = [r.text for r in reviews[2000:2100]] + ["Café naïve — 😀 ünïcödé!", "  two  spaces "]
    for text in texts:
        ids = loaded(text)["input_ids"]
        assert ids[0] == loaded.bos_token_id and ids.count(loaded.bos_token_id) == 1
        assert loaded.decode(ids, skip_special_tokens=True) == text
    batch = loaded(["The plot", "I watched it last week"], padding=True)
    first = batch["input_ids"][0]
    assert first[0] == loaded.pad_token_id and batch["attention_mask"][0][0] == 0
    assert batch["attention_mask"][1] == [1] * len(batch["input_ids"][1])


def test_tokenizer_rejects_a_vocabulary_smaller_than_the_bytes():
    with pytest.raises(ValueError, match="`vocab_size` must be > 259"):
        train_tokenizer(["a b c"], vocab_size=200)


def test_encode_texts_frames_with_bos_and_eos_and_collate_pads_right(tokenizer):
    seqs = encode_texts(tokenizer, ["Great film.", "The staff were rude."], max_length=64)
    for seq in seqs:
        assert seq[0] == tokenizer.bos_token_id and seq[-1] == tokenizer.eos_token_id
        assert tokenizer.bos_token_id not in seq[1:]
    assert len(encode_texts(tokenizer, ["word " * 100], max_length=10)[0]) == 10
    batch = LMCollator(tokenizer.pad_token_id)(seqs)
    short, long_ = sorted(range(2), key=lambda i: len(seqs[i]))
    n = len(seqs[short])
    assert batch["attention_mask"][short].tolist() == [1] * n + [0] * (len(seqs[long_]) - n)
    assert (batch["input_ids"][short, n:] == tokenizer.pad_token_id).all()
    assert batch["input_ids"][short, :n].tolist() == seqs[short]


# --- SFT module -------------------------------------------------------------------------


def _documented_args(cls) -> set[str]:
    doc = inspect.getdoc(cls) or ""
    args = doc.split("Args:")[1]
    return set(re.findall(r"^    (\w+):", args, flags=re.M))


@pytest.mark.parametrize("cls", [SFTModule, SFTDataModule])
def test_sft_classes_have_typed_documented_arguments(cls):
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    assert all(p.annotation is not inspect.Parameter.empty for p in params)
    assert {p.name for p in params} == _documented_args(cls)


def test_sft_module_arguments_parse_with_jsonargparse():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(SFTModule, "model")
    cfg = parser.parse_args(["--model.n_layer=2", "--model.tokenizer=some/dir"])
    assert cfg.model.n_layer == 2 and cfg.model.tokenizer == "some/dir"


def test_sft_module_validates_its_arguments(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="`n_embd`.*divisible by `n_head`"):
        SFTModule(tokenizer=str(tmp_path), n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="`dropout`"):
        SFTModule(tokenizer=str(tmp_path), n_embd=32, n_head=4, dropout=1.5)


# --- the built world --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_config() -> WorldConfig:
    return WorldConfig.tiny()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rlkl_cache")


@pytest.fixture(scope="module")
def world(tiny_config, cache):
    return build_world(tiny_config, cache_dir=cache, progress=False, num_threads=1)


def test_world_writes_splits_prompts_tokenizer_and_model(world, tiny_config):
    import datasets

    for split, n in (("train", 500), ("validation", 40), ("test", 60)):
        data = datasets.load_dataset("json", data_files=str(world.splits[split]), split="train")
        assert data.column_names == ["text", "rating", "domain"]
        assert len(data) == n
    texts = {s: set(world.texts(s)) for s in world.splits}
    assert not texts["train"] & texts["test"] and not texts["train"] & texts["validation"]
    prompts = world.prompts()
    assert prompts and all(any(t.startswith(p) for t in texts["test"]) for p in prompts)
    assert (world.model_dir / "config.json").is_file()
    assert world.report["sft_steps"] == tiny_config.sft_steps
    assert world.report["corpus"]["num_reviews"] == {"test": 60, "validation": 40, "train": 500}
    assert not list(world.root.parent.glob(".tmp-*"))


def test_world_model_loads_with_auto_classes_and_reproduces_the_report(world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(world.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(world.model_dir)
    assert model.config.n_layer == 1 and model.config.vocab_size == len(tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.padding_side == "left"
    ppl = perplexity(model, tokenizer, world.texts("test"))
    assert ppl == pytest.approx(world.report["test_perplexity"], abs=2e-3)
    assert ppl < 0.7 * len(tokenizer)  # far better than the untrained (uniform) model
    batch = tokenizer(world.prompts()[:3], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 3 and out.shape[1] <= batch["input_ids"].shape[1] + 5


def test_batched_perplexity_equals_a_per_text_computation(world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(world.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(world.model_dir)
    texts = world.texts("validation")[:7]
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in encode_texts(tokenizer, texts, model.config.n_positions):
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            total -= sum(float(logprobs[t, ids[t + 1]]) for t in range(len(ids) - 1))
            count += len(ids) - 1
    expected = math.exp(total / count)
    assert perplexity(model, tokenizer, texts, batch_size=3) == pytest.approx(expected, rel=1e-5)


def test_unigram_perplexity_matches_a_hand_count(world):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(world.model_dir)
    train, test = ["Great film.", "Great food."], ["Great film."]
    train_ids = [ids[1:] for ids in encode_texts(tokenizer, train, 128)]
    counts = Counter(t for ids in train_ids for t in ids)
    n, vocab = sum(counts.values()), len(tokenizer)
    test_ids = encode_texts(tokenizer, test, 128)[0][1:]
    logp = [math.log((counts[t] + 1) / (n + vocab)) for t in test_ids]
    expected = math.exp(-sum(logp) / len(logp))
    assert unigram_perplexity(tokenizer, train, test) == pytest.approx(expected, rel=1e-12)


def test_second_build_is_a_cache_hit(world, tiny_config, cache, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached world")

    monkeypatch.setattr(build_module, "_train_and_evaluate", fail)
    monkeypatch.setattr(cache_module, "_make_corpus", fail)
    start = time.perf_counter()
    again = build_world(tiny_config, cache_dir=cache, progress=False)
    assert time.perf_counter() - start < 1.0
    assert again.root == world.root and again.report == world.report


def test_changed_config_rebuilds_only_what_changed(world, tiny_config, cache, monkeypatch):
    corpus_calls = []
    make_corpus = cache_module._make_corpus
    monkeypatch.setattr(
        cache_module, "_make_corpus", lambda *a: corpus_calls.append(1) or make_corpus(*a)
    )
    changed = build_world(
        WorldConfig.tiny(sft_steps=4), cache_dir=cache, progress=False, num_threads=1
    )
    assert changed.root != world.root and changed.report["sft_steps"] == 4
    assert changed.corpus.root == world.corpus.root and corpus_calls == []  # corpus reused
    reseeded = build_corpus(WorldConfig.tiny(seed=1), cache_dir=cache, progress=False)
    assert reseeded.root != world.corpus.root and corpus_calls == [1]
    assert set(reseeded.splits["test"].read_text().splitlines()) != set(
        world.splits["test"].read_text().splitlines()
    )


def test_interrupted_build_leaves_no_half_world(world, cache, monkeypatch):
    config = WorldConfig.tiny(sft_steps=3)

    def interrupted(config, corpus, out, progress):
        (out / "model").mkdir()
        (out / "model" / "half-written.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "_train_and_evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_world(config, cache_dir=cache, progress=False)
    target = cache / f"world-{config.world_key()}"
    assert not target.exists()
    assert not list(cache.glob(".tmp-*"))
    monkeypatch.undo()
    rebuilt = build_world(config, cache_dir=cache, progress=False, num_threads=1)
    assert rebuilt.root == target and (target / "report.json").is_file()


def test_interrupted_rebuild_leaves_the_old_stage(tmp_path):
    """A stage being replaced (e.g. a world rebuilt into its --out) goes only once the new one
    is complete: Ctrl-C during the rebuild leaves the old one whole, and nothing beside it."""
    target = tmp_path / "mine"
    target.mkdir()
    (target / "model.bin").write_bytes(b"old weights")
    (target / "done.json").write_text('{"key": "old"}')

    def interrupted(out: Path) -> None:
        (out / "model.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    def is_new(d: Path) -> bool:
        return json.loads((d / "done.json").read_text())["key"] == "new"

    with pytest.raises(KeyboardInterrupt):
        cache_module.build_stage(target, "done.json", interrupted, False, complete=is_new)
    assert (target / "model.bin").read_bytes() == b"old weights"
    assert json.loads((target / "done.json").read_text()) == {"key": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no lock file left

    def make(out: Path) -> None:
        (out / "model.bin").write_bytes(b"new weights")
        (out / "done.json").write_text('{"key": "new"}')

    cache_module.build_stage(target, "done.json", make, False, complete=is_new)
    assert (target / "model.bin").read_bytes() == b"new weights" and is_new(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_the_build_lock_excludes_while_its_file_is_removed_after_each_holder(tmp_path):
    """Each holder removes the lock file; a waiter on the removed file locks the new one."""
    path = tmp_path / ".mine.lock"
    inside, most, guard = [0], [0], threading.Lock()

    def hold() -> None:
        with cache_module._lock(path):
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.02)
            with guard:
                inside[0] -= 1

    threads = [threading.Thread(target=hold) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1  # never two holders at once
    assert not path.exists()


def test_incomplete_cache_entry_is_rebuilt(world, cache):
    config = WorldConfig.tiny(sft_steps=2)
    target = cache / f"world-{config.world_key()}"
    target.mkdir()
    (target / "junk").write_text("left by hand")
    rebuilt = build_world(config, cache_dir=cache, progress=False, num_threads=1)
    assert (rebuilt.root / "report.json").is_file() and not (rebuilt.root / "junk").exists()


def test_report_is_json_with_the_measured_numbers(world):
    report = json.loads((world.root / "report.json").read_text())
    for key in (
        "test_perplexity",
        "unigram_test_perplexity",
        "validation_perplexity",
        "build_seconds",
        "sft_tokens_seen_approx",
    ):
        assert report[key] > 0
    assert -1 <= report["corpus"]["vader_rating_pearson_test"] <= 1
    # the trainer's logged validation perplexity and the standalone evaluation agree
    assert report["validation_perplexity_trainer"] == pytest.approx(
        report["validation_perplexity"], abs=2e-3
    )


def test_cache_location_and_default_model_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert default_cache_dir() == tmp_path
    path = default_model_dir(build=False)
    assert path == tmp_path / f"world-{WorldConfig().world_key()}" / "model"
    assert not path.exists()
    monkeypatch.delenv(CACHE_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "rlkl_lightning"


def test_config_keys_and_validation():
    assert WorldConfig().world_key() == WorldConfig().world_key()
    assert WorldConfig().corpus_key() == WorldConfig(sft_steps=1).corpus_key()
    assert WorldConfig().world_key() != WorldConfig(sft_steps=1).world_key()
    assert WorldConfig().corpus_key() != WorldConfig(vocab_size=1000).corpus_key()
    with pytest.raises(ValueError, match="`num_reviews` must be an integer >= 1"):
        WorldConfig(num_reviews=0)
    with pytest.raises(ValueError, match="`num_validation` \\+ `num_test`"):
        WorldConfig(num_reviews=100, num_validation=50, num_test=50)
    with pytest.raises(ValueError, match="`n_embd`"):
        WorldConfig(n_embd=130, n_head=4)
    with pytest.raises(ValueError, match="`prompt_max_words`"):
        WorldConfig(prompt_min_words=4, prompt_max_words=3)


def test_world_builds_while_lightningcli_instantiates_a_module(tiny_config, tmp_path):
    # `policy: default` builds the world inside the CLI's instantiation of the PPO module, where
    # Lightning's "given hyperparameters" context is set to that module's arguments; the SFT
    # modules must not pick them up (they once got `tokenizer=None` and tried the hub).
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

    with _given_hyperparameters_context({"tokenizer": None, "policy": "default"}, "cli"):
        world = build_world(tiny_config, cache_dir=tmp_path, progress=False, num_threads=1)
    assert (world.model_dir / "config.json").is_file()
