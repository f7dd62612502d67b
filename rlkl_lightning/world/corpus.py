"""A seeded generator of English review-like text with a 1-5 star rating.

The rating drives the sentiment of every sentence: 5-star reviews are strongly
positive throughout, 4-star ones mildly positive with the odd concession ("The
parking was a bit limited, but the staff were lovely"), 3-star reviews mix mild praise
and complaints, and 2 and 1 mirror 4 and 5. Words come from :mod:`.lexicon`, sentence
shapes from :mod:`.patterns`. The same seed always gives the same reviews (Python's
``random.Random`` is portable across platforms).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from rlkl_lightning.world import lexicon as lx
from rlkl_lightning.world.patterns import PATTERNS, Pattern

SPLITS = ("train", "validation", "test")
T = TypeVar("T")

# Per rating: the review's opinion (0: either), the chance that an opinion sentence
# agrees with it, the chance of a contrast sentence, and the weights of strength 1/2/3.
_MAJOR = {1: -1, 2: -1, 3: 0, 4: 1, 5: 1}
_AGREE = {1: 0.97, 2: 0.85, 3: 0.5, 4: 0.85, 5: 0.97}
_CONTRAST = {1: 0.08, 2: 0.35, 3: 0.5, 4: 0.35, 5: 0.08}
_STRENGTH = {
    1: (0.05, 0.35, 0.6),
    2: (0.45, 0.45, 0.1),
    3: (0.75, 0.25, 0.0),
    4: (0.45, 0.45, 0.1),
    5: (0.05, 0.35, 0.6),
}
_SENTENCES = ((1, 2, 3, 4), (0.15, 0.3, 0.3, 0.25))
_SLOT = re.compile(r"\{(~?)([a-z]+)\}")
_NOUN_SLOTS = ("item", "aspect", "it")
_EVAL_SLOTS = ("pred", "adj", "bare", "manner")
_CONTRACTIONS = {
    " was not ": " wasn't ",
    " is not ": " isn't ",
    " were not ": " weren't ",
    " are not ": " aren't ",
    " did not ": " didn't ",
    " would not ": " wouldn't ",
}
_AN_EXCEPTIONS = ("uni", "use", "usu", "eu", "one")


@dataclass(frozen=True)
class Review:
    """One generated review.

    Attributes:
        text: The review, 1-4 sentences.
        rating: Stars, 1 (worst) to 5 (best).
        domain: What kind of thing is reviewed (``lexicon.DOMAINS`` names).
    """

    text: str
    rating: int
    domain: str

    def to_dict(self) -> dict:
        """The review as a JSON-ready dict (``text``, ``rating``, ``domain``)."""
        return asdict(self)


@dataclass
class _Noun:
    text: str
    plural: bool
    group: lx.AspectGroup | None  # None: the item as a whole


class ReviewGenerator:
    """Writes reviews from a seeded random stream.

    Args:
        seed: Seed of the generator; equal seeds give equal reviews.
    """

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self._by_kind: dict[str, list[Pattern]] = {}
        for pattern in PATTERNS:
            self._by_kind.setdefault(pattern.kind, []).append(pattern)

    def review(self, rating: int | None = None, domain: str | None = None) -> Review:
        """One review with the given (else random) rating and domain."""
        rng = self.rng
        rating = rng.randint(1, 5) if rating is None else rating
        if rating not in _MAJOR:
            raise ValueError(f"ReviewGenerator: `rating` must be 1..5, got {rating!r}")
        names = [d.name for d in lx.DOMAINS]
        if domain is not None and domain not in names:
            raise ValueError(f"ReviewGenerator: `domain` must be one of {names}, got {domain!r}")
        dom = rng.choice(lx.DOMAINS) if domain is None else lx.DOMAINS[names.index(domain)]
        writer = _ReviewWriter(rng, dom, rating, self._by_kind)
        return Review(writer.write(), rating, dom.name)

    def reviews(self, n: int) -> Iterator[Review]:
        """``n`` reviews (duplicates possible; see :func:`generate_reviews`)."""
        for _ in range(n):
            yield self.review()


def generate_reviews(n: int, seed: int = 0) -> list[Review]:
    """``n`` reviews with distinct texts, deterministic for ``seed``.

    Short reviews can repeat by chance; repeats are dropped and generation goes on
    until ``n`` distinct texts exist.
    """
    if n < 1:
        raise ValueError(f"generate_reviews: `n` must be >= 1, got {n}")
    generator = ReviewGenerator(seed)
    seen: set[str] = set()
    out: list[Review] = []
    for _ in range(20 * n):
        review = generator.review()
        if review.text not in seen:
            seen.add(review.text)
            out.append(review)
            if len(out) == n:
                return out
    raise RuntimeError(f"generate_reviews: could not write {n} distinct reviews")


def split_reviews(
    reviews: Sequence[Review], validation: int, test: int, seed: int = 0
) -> dict[str, list[Review]]:
    """Shuffle distinct reviews and cut them into train / validation / test.

    Args:
        reviews: Reviews with distinct texts (as from :func:`generate_reviews`).
        validation: Number of validation reviews.
        test: Number of held-out test reviews.
        seed: Seed of the shuffle.
    """
    if len({r.text for r in reviews}) != len(reviews):
        raise ValueError("split_reviews: `reviews` must have distinct texts")
    return shuffle_split(reviews, validation, test, seed, owner="split_reviews")


def shuffle_split(
    items: Sequence[T], validation: int, test: int, seed: int = 0, owner: str = "shuffle_split"
) -> dict[str, list[T]]:
    """Shuffle ``items`` with ``seed`` and cut them into train / validation / test.

    The first ``test`` of the shuffled items are the test split, the next ``validation`` the
    validation split, the rest the training split. Used for the default world's reviews and
    for a user's texts (:mod:`rlkl_lightning.world.custom`).
    """
    if validation < 1 or test < 1 or validation + test >= len(items):
        raise ValueError(
            f"{owner}: need validation >= 1, test >= 1 and validation + test < "
            f"{len(items)} items; got validation={validation}, test={test}"
        )
    order = list(items)
    random.Random(seed).shuffle(order)
    return {
        "test": order[:test],
        "validation": order[test : test + validation],
        "train": order[test + validation :],
    }


def make_prompt(text: str, n_words: int, min_words: int = 2) -> str | None:
    """The opening of a review, stopped before its first opinion word or negation.

    The prompt is the first ``n_words`` words, cut before the first word with a
    polarity in the lexicon (or ``not``/``never``/``-n't``), so the opening does not
    give the sentiment away: the policy writes it. Returns ``None`` if fewer than
    ``min_words`` words remain.
    """
    polar = _polar_words()
    words: list[str] = []
    for word in text.split()[:n_words]:
        bare = word.strip(",.!?;:").lower()
        if bare in polar or bare in ("not", "never") or bare.endswith("n't"):
            break
        words.append(word)
    return " ".join(words) if len(words) >= min_words else None


def make_prompts(
    reviews: Sequence[Review], min_words: int = 2, max_words: int = 5, seed: int = 0
) -> list[dict]:
    """Openings of ``reviews`` (see :func:`make_prompt`), one per review where possible.

    Each opening is ``k`` words with ``k`` drawn uniformly from
    ``[min_words, max_words]``; reviews that open with an opinion word give none.
    Returns dicts with ``text`` (the opening), ``rating`` and ``domain`` of the source.
    """
    rng = random.Random(seed)
    out = []
    for review in reviews:
        prompt = make_prompt(review.text, rng.randint(min_words, max_words), min_words)
        if prompt is not None:
            out.append({"text": prompt, "rating": review.rating, "domain": review.domain})
    return out


_POLAR: frozenset[str] | None = None


def _polar_words() -> frozenset[str]:
    global _POLAR
    if _POLAR is None:
        _POLAR = frozenset(lx.polar_vocabulary())
    return _POLAR


class _ReviewWriter:
    """Plans and writes the sentences of one review."""

    def __init__(self, rng: random.Random, domain: lx.Domain, rating: int, by_kind) -> None:
        self.rng, self.domain, self.rating, self.by_kind = rng, domain, rating, by_kind
        self.past = rng.random() >= domain.present_tense
        self.item = rng.choice(domain.items)  # one review, one item
        self.used: set[str] = set()

    def write(self) -> str:
        rng, rating = self.rng, self.rating
        n = rng.choices(*_SENTENCES)[0]
        kinds = []
        for _ in range(n):
            kinds.append("contrast" if rng.random() < _CONTRAST[rating] else "opinion")
        if n >= 3 and rng.random() < 0.5:
            kinds[0] = "context"
        if n >= 2 and rng.random() < 0.45:
            if rating == 3:
                kinds[-1] = "lukewarm" if rng.random() < 0.75 else "rating"
            else:
                kinds[-1] = "verdict" if rng.random() < 0.8 else "rating"
        text = " ".join(self.sentence(kind) for kind in kinds)
        if rng.random() < 0.3:
            for full, short in _CONTRACTIONS.items():
                text = text.replace(full, short)
        return text

    def sentence(self, kind: str) -> str:
        rng, rating = self.rng, self.rating
        major = _MAJOR[rating] or rng.choice((-1, 1))
        if kind == "opinion" and rng.random() > _AGREE[rating]:
            major = -major
        strength = rng.choices((1, 2, 3), _STRENGTH[rating])[0]
        minor_strength = 1 if rating in (1, 5) else rng.choice((1, 2))
        candidates = [
            p
            for p in self.by_kind[kind]
            if p.polarity in (None, major) and p.domain in (None, self.domain.name)
        ]
        pattern = rng.choice(candidates)
        return self.render(pattern, (major, strength), (-major, minor_strength))

    # --- one sentence --------------------------------------------------------------

    def render(self, pattern: Pattern, major: tuple[int, int], minor: tuple[int, int]) -> str:
        parts = _SLOT.split(pattern.text)  # literal, flag, name, literal, flag, name, ...
        slots = [(parts[i], parts[i + 1]) for i in range(1, len(parts), 3)]
        literals = parts[0::3]
        nouns: dict[int, _Noun] = {
            i: self.noun(name) for i, (_, name) in enumerate(slots) if name in _NOUN_SLOTS
        }
        out = [literals[0]]
        for i, (flag, name) in enumerate(slots):
            if i in nouns:
                out.append(nouns[i].text)
            else:
                polarity, strength = minor if flag else major
                noun = self.bind(i, name, nouns, literals)
                out.append(self.fill(name, polarity, strength, noun))
            out.append(literals[i + 1])
        return _finish("".join(out))

    def noun(self, name: str) -> _Noun:
        rng = self.rng
        if name == "it":
            return _Noun("it", False, None)
        if name == "item":
            return _Noun(self.item.text, self.item.plural, None)
        for _ in range(6):  # prefer an aspect the review has not mentioned yet
            group = rng.choice(self.domain.aspects)
            noun = rng.choice(group.nouns)
            if noun.text not in self.used:
                break
        self.used.add(noun.text)
        return _Noun(noun.text, noun.plural, group)

    @staticmethod
    def bind(i: int, name: str, nouns: dict[int, _Noun], literals: list[str]) -> _Noun | None:
        """The noun slot that slot ``i`` agrees with or describes."""
        before = [j for j in nouns if j < i]
        after = [j for j in nouns if j > i]
        if name in _EVAL_SLOTS and after and after[0] == i + 1 and not literals[i + 1].strip():
            return nouns[i + 1]  # "{adj} {aspect}": the adjective describes the next noun
        if before:
            return nouns[before[-1]]
        if name in _EVAL_SLOTS and after:
            return nouns[after[0]]  # "{bare} as the {aspect} were"
        return None

    def fill(self, name: str, polarity: int, strength: int, noun: _Noun | None) -> str:
        rng, past = self.rng, self.past
        plural = noun is not None and noun.plural
        group = noun.group if noun is not None else None
        if name == "be":
            return ("were" if plural else "was") if past else ("are" if plural else "is")
        if name == "is":
            return "was" if past else "is"
        if name == "are":
            return "were" if past else "are"
        if name == "becomes":
            return "became" if past else "becomes"
        if name in ("pred", "adj", "bare"):
            pool = self.adjectives(group)
            if name == "bare":
                return self.pick(pool, polarity, strength)
            return self.evaluation(pool, polarity, strength, negatable=name == "pred")
        if name == "manner":
            participles = group.participles if group else self.domain.participles
            adverb = self.pick(lx.MANNER_ADVERBS, polarity, max(strength, 2))
            return f"{adverb} {rng.choice(participles)}"
        if name == "verb":
            verb = self.pick(lx.VERBS, polarity, strength)
            if strength >= 2 and rng.random() < 0.3:
                boosters = ("really", "absolutely", "truly") if strength == 3 else ("really",)
                verb = f"{rng.choice(boosters)} {verb}"
            return verb
        if name == "feel":
            return self.modified(lx.FEELINGS, polarity, strength)
        if name == "noun":
            return self.sentiment_noun(polarity, strength)
        if name == "rec":
            return self.pick(lx.RECOMMENDATIONS, polarity, strength)
        if name == "opener":
            return self.pick(lx.OPENERS, polarity, 2)
        if name == "again":
            return rng.choice(self.domain.again)
        if name == "span":
            return rng.choice(self.domain.span)
        if name == "stars":
            number = lx.NUMBER_WORDS[self.rating - 1]
            return f"{number} star" if self.rating == 1 else f"{number} stars"
        fills = self.domain.fills.get(name) or lx.SHARED_FILLS.get(name)
        if fills is None:
            raise KeyError(f"unknown pattern slot {{{name}}}")
        return rng.choice(fills)

    def adjectives(self, group: lx.AspectGroup | None) -> tuple[lx.Word, ...]:
        specific = group.adjectives if group else self.domain.overall
        return specific if self.rng.random() < 0.65 else lx.ADJECTIVES

    def pick(self, pool: tuple[lx.Word, ...], polarity: int, strength: int) -> str:
        """A word of ``pool`` with this polarity, at the nearest available strength.

        Words not used yet in the review are preferred.
        """
        graded = _graded(pool)
        for distance in range(3):
            for s in (strength - distance, strength + distance):
                words = graded.get((polarity, s))
                if words:
                    fresh = [w for w in words if w not in self.used]
                    word = self.rng.choice(fresh or words)
                    self.used.add(word)
                    return word
        raise ValueError(f"no word of polarity {polarity} in the pool")

    def evaluation(self, pool, polarity: int, strength: int, negatable: bool) -> str:
        """An adjective phrase: modified, toned down, or a negated opposite."""
        rng = self.rng
        p_not = 0.3 if strength == 1 else 0.2 if (strength == 2 and polarity < 0) else 0.0
        if negatable and rng.random() < p_not:
            # "not great" is a mild complaint, "not that bad" mild praise.
            if polarity < 0:
                soft = rng.choice(lx.NEGATION_SOFTENERS).text if rng.random() < 0.4 else ""
                word = self.pick(pool, 1, 2)
            else:
                soft = rng.choice(("that", "at all")) if rng.random() < 0.4 else ""
                word = self.pick(pool, -1, rng.choice((2, 3)))
            return f"not {soft} {word}" if soft else f"not {word}"
        return self.modified(pool, polarity, strength)

    def modified(self, pool, polarity: int, strength: int) -> str:
        rng = self.rng
        if strength == 3:
            if rng.random() < 0.3:
                return f"{rng.choice(lx.BOOSTERS).text} {self.pick(pool, polarity, 2)}"
            word = self.pick(pool, polarity, 3)
            if rng.random() < 0.35:
                extremes = lx.POSITIVE_EXTREMES if polarity > 0 else lx.NEGATIVE_EXTREMES
                return f"{rng.choice(extremes).text} {word}"
            return word
        if strength == 2:
            word = self.pick(pool, polarity, 2)
            return f"{rng.choice(lx.BOOSTERS).text} {word}" if rng.random() < 0.15 else word
        if rng.random() < 0.5:
            return self.pick(pool, polarity, 1)
        downtoners = lx.POSITIVE_DOWNTONERS if polarity > 0 else lx.NEGATIVE_DOWNTONERS
        return f"{rng.choice(downtoners).text} {self.pick(pool, polarity, 2)}"

    def sentiment_noun(self, polarity: int, strength: int) -> str:
        rng = self.rng
        if strength == 1:
            word = self.pick(lx.SENTIMENT_NOUNS, polarity, 2)
            return f"a nice little {word}" if polarity > 0 else f"a bit of a {word}"
        word = self.pick(lx.SENTIMENT_NOUNS, polarity, strength)
        if rng.random() < 0.5:
            mods = lx.NOUN_MODIFIERS_POSITIVE if polarity > 0 else lx.NOUN_MODIFIERS_NEGATIVE
            word = f"{rng.choice(mods).text} {word}"
        return f"a {word}"


_GRADED: dict[int, dict[tuple[int, int], tuple[str, ...]]] = {}


def _graded(pool: tuple[lx.Word, ...]) -> dict[tuple[int, int], tuple[str, ...]]:
    """Words of a (module-level, immutable) pool by (polarity, strength), cached."""
    key = id(pool)
    if key not in _GRADED:
        table: dict[tuple[int, int], list[str]] = {}
        for word in pool:
            table.setdefault((word.polarity, word.strength), []).append(word.text)
        _GRADED[key] = {k: tuple(v) for k, v in table.items()}
    return _GRADED[key]


def _finish(sentence: str) -> str:
    """Fix ``a``/``an`` and capitalise the first letter."""

    def article(match: re.Match) -> str:
        a, word = match.group(1), match.group(2).lower()
        vowel = word[0] in "aeiou" and not word.startswith(_AN_EXCEPTIONS)
        return f"{a}{'n' if vowel else ''} {match.group(2)}"

    sentence = re.sub(r"\b([Aa]) ([A-Za-z]+)", article, sentence)
    return sentence[:1].upper() + sentence[1:]
