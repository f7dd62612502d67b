"""The loss aggregations of the shared update against their closed forms.

A one-parameter "policy" whose per-token loss is ``theta * c[b, t]`` makes each optimizer step's
gradient the aggregation's weights applied to ``c``: with plain SGD at learning rate 1 the
parameter moves by minus that gradient, so every formula of
:mod:`rlkl_lightning.algorithms.aggregation` is read off the parameter, in float64, through
:func:`~rlkl_lightning.algorithms.update.run_update` itself (micro-batches, minibatches and, in
the two-process test, DDP's mean of the ranks' gradients over gloo).
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlkl_lightning.algorithms.aggregation import LOSS_AGGREGATIONS, token_weights, weighted_sum
from rlkl_lightning.algorithms.objective import PolicyObjective
from rlkl_lightning.algorithms.options import KLPenalty, Objective, Optimization
from rlkl_lightning.algorithms.update import OneThread, run_update
from rlkl_lightning.masked import masked_mean
from rlkl_lightning.trajectory import Trajectory

L = 5  # max_new_tokens


def batch(lengths: list[int], seed: int) -> tuple[Trajectory, torch.Tensor]:
    """A trajectory with responses of ``lengths`` tokens and per-token coefficients ``c``."""
    n = len(lengths)
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n, L, generator=g, dtype=torch.float64)
    c = torch.where(mask.bool(), c, torch.full_like(c, 1e6))  # padding never counts
    traj = Trajectory(
        input_ids=torch.zeros(n, 2 + L, dtype=torch.long),
        attention_mask=torch.ones(n, 2 + L, dtype=torch.long),
        response_ids=torch.zeros(n, L, dtype=torch.long),
        response_mask=mask,
        logprobs=c,  # carries c to the loss
    )
    return traj, c


class Linear(torch.nn.Module):
    """The module contract of run_update around ``loss = reduce(theta * c, mask)``.

    ``reduce`` is the policy objective's, which owns the aggregation.
    """

    def __init__(self, aggregation: str, minibatches: int, accum: int, world: int = 1):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.optimization = Optimization(
            ppo_epochs=1, num_minibatches=minibatches, grad_accum_steps=accum, max_grad_norm=None
        )
        objective = Objective(aggregation=aggregation)
        self.policy_objective = PolicyObjective(objective, KLPenalty(), 1.0, L)
        self.threads = OneThread()
        self.sharded_models = ()
        self.device = torch.device("cpu")
        strategy = SimpleNamespace(reduce=self._all_reduce_sum)
        self._trainer = SimpleNamespace(precision_plugin=None, world_size=world, strategy=strategy)
        self.trainer = self._trainer
        self._opt = torch.optim.SGD([self.theta], lr=1.0)
        self._sched = torch.optim.lr_scheduler.LambdaLR(self._opt, lambda _: 1.0)
        self.steps: list[float] = []

    @staticmethod
    def _all_reduce_sum(value, reduce_op):
        out = value.clone()
        dist.all_reduce(out)
        return out

    def loss(self, minibatch):
        reduce = self.policy_objective.reduce(minibatch)
        loss = reduce(self.theta * minibatch.logprobs, minibatch.response_mask)
        return loss, {"loss/policy": loss.detach(), "policy/clipfrac": torch.tensor(0.0)}

    def gate(self, bad, why):
        assert not bad, why

    def manual_backward(self, loss):
        grad = torch.autograd.grad(loss, self.theta)[0]
        if self.trainer.world_size > 1:  # what DDP does: the mean of the ranks' gradients
            dist.all_reduce(grad)
            grad = grad / self.trainer.world_size
        self.theta.grad = grad if self.theta.grad is None else self.theta.grad + grad

    def optimizers(self):
        return self._opt

    def lr_schedulers(self):
        return self._sched


class Recording(OneThread):
    """The plain thread that also records the parameter's move at each optimizer step."""

    def __init__(self, theta: torch.Tensor):
        self.theta, self.steps = theta, []

    def step(self, optimizer) -> None:
        before = float(self.theta.detach())
        optimizer.step()
        self.steps.append(float(self.theta.detach()) - before)


def moves(module: Linear, traj: Trajectory) -> list[float]:
    """The parameter's move at each optimizer step (minus the step's gradient)."""
    module.threads = Recording(module.theta)
    run_update(module, traj)
    return module.threads.steps


