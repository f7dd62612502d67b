"""Property-based tests: KL estimators, reductions, reward shaping, GAE and whitening.

Finite inputs give finite outputs, padded positions never matter (whatever they hold, nan and
inf included) and are 0 in every output, and the results keep their defining identities. The
controller laws have their own properties in ``kl/test_controllers.py`` (beta finite, > 0 and
inside its bounds for any KL, finite or not); here invalid law parameters are fuzzed, and the
text loader is fed arbitrary bytes.

Input ranges: log-probabilities in [-80, 0] for float32, so that ``exp(-l)`` in ``k3`` is
representable (a sampled token with probability below e^-80 does not occur); logits,
rewards, values and scores up to 1e4 in magnitude.
"""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlkl_lightning.algorithms.advantages import gae, shape_rewards
from rlkl_lightning.kl.controllers import (
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
    LogPIDKLController,
    PIKLController,
)
from rlkl_lightning.kl.estimators import exact_kl, per_token_kl, sequence_kl, token_mean_kl
from rlkl_lightning.masked import masked_whiten
from rlkl_lightning.texts import load_texts

FUZZ = settings(max_examples=100, deadline=None)
GARBAGE = [math.nan, math.inf, -math.inf, 1e30, -7.0]


@st.composite
def padded(draw, low=-1e4, high=1e4, min_rows=1, max_rows=4, max_len=6, min_valid=0):
    """A ``[B, T]`` float32 tensor, a right-padding mask of prefix lengths, and garbage for
    the padded positions."""
    rows = draw(st.integers(min_rows, max_rows))
    length = draw(st.integers(1, max_len))
    lengths = draw(st.lists(st.integers(min_valid, length), min_size=rows, max_size=rows))
    values = draw(
        st.lists(
            st.floats(low, high, allow_nan=False, width=32),
            min_size=rows * length,
            max_size=rows * length,
        )
    )
    x = torch.tensor(values, dtype=torch.float32).reshape(rows, length)
    mask = torch.arange(length).expand(rows, length) < torch.tensor(lengths).unsqueeze(1)
    garbage = draw(st.sampled_from(GARBAGE))
    return x, mask, garbage


def with_garbage(x: torch.Tensor, mask: torch.Tensor, garbage: float) -> torch.Tensor:
    return x.masked_fill(~mask, garbage)


# ---- KL estimators and reductions ------------------------------------------------------------


@FUZZ
@given(
    data=padded(low=-80.0, high=0.0),
    ref=st.lists(st.floats(-80.0, 0.0, width=32), min_size=24, max_size=24),
    estimator=st.sampled_from(["k1", "k2", "k3"]),
)
def test_sample_estimators_are_finite_and_respect_the_mask(data, ref, estimator):
    logprobs, mask, garbage = data
    ref_logprobs = torch.tensor(ref[: logprobs.numel()]).reshape(logprobs.shape)
    kl = per_token_kl(logprobs, ref_logprobs, estimator)
    assert kl.shape == logprobs.shape and kl.dtype == torch.float32
    assert torch.isfinite(kl).all()
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        assert torch.equal(kl, log_ratio)
    else:
        assert (kl >= 0).all()  # k2 = l^2/2 and k3 = e^-l - 1 + l are never negative
    per_seq = sequence_kl(kl, mask)
    assert torch.isfinite(per_seq).all()
    # Padding never counts, whatever it holds.
    dirty = with_garbage(kl, mask, garbage)
    assert torch.equal(sequence_kl(dirty, mask), per_seq)
    expected = [float(kl[i][mask[i]].double().sum()) for i in range(kl.shape[0])]
    assert per_seq.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-4)
    if mask.any():
        mean = token_mean_kl(dirty, mask)
        assert torch.isfinite(mean)
        assert float(mean) == pytest.approx(float(kl[mask].double().mean()), rel=1e-5, abs=1e-4)


