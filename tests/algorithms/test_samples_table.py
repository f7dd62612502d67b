"""The samples table: which batches it shows, and at which step it is logged.

A table lines up with its batch's scalars in TensorBoard: it is logged at the step Lightning
gives them (a skipped batch counts), and what it shows is that batch's (its scores average to
the batch's ``objective/score``, its largest per-token KL is the batch's ``kl_tokens/max_kl``).
With a reference refresh every ``L`` batches and a table every ``L``, the table is of the last
batch before each refresh, not of the first after it (whose KL is ~0).
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.tiny_ppo import fit, good_fraction, module_args
from lightning.pytorch.loggers import Logger

from rlkl_lightning import PPOModule, ReferenceRefresh
from rlkl_lightning import metric_keys as keys
from rlkl_lightning.rewards import FunctionReward

BATCH = 4


class TableLogger(Logger):
    """Records the scalars and the text tables by step, as TensorBoard would show them."""

    def __init__(self):
        super().__init__()
        self.scalars: dict[int, dict[str, float]] = {}
        self.tables: dict[int, str] = {}

    name, version = "tables", 0

    @property
    def experiment(self):
        return self

    def add_text(self, tag, text, global_step):
        assert tag == "samples" and global_step not in self.tables
        self.tables[global_step] = text

    def log_metrics(self, metrics, step):
        self.scalars.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def table_columns(table: str) -> tuple[list[float], list[float]]:
    """The scores of a table's rows, and every per-token KL its last column names."""
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    scores = [float(row[2]) for row in rows]
    kls = [float(x) for row in rows for x in re.findall(r"' (\S+?)(?:,|$| \|)", row[-1])]
    return scores, kls


def test_the_table_is_logged_at_its_batchs_step_and_not_right_after_a_refresh(tiny_lm_dir):
    calls = []

    def reward(prompt: str, response: str) -> float:  # the 6th batch's scores are NaN
        calls.append(prompt)
        return float("nan") if 5 * BATCH < len(calls) <= 6 * BATCH else good_fraction("", response)

    torch.manual_seed(0)
    model = PPOModule(
        **module_args(
            tiny_lm_dir,
            reward=FunctionReward(reward),
            penalty={"init_coef": 0.1},
            logging={"log_samples_every": 2, "num_logged_samples": BATCH, "kl_token_threshold": 1},
        )
    )
    logger = TableLogger()
    with pytest.warns(RuntimeWarning, match="skipping batch 6"):
        fit(
            model, batches=8, batch_size=BATCH, callbacks=[ReferenceRefresh(every=2)], logger=logger
        )
    assert model.batches_seen == 7 and model.skipped_batches == 1  # the 6th batch is skipped
    # Trained batches 1, 2, 4 and 6: the 6th trained batch is the 7th batch, step 6 (the skip
    # counts). The refreshes come after trained batches 2, 4 and 6: no table is right after one.
    assert sorted(logger.tables) == [0, 1, 3, 6]
    for step, table in logger.tables.items():
        scalars = logger.scalars[step]
        scores, kls = table_columns(table)
        assert len(scores) == BATCH
        assert sum(scores) / BATCH == pytest.approx(scalars[keys.SCORE], abs=1e-3), step
        assert max(kls) == pytest.approx(scalars[keys.TOKENS_MAX_KL], rel=1e-2), step
        if step:  # trained since the last refresh; right after a hard one it is ~1e-7
            assert scalars[keys.TOKENS_MAX_KL] > 1e-3, step
