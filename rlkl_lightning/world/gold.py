"""The default world's gold sentiment: the rating a reader who knows the generator expects.

The world wrote every review from a rating (:mod:`.corpus`), so the true sentiment of a text
is the rating it was written from. :func:`gold_score` inverts the generator: it reads the
text with the world's own lexicon (:mod:`.lexicon`) and grammar (:mod:`.patterns`), computes
the likelihood of each sentence under each rating with the generator's own probabilities,
and returns the posterior mean rating (uniform prior, as the generator draws ratings),
rescaled from [1, 5] to [-1, 1]. It is fast, deterministic, needs no model, and reads any
text, including a policy's ungrammatical samples.

How a sentence is read, as the generator writes it:

- **Units.** Every opinion word or phrase of the lexicon is a unit of polarity ``p`` and, with
  the words in front of it, a likelihood over the sentence's strength ``s`` (1 mild, 2 clear,
  3 strong). Intensifiers scale as in ``_ReviewWriter.modified``: a strength-3 word is strong
  (an extreme such as "absolutely" in front or not); a booster ("really") before a strength-2
  word makes it strong (or, less often, leaves it clear); a downtoner ("somewhat", "a bit")
  makes it mild. A verb's strength is its own ("really enjoyed" is clear).
- **Negation** flips, as in ``_ReviewWriter.evaluation``: "not [particularly] good" is a mild
  or clear complaint, "not [that] bad" mild praise. Lexicon phrases with "not" ("did not
  like", "not recommend") are units of their own.
- **Contrast.** In "A, but B" (also "yet", "Although A, B", "Despite A, B", "A aside, B",
  "Dull as A was, B") the generator concedes the opposite of the review's opinion in A, mildly,
  and states the opinion in B. So B's polarity is the rating's (never flipped), A's is its
  opposite, and a contrast is likelier in a 2-4 star review than in a 1 or 5 star one.
- **Opinion sentences** agree with the rating's polarity with the generator's probability
  (``_AGREE``) and have a strength drawn from ``_STRENGTH``. Fixed sentences of the patterns
  ("Highly recommended.", "Not bad, not great.") count as the pattern's polarity or, for the
  lukewarm ones, as a 3-star sentence; "four stars" names the rating. Sentences without an
  opinion (context) say nothing.

Each sentence's likelihoods over the five ratings are normalised and mixed with a uniform
``smoothing`` share, so one sentence the generator could not have written (a policy's) moves
the posterior a bounded amount. ``python -m rlkl_lightning.world.gold_validation`` prints its
correlation with the rating on reviews the reference never saw, beside VADER's (docs/worlds.md,
"The gold reward").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import Literal

import numpy as np

from rlkl_lightning.world import lexicon as lx
from rlkl_lightning.world.corpus import _AGREE, _CONTRAST, _MAJOR, _STRENGTH
from rlkl_lightning.world.patterns import PATTERNS

RATINGS = np.arange(1, 6)
TEXTS = ("response", "prompt+response")
# Slots that carry an opinion; a pattern without them is a fixed sentence.
_EVAL_SLOTS = {"pred", "adj", "bare", "manner", "verb", "feel", "noun", "rec", "opener"}
# How modifiers change a unit's strength, likelihood per sentence strength s = 1, 2, 3
# (_ReviewWriter.modified: strength 3 is a booster + strength-2 word with p 0.3, else a
# strength-3 word, with an extreme in front with p 0.35; strength 2 is a strength-2 word, with
# a booster with p 0.15; strength 1 is a strength-1 word or a downtoner + strength-2 word).
_BARE = {1: (0.5, 0, 0), 2: (0, 0.85, 0), 3: (0, 0, 0.7 * 0.65)}
_BOOSTED = (0, 0.15, 0.3)
_EXTREME = (0, 0, 0.7 * 0.35)
_DOWNTONED = (0.5, 0, 0)
# _ReviewWriter.evaluation: "not" + a positive word at strength 1 (p 0.3) or at strength 2
# of a negative opinion (p 0.2); "not" + a negative word only at strength 1.
_NOT_POSITIVE = (0.3, 0.2, 0)
_NOT_NEGATIVE = (0.3, 0, 0)
# _ReviewWriter.sentence: the conceded clause of a contrast is mild in 1 and 5 star reviews,
# mild or clear otherwise.
_MINOR_STRENGTH = {1: (1, 0, 0), 2: (0.5, 0.5, 0), 3: (0.5, 0.5, 0), 4: (0.5, 0.5, 0)}
_MINOR_STRENGTH[5] = _MINOR_STRENGTH[1]
# A share of any strength for the conceded clause: a strong concession (which the generator
# never writes) must not turn the main clause's polarity around.
_MINOR_FLOOR = 0.05
_NEGATORS = ("not", "never")
_CONTRAST_WORDS = ("but", "yet")
_CONCESSIVE_OPENERS = ("although", "though", "despite", "while")
_WINDOW = 3  # a modifier or "not" reaches the opinion word at most this many tokens on
_NICE_LITTLE = ("nice", "little")
_OTHER_POLARITY = 0.05  # a unit's likelihood for the other polarity, relative


def tokens(text: str) -> list[str]:
    """Lower-cased words and commas, with ``n't`` spelt ``not`` (the generator contracts)."""
    text = text.lower().replace("won't", "will not").replace("can't", "can not")
    text = re.sub(r"n't\b", " not", text)
    return re.findall(r"[a-z]+(?:-[a-z]+)*|,", text)