@FUZZ
@given(
    logits=st.lists(st.floats(-1e4, 1e4, width=32), min_size=12, max_size=12),
    ref_logits=st.lists(st.floats(-1e4, 1e4, width=32), min_size=12, max_size=12),
    vocab=st.sampled_from([2, 3, 4, 6]),
)
def test_exact_kl_is_finite_and_non_negative(logits, ref_logits, vocab):
    p = torch.tensor(logits).reshape(-1, vocab)
    q = torch.tensor(ref_logits).reshape(-1, vocab)
    kl = exact_kl(p, q)
    assert kl.shape == (12 // vocab,)
    assert torch.isfinite(kl).all() and (kl >= 0).all()
    assert torch.equal(exact_kl(p, p), torch.zeros_like(kl))


# ---- reward shaping and GAE --------------------------------------------------------------------


@FUZZ
@given(
    data=padded(min_valid=1),
    kl_data=st.lists(st.floats(-1e3, 1e3, width=32), min_size=24, max_size=24),
    kl_coef=st.floats(0.0, 1e3),
)
def test_shape_rewards_sum_to_score_minus_penalty_and_respect_the_mask(data, kl_data, kl_coef):
    kl, mask, garbage = data
    scores = torch.tensor(kl_data[: kl.shape[0]], dtype=torch.float32)
    rewards = shape_rewards(scores, with_garbage(kl, mask, garbage), kl_coef, mask)
    assert torch.isfinite(rewards).all()
    assert (rewards[~mask] == 0).all()
    assert torch.equal(rewards, shape_rewards(scores, kl, kl_coef, mask))
    for i in range(kl.shape[0]):
        total = float(scores[i]) - kl_coef * float(kl[i][mask[i]].double().sum())
        scale = abs(float(scores[i])) + kl_coef * float(kl[i][mask[i]].abs().double().sum())
        assert float(rewards[i].double().sum()) == pytest.approx(total, abs=1e-5 * scale + 1e-6)


@FUZZ
@given(
    data=padded(),
    values=st.lists(st.floats(-1e4, 1e4, width=32), min_size=24, max_size=24),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    value_garbage=st.sampled_from(GARBAGE),
)
def test_gae_is_finite_bounded_and_ignores_padding(data, values, gamma, lam, value_garbage):
    rewards, mask, garbage = data
    v = torch.tensor(values[: rewards.numel()]).reshape(rewards.shape)
    advantages, returns = gae(rewards, v, mask, gamma, lam)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()
    dirty = gae(
        with_garbage(rewards, mask, garbage), with_garbage(v, mask, value_garbage), mask, gamma, lam
    )
    assert torch.equal(dirty[0], advantages) and torch.equal(dirty[1], returns)
    # |delta_t| <= max|r| + 2 max|V| and |A_t| <= sum of discounted |delta| <= T * that.
    if mask.any():
        bound = rewards.shape[1] * (rewards[mask].abs().max() + 2 * v[mask].abs().max())
        assert float(advantages.abs().max()) <= float(bound) * (1 + 1e-5) + 1e-3
        torch.testing.assert_close(
            returns[mask] - advantages[mask], v[mask], rtol=1e-5, atol=1e-3 + 1e-6 * float(bound)
        )


@FUZZ
@given(data=padded(min_rows=2, min_valid=1), shift_mean=st.booleans())  # >= 2 valid entries
def test_whitening_is_finite_and_ignores_padding(data, shift_mean):
    x, mask, garbage = data
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    assert torch.isfinite(out).all()
    assert (out[~mask] == 0).all()
    assert torch.equal(masked_whiten(with_garbage(x, mask, garbage), mask, shift_mean), out)
    n = int(mask.sum())
    if n >= 2:
        # |x_i - m| <= sqrt(n - 1) * std for the unbiased std of the same deviations.
        bound = math.sqrt(n - 1) * (1 + 1e-4) + 1e-4
        assert float(masked_whiten(x, mask).abs().max()) <= bound


# ---- controller parameters ----------------------------------------------------------------------

BAD = st.sampled_from([0.0, -1.0, -1e-9, math.nan, math.inf, -math.inf])
# Each law with valid arguments, and the options that must be finite and > 0.
LAWS = {
    FixedKLController: ({"kl_coef": 0.1}, ["kl_coef", "min_kl_coef", "max_kl_coef"]),
    AdaptiveKLController: (
        {"init_kl_coef": 0.1, "target": 6.0},
        ["init_kl_coef", "target", "horizon", "min_kl_coef"],
    ),
    ExponentialKLController: (
        {"init_kl_coef": 0.1, "target": 6.0},
        ["init_kl_coef", "target", "k", "max_kl_coef"],
    ),
    PIKLController: (
        {"init_kl_coef": 0.1, "target": 6.0},
        ["init_kl_coef", "target", "error_clip", "min_kl_coef"],
    ),
    LogPIDKLController: (
        {"init_kl_coef": 0.1, "target": 6.0},
        ["init_kl_coef", "target", "ki", "max_fall", "error_clip", "max_kl_coef"],
    ),
}
LAW_OPTIONS = [(cls, option) for cls, (_, options) in LAWS.items() for option in options]


@FUZZ
@given(law_option=st.sampled_from(LAW_OPTIONS), bad=BAD)
def test_invalid_controller_parameters_always_name_the_option(law_option, bad):
    cls, option = law_option
    assume(not (cls is FixedKLController and option == "kl_coef" and bad == 0.0))  # beta 0: valid
    kwargs = {**LAWS[cls][0], option: bad}
    with pytest.raises(ValueError, match=rf"{cls.__name__}: `{option}` must be a finite number"):
        cls(**kwargs)


# ---- the text loader -----------------------------------------------------------------------------

FILE_FUZZ = settings(max_examples=40, deadline=None)  # each example is a datasets load


def _lines(draw_text):
    return st.lists(draw_text, max_size=6).map(lambda lines: "\n".join(lines).encode())


UTF8 = st.characters(codec="utf-8")  # what a text file can hold (no lone surrogates)
CSV_CELL = st.text(alphabet=st.sampled_from('ab ,"\n\r\t;') | UTF8, max_size=8)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(UTF8, max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)
CONTENT = {
    ".txt": st.binary(max_size=200) | _lines(st.text(UTF8, max_size=20)),
    ".csv": st.binary(max_size=200)
    | _lines(st.lists(CSV_CELL, max_size=4).map(",".join)).map(lambda b: b"text,label\n" + b),
    ".jsonl": st.binary(max_size=200)
    | _lines(
        st.one_of(
            st.fixed_dictionaries({"text": JSON_VALUE}).map(json.dumps),
            JSON_VALUE.map(json.dumps),
            st.text(UTF8, max_size=10),
        )
    ),
}


@FILE_FUZZ
@given(data=st.data(), suffix=st.sampled_from(sorted(CONTENT)))
def test_text_loader_takes_any_bytes(data, suffix):
    """Any file gives non-empty, stripped texts without NUL, or an error naming option and file.

    Never a crash: a file holding ``null`` once took the process down inside pyarrow.
    """
    content = data.draw(CONTENT[suffix], label="content")
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dropped empty texts
        path = Path(tmp) / f"fuzz{suffix}"
        path.write_bytes(content)
        try:
            texts = load_texts(str(path), "text", max_chars=50)
        except ValueError as error:
            assert "`prompts`" in str(error) or "`prompt_column`" in str(error), error
            assert f"fuzz{suffix}" in str(error), error
            return
    assert texts and all(isinstance(t, str) for t in texts)
    assert all(t == t.strip() and 0 < len(t) <= 50 and "\x00" not in t for t in texts)
    assert all(t.encode("utf-8") for t in texts)  # valid Unicode: tokenizers take it
