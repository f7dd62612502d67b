"""A callback that records, on its own rank, what a rollout engine did in each batch.

Used by ``tests/vllm/test_ddp.py``, ``test_tensor_parallel.py`` and ``test_fsdp.py`` through
``train.py`` (``trainer.callbacks``): per batch the beta the batch used, the rows this rank
sampled and this rank's sampler/trainer gap (the mean absolute per-token difference of the
engine's and the trainer's log-probs, in nats), its own responses (the valid tokens of each
row), and what its vLLM engine was asked and answered (``requests``: the prompts' token ids, the
seeds and the tokens of every request, a tensor-parallel group's gathered rows included) and
vLLM's tensor-parallel size; at the end of the fit the policy's weights. ``stale_rank`` switches
that rank's weight pushes off after the first one (the engine keeps the initial weights: the
negative control); under FSDP that rank still gathers the weights with the others (a
collective), and drops them.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from rlkl_lightning.algorithms.engines.vllm import engine_weights
from rlkl_lightning.models.sharding import is_fsdp


class EngineRecorder(pl.Callback):
    """Write ``rank{r}.pt``: betas, rows, gaps per batch and the final policy weights."""

    def __init__(self, out_dir: str, stale_rank: int = -1) -> None:
        self.out_dir = Path(out_dir)
        self.stale_rank = stale_rank
        self.betas: list[float] = []
        self.rows: list[int] = []
        self.gaps: list[float] = []
        self.responses: list[list[list[int]]] = []
        self.requests: list[dict[str, list]] = []
        self.tensor_parallel = 0  # vLLM's tensor-parallel group size

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:  # noqa: D102
        engine = pl_module.rollout_engine
        sample, push = engine.sample, engine.push

        def recorded_generate(requests, params, **kwargs):
            outputs = generate(requests, params, **kwargs)
            self.requests.append(
                {
                    "prompts": [r["prompt_token_ids"] for r in requests],
                    "seeds": [p.seed for p in params],
                    "tokens": [list(out.outputs[0].token_ids) for out in outputs],
                }
            )
            return outputs

        generate = None

        def recorded_sample(module, prompt_ids, prompt_mask, keep_logits):
            nonlocal generate
            llm = engine.llm_engine.llm  # started at the module's on_fit_start, after this hook
            if generate is None:
                from vllm.distributed import parallel_state

                generate, llm.generate = llm.generate, recorded_generate
                self.tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
            traj, scores = sample(module, prompt_ids, prompt_mask, keep_logits)
            mask = traj.response_mask
            ids = traj.response_ids.cpu()
            self.responses.append(
                [r[m].tolist() for r, m in zip(ids, mask.cpu().bool(), strict=True)]
            )
            gap = (traj.logprobs - traj.sampler_logprobs).abs() * mask
            self.gaps.append(float(gap.sum() / mask.sum()))
            self.rows.append(len(prompt_ids))
            return traj, scores

        pushes = []

        def stale_push(module):
            if not pushes:  # the first push: the engine's dummy weights become the policy's
                push(module)
            elif is_fsdp(module.policy) and pushes[-1] != module.weights_version:
                collections.deque(engine_weights(module.policy), maxlen=0)  # gathered, dropped
            pushes.append(module.weights_version)

        engine.sample = recorded_sample
        if trainer.global_rank == self.stale_rank:
            engine.push = stale_push

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: D102
        self.betas.append(float(pl_module.kl_coef))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:  # noqa: D102
        weights = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
        record = {"betas": self.betas, "rows": self.rows, "gaps": self.gaps, "weights": weights}
        record.update(responses=self.responses, requests=self.requests)
        record["tensor_parallel"] = self.tensor_parallel
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(record, self.out_dir / f"rank{trainer.global_rank}.pt")