def _key(text: str) -> tuple[str, ...]:
    """A lexicon entry as a token sequence, without its punctuation ("Sadly," -> "sadly")."""
    return tuple(w for w in tokens(text) if w != ",")


def sentences(text: str) -> list[list[str]]:
    """The tokens of each sentence (split at ``.``, ``!``, ``?``), empty ones dropped."""
    return [t for part in re.split(r"[.!?]+", text) if (t := tokens(part))]


class _Lexicon:
    """The world's opinion words and modifiers, by token sequence."""

    def __init__(self) -> None:
        found: dict[tuple[str, ...], tuple[int, str, set[int]]] = {}
        pools = [(lx.ADJECTIVES, "adj"), (lx.FEELINGS, "adj"), (lx.VERBS, "verb")]
        pools += [(lx.SENTIMENT_NOUNS, "noun"), (lx.MANNER_ADVERBS, "manner")]
        pools += [(lx.RECOMMENDATIONS, "rec"), (lx.OPENERS, "opener")]
        for domain in lx.DOMAINS:
            pools += [(domain.overall, "adj")] + [(g.adjectives, "adj") for g in domain.aspects]
        for pool, kind in pools:
            for word in pool:
                key = _key(word.text)
                found.setdefault(key, (word.polarity, kind, set()))[2].add(word.strength)
        #: token sequence -> (polarity, kind of word, its strengths in the lexicon)
        self.units = {k: (p, kind, frozenset(s)) for k, (p, kind, s) in found.items()}
        self.modifiers: dict[tuple[str, ...], str] = {}
        for pool, kind in [
            (lx.POSITIVE_EXTREMES + lx.NEGATIVE_EXTREMES, "extreme"),
            (lx.BOOSTERS, "booster"),
            (lx.POSITIVE_DOWNTONERS + lx.NEGATIVE_DOWNTONERS, "downtoner"),
        ]:
            for word in pool:
                self.modifiers.setdefault(_key(word.text), kind)
        # _ReviewWriter.sentiment_noun: "a nice little gem" is mild praise (checked in
        # `modifier`: before a sentiment noun only).
        self.modifiers[_NICE_LITTLE] = "downtoner"
        self.softeners = {_key(w.text) for w in lx.NEGATION_SOFTENERS}
        # Literal words of opinion patterns are not opinions ("a small price to pay").
        self.masks: set[tuple[str, ...]] = set()
        polar = {k for k in self.units if len(k) == 1}
        for pattern in PATTERNS:
            parts = re.split(r"\{~?[a-z]+\}", pattern.text)
            if _slots(pattern) & _EVAL_SLOTS:
                for part in parts:
                    words = tuple(w for w in tokens(part) if w != ",")
                    if any((w,) in polar for w in words):
                        self.masks.add(words)
        self.longest = max(len(k) for k in [*self.units, *self.modifiers, *self.masks])

    def match(self, words: list[str], i: int, table) -> tuple[str, ...] | None:
        """The longest key of ``table`` that starts at ``words[i]``."""
        for n in range(min(self.longest, len(words) - i), 0, -1):
            if tuple(words[i : i + n]) in table:
                return tuple(words[i : i + n])
        return None

    def modifier(self, words: list[str], i: int) -> tuple[str, ...] | None:
        """The modifier that starts at ``words[i]``, if any."""
        found = self.match(words, i, self.modifiers)
        if found == _NICE_LITTLE:
            after = self.match(words, i + 2, self.units)
            if after is None or self.units[after][1] != "noun":
                return None  # "a nice little cafe": "nice" is the opinion
        return found


