"""The policy objective every algorithm uses: surrogate, entropy bonus, KL term, aggregation.

One (micro-)minibatch's loss is, in this order of summation::

    loss = surrogate [+ the algorithm's own term, e.g. PPO's vf_coef x value loss]
           - ent_coef x entropy            (with ent_coef > 0)
           + kl_coef x kl_loss / kl_scale  (with penalty.placement = "loss")

* the surrogate is PPO's clipped one (Schulman et al. 2017, arXiv 1707.06347, eq. 7) with a
  per-token or per-sequence ratio (GSPO, arXiv 2507.18071) and clip-higher (DAPO, arXiv
  2503.14476): :func:`~rlkl_lightning.algorithms.losses.policy_loss`;
* the KL term is :func:`~rlkl_lightning.kl.loss.kl_loss` (docs/kl.md, "Where the KL goes"),
  each sequence's divided by the scale its advantages were divided by
  (``Trajectory.kl_scale``: PPO's whitening; none for RLOO and GRPO), so that beta weighs the
  KL in the raw reward's units wherever the advantages are whitened (docs/kl.md, "What beta
  means in the loss");
* every per-token term is made one number by the loss aggregation of ``objective.aggregation``
  (:mod:`rlkl_lightning.algorithms.aggregation`), which the objective owns: the update asks it
  to weigh each micro-batch's tokens (:meth:`PolicyObjective.weigh`) and every per-token term
  of the micro-batch, an algorithm's own included, is reduced by :meth:`PolicyObjective.reduce`;
* with ``Trajectory.mismatch_weights`` (``engine.correction``, docs/mismatch.md) each token's
  surrogate term is multiplied by its weight before ``reduce``; the entropy bonus and the KL
  term are not (:mod:`rlkl_lightning.algorithms.mismatch`).

An algorithm supplies only its advantages (in the minibatch) and, where it has one, its own
term (:data:`ExtraTerm`), which is added right after the surrogate.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.aggregation import token_weights, weighted_sum
from rlkl_lightning.algorithms.losses import entropy_from_logits, policy_loss
from rlkl_lightning.algorithms.mismatch import weighted
from rlkl_lightning.algorithms.options import KLPenalty, Objective
from rlkl_lightning.algorithms.update import Reduce
from rlkl_lightning.kl.loss import kl_loss
from rlkl_lightning.masked import masked_mean
from rlkl_lightning.models.logprobs import Defer, TokenScores, score_tokens
from rlkl_lightning.models.packing import PackedRows, check_packable, pack
from rlkl_lightning.trajectory import Trajectory

#: An algorithm's own loss term, computed from the policy's scores of the minibatch:
#: ``extra(new) -> (term, stats)``; ``term`` is added to the surrogate as it is.
ExtraTerm = Callable[[TokenScores], tuple[Tensor, dict[str, Tensor]]]


class PolicyObjective:
    """The loss of a (micro-)minibatch from its advantages, for any algorithm.

    Args:
        options: The ``objective`` group (clips, ratio, aggregation, entropy bonus).
        penalty: The ``penalty`` group (placement, loss estimator, weight cap, trust region).
        temperature: The sampling temperature the log-probs are taken at.
        max_new_tokens: ``sampling.max_new_tokens``, the ``fixed_length`` aggregation's ``L``
            (needed with it alone).
        packing: ``optimization.packing``: ``packed`` forwards each micro-batch's sequences
            packed into rows without their padding (:meth:`packed_rows`).
    """

    def __init__(
        self,
        options: Objective,
        penalty: KLPenalty,
        temperature: float,
        max_new_tokens: int | None = None,
        packing: str = "none",
    ) -> None:
        self.options = options
        self.packing = packing
        #: Rows packed outside a compiled graph for the micro-batch whose loss it runs
        #: (:class:`~rlkl_lightning.algorithms.compiled_update.CompiledUpdate`), or None.
        self.given_rows: PackedRows | None = None
        self.penalty = penalty
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        if options.aggregation == "fixed_length" and max_new_tokens is None:
            raise ValueError(
                "PolicyObjective: `objective.aggregation`='fixed_length' divides by "
                "`sampling.max_new_tokens`: pass `max_new_tokens`"
            )

    def packed_rows(self, model: nn.Module, minibatch: Trajectory) -> PackedRows | None:
        """``minibatch``'s sequences packed for ``model``'s forward pass, or None: padded rows.

        Raises:
            ValueError: Where ``model`` cannot run packed rows (FSDP, an attention
                implementation that ignores packed position ids), naming the option.
        """
        if self.packing == "none":
            return None
        if self.given_rows is not None:  # packed by the compiled update, outside its graph
            return self.given_rows
        check_packable(model)
        return pack(minibatch.attention_mask, minibatch.response_mask, minibatch.input_ids)

    # ------------------------------------------------------------------ the aggregation
    def tokens_per_rank(
        self, mask: Tensor, global_sum: Callable[[Tensor], Tensor], world: int
    ) -> float:
        """``batch_token_mean``'s normaliser ``N / world_size``; 0.0 for the other aggregations.

        ``N`` is the batch's response tokens (``mask``) summed over every rank by
        ``global_sum``, a collective under DDP, which only this aggregation calls.
        """
        if self.options.aggregation != "batch_token_mean":
            return 0.0
        local = mask.sum().to(torch.float32)
        return float(global_sum(local)) / world

    def weigh(
        self, micro: Trajectory, minibatch_size: int, share: Tensor, tokens_per_rank: float
    ) -> tuple[Trajectory, Tensor]:
        """A micro-batch with its tokens' weights in its minibatch's loss, and its loss's factor.

        ``token_mean`` keeps its original form: no weights (the loss is the micro-batch's token
        mean) and the factor ``share``, the micro-batch's share of the minibatch's tokens. The
        other aggregations weigh every token (``loss_weights``,
        :func:`~rlkl_lightning.algorithms.aggregation.token_weights`) and the factor is 1.

        Args:
            micro: The micro-batch.
            minibatch_size: ``n``, the responses of its minibatch on this rank.
            share: The micro-batch's response tokens over its minibatch's.
            tokens_per_rank: :meth:`tokens_per_rank` of the batch.
        """
        aggregation = self.options.aggregation
        if aggregation == "token_mean":
            return micro, share
        weights = token_weights(
            micro.response_mask, aggregation, minibatch_size, self.max_new_tokens, tokens_per_rank
        )
        return micro._replace(loss_weights=weights), torch.ones_like(share)

    @staticmethod
    def reduce(minibatch: Trajectory) -> Reduce:
        """How a (micro-)minibatch's per-token terms become one number: ``reduce(x, mask)``.

        The token mean, or the sum weighted by the ``loss_weights`` :meth:`weigh` set.
        """
        if minibatch.loss_weights is None:
            return masked_mean
        return partial(weighted_sum, weights=minibatch.loss_weights)

    def __call__(
        self,
        policy: nn.Module,
        minibatch: Trajectory,
        kl_coef: float,
        defer: Defer | None = None,
        extra: ExtraTerm | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss and its detached statistics (``loss/*``, ``policy/*``).

        Args:
            policy: The policy (its forward pass carries the gradient).
            minibatch: Supplies the sequences, the rollout and reference log-probs, the
                advantages, the mask and the tokens' weights in the loss (:meth:`reduce`).
            kl_coef: Beta, for the KL term of the loss.
            defer: Where the fused head may hand its weight gradient off (a helper thread's).
            extra: The algorithm's own term (PPO's value loss), added after the surrogate.
        """
        opts, mb = self.options, minibatch
        reduce = self.reduce(mb)
        # Without an entropy bonus no [B, R, V] logits are needed: the fused head (logprobs.py).
        rows = self.packed_rows(policy, mb)
        new = score_tokens(policy, mb, self.temperature, bool(opts.ent_coef), defer, rows)
        mask = mb.response_mask
        pg_loss, pg_stats = policy_loss(
            new.logprobs,
            mb.logprobs,
            mb.advantages,
            mask,
            opts.cliprange,
            weighted(reduce, mb.mismatch_weights),  # reduce itself without a correction
            opts.cliprange_high,
            opts.importance_ratio,
        )
        stats = {keys.LOSS_POLICY: pg_loss.detach()}
        loss = pg_loss
        if extra is not None:
            term, extra_stats = extra(new)
            loss = loss + term
            stats.update(extra_stats)
        stats[keys.APPROX_KL] = pg_stats.approx_kl
        stats[keys.CLIPFRAC] = pg_stats.clipfrac
        if opts.ent_coef:
            entropy = reduce(entropy_from_logits(new.logits), mask)
            loss = loss - opts.ent_coef * entropy
            stats[keys.LOSS_ENTROPY_BONUS] = entropy.detach()
        if self.penalty.placement == "loss":
            args = (new.logprobs, mb.logprobs, mb.ref_logprobs, mask, self.penalty.loss_estimator)
            kl_args = (self.penalty.loss_weight_clip, reduce, self.penalty.trust_region)
            term = kl_loss(*args, *kl_args, scale=mb.kl_scale)
            if mb.kl_scale is None:
                stats[keys.LOSS_KL] = term.detach()
            else:  # loss/kl stays the term in nats; the loss divides it as the advantages were
                with torch.no_grad():
                    stats[keys.LOSS_KL] = kl_loss(*args, *kl_args)
            loss = loss + kl_coef * term
        stats[keys.LOSS_TOTAL] = loss.detach()
        return loss, stats
