"""Two torchrun launches on the loopback address train, then resume with ``--ckpt_path last``.

As docs/scaling-out.md's commands run on two machines (``helpers.torchrun``): both launches
end with status 0, the checkpoint holds the steps of the run and then of the resumed one, and
no rank prints a Python warning (torch's FutureWarnings for the collectives among them).
The vLLM engine's run: ``tests/vllm/test_torchrun.py``.
"""

from __future__ import annotations

import pytest
from helpers.torchrun import train_and_resume

pytestmark = pytest.mark.dist  # several processes: make test-dist

#: One launch: 2 processes start, load the default world and train (about 30 s here).
TIMEOUT_S = 300


def test_two_torchrun_nodes_on_loopback_train_and_resume_without_warnings(tmp_path):
    launches = train_and_resume(tmp_path, "grpo_adaptive.yaml", "grpo_adaptive", TIMEOUT_S)
    for texts in launches:
        for node, text in enumerate(texts):
            assert "Warning" not in text, f"node {node}:\n{text[-4000:]}"