def _slots(pattern) -> set[str]:
    return set(re.findall(r"\{~?([a-z]+)\}", pattern.text))


@cache
def _lexicon() -> _Lexicon:
    return _Lexicon()


@cache
def _fixed_sentences() -> list[tuple[re.Pattern, str, int]]:
    """Patterns without an opinion slot, as regexes over a sentence's joined tokens.

    Returns ``(regex, kind, polarity)`` for the opinion, verdict and lukewarm ones ("Highly
    recommended.", "Fine, but I would not {again}."); each slot matches one or more words.
    """
    out = []
    for pattern in PATTERNS:
        if pattern.kind not in ("opinion", "verdict", "lukewarm") or _slots(pattern) & _EVAL_SLOTS:
            continue
        literals = re.split(r"\{~?[a-z]+\}", pattern.text)
        pieces = [re.escape(" ".join(tokens(literals[0])))]
        for literal in literals[1:]:
            pieces += [r"\S+(?: \S+)*?", re.escape(" ".join(tokens(literal)))]
        regex = re.compile(" ".join(piece for piece in pieces if piece))
        out.append((regex, pattern.kind, pattern.polarity or 0))
    return out


def _tables() -> dict[str, np.ndarray]:
    """The generator's probabilities per rating (rows: ratings 1-5; polarity 0 is negative)."""
    major = np.array([_MAJOR[r] for r in RATINGS])
    agree = np.array([_AGREE[r] for r in RATINGS])
    # An opinion sentence agrees with the rating's polarity with p _AGREE; a 3-star review
    # draws the polarity of each sentence. A verdict or a contrast's main clause states it.
    opinion = np.stack([np.where(sign * major > 0, agree, 1 - agree) for sign in (-1, 1)], 1)
    opinion[major == 0] = 0.5
    stated = np.stack([(sign * major > 0) + 0.5 * (major == 0) for sign in (-1, 1)], 1)
    minor = np.array([_MINOR_STRENGTH[r] for r in RATINGS], dtype=float)
    return {
        "opinion": opinion,  # [5, 2] p(polarity | rating)
        "stated": stated,  # [5, 2]
        "strength": np.array([_STRENGTH[r] for r in RATINGS], dtype=float),  # [5, 3]
        "minor": (1 - _MINOR_FLOOR) * minor + _MINOR_FLOOR / 3,  # [5, 3]
        "contrast": np.array([_CONTRAST[r] for r in RATINGS]),  # [5] p(contrast sentence)
    }


_TABLES = _tables()


