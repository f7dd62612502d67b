"""Sentence patterns of the default world's review generator.

A pattern is a sentence with ``{slot}`` placeholders that :mod:`.corpus` fills from
:mod:`.lexicon`. Slots:

- ``{item}``, ``{aspect}``, ``{it}``: what is reviewed ("film"), one of its aspects
  ("plot"), or "it" for the item. An evaluation slot describes the noun slot right
  after it ("{adj} {aspect}"), else the last one before it ("the {aspect} {be} {pred}");
  ``{be}`` agrees with the last noun before it.
- ``{be}`` (is/are/was/were, agreeing), ``{is}`` (singular), ``{are}`` (plural),
  ``{becomes}``: verbs in the review's tense.
- ``{pred}``: an evaluation after a verb, possibly negated ("not particularly good");
  ``{adj}``: a modified adjective ("truly superb"); ``{bare}``: an adjective alone;
  ``{manner}``: adverb + participle ("beautifully shot"); ``{verb}`` ("really enjoyed"),
  ``{feel}`` ("thrilled"), ``{noun}`` ("an absolute disaster"), ``{rec}``
  ("highly recommend"), ``{opener}`` ("Sadly,").
- ``{again}``, ``{span}``, ``{stars}`` and any other name: phrases from the domain
  or the shared fillers ("watch it again", "from start to finish", "four stars").

A ``~`` before a slot name (``{~pred}``) takes the sentence's *minor* polarity: in a
contrast pattern the first clause concedes the opposite of the review's opinion and
the clause after "but" states it, which is how English weighs the two (and how VADER
does: it up-weights the clause after "but").

Kinds: ``opinion`` (one polarity), ``contrast`` (minor then major polarity),
``verdict`` (a closing judgement), ``lukewarm`` (for 3-star reviews), ``rating``
(names the stars), ``context`` (neutral narrative, per domain).
"""

from __future__ import annotations

from typing import NamedTuple

KINDS = ("opinion", "contrast", "verdict", "lukewarm", "rating", "context")


class Pattern(NamedTuple):
    """One sentence pattern.

    Attributes:
        text: The sentence with ``{slot}`` placeholders.
        kind: One of ``KINDS``.
        polarity: +1 or -1 if the pattern only makes sense with that (major) polarity,
            ``None`` if it fits both.
        domain: Domain name if the pattern belongs to one domain, else ``None``.
    """

    text: str
    kind: str
    polarity: int | None = None
    domain: str | None = None


def _many(kind: str, *texts: str, polarity: int | None = None, domain: str | None = None):
    return tuple(Pattern(text, kind, polarity, domain) for text in texts)


OPINION = _many(
    "opinion",
    "The {aspect} {be} {pred}.",
    "This {item} {be} {pred}.",
    "In my view, the {aspect} {be} {pred}.",
    "I found the {aspect} {adj}.",
    "Frankly, the {aspect} {be} {pred}.",
    "The {aspect} in particular {be} {pred}.",
    "What a {adj} {item}!",
    "It {is} a {adj} {item}.",
    "{adj} {aspect}.",
    "{adj} {aspect} and {adj} {aspect}.",
    "The {aspect} {be} {pred} and the {aspect} {be} {pred}.",
    "I {verb} the {aspect} and the {aspect}.",
    "I {verb} the {aspect}.",
    "I {verb} this {item}.",
    "We {verb} the {aspect}.",
    "I was {feel} with the {aspect}.",
    "I was {feel} with this {item}.",
    "Overall, I was {feel}.",
    "This {item} {is} {noun}.",
    "The {aspect} {be} {noun}.",
    "The {aspect} {be} {manner}.",
    "The {item} {is} {manner}.",
    "A {adj} {item}.",
    "{adj} {span}.",
    "The {item} {is} {adj} {span}.",
    "Even the {aspect} {be} {pred}.",
    "{opener} the {aspect} {be} {pred}.",
    "To my surprise, the {aspect} {be} {pred}.",
    "My {who} {verb} the {aspect}.",
    "My {who} and I {verb} it.",
    "I {verb} the {aspect}, and the {aspect} {be} {pred} too.",
    "Frankly, this {item} {is} {noun}.",
    "What {noun}!",
    "{noun} of a {item}.",
    "It {is} {adj}, {adj} and {adj}.",
    "The {aspect} felt {adj}.",
    "The {aspect} {be} {manner} and {adj}.",
    "All in all, {noun}.",
)
OPINION += _many(
    "opinion",
    "I enjoyed every minute of it.",
    "Overall, a great experience.",
    polarity=1,
)
OPINION += _many(
    "opinion",
    "I regretted every minute of it.",
    "Overall, a miserable experience.",
    polarity=-1,
)

