"""What failed rewards do to beta and the KL: masking vs a zero reward vs the KL masked too.

PPO on the default world with the adaptive law (configs/ppo_adaptive.yaml's settings), the
reward VADER, 10% of each batch's rewards failing in one of two modes: ``uniform`` (each sample
by chance, from the study's own generator) or ``longest`` (the longest tenth of the batch's
responses, by characters: failures that hit long, high-KL responses). Three ways to take a
failure:

- ``mask``: the library's (the sample out of the advantages and losses, kept in the KL);
- ``zero``: the failed sample scored 0 (verl's);
- ``kl_masked``: masked, and left out of the KL the controller reads too (its per-sequence KL
  replaced by the scored samples' mean, so ``objective/kl`` is theirs).

Beside them the fault-free run. For every seed it prints the final beta, the mean true KL
(every sample's, nats per sequence) and the mean true VADER score of the last 10 batches, then
the mean and standard error over seeds of each variant.

    python scripts/failed_reward_study.py --seeds 0 1 2 --batches 150
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

import torch
from lightning.pytorch import Trainer, seed_everything

from rlkl_lightning import AdaptiveKLController, KLControllerCallback, PPOModule
from rlkl_lightning.data import PromptDataModule
from rlkl_lightning.rewards import VaderSentimentReward

RATE = 0.1
LAST = 10  # batches the final numbers average over


class FailingVader:
    """VADER with ``RATE`` of the samples failed (``nan``, masked) or scored 0 (``zero``)."""

    def __init__(self, mode: str, variant: str, seed: int) -> None:
        self.vader = VaderSentimentReward()
        self.mode, self.zero = mode, variant == "zero"
        self.marks_failures = not self.zero
        self.rng = random.Random(seed)
        self.true_scores: list[float] = []  # every sample's VADER, per batch

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """VADER's scores, ``RATE`` of them failed as the mode says."""
        scores = self.vader(prompts, responses)
        self.true_scores.append(float(scores.mean()))
        n = len(responses)
        if self.mode == "uniform":
            failed = [self.rng.random() < RATE for _ in range(n)]
        elif self.mode == "longest":
            order = sorted(range(n), key=lambda i: (-len(responses[i]), i))
            longest = set(order[: round(RATE * n)])
            failed = [i in longest for i in range(n)]
        else:
            failed = [False] * n
        filler = 0.0 if self.zero else math.nan
        return scores.masked_fill(torch.tensor(failed), filler)


class StudyPPO(PPOModule):
    """PPOModule that records every sample's KL, and with ``mask_kl`` hides the failed ones'."""

    mask_kl = False

    def score(self, prompts, traj, policy_scores):  # noqa: D102
        traj, responses, diagnostics = super().score(prompts, traj, policy_scores)
        self.true_kl = getattr(self, "true_kl", [])
        self.true_kl.append(float(diagnostics["kl_k1"].mean()))
        if self.mask_kl and "failed" in diagnostics and diagnostics["failed"].any():
            scored = ~diagnostics["failed"]
            for key in [k for k in diagnostics if k.startswith("kl_") and "/" not in k]:
                value = diagnostics[key]
                diagnostics[key] = torch.where(scored, value, value[scored].mean())
        return traj, responses, diagnostics


def run(seed: int, mode: str, variant: str, batches: int) -> tuple[float, float, float]:
    """Final beta, true KL and true score of one run."""
    seed_everything(seed, verbose=False)
    reward = FailingVader(mode, variant, seed)
    module = StudyPPO(
        reward=reward,
        sampling={"max_prompt_tokens": 16},
        optimization={"lr": 1.0e-4},
        logging={"log_samples_every": 0},
    )
    module.mask_kl = variant == "kl_masked"
    law = AdaptiveKLController(init_kl_coef=module.kl_coef, target=6.0, horizon=1000)
    steps = module.optimization.ppo_epochs * module.optimization.num_minibatches
    trainer = Trainer(
        accelerator="cpu",
        max_steps=batches * steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[KLControllerCallback(law)],
    )
    trainer.fit(module, PromptDataModule(batch_size=32, heldout=None, seed=seed))
    kl = statistics.mean(module.true_kl[-LAST:])
    score = statistics.mean(reward.true_scores[-LAST:])
    return module.kl_coef, kl, score


def main() -> None:
    """Every variant and seed, then the table of means and standard errors."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--modes", nargs="+", default=["uniform", "longest"])
    parser.add_argument("--no_clean", action="store_true", help="leave out the fault-free run")
    args = parser.parse_args()
    cases = [("none", "mask")] * (not args.no_clean) + [
        (m, v) for m in args.modes for v in ("mask", "zero", "kl_masked")
    ]
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for mode, variant in cases:
        for seed in args.seeds:
            out = run(seed, mode, variant, args.batches)
            results.setdefault((mode, variant), []).append(out)
            print(
                f"{mode:8s} {variant:9s} seed {seed}: beta {out[0]:.4f} kl {out[1]:.3f} "
                f"score {out[2]:.3f}",
                flush=True,
            )
    print(
        "\n| failures | variant | final beta | final KL (nats/seq) | score |\n|---|---|---|---|---|"
    )
    for (mode, variant), rows in results.items():
        cells = []
        for column in zip(*rows, strict=True):
            se = statistics.stdev(column) / math.sqrt(len(column)) if len(column) > 1 else 0.0
            cells.append(f"{statistics.mean(column):.4f} ± {se:.4f}")
        name = "fault-free" if mode == "none" else variant
        print(f"| {mode if mode != 'none' else '-'} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