class GoldScorer:
    """Reads texts with the world's grammar; the ablation switches exist to test that it does.

    Args:
        negation: Read "not" as the generator writes it (off: ignored).
        contrast: Read the conceded and the main clause of a contrast (off: one clause).
        intensifiers: Let boosters, extremes and downtoners scale strength (off: ignored).
        smoothing: The uniform share mixed into each sentence's likelihoods over the ratings.
    """

    def __init__(
        self,
        negation: bool = True,
        contrast: bool = True,
        intensifiers: bool = True,
        smoothing: float = 0.05,
    ) -> None:
        if not 0 < smoothing < 1:
            raise ValueError(f"GoldScorer: `smoothing` must be in (0, 1), got {smoothing!r}")
        self.negation, self.contrast, self.intensifiers = negation, contrast, intensifiers
        self.smoothing = smoothing
        self.lex = _lexicon()

    def __call__(self, text: str) -> float:
        """The gold score of ``text`` in [-1, 1]: ``(E[rating | text] - 3) / 2``."""
        return float((self.posterior(text) @ RATINGS - 3) / 2)

    def posterior(self, text: str) -> np.ndarray:
        """``[5]`` probabilities of ratings 1-5 given ``text`` (uniform for no opinion)."""
        log_post = np.zeros(5)
        for words in sentences(text):
            likelihood = self.sentence_likelihood(words)
            if likelihood is None or not likelihood.sum() > 0:
                continue
            share = (1 - self.smoothing) * likelihood / likelihood.sum() + self.smoothing / 5
            log_post += np.log(share)
        post = np.exp(log_post - log_post.max())
        return post / post.sum()

    def sentence_likelihood(self, words: list[str]) -> np.ndarray | None:
        """``[5]`` likelihood of one sentence under each rating; None: it holds no opinion."""
        t = _TABLES
        joined = " ".join(words)
        stars = re.search(r"\b(one|two|three|four|five) stars?\b", joined)
        if stars:
            return (RATINGS == lx.NUMBER_WORDS.index(stars.group(1)) + 1).astype(float)
        for regex, kind, polarity in _fixed_sentences():
            if regex.fullmatch(joined):
                if kind == "lukewarm":
                    return (RATINGS == 3).astype(float)
                table = t["opinion"] if kind == "opinion" else t["stated"]
                return table[:, int(polarity > 0)] * (1 - t["contrast"] * (kind == "opinion"))
        minor, main = self.clauses(words) if self.contrast else (None, words)
        main_units = self.units(main)
        if minor is None:
            if not main_units:
                return None
            clause = np.prod(main_units, axis=0)  # [2, 3]: one polarity and strength for all
            opinion = np.einsum("rp,rs,ps->r", t["opinion"], t["strength"], clause)
            return (1 - t["contrast"]) * opinion
        main_clause = np.prod(main_units, axis=0) if main_units else np.ones((2, 3))
        minor_units = self.units(minor)
        conceded = np.prod(minor_units, axis=0)[::-1] if minor_units else np.ones((2, 3))
        return t["contrast"] * np.einsum(
            "rp,rs,ps,rt,pt->r", t["stated"], t["strength"], main_clause, t["minor"], conceded
        )

    def clauses(self, words: list[str]) -> tuple[list[str] | None, list[str]]:
        """(conceded clause, main clause) of a contrast, or (None, the sentence)."""
        for i, word in enumerate(words):
            if word in _CONTRAST_WORDS:
                return words[:i], words[i + 1 :]
        if "," in words:
            comma = words.index(",")
            first = words[:comma]
            opener, last = (first[0], first[-1]) if first else ("", "")
            concessive = opener in _CONCESSIVE_OPENERS or last == "aside"
            if concessive or (len(first) > 2 and first[1] == "as"):  # "dull as the plot was"
                return first, words[comma + 1 :]
        return None, words

    def units(self, words: list[str]) -> list[np.ndarray]:
        """``[2, 3]`` likelihood (polarity, strength) of each opinion unit of a clause.

        A modifier or "not" reaches the next opinion word within ``_WINDOW`` words, never
        past a comma; words between "not" and the opinion word ("not particularly good")
        soften nothing the generator can tell apart, so they are skipped.
        """
        lex, out = self.lex, []
        modifier, negated, age = None, False, 0
        i = 0
        while i < len(words):
            if mask := lex.match(words, i, lex.masks):
                i += len(mask)
                continue
            unit = lex.match(words, i, lex.units)
            mod = lex.modifier(words, i) if self.intensifiers else None
            if unit and not (mod and len(mod) > len(unit)):
                polarity, kind, strengths = lex.units[unit]
                out.append(self.unit(polarity, kind, strengths, modifier, negated))
                modifier, negated = None, False
                i += len(unit)
                continue
            if self.negation and words[i] in _NEGATORS:
                negated, age = True, 0
            elif negated and (soft := lex.match(words, i, lex.softeners)):
                i += len(soft)
                continue
            elif mod:
                modifier, age = lex.modifiers[mod], 0
                i += len(mod)
                continue
            else:
                age += 1
                if words[i] == "," or age >= _WINDOW:
                    modifier, negated = None, False
            i += 1
        return out

    def unit(
        self, polarity: int, kind: str, strengths: frozenset[int], modifier, negated: bool
    ) -> np.ndarray:
        """``[2, 3]`` likelihood of one unit: row 0 negative, row 1 positive; s = 1, 2, 3."""
        if negated:
            polarity = -polarity
            row = np.array(_NOT_POSITIVE if polarity < 0 else _NOT_NEGATIVE, dtype=float)
        elif kind == "adj":
            row = {
                "booster": _BOOSTED,  # the generator boosts clear words: clear or strong
                "extreme": _EXTREME,
                "downtoner": _DOWNTONED,
            }.get(modifier) or np.sum([_BARE[k] for k in strengths], axis=0)
        elif kind == "manner":  # the adverb is at least clear: a clear one may read as mild
            row = np.array([(1, 1, 0) if k == 2 else (0, 0, 1) for k in strengths]).max(0)
        elif kind == "opener":  # a fixed strength, whatever the sentence's
            row = np.ones(3)
        elif kind == "noun" and modifier == "downtoner":  # "a bit of a letdown"
            row = np.array(_DOWNTONED, dtype=float)
        else:  # verbs, nouns, recommendations: the word's own strength
            row = np.array([float(s in strengths) for s in (1, 2, 3)])
        row = np.asarray(row, dtype=float)
        other = np.full(3, _OTHER_POLARITY * row.max())
        return np.stack([row, other] if polarity < 0 else [other, row])


