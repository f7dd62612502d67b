"""A PPOModule that records what each batch did, with rollouts seeded by the sample.

Used by ``tests/system/test_ddp_ppo.py`` in-process and, through ``train.py``, in the processes a
DDP run starts (they import this file by its ``class_path``; the test puts ``tests/`` on
``PYTHONPATH``). Not collected by pytest (no ``test_`` prefix).

Two things differ from a plain ``PPOModule``, both only to make runs comparable:

* rollouts: each prompt's response is sampled alone, from a torch RNG seeded with a hash of
  (prompt tokens, batch number), then the rows are padded back into one ``Trajectory``. The
  response of a prompt is then the same whichever rank, batch composition or world size
  samples it; the real ``sample_and_score`` function does the sampling and keeps the policy's
  scores of each row, which are padded back together with the trajectory;
* in batch ``cut_batch`` (0-based) each response is cut to a length of 1 to
  ``max_new_tokens`` tokens drawn from the same hash, as if it had stopped at an EOS there, so
  the ranks hold different numbers of response tokens;
* the reward is the fraction of ``good`` words, ``nan`` for the prompt ``poison_prompt``
  (a numeric fault on one rank only).

Everything else (scoring, KL, GAE, whitening, updates, logging, callbacks) is PPOModule's own;
the rollout and shape phases are overridden only to seed and to record.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from rlkl_lightning import PPOModule
from rlkl_lightning.algorithms.advantages import gae, shape_rewards
from rlkl_lightning.algorithms.rollout import sample_and_score
from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.models.logprobs import TokenScores
from rlkl_lightning.rewards import FunctionReward
from rlkl_lightning.trajectory import Trajectory


class PoisonableReward:
    """Fraction of ``good`` words in the response; ``nan`` for one prompt."""

    def __init__(self, poison_prompt: str = "") -> None:
        self.poison_prompt = poison_prompt

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        scores = []
        for prompt, response in zip(prompts, responses, strict=True):
            words = response.split()
            good = sum(w == "good" for w in words) / max(len(words), 1)
            scores.append(math.nan if prompt == self.poison_prompt else good)
        return torch.tensor(scores)


class RecordingPPO(PPOModule):
    """PPOModule with per-sample seeded rollouts that writes a JSON record per rank."""

    def __init__(
        self,
        policy: str,
        record_dir: str,
        reference: str | None = None,
        poison_prompt: str = "",
        cut_batch: int = -1,
        penalty: dict | None = None,
        sampling: dict | None = None,
        optimization: dict | None = None,
        models: dict | None = None,
    ) -> None:
        """``kl``, ``sampling``, ``optimization``, ``models``: fields that change from the
        recorder's own (``penalty.init_coef=0.2``, 8 prompt and 6 response tokens, one step per
        batch at ``lr=3e-3``)."""
        super().__init__(
            policy=policy,
            reference=reference,
            reward=FunctionReward(PoisonableReward(poison_prompt), batched=True),
            penalty={"init_coef": 0.2, **(penalty or {})},
            sampling={
                "max_prompt_tokens": 8,
                "max_new_tokens": 6,
                "stop_at_eos": False,  # equal tokens per rank (but in cut_batch): see the test
                **(sampling or {}),
            },
            optimization={
                "ppo_epochs": 1,
                "num_minibatches": 1,
                "lr": 3e-3,
                **(optimization or {}),
            },
            logging={"log_samples_every": 0},
            models=models or {},
        )
        self.record_dir = record_dir
        self.cut_batch = cut_batch
        self.batches: list[dict] = []
        self.weights_before_cut: dict[str, torch.Tensor] = {}

    # ---- per-sample random streams
    def rollout(self, prompts: list[str]) -> tuple[Trajectory, TokenScores]:
        hp = self.sampling
        prompt_ids, prompt_mask = self._encode_prompts(prompts)
        pad = self.tokenizer.pad_token_id
        kwargs = dict(
            max_new_tokens=hp.max_new_tokens,
            temperature=hp.temperature,
            top_k=hp.top_k,
            top_p=hp.top_p,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=pad,
            stop_at_eos=hp.stop_at_eos,
        )
        rows = []
        for ids, mask in zip(prompt_ids, prompt_mask, strict=True):
            prompt = ids[mask.bool()].unsqueeze(0)
            key = f"{prompt.tolist()}|{self.batches_seen}".encode()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(key))
                row, scores = sample_and_score(
                    self.policy, prompt, torch.ones_like(prompt), **kwargs
                )
            if len(self.batches) - 1 == self.cut_batch:
                keep = 1 + zlib.crc32(key) % row.response_ids.shape[1]
                end = prompt.shape[1] + keep
                row = Trajectory(
                    row.input_ids[:, :end],
                    row.attention_mask[:, :end],
                    row.response_ids[:, :keep],
                    row.response_mask[:, :keep],
                )
                scores = TokenScores(*(t[:, :keep] for t in scores))
            rows.append((row, scores))
        self.batches[-1]["responses"] = [r.response_ids[0].tolist() for r, _ in rows]
        width = max(r.input_ids.shape[1] - r.response_ids.shape[1] for r, _ in rows)
        length = max(r.response_ids.shape[1] for r, _ in rows)

        def pad_to(t: torch.Tensor, left: int, right: int, value: int | float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (left, right), value=value)

        parts: dict[str, list[torch.Tensor]] = {"ids": [], "am": [], "resp": [], "rmask": []}
        padded_scores = []
        for r, scores in rows:
            n_prompt = r.input_ids.shape[1] - r.response_ids.shape[1]
            extra = length - r.response_ids.shape[1]
            resp = pad_to(r.response_ids, 0, extra, pad)
            parts["resp"].append(resp)
            parts["rmask"].append(pad_to(r.response_mask, 0, extra, 0.0))
            prompt = pad_to(r.input_ids[:, :n_prompt], width - n_prompt, 0, pad)
            parts["ids"].append(torch.cat([prompt, resp], 1))
            parts["am"].append(pad_to(r.attention_mask, width - n_prompt, extra, 0))
            # Scores at padded response positions are masked out everywhere: zeros.
            padded_scores.append(
                TokenScores(
                    pad_to(scores.logits.transpose(1, 2), 0, extra, 0.0).transpose(1, 2),
                    pad_to(scores.logprobs, 0, extra, 0.0),
                    pad_to(scores.hidden.transpose(1, 2), 0, extra, 0.0).transpose(1, 2),
                )
            )
        scores = TokenScores(*(torch.cat(ts) for ts in zip(*padded_scores, strict=True)))
        ids = (torch.cat(parts[k]) for k in ("ids", "am", "resp", "rmask"))
        return Trajectory(*ids, scores.logprobs), scores

    # ---- recording wrappers around the module's own functions
    def shape(self, traj: Trajectory) -> Trajectory:
        """PPOModule's shaping; records its inputs and the advantages before and after whitening."""
        row, mask = self.batches[-1], traj.response_mask
        valid = mask.bool()
        row["kl_seq"] = torch.where(valid, traj.kl, 0.0).sum(1).tolist()
        row["tokens"] = mask.sum(1).tolist()
        row["scores"] = traj.scores.tolist()
        row["kl_coef_in_rewards"] = float(self.kl_coef)
        rewards = shape_rewards(traj.scores, traj.kl, self.kl_coef, mask)
        raw, _ = gae(rewards, traj.values, mask, self.ppo.gamma, self.ppo.lam)
        shaped = super().shape(traj)
        row["advantages_raw"] = [raw[i][valid[i]].tolist() for i in range(raw.shape[0])]
        row["advantages"] = [shaped.advantages[i][valid[i]].tolist() for i in range(raw.shape[0])]
        return shaped

    def _weights(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().clone()
            for k, v in self.state_dict().items()
            if not k.startswith("reference.")
        }

    def training_step(self, batch, batch_idx):
        """PPOModule's training step, with the rollouts seeded by the sample and recorded."""
        if len(self.batches) == self.cut_batch:
            self.weights_before_cut = self._weights()
        self.batches.append({"prompts": list(batch["prompt"]), "beta_used": self.kl_coef})
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        """Runs after the callbacks: the metrics include the new beta."""
        metrics = self.trainer.callback_metrics
        self.batches[-1]["metrics"] = {k: float(v) for k, v in metrics.items()}

    def on_train_end(self):
        """Write this rank's record and weights."""
        callback = next(c for c in self.trainer.callbacks if isinstance(c, KLControllerCallback))
        out = Path(self.record_dir)
        out.mkdir(parents=True, exist_ok=True)
        rank = self.global_rank
        record = {
            "world_size": self.trainer.world_size,
            "batches": self.batches,
            "kl_coef": self.kl_coef,
            "controller": callback.state_dict(),
            "samples_seen": self.samples_seen,
            "batches_seen": self.batches_seen,
            "skipped_batches": self.skipped_batches,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        weights = {"final": self._weights(), "before_cut": self.weights_before_cut}
        torch.save(weights, out / f"rank{rank}.pt")
