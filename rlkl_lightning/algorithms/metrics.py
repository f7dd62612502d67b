"""The per-batch training metrics of docs/metrics.md, computed from one trajectory.

Pure functions of tensors; the module logs what they return. Per-token means are taken over
the tokens of the global batch: each rank's sums are added over all ranks (``global_sum``),
then divided, so they are right under DDP whatever the ranks' token counts. Under DDP the
per-sample means (``objective/kl`` among them, the KL callbacks' input) are taken over the
samples of the global batch the same way, whatever the ranks' sample counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl.estimators import KL_ESTIMATORS
from rlkl_lightning.rewards import InvalidRewardError, RewardShapeError, validate_scores
from rlkl_lightning.trajectory import Trajectory


def batch_metrics(
    traj: Trajectory,
    diagnostics: dict[str, Tensor],
    kl_estimator: str,
    kl_coef: float,
    clock: list[float],
    global_sum: Callable[[Tensor], Tensor],
    distributed: bool = False,
) -> dict[str, Tensor]:
    """The ``objective/*`` and ``perf/*`` metrics of a trained batch.

    Args:
        traj: The batch's trajectory (``scores``, ``kl`` and ``response_mask`` are read).
        diagnostics: Per-sequence KL ``[B]`` of every estimator (``kl_k1`` ... ``kl_exact``),
            the summed token entropy ``entropy_sum`` and, with a gold reward, its ``[B]``
            scores ``gold``, from the scoring phase.
        kl_estimator: The estimator of ``objective/kl``.
        kl_coef: The beta the batch's rewards or losses used.
        clock: ``perf_counter`` times at the start, after rollout, after shaping, at the end.
        global_sum: Sums a tensor over all ranks (identity on one process).
        distributed: Several ranks: per-sample means are sums over the global batch divided
            by its number of samples (logged with ``sync_dist``, the plain mean over ranks of
            per-rank means would weight a rank's samples by its share of ranks, not of samples).
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
        keys.KL: kl_seq.mean(),
        keys.KL_PER_TOKEN: kl_sum / all_tokens,
        keys.SCORE: traj.scores.mean(),
        keys.NON_SCORE_REWARD: -kl_coef * kl_seq.mean(),
        keys.ENTROPY: entropy_sum / all_tokens,
        keys.RESPONSE_TOKENS: n_tokens / n,
        keys.TOKENS_PER_S: n_tokens / (t_end - t_start),
        keys.ROLLOUT_S: torch.tensor(t_rollout - t_start, dtype=torch.float32),
        keys.SCORE_S: torch.tensor(t_scored - t_rollout, dtype=torch.float32),
        keys.UPDATE_S: torch.tensor(t_end - t_scored, dtype=torch.float32),
    }
    for name in KL_ESTIMATORS:
        metrics[keys.kl_of(name)] = diagnostics[f"kl_{name}"].mean()
    if "gold" in diagnostics:
        metrics[keys.GOLD_SCORE] = diagnostics["gold"].mean()
    if distributed:
        metrics.update(_global_sample_means(traj, diagnostics, kl_estimator, kl_coef, global_sum))
    return metrics


def _global_sample_means(
    traj: Trajectory,
    diagnostics: dict[str, Tensor],
    kl_estimator: str,
    kl_coef: float,
    global_sum: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """The per-sample means of :func:`batch_metrics` over the samples of all ranks (one sum)."""
    per_sample = {keys.kl_of(name): diagnostics[f"kl_{name}"] for name in KL_ESTIMATORS}
    per_sample[keys.SCORE] = traj.scores
    per_sample[keys.RESPONSE_TOKENS] = traj.response_mask.sum(1)
    if "gold" in diagnostics:
        per_sample[keys.GOLD_SCORE] = diagnostics["gold"]
    device = traj.response_mask.device
    local = [v.to(device=device, dtype=torch.float64).sum() for v in per_sample.values()]
    n = torch.tensor(float(traj.response_mask.shape[0]), dtype=torch.float64, device=device)
    *sums, total = global_sum(torch.stack([*local, n])).unbind()
    means = {key: value / total for key, value in zip(per_sample, sums, strict=True)}
    means[keys.KL] = means[keys.kl_of(kl_estimator)]
    means[keys.NON_SCORE_REWARD] = -kl_coef * means[keys.KL]
    return means


def gold_scores(
    gold_reward: Callable | None, prompts: list[str], responses: list[str], owner: str
) -> dict[str, Tensor]:
    """``{"gold": [B] scores}`` of a gold reward (``{}`` without one), for the log only.

    The gold reward is never trained on, so its faults never skip a batch: non-finite scores
    are logged as ``nan``. One that does not return a score per sample is broken: that stops.
    """
    if gold_reward is None:
        return {}
    try:
        return {"gold": validate_scores(gold_reward(prompts, responses), len(prompts), gold_reward)}
    except RewardShapeError as err:
        raise ValueError(
            f"{owner}: `gold_reward` must return one score per (prompt, response) pair, shape "
            f"[{len(prompts)}]: {err}"
        ) from err
    except InvalidRewardError:
        return {"gold": torch.full((len(prompts),), float("nan"))}


def samples_table(
    prompts: list[str], responses: list[str], scores: Tensor, rows: int, gold: Tensor | None = None
) -> str:
    """A markdown table of the first ``rows`` (prompt, response, score[, gold score]) rows."""
    head = ["prompt", "response", "score"] + (["gold score"] if gold is not None else [])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    golds = gold.tolist() if gold is not None else [None] * len(prompts)
    for prompt, response, score, g in list(zip(prompts, responses, scores.tolist(), golds))[:rows]:
        cells = [s.replace("|", "\\|").replace("\n", " ") for s in (prompt, response)]
        cells += [f"{score:.3f}"] + ([] if g is None else [f"{g:.3f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def log_samples_table(
    module: LightningModule,
    prompts: list[str],
    responses: list[str],
    scores: Tensor,
    gold: Tensor | None = None,
) -> None:
    """Write :func:`samples_table` to the module's TensorBoard every ``log_samples_every`` batches.

    Args:
        module: The training module (its ``hparams``, ``batches_seen`` and ``logger``).
        prompts: The batch's prompts.
        responses: Their decoded responses.
        scores: ``[B]`` their reward-model scores.
        gold: ``[B]`` their gold scores, if a gold reward is logged.
    """
    every = module.hparams.log_samples_every
    if not every or (module.batches_seen - 1) % every:
        return
    experiment = getattr(module.logger, "experiment", None)
    if experiment is None or not hasattr(experiment, "add_text"):
        return
    table = samples_table(prompts, responses, scores, module.hparams.num_logged_samples, gold)
    experiment.add_text("samples", table, global_step=module.batches_seen)
