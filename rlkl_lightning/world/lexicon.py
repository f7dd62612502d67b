"""The hand-written lexicon of the default world's review generator.

Every evaluative word carries a polarity (+1 positive, -1 negative) and a strength
(1 mild, 2 clear, 3 strong); neutral words (items, aspects, narrative fillers) have
polarity 0 and strength 0. Modifiers (``really``, ``somewhat``) are neutral words whose
strength says how much they scale the adjective after them.

The positive and negative words were chosen so that most of them are in the VADER
lexicon (the default reward scores responses with VADER); domain words VADER does not
know (``soggy``, ``flimsy``) are kept where English needs them. A test of the default world
measures the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

POSITIVE, NEUTRAL, NEGATIVE = 1, 0, -1


class Word(NamedTuple):
    """One lexicon entry.

    Attributes:
        text: The word or short phrase (``"a bit"``).
        polarity: +1 positive, -1 negative, 0 neutral.
        strength: 1 mild, 2 clear, 3 strong; 0 for neutral words. For modifiers,
            how strongly they scale the word after them (1 tones down, 3 is extreme).
    """

    text: str
    polarity: int
    strength: int


class Noun(NamedTuple):
    """A noun phrase and its grammatical number (for ``is``/``are`` agreement)."""

    text: str
    plural: bool = False


def graded(
    p3: str = "", p2: str = "", p1: str = "", n1: str = "", n2: str = "", n3: str = ""
) -> tuple[Word, ...]:
    """Words graded from strongly positive (``p3``) to strongly negative (``n3``).

    Each argument is a space-separated list; an underscore joins a phrase
    (``"a_bit"`` -> ``"a bit"``).
    """
    levels = ((p3, 1, 3), (p2, 1, 2), (p1, 1, 1), (n1, -1, 1), (n2, -1, 2), (n3, -1, 3))
    return tuple(
        Word(text.replace("_", " "), polarity, strength)
        for spaced, polarity, strength in levels
        for text in spaced.split()
    )


def neutral(spaced: str, strength: int = 0) -> tuple[Word, ...]:
    """Neutral words (polarity 0) from a space-separated list; ``_`` joins phrases."""
    return tuple(Word(text.replace("_", " "), NEUTRAL, strength) for text in spaced.split())


def nouns(singular: str = "", plural: str = "") -> tuple[Noun, ...]:
    """Noun phrases from space-separated lists; ``_`` joins words (``battery_life``)."""
    return tuple(Noun(t.replace("_", " "), False) for t in singular.split()) + tuple(
        Noun(t.replace("_", " "), True) for t in plural.split()
    )


def phrases(listed: str) -> tuple[str, ...]:
    """Fixed phrases from a comma-separated list (``"last week, on Sunday"``)."""
    return tuple(text.strip() for text in listed.split(","))


# --- evaluative words that fit any subject --------------------------------------------

ADJECTIVES = graded(
    p3="excellent outstanding superb brilliant wonderful fantastic amazing terrific "
    "marvelous perfect flawless fabulous splendid great remarkable awesome",
    p2="good nice lovely pleasant impressive solid",
    p1="decent fine okay acceptable adequate satisfactory reasonable",
    n1="mediocre average ordinary forgettable unremarkable underwhelming uninspired weak",
    n2="bad poor disappointing dull frustrating annoying lousy inferior unpleasant",
    n3="awful terrible horrible dreadful appalling atrocious abysmal disgraceful pathetic "
    "dismal woeful",
)

# Modifiers of an adjective: extreme ones go with strength-3 adjectives ("absolutely
# superb", "utterly awful"), boosters with strength-2 ones ("really good"), downtoners
# make a strength-2 adjective mild ("somewhat dull"; the positive ones: "fairly good").
POSITIVE_EXTREMES = neutral("absolutely truly simply", strength=3)
NEGATIVE_EXTREMES = neutral("absolutely truly simply utterly completely", strength=3)
BOOSTERS = neutral(
    "really very extremely incredibly remarkably genuinely especially so exceptionally",
    strength=2,
)
POSITIVE_DOWNTONERS = neutral("fairly reasonably mostly quite", strength=1)
NEGATIVE_DOWNTONERS = neutral("somewhat slightly a_bit a_little rather mildly", strength=1)
# Words placed between "not" and an adjective ("not particularly good").
NEGATION_SOFTENERS = neutral("very particularly especially that exactly at_all", strength=1)

# Adverbs of manner, used before a participle ("beautifully shot", "poorly cooked").
MANNER_ADVERBS = graded(
    p3="brilliantly beautifully wonderfully perfectly superbly lovingly",
    p2="cleverly nicely skillfully well expertly carefully",
    n2="poorly badly clumsily awkwardly lazily carelessly",
    n3="terribly horribly shoddily sloppily",
)

# Verbs of the reviewer's opinion, in the past tense.
VERBS = graded(
    p3="loved adored cherished",
    p2="enjoyed liked appreciated admired relished",
    p1="quite_liked mostly_enjoyed",
    n1="did_not_love did_not_really_enjoy",
    n2="disliked did_not_like",
    n3="hated loathed despised detested",
)

# The reviewer's feelings, each reading well in "I was ___ with the plot".
FEELINGS = graded(
    p3="delighted thrilled ecstatic",
    p2="impressed pleased happy satisfied",
    n2="disappointed annoyed frustrated unimpressed unhappy dissatisfied bored irritated",
    n3="disgusted furious angry appalled",
)

# Nouns that carry an opinion ("a gem", "a disaster"), with the modifiers they take.
SENTIMENT_NOUNS = graded(
    p3="masterpiece triumph joy delight treasure paradise",
    p2="gem treat pleasure winner highlight success bargain blessing",
    n2="disappointment letdown failure flop waste mess shame",
    n3="disaster nightmare catastrophe fiasco disgrace insult",
)
NOUN_MODIFIERS_POSITIVE = neutral("real true genuine absolute little")
NOUN_MODIFIERS_NEGATIVE = neutral("complete total absolute real utter")

# Recommendations ("I would highly recommend this film").
RECOMMENDATIONS = graded(
    p3="highly_recommend wholeheartedly_recommend strongly_recommend",
    p2="definitely_recommend happily_recommend recommend",
    p1="probably_recommend cautiously_recommend",
    n1="hesitate_to_recommend",
    n2="not_recommend",
    n3="never_recommend",
)

# Sentence openers whose own sentiment agrees with the sentence that follows.
OPENERS = graded(
    p2="Thankfully, Luckily, Happily, Fortunately,",
    n2="Sadly, Unfortunately, Disappointingly,",
)

NUMBER_WORDS = ("one", "two", "three", "four", "five")

# Narrative fillers shared by all domains.
SHARED_FILLS: dict[str, tuple[str, ...]] = {
    "who": phrases(
        "wife, husband, partner, sister, brother, mother, father, friends, kids, parents, "
        "colleagues, girlfriend, boyfriend, flatmate"
    ),
    "when": phrases(
        "last week, last weekend, last month, on Friday night, on Sunday, over the holidays, "
        "in the spring, in the summer, last autumn, in January, a few days ago, yesterday"
    ),
}


@dataclass(frozen=True)
class AspectGroup:
    """Aspects of an item that share their evaluative adjectives.

    Attributes:
        nouns: The aspect nouns ("plot", "ending").
        adjectives: Graded adjectives that fit these nouns.
        participles: Past participles for manner phrases ("written" -> "cleverly written").
    """

    nouns: tuple[Noun, ...]
    adjectives: tuple[Word, ...]
    participles: tuple[str, ...]


@dataclass(frozen=True)
class Domain:
    """A kind of thing being reviewed.

    Attributes:
        name: Domain label stored with each review ("films").
        items: What is reviewed ("film", "movie").
        overall: Graded adjectives for the item as a whole ("gripping").
        participles: Past participles for the whole item ("made", "directed").
        aspects: Aspect groups.
        again: Base-form phrase for doing it again ("watch it again").
        span: Phrases for the whole experience ("from start to finish").
        fills: Neutral fillers for the domain's narrative patterns, by slot name.
        present_tense: Probability that a review is written in the present tense.
    """

    name: str
    items: tuple[Noun, ...]
    overall: tuple[Word, ...]
    participles: tuple[str, ...]
    aspects: tuple[AspectGroup, ...]
    again: tuple[str, ...]
    span: tuple[str, ...]
    fills: dict[str, tuple[str, ...]] = field(default_factory=dict)
    present_tense: float = 0.3


FILMS = Domain(
    name="films",
    items=nouns("film movie thriller comedy drama documentary sequel western musical"),
    overall=graded(
        p3="gripping thrilling captivating heartwarming breathtaking hilarious",
        p2="entertaining engaging moving funny compelling powerful thoughtful fun exciting "
        "amusing inspiring heartfelt",
        p1="watchable harmless",
        n1="predictable slow forgettable repetitive",
        n2="tedious pointless pretentious confusing lame silly stupid dumb exhausting",
        n3="unwatchable painful insufferable dismal",
    ),
    participles=phrases("made, directed, shot, acted"),
    aspects=(
        AspectGroup(
            nouns=nouns("plot story script screenplay ending dialogue pacing twist premise"),
            adjectives=graded(
                p3="gripping brilliant ingenious",
                p2="clever engaging compelling original witty intelligent fascinating smart",
                p1="coherent",
                n1="predictable thin familiar repetitive",
                n2="confusing silly tedious clumsy muddled stupid flawed dumb",
                n3="ridiculous incoherent nonsensical",
            ),
            participles=phrases("handled, done"),
        ),
        AspectGroup(
            nouns=nouns("acting cast villain lead heroine", "performances characters actors"),
            adjectives=graded(
                p3="brilliant superb captivating",
                p2="convincing charming talented natural likeable believable sincere playful",
                p1="competent",
                n1="stiff bland",
                n2="wooden unconvincing awkward lifeless annoying irritating",
                n3="cringeworthy laughable idiotic",
            ),
            participles=phrases("played, handled"),
        ),
        AspectGroup(
            nouns=nouns("cinematography soundtrack score editing photography", "visuals effects"),
            adjectives=graded(
                p3="stunning gorgeous breathtaking spectacular",
                p2="beautiful striking lovely atmospheric bold sophisticated",
                p1="competent",
                n1="generic dated",
                n2="ugly cheap messy grating distracting chaotic",
                n3="hideous horrid",
            ),
            participles=phrases("done, handled, put together"),
        ),
    ),
    again=phrases("watch it again, see it again"),
    span=phrases("from start to finish, from the first scene to the last, all the way through"),
    fills={
        "venue": phrases(
            "the cinema, a film festival, home, a late screening, an open-air screening"
        ),
        "genre": phrases(
            "thriller, comedy, drama, war film, romance, horror film, documentary, "
            "animated film, science fiction film, period drama"
        ),
        "topic": phrases(
            "two brothers, a small town, a retired detective, a lost dog, a family reunion, "
            "a chess player, a boxer, a space mission, a rock band on tour, "
            "a teacher and her students"
        ),
        "length": phrases("just under two hours, about ninety minutes, nearly three hours"),
    },
)

RESTAURANTS = Domain(
    name="restaurants",
    items=nouns("restaurant place cafe bistro diner pizzeria brasserie tavern"),
    overall=graded(
        p3="wonderful delightful charming",
        p2="lovely cozy welcoming friendly cute",
        p1="decent",
        n1="ordinary",
        n2="disappointing overpriced noisy dirty",
        n3="filthy disgusting",
    ),
    participles=phrases("run, managed, decorated"),
    aspects=(
        AspectGroup(
            nouns=nouns(
                "food pasta risotto steak curry soup burger pizza dessert bread salad fish "
                "lamb cheesecake",
                "fries noodles dumplings starters",
            ),
            adjectives=graded(
                p3="delicious scrumptious divine heavenly",
                p2="tasty fresh flavorful tender rich yummy",
                p1="edible",
                n1="bland salty dry",
                n2="stale greasy soggy overcooked cold tasteless bitter",
                n3="inedible disgusting revolting rotten nasty",
            ),
            participles=phrases("cooked, seasoned, prepared, presented"),
        ),
        AspectGroup(
            nouns=nouns("service staff waiter waitress manager host chef", "waiters"),
            adjectives=graded(
                p3="wonderful gracious",
                p2="friendly attentive helpful polite cheerful courteous warm sweet",
                p1="efficient",
                n1="slow distracted",
                n2="rude unfriendly dismissive careless impatient arrogant lazy disorganized",
                n3="hostile incompetent",
            ),
            participles=phrases("trained, organized, managed"),
        ),
        AspectGroup(
            nouns=nouns("atmosphere decor music terrace interior", "surroundings"),
            adjectives=graded(
                p3="charming romantic magical",
                p2="cozy relaxed lively elegant pleasant calm",
                p1="casual",
                n1="drab",
                n2="noisy cramped gloomy dirty depressing chaotic",
                n3="grim miserable",
            ),
            participles=phrases("done, put together"),
        ),
        AspectGroup(
            nouns=nouns("menu wine_list"),
            adjectives=graded(
                p3="superb inspired",
                p2="interesting varied inventive tempting",
                p1="sensible",
                n1="limited predictable",
                n2="boring confusing dull",
                n3="dire",
            ),
            participles=phrases("chosen, planned, put together"),
        ),
        AspectGroup(
            nouns=nouns("bill", "prices"),
            adjectives=graded(
                p3="unbeatable",
                p2="fair reasonable",
                p1="acceptable",
                n1="high",
                n2="steep overpriced",
                n3="outrageous",
            ),
            participles=phrases("priced, calculated"),
        ),
        AspectGroup(
            nouns=nouns("", "portions"),
            adjectives=graded(
                p3="enormous",
                p2="generous hearty",
                p1="sensible",
                n1="small",
                n2="stingy tiny meagre",
                n3="laughable",
            ),
            participles=phrases("sized, judged"),
        ),
    ),
    again=phrases("go back, eat there again"),
    span=phrases("from start to finish, from the starters to the dessert"),
    fills={
        "occasion": phrases(
            "lunch, a birthday dinner, our anniversary, a quick bite, brunch, a work dinner, "
            "a late supper"
        ),
        "dish": phrases(
            "pasta, risotto, steak, curry, fish soup, burger, ramen, lasagne, roast chicken, "
            "vegetable tart, seafood platter, tasting menu"
        ),
        "number": NUMBER_WORDS[1:],
        "landmark": phrases(
            "the station, the old harbour, the market, the cathedral, the university"
        ),
    },
    present_tense=0.2,
)

BOOKS = Domain(
    name="books",
    items=nouns("book novel memoir biography thriller collection debut"),
    overall=graded(
        p3="gripping captivating unforgettable",
        p2="engaging moving thoughtful funny absorbing enjoyable fascinating inspiring "
        "heartfelt amusing",
        p1="readable",
        n1="forgettable uneven repetitive",
        n2="tedious shallow pretentious dull plodding flawed exhausting",
        n3="unreadable painful",
    ),
    participles=phrases("written, translated, researched, edited"),
    aspects=(
        AspectGroup(
            nouns=nouns("writing prose style dialogue translation voice"),
            adjectives=graded(
                p3="beautiful lyrical exquisite",
                p2="elegant vivid witty clear graceful",
                p1="competent",
                n1="pedestrian flat",
                n2="clumsy clunky overwritten stilted dry",
                n3="unbearable",
            ),
            participles=phrases("written, translated, crafted"),
        ),
        AspectGroup(
            nouns=nouns("plot story ending pacing structure twist"),
            adjectives=graded(
                p3="gripping brilliant",
                p2="clever compelling engaging surprising satisfying fascinating",
                p1="solid",
                n1="predictable thin repetitive",
                n2="tedious confusing rushed contrived flawed",
                n3="ridiculous",
            ),
            participles=phrases("handled, done, constructed"),
        ),
        AspectGroup(
            nouns=nouns("narrator protagonist heroine hero", "characters"),
            adjectives=graded(
                p3="unforgettable wonderful",
                p2="likeable believable complex memorable sympathetic sincere honest",
                p1="plausible",
                n1="thin",
                n2="flat annoying unlikeable shallow irritating dumb",
                n3="insufferable",
            ),
            participles=phrases("drawn, developed, written"),
        ),
    ),
    again=phrases("read it again, read more by this author"),
    span=phrases("from the first page to the last, from cover to cover, all the way through"),
    fills={
        "genre": phrases(
            "novel, memoir, crime novel, fantasy novel, biography, short story collection, "
            "historical novel, travel book, family saga"
        ),
        "topic": phrases(
            "a fishing village, two sisters, a missing painting, a wartime romance, "
            "a young doctor, a family farm, an expedition to the Arctic, a small bookshop"
        ),
        "where": phrases(
            "on holiday, over a long weekend, in two sittings, on the train to work, "
            "in bed over a week, on a long flight"
        ),
        "found": phrases("an airport bookshop, the library, a charity shop, a second-hand stall"),
        "pages": phrases("three hundred, four hundred, two hundred, six hundred"),
    },
    present_tense=0.5,
)

HOTELS = Domain(
    name="hotels",
    items=nouns("hotel resort inn guesthouse hostel lodge"),
    overall=graded(
        p3="wonderful luxurious perfect",
        p2="comfortable charming clean peaceful welcoming",
        p1="decent",
        n1="tired dated",
        n2="dirty noisy shabby overpriced depressing",
        n3="filthy horrible",
    ),
    participles=phrases("run, kept, maintained, managed"),
    aspects=(
        AspectGroup(
            nouns=nouns("room bed bathroom shower suite", "pillows sheets towels"),
            adjectives=graded(
                p3="spotless gorgeous stunning",
                p2="clean comfortable spacious bright cozy quiet",
                p1="basic",
                n1="small dated",
                n2="dirty cramped noisy smelly damp uncomfortable grimy stinky",
                n3="filthy disgusting",
            ),
            participles=phrases("kept, cleaned, looked after"),
        ),
        AspectGroup(
            nouns=nouns("view balcony", "surroundings"),
            adjectives=graded(
                p3="breathtaking stunning gorgeous",
                p2="lovely beautiful pleasant peaceful",
                p1="nice",
                n1="ordinary",
                n2="disappointing ugly bleak",
                n3="depressing",
            ),
            participles=phrases("framed, kept"),
        ),
        AspectGroup(
            nouns=nouns("staff reception concierge housekeeping manager"),
            adjectives=graded(
                p3="wonderful outstanding",
                p2="friendly helpful welcoming polite professional kind sweet",
                p1="efficient",
                n1="indifferent",
                n2="rude unhelpful unfriendly slow careless arrogant lazy disorganized",
                n3="hostile incompetent",
            ),
            participles=phrases("trained, managed"),
        ),
        AspectGroup(
            nouns=nouns("location breakfast pool spa gym garden wifi parking"),
            adjectives=graded(
                p3="perfect superb",
                p2="convenient lovely relaxing peaceful generous",
                p1="adequate",
                n1="limited",
                n2="inconvenient disappointing crowded noisy unreliable",
                n3="awful",
            ),
            participles=phrases("kept, maintained, looked after"),
        ),
    ),
    again=phrases("stay there again, go back"),
    span=phrases("from check-in to check-out, from start to finish"),
    fills={
        "nights": NUMBER_WORDS[1:] + phrases("six, seven"),
        "room": phrases("double room, suite, family room, twin room, sea view room"),
        "distance": phrases("a short walk, ten minutes by car, two blocks, a long bus ride"),
        "landmark": phrases(
            "the beach, the old town, the airport, the train station, the conference centre"
        ),
        "purpose": phrases("a wedding, a work trip, a city break, a family holiday, a conference"),
    },
    present_tense=0.15,
)

GADGETS = Domain(
    name="gadgets",
    items=nouns("phone laptop tablet speaker camera smartwatch headset router keyboard kettle"),
    overall=graded(
        p3="excellent brilliant superb",
        p2="reliable handy useful solid sleek easy neat cool effective",
        p1="decent",
        n1="fiddly",
        n2="flimsy faulty buggy unreliable slow",
        n3="useless defective broken",
    ),
    participles=phrases("made, designed, built, engineered"),
    aspects=(
        AspectGroup(
            nouns=nouns("battery battery_life charging"),
            adjectives=graded(
                p3="outstanding superb",
                p2="impressive reliable good strong",
                p1="adequate",
                n1="short",
                n2="weak poor disappointing unreliable",
                n3="pathetic useless dismal",
            ),
            participles=phrases("designed, engineered, optimized"),
        ),
        AspectGroup(
            nouns=nouns("screen display sound camera microphone", "speakers"),
            adjectives=graded(
                p3="stunning gorgeous brilliant",
                p2="bright sharp clear rich crisp",
                p1="acceptable",
                n1="dim",
                n2="tinny muffled blurry grainy poor",
                n3="awful",
            ),
            participles=phrases("tuned, calibrated, designed"),
        ),
        AspectGroup(
            nouns=nouns("design build_quality case hinge finish", "buttons"),
            adjectives=graded(
                p3="beautiful elegant",
                p2="sturdy solid sleek stylish premium",
                p1="tidy",
                n1="plasticky",
                n2="flimsy cheap ugly fragile clunky",
                n3="broken",
            ),
            participles=phrases("built, made, designed, finished"),
        ),
        AspectGroup(
            nouns=nouns("software app setup interface performance support manual", "updates"),
            adjectives=graded(
                p3="flawless excellent",
                p2="fast smooth intuitive responsive easy helpful",
                p1="functional",
                n1="sluggish",
                n2="buggy laggy confusing unstable unhelpful slow difficult",
                n3="useless woeful",
            ),
            participles=phrases("designed, thought out"),
        ),
    ),
    again=phrases("buy it again, buy another one"),
    span=phrases("from the moment I unboxed it, from day one"),
    fills={
        "duration": phrases("three weeks, a month, two months, half a year, a year, ten days"),
        "use": phrases(
            "work, gaming, video calls, music, travel, watching films, the kitchen, running"
        ),
        "price": phrases("fifty pounds, two hundred dollars, ninety euros, three hundred dollars"),
        "arrival": phrases("two days after ordering, in a plain box, a week late, on time"),
    },
    present_tense=0.6,
)

DOMAINS: tuple[Domain, ...] = (FILMS, RESTAURANTS, BOOKS, HOTELS, GADGETS)


def all_words() -> tuple[Word, ...]:
    """Every lexicon entry, general and per domain (a word may appear several times)."""
    entries: list[Word] = [
        *ADJECTIVES,
        *POSITIVE_EXTREMES,
        *NEGATIVE_EXTREMES,
        *BOOSTERS,
        *POSITIVE_DOWNTONERS,
        *NEGATIVE_DOWNTONERS,
        *NEGATION_SOFTENERS,
        *MANNER_ADVERBS,
        *VERBS,
        *FEELINGS,
        *SENTIMENT_NOUNS,
        *NOUN_MODIFIERS_POSITIVE,
        *NOUN_MODIFIERS_NEGATIVE,
        *RECOMMENDATIONS,
        *OPENERS,
    ]
    for fill in SHARED_FILLS.values():
        entries.extend(neutral_phrase(text) for text in fill)
    for domain in DOMAINS:
        entries.extend(Word(n.text, NEUTRAL, 0) for n in domain.items)
        entries.extend(domain.overall)
        entries.extend(neutral_phrase(p) for p in domain.participles + domain.again + domain.span)
        for group in domain.aspects:
            entries.extend(Word(n.text, NEUTRAL, 0) for n in group.nouns)
            entries.extend(group.adjectives)
            entries.extend(neutral_phrase(p) for p in group.participles)
        for fill in domain.fills.values():
            entries.extend(neutral_phrase(text) for text in fill)
    return tuple(entries)


def neutral_phrase(text: str) -> Word:
    """A neutral entry for a filler phrase."""
    return Word(text, NEUTRAL, 0)


def vocabulary() -> frozenset[str]:
    """Distinct lower-cased words of the lexicon (phrases split on spaces)."""
    return frozenset(
        token.strip(",.").lower() for entry in all_words() for token in entry.text.split()
    )


def polar_vocabulary() -> dict[str, int]:
    """Distinct single words with an opinion, mapped to their polarity.

    A word listed with both polarities in different places (none should be) maps to
    the polarity it was given last.
    """
    return {
        entry.text.strip(",.").lower(): entry.polarity
        for entry in all_words()
        if entry.polarity != NEUTRAL and " " not in entry.text
    }