def gold_score(text: str) -> float:
    """The gold score of ``text`` in [-1, 1] with the full grammar (see the module docstring)."""
    return _default_scorer()(text)


@cache
def _default_scorer() -> GoldScorer:
    return GoldScorer()


class GoldSentimentReward:
    """The gold score of each response, as a reward model (``reward(prompts, responses)``).

    Logged beside the trained proxy as ``objective/gold_score`` (``RLPipeline``'s
    ``gold_reward``), it shows whether optimising the proxy still improves the sentiment the
    world meant.

    Args:
        text: What is read: ``"prompt+response"`` (default: the review the policy completed,
            so a prompt that opens a contrast, "Although the plot", is read as one) or
            ``"response"`` alone (the text the proxy scores).
    """

    def __init__(self, text: Literal["response", "prompt+response"] = "prompt+response") -> None:
        if text not in TEXTS:
            raise ValueError(f"GoldSentimentReward: `text` must be one of {TEXTS}, got {text!r}")
        self.text = text

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]):
        """``[B]`` float32 gold scores (see :class:`rlkl_lightning.rewards.RewardModel`)."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"{self!r}: got {len(prompts)} prompts but {len(responses)} responses")
        if self.text == "response":
            texts = list(responses)
        else:
            texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        return torch.tensor([gold_score(t) for t in texts], dtype=torch.float32)

    def __repr__(self) -> str:
        return f"GoldSentimentReward(text={self.text!r})"