def closed_form(aggregation: str, c: torch.Tensor, mask: torch.Tensor, total: float) -> float:
    """The gradient of one minibatch's loss (rows ``c``, ``mask``), straight from the formula."""
    cm = torch.where(mask.bool(), c, torch.zeros_like(c))
    if aggregation == "token_mean":
        return float(cm.sum() / mask.sum())
    if aggregation == "sequence_mean":
        return float((cm.sum(1) / mask.sum(1)).mean())
    if aggregation == "fixed_length":
        return float(cm.sum() / (c.shape[0] * L))
    return float(cm.sum() / total)


LENGTHS = [5, 1, 3, 2, 4, 5, 1, 2]


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("accum", [1, 2])
def test_each_aggregation_is_its_closed_form_whatever_the_micro_batches(aggregation, accum):
    """One minibatch: the step is the formula; 1 and 2 micro-batches give the same gradient."""
    traj, c = batch(LENGTHS, seed=0)
    (step,) = moves(Linear(aggregation, 1, accum), traj)
    want = closed_form(aggregation, c, traj.response_mask, float(traj.response_mask.sum()))
    assert step == pytest.approx(-want, abs=1e-12)


def test_the_aggregations_differ_on_uneven_lengths():
    """The closed forms tell the aggregations apart on this batch (the test above can fail);
    over one minibatch on one rank, DAPO's normaliser is the token mean's."""
    traj, c = batch(LENGTHS, seed=0)
    mask, total = traj.response_mask, float(traj.response_mask.sum())
    values = [closed_form(a, c, mask, total) for a in LOSS_AGGREGATIONS[:3]]
    assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1 :]) > 1e-3
    assert closed_form("batch_token_mean", c, mask, total) == values[0]


def test_batch_token_mean_divides_every_minibatch_by_the_whole_batch():
    """Two minibatches: each step is its tokens' sum over the batch's tokens; they add up."""
    traj, c = batch(LENGTHS, seed=1)
    torch.manual_seed(0)
    steps = moves(Linear("batch_token_mean", 2, 2), traj)
    torch.manual_seed(0)  # the same minibatches as run_update drew
    order = torch.randperm(len(LENGTHS))
    total = float(traj.response_mask.sum())
    for step, rows in zip(steps, order.chunk(2), strict=True):
        want = closed_form("batch_token_mean", c[rows], traj.response_mask[rows], total)
        assert step == pytest.approx(-want, abs=1e-12)
    assert sum(steps) == pytest.approx(
        -closed_form("token_mean", c, traj.response_mask, 0), abs=1e-12
    )


def test_the_token_weights_of_a_micro_batch():
    """``token_weights`` on a 2-row micro-batch of a 4-response minibatch, written out."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    seq = token_weights(mask, "sequence_mean", 4, 3, 10.0)
    assert seq.tolist() == [[1 / 8, 1 / 8, 0.0], [1 / 4, 0.0, 0.0]]
    assert token_weights(mask, "fixed_length", 4, 3, 10.0).tolist() == (mask / 12).tolist()
    assert token_weights(mask, "batch_token_mean", 4, 3, 2.5).tolist() == (mask / 2.5).tolist()
    with pytest.raises(ValueError, match="`aggregation` must be one of"):
        token_weights(mask, "token_mean", 4, 3, 10.0)


def old_micro_loss(aggregation, x, part, minibatch_size, share, tokens_per_rank):
    """The update's computation before the objective owned the aggregation (0.4.0)."""
    if aggregation == "token_mean":
        return masked_mean(x, part.response_mask), share
    w = token_weights(part.response_mask, aggregation, minibatch_size, L, tokens_per_rank)
    return weighted_sum(x, part.response_mask, weights=w), torch.ones_like(share)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_the_objective_aggregates_as_the_update_did_bit_for_bit(aggregation):
    """``weigh`` then ``reduce``: each micro-batch's loss and factor equal 0.4.0's bits, and
    only ``batch_token_mean`` sums the batch's tokens over the ranks."""
    traj, c = batch(LENGTHS, seed=3)
    objective = PolicyObjective(Objective(aggregation=aggregation), KLPenalty(), 1.0, L)
    sums = []

    def global_sum(x):
        sums.append(x)
        return x * 3  # three ranks holding as many tokens

    tokens_per_rank = objective.tokens_per_rank(traj.response_mask, global_sum, 3)
    dapo = aggregation == "batch_token_mean"
    assert tokens_per_rank == (float(traj.response_mask.sum()) if dapo else 0.0)
    assert len(sums) == dapo
    minibatch = torch.tensor([6, 1, 3, 0, 5])
    mb_tokens = traj.response_mask[minibatch].sum()
    for micro in minibatch.split(2):
        part = traj.select(micro)
        share = part.response_mask.sum() / mb_tokens
        x = c[micro].float()
        want, want_factor = old_micro_loss(aggregation, x, part, 5, share, tokens_per_rank)
        weighed, factor = objective.weigh(part, 5, share, tokens_per_rank)
        got = objective.reduce(weighed)(x, weighed.response_mask)
        assert torch.equal(got, want) and torch.equal(factor, want_factor)
        assert (weighed.loss_weights is None) == (aggregation == "token_mean")


