"""Two DDP ranks with different numbers of rows take the same optimizer steps (gloo, CPU).

``torch.chunk`` splits ``n`` rows into at most ``num_minibatches`` pieces of ``ceil(n / m)``:
1 row makes 1 minibatch where 3 make 2, and 3 rows make 3 pieces of 1 where 4 make 4. A rank
with fewer pieces took fewer optimizer steps (and backward passes, and skip-gate collectives)
than the other, which then waited in the gradient all-reduce forever. Now every rank takes
``ppo_epochs x num_minibatches`` steps of ``grad_accum_steps`` micro-batches; an empty one
is a backward pass of a zero loss (the loss of one of the rank's rows times 0), so the
all-reduce gets this rank's zero gradient and the other rank's gradient alone steps both.

A data module of the user's (``helpers.uneven_prompts.UnevenPrompts``) gives rank 0 and rank 1
their own batch sizes. Each run must end within the timeout (a hang fails it), both ranks must
end on the same weights, bit for bit, and the trainer must have counted every step.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers.ddp_runs import STEPS, WORDS, config, records, train_py

#: Long enough for a 2-process run of the tiny model on a loaded machine (about 30 s alone).
TIMEOUT_S = 180


@pytest.mark.dist  # several processes: make test-dist
@pytest.mark.parametrize(
    ("per_rank", "optimization"),
    [
        # the review's case: 1 row against 3 in 2 minibatches, each in 2 micro-batches
        ([1, 3], {"ppo_epochs": 2, "num_minibatches": 2, "grad_accum_steps": 2}),
        # more rows than minibatches on both ranks, and still 3 pieces against 4
        ([3, 4], {"ppo_epochs": 1, "num_minibatches": 4}),
    ],
    ids=["1-vs-3-rows", "3-vs-4-rows"],
)
def test_uneven_ranks_take_every_optimizer_step(tmp_path, tiny_lm_dir, per_rank, optimization):
    from helpers.tiny_models import make_tiny_lm

    from rlkl_lightning.models.loading import load_causal_lm

    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts_file = tmp_path / "prompts.txt"
    count = STEPS * sum(per_rank)
    lines = [
        " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 3)) for i in range(count)
    ]
    prompts_file.write_text("\n".join(lines) + "\n")
    path = config(tmp_path, lms, prompts_file, "uneven", "", 1)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["use_distributed_sampler"] = False
    cfg["model"]["init_args"]["cut_batch"] = -1
    cfg["model"]["init_args"]["optimization"] = optimization
    cfg["data"] = {
        "class_path": "helpers.uneven_prompts.UnevenPrompts",
        "init_args": {"prompts": str(prompts_file), "per_rank": per_rank, "batches": STEPS},
    }
    path.write_text(yaml.safe_dump(cfg))
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    train_py(path, tmp_path, *ddp, timeout=TIMEOUT_S)

    (rank0, rank1), (w0, w1) = records(tmp_path / "uneven", 2)
    assert rank0["skipped_batches"] == rank1["skipped_batches"] == 0
    assert len(rank0["batches"]) == len(rank1["batches"]) == STEPS
    for b0, b1 in zip(rank0["batches"], rank1["batches"], strict=True):
        assert (len(b0["prompts"]), len(b1["prompts"])) == tuple(per_rank)
        assert b0["metrics"] == b1["metrics"]  # logged metrics are global (sync_dist)
    # The ranks stepped together: the same weights, bit for bit, and they did move.
    final0, final1 = w0["final"], w1["final"]
    assert final0.keys() == final1.keys()
    assert all(torch.equal(final0[k], final1[k]) for k in final0)
    initial = load_causal_lm(str(tiny_lm_dir)).state_dict()
    assert max(float((final0[f"policy.{k}"] - v).abs().max()) for k, v in initial.items()) > 1e-3
    # Every batch took ppo_epochs x num_minibatches optimizer steps, on every parameter.
    steps = STEPS * optimization["ppo_epochs"] * optimization["num_minibatches"]
    ckpt = torch.load(tmp_path / "uneven" / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == steps
    adam = ckpt["optimizer_states"][0]["state"]
    assert adam and {int(s["step"]) for s in adam.values()} == {steps}


def test_split_makes_every_piece_and_keeps_torch_chunks_full_splits():
    """``split`` gives exactly ``parts`` pieces of the rows, in order; where ``torch.chunk``
    already does, its pieces (every run whose pieces all had rows logs what it logged)."""
    from rlkl_lightning.algorithms.update import split

    for rows in range(0, 13):
        for parts in range(1, 6):
            order = torch.randperm(rows)
            pieces = split(order, parts)
            assert len(pieces) == parts
            assert torch.equal(torch.cat(pieces), order)
            sizes = [len(p) for p in pieces]
            assert max(sizes) - min(sizes) <= max(1, rows // parts)  # never all in one
            chunks = order.chunk(parts)
            if len(chunks) == parts:
                assert all(torch.equal(a, b) for a, b in zip(pieces, chunks, strict=True))
    assert [len(p) for p in split(torch.arange(6), 4)] == [2, 2, 1, 1]  # chunk: 2, 2, 2
    assert [len(p) for p in split(torch.arange(1), 2)] == [1, 0]
