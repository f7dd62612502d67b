"""The console of a run: each Python warning shown once per run, by the process of rank 0."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from rlkl_lightning.console import warnings_on_rank_zero_only


@pytest.mark.parametrize(("rank", "shown"), [(0, 1), (1, 0), (3, 0)])
def test_a_warning_is_shown_by_rank_zero_only(rank, shown, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    printed = []
    with warnings.catch_warnings():  # puts warnings.showwarning back afterwards
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: printed.append(str(message))
        warnings_on_rank_zero_only()
        warnings_on_rank_zero_only()  # installed once: a second call wraps nothing
        warnings.warn("the same on every rank", FutureWarning, stacklevel=1)
    assert printed == ["the same on every rank"] * shown
