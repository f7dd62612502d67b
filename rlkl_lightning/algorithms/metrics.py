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
from rlkl_lightning.algorithms.memory import process_peak_bytes
from rlkl_lightning.kl.estimators import estimator_names
from rlkl_lightning.rewards import InvalidRewardError, RewardShapeError, validate_scores
from rlkl_lightning.trajectory import Trajectory


def logged_estimators(measured: str) -> tuple[str, ...]:
    """The estimators whose KL a batch logs: every registered one, then a plugged ``measured``."""
    registered = estimator_names()
    return registered if measured in registered else (*registered, measured)


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
        traj: The batch's trajectory (``scores``, ``kl``, ``response_mask`` and
            ``attention_mask`` are read).
        diagnostics: Per-sequence KL ``[B]`` of every estimator (``kl_k1`` ... ``kl_exact``),
            the summed token entropy ``entropy_sum``, with a gold reward its ``[B]`` scores
            ``gold``, and with ``penalty.trust_region`` the ``[B]`` KL of the tokens inside it
            (``penalized_kl``: the penalty applied) and the count of those outside
            (``outside_tokens``), from the scoring phase.
        kl_estimator: The name of the estimator of ``objective/kl``; a plugged one's KL is
            logged under its own name too (``objective/kl_<name>``), beside the registered ones.
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
    trained = traj.sample_mask  # failed rewards: the KL of the samples the update trains on
    kl_rows = kl_seq if trained is None else kl_seq[trained]
    kl_tokens = n_tokens if trained is None else mask[trained].sum()
    kl_sum, entropy_sum, all_tokens, trained_tokens = global_sum(
        torch.stack(
            [
                kl_rows.sum(),
                diagnostics["entropy_sum"],
                n_tokens.to(traj.kl.dtype),
                kl_tokens.to(traj.kl.dtype),
            ]
        )
    )
    t_start, t_rollout, t_scored, t_end = clock
    scored = ~diagnostics["failed"] if "failed" in diagnostics else None
    metrics = {
        keys.KL: kl_rows.mean(),
        keys.KL_PER_TOKEN: kl_sum / trained_tokens,
        keys.SCORE: traj.scores.mean() if scored is None else traj.scores[scored].mean(),
        keys.NON_SCORE_REWARD: -kl_coef * kl_rows.mean(),
        keys.ENTROPY: entropy_sum / all_tokens,
        keys.RESPONSE_TOKENS: n_tokens / n,
        keys.TOKENS_PER_S: n_tokens / (t_end - t_start),
        keys.THROUGHPUT: traj.attention_mask.sum() / (t_end - t_start),
        keys.ROLLOUT_S: torch.tensor(t_rollout - t_start, dtype=torch.float32),
        keys.SCORE_S: torch.tensor(t_scored - t_rollout, dtype=torch.float32),
        keys.UPDATE_S: torch.tensor(t_end - t_scored, dtype=torch.float32),
    }
    rows = slice(None) if trained is None else trained
    for name in logged_estimators(kl_estimator):
        metrics[keys.kl_of(name)] = diagnostics[f"kl_{name}"][rows].mean()
    if "gold" in diagnostics:
        metrics[keys.GOLD_SCORE] = diagnostics["gold"].mean()
    if "penalized_kl" in diagnostics:  # penalty.trust_region: the penalty applied, what it left out
        metrics[keys.NON_SCORE_REWARD] = -kl_coef * diagnostics["penalized_kl"][rows].mean()
        outside = global_sum(diagnostics["outside_tokens"].to(all_tokens.dtype))
        metrics[keys.TRUST_REGION_MASKED] = outside / all_tokens
    if distributed:
        metrics.update(_global_sample_means(traj, diagnostics, kl_estimator, kl_coef, global_sum))
    return metrics


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory so far, in GB, of the memory a run on ``device`` runs out of.

    On CUDA the peak of the memory torch reserved on ``device`` (the trainer's and an
    in-process vLLM engine's tensors); elsewhere the process's peak resident set
    (:func:`~rlkl_lightning.algorithms.memory.process_peak_bytes`: the phases' resets included).
    """
    return process_peak_bytes(device) / 1e9


def peak_memory_metrics(
    rank: int,
    world_size: int,
    device: torch.device,
    global_sum: Callable[[Tensor], Tensor],
    phases: dict[str, int] | None = None,
    process: bool = True,
) -> dict[str, Tensor]:
    """Every rank's peak memory in GB, one key per rank and value, the same on every rank.

    Args:
        rank: This process's global rank.
        world_size: The number of ranks.
        device: The device whose memory is measured.
        global_sum: Sums a tensor over all ranks (identity on one process).
        phases: This rank's peak bytes of each phase of the batch
            (:class:`~rlkl_lightning.algorithms.memory.PhasePeaks`), the same phases on every
            rank: ``perf/peak_mem_gb/{phase}/rank{r}``.
        process: Also the process's peak so far, :func:`peak_memory_gb`
            (``perf/peak_mem_gb/rank{r}``).

    One sum over the ranks of a matrix holding each rank's values in its own column: a
    collective under DDP (call it on every rank).
    """
    values = {phase: peak / 1e9 for phase, peak in (phases or {}).items()}
    if process:
        values[None] = peak_memory_gb(device)
    own = torch.zeros(len(values), world_size, dtype=torch.float64, device=device)
    own[:, rank] = torch.tensor(list(values.values()), dtype=torch.float64)
    peaks = global_sum(own).to(torch.float32).cpu()
    return {
        keys.peak_memory_of(r, phase): peak
        for phase, row in zip(values, peaks.unbind(), strict=True)
        for r, peak in enumerate(row.unbind())
    }


def _global_sample_means(
    traj: Trajectory,
    diagnostics: dict[str, Tensor],
    kl_estimator: str,
    kl_coef: float,
    global_sum: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """The per-sample means of :func:`batch_metrics` over the samples of all ranks (one sum)."""
    trained = traj.sample_mask  # failed rewards: the KL of the samples the update trains on
    rows = slice(None) if trained is None else trained
    per_kl = {
        keys.kl_of(name): diagnostics[f"kl_{name}"][rows]
        for name in logged_estimators(kl_estimator)
    }
    if "penalized_kl" in diagnostics:
        per_kl[keys.NON_SCORE_REWARD] = diagnostics["penalized_kl"][rows]
    per_sample = {keys.RESPONSE_TOKENS: traj.response_mask.sum(1)}
    if "gold" in diagnostics:
        per_sample[keys.GOLD_SCORE] = diagnostics["gold"]
    device = traj.response_mask.device
    scored = ~diagnostics["failed"] if "failed" in diagnostics else None
    # the score is the mean of the scored samples alone
    per_scored = {keys.SCORE: traj.scores if scored is None else traj.scores[scored]}
    parts = (per_kl, per_sample, per_scored)
    local = [v.to(device=device, dtype=torch.float64).sum() for p in parts for v in p.values()]
    n = torch.tensor(float(traj.response_mask.shape[0]), dtype=torch.float64, device=device)
    n_trained = n if trained is None else trained.sum().to(torch.float64)
    n_scored = n if scored is None else scored.sum().to(torch.float64)
    sums = global_sum(torch.stack([*local, n_trained, n, n_scored])).tolist()
    *sums, total_trained, total, total_scored = sums
    means = {}
    for part, count in zip(parts, (total_trained, total, total_scored), strict=True):
        for key in part:
            means[key] = torch.tensor(sums.pop(0) / count, dtype=torch.float64)
    means[keys.KL] = means[keys.kl_of(kl_estimator)]
    means[keys.NON_SCORE_REWARD] = -kl_coef * means.get(keys.NON_SCORE_REWARD, means[keys.KL])
    return means


def reward_metrics(
    failed: Tensor, stats: dict, global_sum: Callable[[Tensor], Tensor], kl: Tensor | None = None
) -> dict[str, Tensor]:
    """The ``reward/*`` metrics of a reward that marks failed samples (RemoteReward).

    Args:
        failed: ``[B]`` bool, the samples whose reward failed.
        stats: The reward's ``last_stats``: ``retries`` (int) and ``latency_ms`` (a list, one
            per request); missing ones count as none.
        global_sum: Sums a tensor over all ranks (identity on one process).
        kl: ``[B]`` the per-sequence KL of ``objective/kl``'s estimator, for the failed samples'
            mean (``reward/failed_kl``, logged where any sample failed).

    Returns:
        The failed share and the retries of all ranks, and this rank's request latency
        quantiles (under DDP the logged value is their mean over ranks).
    """
    device = failed.device
    failed_kl = 0.0 if kl is None else float(kl[failed].double().sum())
    local = [float(failed.sum()), float(failed.numel()), float(stats.get("retries", 0)), failed_kl]
    n_failed, n, retries, kl_sum = global_sum(
        torch.tensor(local, dtype=torch.float64, device=device)
    )
    latency = torch.tensor(stats.get("latency_ms") or [float("nan")], dtype=torch.float64)
    p50, p95 = latency.quantile(torch.tensor([0.5, 0.95], dtype=torch.float64))
    metrics = {
        keys.REWARD_FAILED_FRACTION: n_failed / n,
        keys.REWARD_RETRIES: retries,
        keys.REWARD_LATENCY_P50: p50,
        keys.REWARD_LATENCY_P95: p95,
    }
    if kl is not None and n_failed > 0:  # the same on every rank: the counts are global
        metrics[keys.REWARD_FAILED_KL] = kl_sum / n_failed
    return metrics


def token_kl_stats(
    log_ratio: Tensor,
    token_kl: Tensor,
    mask: Tensor,
    threshold: float,
    global_sum: Callable[[Tensor], Tensor],
    global_max: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """The ``kl_tokens/*`` diagnostics: a few extreme tokens that a batch mean hides.

    A handful of tokens with a huge log-ratio can carry most of a batch's KL (torchforge #664);
    these say how large the worst ones are and how many there are.

    Args:
        log_ratio: ``[B, R]`` per-token ``log pi - log pi_ref`` of the sampled tokens.
        token_kl: ``[B, R]`` per-token KL of the ``kl_estimator``.
        mask: ``[B, R]``, nonzero on response tokens.
        threshold: A token counts in ``beyond_threshold`` when ``|log_ratio| > threshold``.
        global_sum: Sums a tensor over all ranks (identity on one process).
        global_max: Maximises a tensor over all ranks (identity on one process).

    Returns:
        The maxima and counts of the global batch; the quantiles are this rank's (under DDP the
        logged value is their mean over ranks).
    """
    valid = mask.bool()
    ratio, kl = log_ratio[valid].abs().float(), token_kl[valid].float()
    if kl.numel() == 0:  # no response token on this rank
        ratio = kl = torch.zeros(1, dtype=torch.float32, device=log_ratio.device)
    seq_kl = (token_kl * mask).sum(-1).float()
    top = global_max(torch.stack([ratio.max(), kl.max(), seq_kl.max()]))
    # The levels in float32 like ``kl``: a ``*-true`` precision makes its own dtype the default
    # (bf16, fp16, fp64), and quantile needs both in one dtype (and bf16/fp16 it refuses).
    levels = torch.tensor([0.99, 0.999], dtype=kl.dtype, device=kl.device)
    quantiles = torch.quantile(kl, levels)
    beyond = global_sum((ratio > threshold).sum().float())
    return {
        keys.TOKENS_MAX_LOG_RATIO: top[0],
        keys.TOKENS_MAX_KL: top[1],
        keys.TOKENS_MAX_SEQUENCE_KL: top[2],
        keys.TOKENS_KL_Q99: quantiles[0],
        keys.TOKENS_KL_Q999: quantiles[1],
        keys.TOKENS_BEYOND: beyond,
    }


def top_kl_tokens(
    tokenizer, response_ids: Tensor, token_kl: Tensor, mask: Tensor, rows: int, k: int = 3
) -> list[str]:
    """For each of the first ``rows`` responses, its ``k`` tokens of largest KL: ``'tok' 1.23``."""
    out = []
    for ids, kl, m in list(zip(response_ids, token_kl, mask.bool(), strict=True))[:rows]:
        kl = kl.float().masked_fill(~m, -float("inf"))
        n = min(k, int(m.sum()))
        top = kl.topk(n).indices.tolist() if n else []
        out.append(
            ", ".join(f"{tokenizer.decode([int(ids[i])])!r} {float(kl[i]):.3g}" for i in top)
        )
    return out


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
    prompts: list[str],
    responses: list[str],
    scores: Tensor,
    rows: int,
    gold: Tensor | None = None,
    top_kl: list[str] | None = None,
) -> str:
    """A markdown table of the first ``rows`` (prompt, response, score[, gold score]) rows.

    With ``top_kl`` (:func:`top_kl_tokens`), a last column names each response's tokens of
    largest KL.
    """
    head = ["prompt", "response", "score"] + (["gold score"] if gold is not None else [])
    head += ["largest per-token KL"] if top_kl is not None else []
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    golds = gold.tolist() if gold is not None else [None] * len(prompts)
    tops = top_kl if top_kl is not None else [None] * len(prompts)
    rows_of = list(zip(prompts, responses, scores.tolist(), golds, tops))[:rows]
    for prompt, response, score, g, t in rows_of:
        texts = (prompt, response) if t is None else (prompt, response, t)
        cells = [s.replace("|", "\\|").replace("\n", " ") for s in texts]
        cells[2:2] = [f"{score:.3f}"] + ([] if g is None else [f"{g:.3f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def log_samples_table(
    module: LightningModule,
    prompts: list[str],
    responses: list[str],
    scores: Tensor,
    gold: Tensor | None = None,
    top_kl: Callable[[int], list[str]] | None = None,
) -> None:
    """Write :func:`samples_table` to the module's TensorBoard, at the step of the batch's scalars.

    The tables shown are of the first batch (what the starting policy writes) and of every
    ``log_samples_every``-th trained batch after it (batches ``L, 2L, ...``, counted from 1).
    So with a :class:`~rlkl_lightning.algorithms.reference_refresh.ReferenceRefresh` whose
    ``every`` divides ``L``, a table shows the last batch before a refresh, whose KL has grown
    since the last one, never the batch right after it (whose KL is ~0 with ``mode="hard"``).
    The step is the one Lightning logs this batch's scalars at (0-based, skipped batches
    included), so a table lines up with its batch's ``objective/*`` in TensorBoard.

    Args:
        module: The training module (its ``logging`` options, ``batches_seen`` and ``logger``).
        prompts: The batch's prompts.
        responses: Their decoded responses.
        scores: ``[B]`` their reward-model scores.
        gold: ``[B]`` their gold scores, if a gold reward is logged.
        top_kl: ``rows -> `` :func:`top_kl_tokens` of the first rows, for the KL column.
    """
    every = module.logging.log_samples_every
    done = module.batches_seen  # this batch included
    if not every or (done != 1 and done % every):
        return
    experiment = getattr(module.logger, "experiment", None)
    if experiment is None or not hasattr(experiment, "add_text"):
        return
    rows = module.logging.num_logged_samples
    tops = top_kl(rows) if top_kl is not None else None
    table = samples_table(prompts, responses, scores, rows, gold, tops)
    # The step Lightning's logger connector gives this batch's scalars (it counts every batch,
    # skipped ones too, and is restored on resume); ``batches_seen`` counts trained batches.
    step = module.trainer.fit_loop.epoch_loop._batches_that_stepped
    experiment.add_text("samples", table, global_step=step)
