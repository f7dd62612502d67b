"""The key of every logged metric, written once (docs/metrics.md says what each one means).

Modules, callbacks and the study import these names instead of writing the strings. A
callback of a module of one's own reads ``KL`` (or ``KL_PER_TOKEN``) from
``trainer.callback_metrics``.
"""

# The objective: the batch's KL to the reference, beta, the reward.
KL = "objective/kl"  #: nats per sequence: the controller's input (unit "sequence")
KL_PER_TOKEN = "objective/kl_per_token"  #: nats per response token (unit "token")
KL_COEF = "objective/kl_coef"  #: beta, as the controller callback set it
KL_TARGET = "objective/kl_target"  #: the KL target, as a CapabilityBudget moves it
SCORE = "objective/score"
GOLD_SCORE = "objective/gold_score"
NON_SCORE_REWARD = "objective/non_score_reward"
ENTROPY = "objective/entropy"
RESPONSE_TOKENS = "objective/response_tokens"
FRAC_REWARD_ZERO_STD = "objective/frac_reward_zero_std"  #: RLOOModule: groups of equal scores
TRAINED_FRACTION = "objective/trained_fraction"  #: RLOOModule: responses the update kept
#: With `penalty.trust_region`: the fraction of response tokens left out of the KL penalty
TRUST_REGION_MASKED = "objective/trust_region_masked"


def kl_of(estimator: str) -> str:
    """The key of the per-sequence KL measured with ``estimator`` (``k1`` ... ``exact``)."""
    return f"objective/kl_{estimator}"


# The update: its losses and the policy's statistics (means over the optimizer steps).
LOSS_TOTAL = "loss/total"
LOSS_POLICY = "loss/policy"
LOSS_VALUE = "loss/value"
LOSS_KL = "loss/kl"
LOSS_ENTROPY_BONUS = "loss/entropy_bonus"
APPROX_KL = "policy/approx_kl"
CLIPFRAC = "policy/clipfrac"
VALUE_CLIPFRAC = "policy/value_clipfrac"
GRAD_NORM = "policy/grad_norm"
LR = "policy/lr"

# The reference (a ReferenceRefresh callback turns it on).
REFERENCE_REFRESHES = "reference/refreshes"  #: refreshes so far; the KL callbacks read it

# Per-token KL diagnostics (the module's `kl_token_threshold` turns them on).
TOKENS_MAX_LOG_RATIO = "kl_tokens/max_abs_log_ratio"  #: largest |log pi - log pi_ref| of a token
TOKENS_MAX_KL = "kl_tokens/max_kl"  #: largest per-token KL (the `kl_estimator`'s)
TOKENS_KL_Q99 = "kl_tokens/kl_q99"  #: 99th percentile of the per-token KL
TOKENS_KL_Q999 = "kl_tokens/kl_q999"  #: 99.9th percentile of the per-token KL
TOKENS_BEYOND = "kl_tokens/beyond_threshold"  #: tokens with |log-ratio| > kl_token_threshold
TOKENS_MAX_SEQUENCE_KL = "kl_tokens/max_sequence_kl"  #: largest per-sequence KL of the batch

# Progress and validation.
SAMPLES = "progress/samples"
SKIPPED_BATCHES = "progress/skipped_batches"
SAMPLES_AT_VAL = "progress/samples_at_val"
PERPLEXITY = "val/perplexity"
PERPLEXITY_REF = "val/perplexity_ref"
TEST_PERPLEXITY = "test/perplexity"  #: on the data module's test texts, which nothing steers on
TEST_PERPLEXITY_REF = "test/perplexity_ref"
BUDGET_RATIO = "budget/ratio"  #: a CapabilityBudget's last measured metric / reference's
VAL_LOSS = "val/loss"  #: the world's SFT

# The drift monitor.
MONITOR_AVG_KL = "kl_monitor/avg_kl"
MONITOR_TARGET = "kl_monitor/target"
MONITOR_WARNINGS = "kl_monitor/warnings"
MONITOR_STATE = "kl_monitor/state"

# The exact world (rlkl_lightning.world.exact.ExactMetrics): sums over every response.
EXACT_KL_TO_REF = "exact/kl_to_ref"  #: KL(pi‖ref), nats per sequence
EXACT_REWARD = "exact/reward"  #: E_pi[R]
EXACT_KL_TO_OPTIMUM = "exact/kl_to_optimum"  #: KL(pi‖pi*) to the optimum at the current beta

# The reward's failures and latency (logged only with a reward that marks failed samples:
# RemoteReward, docs/rewards-at-scale.md).
REWARD_FAILED_FRACTION = "reward/failed_fraction"  #: samples whose reward failed (masked)
#: mean KL (objective/kl's estimator) of the samples whose reward failed: out of objective/kl
REWARD_FAILED_KL = "reward/failed_kl"
REWARD_RETRIES = "reward/retries"  #: retried requests of the batch, summed over ranks
REWARD_LATENCY_P50 = "reward/latency_ms_p50"  #: median milliseconds of a request, retries in
REWARD_LATENCY_P95 = "reward/latency_ms_p95"  #: 95th percentile of the same

# Timings (left out of the same-metrics comparison: they differ run to run).
TOKENS_PER_S = "perf/tokens_per_s"
ROLLOUT_S = "perf/rollout_s"
SCORE_S = "perf/score_s"
UPDATE_S = "perf/update_s"
PUSH_S = "perf/push_s"  #: only where the engine has weights of its own (vLLM): the push


#: Prompt and response tokens (padding left out) per second of the step, per device
THROUGHPUT = "perf/throughput"
#: The phases of a batch whose peak memory is logged (``push`` only where ``PUSH_S`` is)
MEMORY_PHASES = ("push", "rollout", "score", "update")


def peak_memory_of(rank: int, phase: str | None = None) -> str:
    """The key of one rank's peak memory in GB: of the process so far, or of one phase.

    ``perf/peak_mem_gb/rank{rank}`` (the process), ``perf/peak_mem_gb/{phase}/rank{rank}``
    (``phase`` one of :data:`MEMORY_PHASES`, during this batch).
    """
    if phase is None:
        return f"perf/peak_mem_gb/rank{rank}"
    return f"perf/peak_mem_gb/{phase}/rank{rank}"


# The sampler/trainer gap (only where the engine that samples is not the trainer: vLLM).
MISMATCH_TOKEN_ABS_MEAN = "mismatch/token_abs_mean"  #: mean abs(log pi - log mu) per token
MISMATCH_TOKEN_ABS_MAX = "mismatch/token_abs_max"  #: largest abs(log pi - log mu) of a token
MISMATCH_SEQ_LOG_RATIO_MIN = "mismatch/seq_log_ratio_min"  #: smallest sum_t (log pi - log mu)
MISMATCH_SEQ_LOG_RATIO_MAX = "mismatch/seq_log_ratio_max"  #: largest sum_t (log pi - log mu)
#: With `engine.correction`: tokens capped (token_tis) or sequences masked (sequence_mis)
MISMATCH_CORRECTED_FRACTION = "mismatch/corrected_fraction"