CONTRAST = _many(
    "contrast",
    "The {aspect} {be} {~pred}, but the {aspect} {be} {pred}.",
    "Although the {aspect} {be} {~pred}, the {aspect} {be} {pred}.",
    "{~adj} {aspect}, but {adj} {aspect}.",
    "The {aspect} {be} {~pred}, but overall {it} {is} {pred}.",
    "I {~verb} the {aspect}, but the {aspect} {be} {pred}.",
    "The {aspect} {be} {~pred}, yet the {aspect} {be} {pred}.",
    "{~bare} as the {aspect} {be}, the {aspect} {be} {pred}.",
    "{~adj} {aspect} aside, the {item} {is} {pred}.",
    "Despite the {~adj} {aspect}, the {item} {is} {pred}.",
    "The {item} {is} {~pred} at first, but it soon {becomes} {adj}.",
    "The {aspect} {be} {~manner}, but the {aspect} {be} {pred}.",
    "The {aspect} {be} {~pred}, but I {verb} the {aspect}.",
)
CONTRAST += _many(
    "contrast",
    "I wanted to like this {item}, but the {aspect} {be} {pred}.",
    "The reviews were glowing, but the {aspect} {be} {pred}.",
    polarity=-1,
)
CONTRAST += _many(
    "contrast",
    "I expected very little, but the {aspect} {be} {pred}.",
    "The {aspect} {be} {~pred}, but that {is} a small price to pay for such a {adj} {item}.",
    polarity=1,
)

VERDICT = _many(
    "verdict",
    "I would {rec} this {item}.",
    "I would {rec} it to anyone.",
    "{noun}, plain and simple.",
)
VERDICT += _many(
    "verdict",
    "Highly recommended.",
    "Worth every penny.",
    "I will definitely {again}.",
    "I would {again} in a heartbeat.",
    "A wonderful experience.",
    "Simply the best {item} I have come across in years.",
    polarity=1,
)
VERDICT += _many(
    "verdict",
    "Avoid.",
    "Save your money.",
    "A complete waste of money.",
    "Not worth the money.",
    "I regret it.",
    "Never again.",
    "The worst {item} I have come across in years.",
    polarity=-1,
)

LUKEWARM = _many(
    "lukewarm",
    "It {is} okay, nothing special.",
    "Not bad, not great.",
    "Fine, but I would not {again}.",
    "Mixed feelings overall.",
    "An average {item}, really.",
    "Some good moments, some dull ones.",
    "It does the job.",
)

RATING = _many("rating", "{stars}.", "{stars} from me.", "I give it {stars}.")

CONTEXT = _many(
    "context",
    "I watched it {when} with my {who}.",
    "I saw it at {venue} {when}.",
    "It is a {genre} about {topic}.",
    "The {item} runs {length}.",
    domain="films",
)
CONTEXT += _many(
    "context",
    "We went there for {occasion} {when}.",
    "I ordered the {dish} and my {who} had the {dish}.",
    "We booked a table for {number}.",
    "The {item} is near {landmark}.",
    domain="restaurants",
)
CONTEXT += _many(
    "context",
    "I read it {where}.",
    "It is a {genre} about {topic}.",
    "I picked it up at {found} {when}.",
    "The {item} runs to about {pages} pages.",
    domain="books",
)
CONTEXT += _many(
    "context",
    "We stayed for {nights} nights {when}.",
    "We booked a {room} for {nights} nights.",
    "The {item} is {distance} from {landmark}.",
    "We were there for {purpose}.",
    domain="hotels",
)
CONTEXT += _many(
    "context",
    "I have been using it for {duration}.",
    "I use it mostly for {use}.",
    "It arrived {arrival}.",
    "It cost about {price}.",
    "I bought it to replace my old {item}.",
    domain="gadgets",
)

PATTERNS: tuple[Pattern, ...] = OPINION + CONTRAST + VERDICT + LUKEWARM + RATING + CONTEXT
