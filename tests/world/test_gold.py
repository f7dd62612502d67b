"""The default world's gold scorer: its grammar, its closed form, and its validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlkl_lightning.world import corpus
from rlkl_lightning.world.gold import GoldScorer, GoldSentimentReward, gold_score
from rlkl_lightning.world.gold_validation import (
    SCORERS,
    fresh_reviews,
    pearson,
    ranks,
    scores,
    spearman,
    subsets,
)

# ------------------------------------------------------------------ the grammar


def test_negation_flips_as_the_generator_writes_it():
    good, not_good = gold_score("The plot was good."), gold_score("The plot was not good.")
    bad, not_bad = gold_score("The plot was bad."), gold_score("The plot was not bad.")
    assert good > 0 > not_good and bad < 0 < not_bad
    # "not good" is a mild or clear complaint, "not bad" only mild praise: both weaker.
    assert bad < not_good and not_bad < good
    assert gold_score("The plot wasn't good.") == not_good  # the generator contracts
    assert gold_score("The plot was not particularly good.") == not_good  # a softener
    assert gold_score("I didn't like it.") == gold_score("I disliked it.")  # both clear, verbs
    assert GoldScorer(negation=False)("The plot was not good.") == good


def test_contrast_reads_the_clause_after_but_as_the_review_s_opinion():
    praise = gold_score("The plot was dull, but the acting was good.")
    complaint = gold_score("The acting was good, but the plot was dull.")
    assert praise > 0 > complaint
    assert praise == pytest.approx(-complaint, abs=1e-12)  # the generator is symmetric
    # A concession makes a 4-star review likelier than a 5-star one: weaker than plain praise.
    assert praise < gold_score("The acting was good.")
    # Even a strong concession (which the generator never writes) does not turn it around.
    assert gold_score("The acting was superb, but the plot was dull.") < 0
    # The other contrast shapes of the patterns, read the same way.
    for text in (
        "Although the plot was dull, the acting was good.",
        "Dull plot aside, the acting was good.",
        "Dull as the plot was, the acting was good.",
        "The plot was dull, yet the acting was good.",
    ):
        assert gold_score(text) == pytest.approx(praise, abs=1e-12), text
    no_contrast = GoldScorer(contrast=False)
    assert no_contrast("The plot was dull, but the acting was good.") == pytest.approx(
        no_contrast("The acting was good, but the plot was dull."), abs=1e-12
    )


def test_intensifiers_scale_as_the_generator_uses_them():
    mild, clear = gold_score("It was fairly good."), gold_score("It was good.")
    strong, boosted = gold_score("It was superb."), gold_score("It was really good.")
    assert 0 < mild < clear < boosted < strong  # a boosted clear word may still be clear
    assert gold_score("It was absolutely superb.") == pytest.approx(strong, abs=1e-12)  # strong
    assert gold_score("It was somewhat bad.") == pytest.approx(-mild, abs=1e-12)
    assert gold_score("It was a bit of a letdown.") == pytest.approx(-mild, abs=1e-12)
    assert gold_score("It was a nice little gem.") == pytest.approx(mild, abs=1e-12)
    assert gold_score("It was a nice little cafe.") > mild  # "nice" itself, clear or mild
    plain = GoldScorer(intensifiers=False)
    assert plain("It was fairly good.") == plain("It was really good.") == plain("It was good.")


def test_fixed_sentences_and_stars_count_as_the_patterns_mean_them():
    assert gold_score("Highly recommended.") > 0 > gold_score("Save your money.")
    assert gold_score("Not bad, not great.") == pytest.approx(0, abs=1e-12)  # 3 stars
    # "a small price to pay" belongs to a positive pattern: "small" is no complaint there.
    assert gold_score("It is a small price to pay for such a lovely hotel.") == gold_score(
        "It is a lovely hotel."
    )
    # A sentence naming the stars: posterior 0.95 on them + 0.01 on each rating.
    assert gold_score("Four stars.") == pytest.approx((0.95 * 4 + 0.05 * 3 - 3) / 2)
    assert gold_score("I give it one star.") == pytest.approx((0.95 * 1 + 0.05 * 3 - 3) / 2)
    # An opener is read with or without its comma (a policy may drop it).
    assert gold_score("sadly the plot") == gold_score("Sadly, the plot") < 0
    for text in ("", "We stayed for two nights.", "!!!", "the the the"):
        assert gold_score(text) == 0.0, text


def test_a_plain_sentence_matches_the_generator_s_probabilities_by_hand():
    """ "The plot was good.": an opinion sentence with one clear positive word."""
    likelihood = []
    for r in range(1, 6):
        if corpus._MAJOR[r] == 0:
            agree_pos = 0.5
        else:
            agree_pos = corpus._AGREE[r] if corpus._MAJOR[r] > 0 else 1 - corpus._AGREE[r]
        s2 = corpus._STRENGTH[r][1]
        # A bare clear word: p 0.85 at strength 2; the other polarity 0.05 of that anywhere.
        pos = agree_pos * s2 * 0.85
        neg = (1 - agree_pos) * sum(corpus._STRENGTH[r]) * 0.05 * 0.85
        likelihood.append((1 - corpus._CONTRAST[r]) * (pos + neg))
    share = 0.95 * np.array(likelihood) / sum(likelihood) + 0.01
    posterior = share / share.sum()
    assert GoldScorer().posterior("The plot was good.") == pytest.approx(posterior, rel=1e-12)
    expected = (posterior @ np.arange(1, 6) - 3) / 2
    assert gold_score("The plot was good.") == pytest.approx(expected, rel=1e-12)


def test_sentences_add_evidence_and_repetition_within_one_does_not():
    one, two = gold_score("Superb."), gold_score("Superb. Superb.")
    assert 0 < one < two < 1
    # One sentence states one opinion: repeating the word inside it adds little.
    assert gold_score("Superb superb superb superb.") < two


def test_the_reward_reads_the_review_the_policy_completed():
    reward = GoldSentimentReward()
    prompts = ["Although the plot was", "The food was"]
    responses = [" dull, the acting was good.", " not great."]
    out = reward(prompts, responses)
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert out.tolist() == pytest.approx([gold_score(p + r) for p, r in zip(prompts, responses)])
    # The prompt opened a contrast: read with it, the main clause is the praise.
    alone = GoldSentimentReward(text="response")(prompts, responses)
    assert out[0] > 0.25 and out[0] > alone[0] + 0.1
    with pytest.raises(ValueError, match=r"`text` must be one of \('response', 'prompt\+resp"):
        GoldSentimentReward(text="prompt")
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reward(prompts, responses[:1])
    with pytest.raises(ValueError, match=r"`smoothing` must be in \(0, 1\)"):
        GoldScorer(smoothing=0.0)


# ------------------------------------------------------------------ validation


def test_ranks_and_spearman_against_closed_forms():
    assert ranks(np.array([3.0, 1.0, 2.0, 2.0])).tolist() == [4.0, 1.0, 2.5, 2.5]
    x = np.array([0.1, 0.5, 0.2, 0.9, 0.3])
    assert spearman(x, np.exp(x)) == pytest.approx(1.0)  # any increasing map
    assert spearman(x, -(x**3)) == pytest.approx(-1.0)
    # rho = 1 - 6 sum d^2 / (n (n^2 - 1)) without ties: ranks of y are 2, 1, 3, 5, 4 vs 1..5.
    assert spearman([1, 2, 3, 4, 5], [2, 1, 3, 5, 4]) == pytest.approx(1 - 6 * 4 / (5 * 24))
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(np.corrcoef([1, 2, 3], [2, 4, 7])[0, 1])


@pytest.fixture(scope="module")
def heldout():
    """2,000 reviews of a generator seed the world does not use, every scorer's scores."""
    reviews = fresh_reviews(2000, seed=2)
    ratings = np.array([r.rating for r in reviews])
    return reviews, ratings, scores([r.text for r in reviews])


BOUND = 0.92  # gold's Pearson r with the rating here is 0.935


def test_gold_tracks_the_rating_far_better_than_vader(heldout):
    _, ratings, found = heldout
    gold, vader = pearson(found["gold"], ratings), pearson(found["vader"], ratings)
    assert gold > BOUND
    assert gold > vader + 0.15  # VADER: 0.754 on these reviews (0.73 on the world's test split)
    assert spearman(found["gold"], ratings) > BOUND


@pytest.mark.parametrize("ablation", [name for name in SCORERS if name != "gold"])
def test_the_bound_fails_without_each_rule_of_the_grammar(heldout, ablation):
    """Each rule switched off falls below the bound, and well below gold where it is used."""
    reviews, ratings, found = heldout
    assert pearson(found[ablation], ratings) < BOUND
    rule = ablation.rsplit(" ", 1)[1]
    used = subsets(reviews)[rule]
    assert used.sum() > 400
    full, without = (pearson(found[name][used], ratings[used]) for name in ("gold", ablation))
    assert full > 0.9 and without < full - 0.02, (full, without)
