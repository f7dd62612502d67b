"""The per-batch training metrics of the README's table, computed from one trajectory.

Pure functions of tensors; the module logs what they return. Per-token means are taken over
the tokens of the global batch: each rank's sums are added over all ranks (``global_sum``),
then divided, so they are right under DDP whatever the ranks' token counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlkl_lightning.kl import KL_ESTIMATORS
from rlkl_lightning.trajectory import Trajectory


def batch_metrics(
    traj: Trajectory,
    diagnostics: dict[str, Tensor],
    kl_estimator: str,
    kl_coef: float,
    clock: list[float],
    global_sum: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """The ``objective/*`` and ``perf/*`` metrics of a trained batch.

    Args:
        traj: The batch's trajectory (``scores``, ``kl`` and ``response_mask`` are read).
        diagnostics: Per-sequence KL ``[B]`` of every estimator (``kl_k1`` ... ``kl_exact``)
            and the summed token entropy ``entropy_sum``, from the scoring phase.
        kl_estimator: The estimator of ``objective/kl``.
        kl_coef: The beta the batch's rewards or losses used.
        clock: ``perf_counter`` times at the start, after rollout, after shaping, at the end.
        global_sum: Sums a tensor over all ranks (identity on one process).
    """
    mask = traj.response_mask
    n = mask.shape[0]
    kl_seq = diagnostics[f"kl_{kl_estimator}"]
    n_tokens = mask.sum()
    kl_sum, entropy_sum, all_tokens = global_sum(
        torch.stack([kl_seq.sum(), diagnostics["entropy_sum"], n_tokens.to(traj.kl.dtype)])
    )
    t_start, t_rollout, t_scored, t_end = clock
    metrics = {
        "objective/kl": kl_seq.mean(),
        "objective/kl_per_token": kl_sum / all_tokens,
        "objective/score": traj.scores.mean(),
        "objective/non_score_reward": -kl_coef * kl_seq.mean(),
        "objective/entropy": entropy_sum / all_tokens,
        "objective/response_tokens": n_tokens / n,
        "perf/tokens_per_s": n_tokens / (t_end - t_start),
        "perf/rollout_s": torch.tensor(t_rollout - t_start, dtype=torch.float32),
        "perf/score_s": torch.tensor(t_scored - t_rollout, dtype=torch.float32),
        "perf/update_s": torch.tensor(t_end - t_scored, dtype=torch.float32),
    }
    for name in KL_ESTIMATORS:
        metrics[f"objective/kl_{name}"] = diagnostics[f"kl_{name}"].mean()
    return metrics


def samples_table(prompts: list[str], responses: list[str], scores: Tensor, rows: int) -> str:
    """A markdown table of the first ``rows`` (prompt, response, score) triples."""
    lines = ["| prompt | response | score |", "|---|---|---|"]
    for prompt, response, score in list(zip(prompts, responses, scores.tolist()))[:rows]:
        cells = [s.replace("|", "\\|").replace("\n", " ") for s in (prompt, response)]
        lines.append(f"| {cells[0]} | {cells[1]} | {score:.3f} |")
    return "\n".join(lines)


def log_samples_table(module, prompts: list[str], responses: list[str], scores: Tensor) -> None:
    """Write :func:`samples_table` to the module's TensorBoard every ``log_samples_every`` batches.

    Args:
        module: The training module (its ``hparams``, ``batches_seen`` and ``logger``).
        prompts: The batch's prompts.
        responses: Their decoded responses.
        scores: ``[B]`` their reward-model scores.
    """
    every = module.hparams.log_samples_every
    if not every or (module.batches_seen - 1) % every:
        return
    experiment = getattr(module.logger, "experiment", None)
    if experiment is None or not hasattr(experiment, "add_text"):
        return
    table = samples_table(prompts, responses, scores, module.hparams.num_logged_samples)
    experiment.add_text("samples", table, global_step=module.batches_seen)