def test_fixed_length_needs_the_response_length_limit():
    with pytest.raises(ValueError, match="`objective.aggregation`='fixed_length' divides by"):
        PolicyObjective(Objective(aggregation="fixed_length"), KLPenalty(), 1.0)


# ---------------------------------------------------------------- two ranks, uneven tokens
RANK_LENGTHS = ([5, 5, 4, 5], [1, 2, 1, 1])  # rank 1 holds far fewer tokens


def _two_ranks(rank: int, init_file: str, out_dir: str, aggregation: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        traj, _ = batch(list(RANK_LENGTHS[rank]), seed=10 + rank)
        steps = [moves(Linear(aggregation, 1, accum, world=2), traj) for accum in (1, 2)]
        torch.save(steps, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("aggregation", ["batch_token_mean", "token_mean"])
def test_two_ranks_with_uneven_tokens(aggregation, tmp_path):
    """gloo, 2 processes: DAPO's normaliser counts both ranks' tokens (the global token mean);
    ``token_mean`` is the mean of the two ranks' token means, which differs on uneven counts."""
    # fork lets the children reuse the imported torch (as tests/test_masked.py does).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    args = (str(tmp_path / "init"), str(tmp_path), aggregation)
    mp.start_processes(_two_ranks, args=args, nprocs=2, join=True, start_method=method)
    data = [batch(list(lengths), seed=10 + r) for r, lengths in enumerate(RANK_LENGTHS)]
    c = torch.cat([d[1] for d in data])
    mask = torch.cat([d[0].response_mask for d in data])
    global_mean = closed_form("token_mean", c, mask, 0)
    local_means = [closed_form("token_mean", d[1], d[0].response_mask, 0) for d in data]
    want = global_mean if aggregation == "batch_token_mean" else sum(local_means) / 2
    assert abs(global_mean - sum(local_means) / 2) > 1e-2  # the two really differ here
    for rank in (0, 1):
        for steps in torch.load(tmp_path / f"rank{rank}.pt"):  # 1 and 2 micro-batches
            assert steps == pytest.approx([-want], abs=1e-12)


def test_more_minibatches_than_rows_warns_once_that_empty_steps_move_the_weights():
    """One process, 2 rows, 4 minibatches: 2 steps without a row (AdamW would still move)."""
    module = Linear("token_mean", minibatches=4, accum=1)
    traj, _ = batch([3, 2], seed=0)
    with pytest.warns(RuntimeWarning) as caught:
        assert len(moves(module, traj)) == 4  # the steps stay: every rank takes as many
        moves(module, traj)  # a second batch: no second warning
    assert [str(w.message) for w in caught] == [
        "`optimization.num_minibatches` must be at most the rows of a batch, 2 (this batch), "
        "got 4: 2 of its optimizer steps would have no rows and still move the weights (AdamW's "
        "moments and weight decay)"
    ]
    enough = Linear("token_mean", minibatches=2, accum=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moves(enough, traj)


def test_the_gradient_norm_is_a_mean_over_the_steps_that_had_rows():
    # Like the losses: an empty step's zero gradient was averaged into `policy/grad_norm`.
    module = Linear("token_mean", minibatches=4, accum=1)
    module.threads = Recording(module.theta)
    traj, _ = batch([3, 2], seed=0)
    with pytest.warns(RuntimeWarning, match="2 of its optimizer steps would have no rows"):
        stats = run_update(module, traj)
    steps = module.threads.steps  # SGD at lr 1, no clip: each move is minus the gradient
    assert [s != 0 for s in steps] == [True, True, False, False]
    assert float(stats["policy/grad_norm"]) == pytest.approx(sum(abs(s) for s in steps) / 2)
