"""Two torchrun launches on the loopback address train, resume, and continue as one launch did.

As docs/scaling-out.md's commands run on two machines (``helpers.torchrun``): both launches
end with status 0, the checkpoint holds the steps of the run and then of the resumed one, and
no rank prints a Python warning (torch's FutureWarnings for the collectives among them). A
third pair of launches trains the 3 batches uninterrupted: the resumed run logged the same
values, bit for bit (every scalar but ``perf/*``: timings, memory peaks), and ended with the
same weights.
The vLLM engine's run: ``tests/vllm/test_torchrun.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.torchrun import train_and_resume, train_whole

from rlkl_lightning.compare.events import read_scalars

pytestmark = pytest.mark.dist  # several processes: make test-dist

#: One launch: 2 processes start, load the default world and train (about 30 s here).
TIMEOUT_S = 300


def logged(run_dir):
    """Every scalar of the run's one TensorBoard directory but ``perf/*`` (timings, memory)."""
    scalars = read_scalars(run_dir / "version_0")
    return {tag: values for tag, values in scalars.items() if not tag.startswith("perf/")}


def test_two_torchrun_nodes_on_loopback_train_and_resume_as_one_launch(tmp_path):
    name = "grpo_adaptive"
    launches = train_and_resume(tmp_path / "cut", "grpo_adaptive.yaml", name, TIMEOUT_S)
    for texts in launches:
        for node, text in enumerate(texts):
            assert "Warning" not in text, f"node {node}:\n{text[-4000:]}"
    train_whole(tmp_path / "whole", "grpo_adaptive.yaml", TIMEOUT_S)
    runs = [tmp_path / run / "runs" / name for run in ("cut", "whole")]
    resumed, whole = (logged(run) for run in runs)
    assert resumed.keys() == whole.keys()
    assert (
        len(whole["objective/kl_coef"]) == 3 and len(set(whole["objective/kl_coef"].values())) == 3
    )
    for tag in whole:
        assert resumed[tag] == whole[tag], tag
    a, b = (
        torch.load(run / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
        for run in runs
    )
    assert a["rlkl_counters"] == b["rlkl_counters"]
    for key in b["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
