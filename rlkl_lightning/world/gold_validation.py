"""How well the gold scorer and VADER track the rating of reviews the reference never saw.

``python -m rlkl_lightning.world.gold_validation`` prints the Pearson and Spearman
correlations with the rating of the gold score (:mod:`.gold`), of VADER's compound score (the
default world's reward) and of the gold scorer with one rule of its grammar switched off, on:

- **fresh**: ``--reviews`` reviews of a generator seed the world did not use (``--seed``), less
  any whose text is in the world's train split;
- **test**: the world's held-out test split (where the world's build measures VADER's
  correlation), built if missing (the corpus stage only: seconds).

Each subset line (``negation``, ``contrast``, ``intensifiers``) restricts the fresh reviews to
those that use the rule, where switching it off shows most.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

import numpy as np

from rlkl_lightning.world.corpus import Review, generate_reviews
from rlkl_lightning.world.gold import GoldScorer, tokens

SCORERS: dict[str, dict[str, bool]] = {
    "gold": {},
    "gold without negation": {"negation": False},
    "gold without contrast": {"contrast": False},
    "gold without intensifiers": {"intensifiers": False},
}
_CONTRAST_MARKS = {"but", "yet", "although", "despite", "aside"}


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``x``, ties sharing their mean rank (as Spearman's rho needs)."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    mean_rank = (starts + ends + 1) / 2  # ranks starts+1 .. ends, averaged
    out = np.empty(len(x))
    out[order] = np.repeat(mean_rank, ends - starts)
    return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation coefficient."""
    return float(np.corrcoef(np.asarray(x, float), np.asarray(y, float))[0, 1])


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: Pearson's correlation of the (tie-averaged) ranks."""
    return pearson(ranks(np.asarray(x, float)), ranks(np.asarray(y, float)))


def vader_scorer() -> Callable[[str], float]:
    """VADER's compound score of a text (the default world's reward)."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    return lambda text: analyzer.polarity_scores(text)["compound"]


def scores(texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Every scorer's scores of ``texts``: ``gold``, ``vader`` and the gold ablations."""
    out = {
        name: np.array([GoldScorer(**flags)(t) for t in texts]) for name, flags in SCORERS.items()
    }
    vader = vader_scorer()
    out["vader"] = np.array([vader(t) for t in texts])
    return out


def fresh_reviews(n: int, seed: int, exclude: set[str] = frozenset()) -> list[Review]:
    """``n`` generated reviews of ``seed``, less those whose text is in ``exclude``."""
    return [r for r in generate_reviews(n, seed=seed) if r.text not in exclude]


def subsets(reviews: Sequence[Review]) -> dict[str, np.ndarray]:
    """Boolean masks of the reviews that use negation, contrast or an intensifier."""
    from rlkl_lightning.world import lexicon as lx

    modifiers = lx.BOOSTERS + lx.POSITIVE_EXTREMES + lx.NEGATIVE_EXTREMES
    modifiers += lx.POSITIVE_DOWNTONERS + lx.NEGATIVE_DOWNTONERS
    phrases = {f" {' '.join(tokens(w.text))} " for w in modifiers}
    words = [tokens(r.text) for r in reviews]
    joined = [f" {' '.join(w)} " for w in words]
    return {
        "negation": np.array(["not" in w for w in words]),
        "contrast": np.array([bool(set(w) & _CONTRAST_MARKS) for w in words]),
        "intensifiers": np.array([any(p in j for p in phrases) for j in joined]),
    }


def correlations(reviews: Sequence[Review]) -> dict[str, dict[str, float]]:
    """``{scorer: {"pearson": r, "spearman": rho}}`` with the rating, over ``reviews``."""
    ratings = np.array([r.rating for r in reviews])
    return {
        name: {"pearson": pearson(s, ratings), "spearman": spearman(s, ratings)}
        for name, s in scores([r.text for r in reviews]).items()
    }


def _world_splits() -> tuple[list[Review], set[str]]:
    """The default world's test split and the texts of its train split."""
    from rlkl_lightning.world.cache import build_corpus

    corpus = build_corpus(progress=False)

    def read(split: str) -> list[Review]:
        lines = corpus.splits[split].read_text().splitlines()
        return [Review(**json.loads(line)) for line in lines if line.strip()]

    return read("test"), {r.text for r in read("train")}


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Print the correlation table; returns ``{set: {scorer: {pearson, spearman}}}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reviews", type=int, default=5000, help="fresh reviews to generate")
    parser.add_argument("--seed", type=int, default=2, help="their generator seed (world: 0)")
    args = parser.parse_args(argv)
    test, train_texts = _world_splits()
    fresh = fresh_reviews(args.reviews, args.seed, train_texts)
    sets = {f"fresh (seed {args.seed})": fresh, "test split": test}
    for name, mask in subsets(fresh).items():
        sets[f"fresh, with {name}"] = [r for r, keep in zip(fresh, mask, strict=True) if keep]
    results = {name: correlations(reviews) for name, reviews in sets.items()}
    names = ["gold", "vader", *list(SCORERS)[1:]]
    print("Correlation with the rating, Pearson / Spearman:\n")
    print("| reviews | n | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for name, result in results.items():
        cells = [f"{result[s]['pearson']:.3f} / {result[s]['spearman']:.3f}" for s in names]
        print(f"| {name} | {len(sets[name])} | " + " | ".join(cells) + " |")
    return results


if __name__ == "__main__":
    main()
