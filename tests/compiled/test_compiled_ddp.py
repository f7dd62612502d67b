"""``optimization.compile`` under DDP: two processes equal one on the global batches.

The assertions of the DDP test of :mod:`system.test_ddp_ppo`
(:func:`helpers.ddp_runs.assert_two_processes_equal_one`: both ranks bit for bit, the 1-process
run to float32 rounding, the skipped batch, the checkpoint), with the update compiled in every
process: each rank compiles its own graph, and DDP's gradient hooks still fire in the compiled
backward pass. Packed as well, as the option packs outside the graph.
"""

from __future__ import annotations

import pytest
from helpers.ddp_runs import assert_two_processes_equal_one

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    "optimization",
    ["{compile: true}", "{compile: true, packing: packed}"],
    ids=["padded", "packed"],
)
def test_compiled_update_under_ddp_equals_one_process(
    tmp_path, tiny_lm_dir, optimization, monkeypatch
):
    # The ranks (subprocesses) and the 1-process run (here) keep their graphs in this test's
    # own inductor cache: its FX graphs show that the option compiled the pass.
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    assert_two_processes_equal_one(tmp_path, tiny_lm_dir, optimization)
    graphs = [f for f in (cache / "fxgraph").rglob("*") if f.is_file()]
    assert len(graphs) >= 2  # a forward and a backward graph at least
