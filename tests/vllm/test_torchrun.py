"""Two torchrun launches on the loopback address train ``configs/grpo_vllm.yaml`` and resume.

One vLLM engine per rank through ``external_launcher`` with the rank variables torchrun set
(``helpers.torchrun``): both launches end with status 0, the resumed run continues from the
checkpoint, and no rank prints a Python ``FutureWarning`` or ``UserWarning`` (vLLM's own
log lines stay: docs/scaling-out.md).
"""

from __future__ import annotations

import pytest
from helpers.torchrun import train_and_resume

pytestmark = pytest.mark.dist  # two training processes

#: One launch: 2 processes start, build their engines and train (about 75 s here).
TIMEOUT_S = 400


def test_two_torchrun_nodes_on_loopback_train_grpo_vllm_and_resume(tmp_path):
    launches = train_and_resume(tmp_path, "grpo_vllm.yaml", "grpo_vllm", TIMEOUT_S)
    for texts in launches:
        for node, text in enumerate(texts):
            for warning in ("FutureWarning", "UserWarning", "DeprecationWarning"):
                assert warning not in text, f"node {node}:\n{text[-4000:]}"
