"""The data order's place across a resume with another number of processes (no processes run)."""

from __future__ import annotations

import warnings

import pytest

from rlkl_lightning.data.samplers import EpochShuffleSampler, RankShardSampler, ResumableDataLoader

N, SEED = 12, 5
ORDER = list(EpochShuffleSampler(N, SEED))


def loaders(processes: int, batch: int) -> list[ResumableDataLoader]:
    """One loader per rank, as ``PromptDataModule`` builds them (one process: no shard)."""
    if processes == 1:
        return [
            ResumableDataLoader(range(N), batch_size=batch, sampler=EpochShuffleSampler(N, SEED))
        ]
    return [
        ResumableDataLoader(
            range(N), batch_size=batch, sampler=RankShardSampler(N, processes, rank, SEED)
        )
        for rank in range(processes)
    ]


def global_batches(ranks: list[ResumableDataLoader], count: int | None = None) -> list[list[int]]:
    """The prompts of each global batch, in the epoch order's positions (rank-interleaved)."""
    iterators = [iter(r) for r in ranks]
    out = []
    while count is None or len(out) < count:
        try:
            parts = [next(i).tolist() for i in iterators]
        except StopIteration:
            break
        out.append(sorted(sum(parts, []), key=ORDER.index))
    return out


@pytest.mark.parametrize(
    ("before", "after", "trained", "shift"),
    [
        ((2, 2), (1, 2), 2, 2),
        ((1, 2), (2, 2), 2, -1),
        ((2, 2), (2, 2), 1, 0),
        ((1, 2), (3, 2), 3, -2),
    ]
    + [((2, 2), (1, 4), 2, 0), ((4, 1), (1, 2), 1, 1)],
    ids=["2-to-1", "1-to-2", "2-to-2", "1-to-3", "2x2-to-1x4", "4x1-to-1x2"],
)
def test_a_resume_with_another_number_of_processes_takes_the_rest_of_the_epoch_once(
    before, after, trained, shift
):
    """``before``, ``after``: (processes, batch_size) of the checkpointed and the resumed run."""
    first = loaders(*before)
    seen = global_batches(first, trained)
    state = first[0].state_dict()
    prompts = trained * before[0] * before[1]
    assert state == {"epoch": 0, "batches": trained, "prompts": prompts, "size": N}
    resumed = loaders(*after)
    for loader in resumed:
        loader.load_state_dict(state)
        assert loader.progress_shift == shift  # Lightning's count of the epoch moves by this
    rest = global_batches(resumed)
    # Every prompt of the epoch exactly once, in the order's sequence, in global batches of
    # batch_size x processes from the place the checkpoint stopped at.
    assert sum(seen + rest, []) == ORDER
    size = after[0] * after[1]
    assert rest == [ORDER[i : i + size] for i in range(len(sum(seen, [])), N, size)]
    assert resumed[0].state_dict()["prompts"] == N


def test_a_place_inside_a_batch_of_the_new_run_is_refused_naming_the_option():
    first = loaders(1, 2)
    global_batches(first, 1)  # 2 prompts in: not a multiple of 2 x 2
    with pytest.raises(
        ValueError, match=r"stopped 2 prompts into epoch 0.*--trainer\.devices"
    ) as err:
        loaders(2, 2)[0].load_state_dict(first[0].state_dict())
    assert "\n" not in str(err.value)


def test_a_checkpoint_without_the_prompts_counts_its_batches_in_this_runs_global_batch():
    resumed = loaders(1, 2)[0]
    resumed.load_state_dict({"epoch": 0, "batches": 3})
    assert resumed.progress_shift == 0
    assert [b.tolist() for b in resumed] == [ORDER[6:8], ORDER[8:10], ORDER[10:12]]


@pytest.mark.parametrize(
    ("before", "after"), [(2, 1), (1, 2), (2, 2)], ids=["2-to-1", "1-to-2", "2-to-2"]
)
def test_a_checkpoint_at_the_end_of_an_epoch_leaves_nothing_of_it_to_train(before, after):
    first = loaders(before, 2)
    global_batches(first)
    resumed = loaders(after, 2)
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
        assert list(loader) == [] and loader.progress_shift == 0


def test_a_resume_over_another_number_of_prompts_says_so_once():
    # A prompts file edited in place between runs: the same path, another order from there on.
    first = loaders(1, 2)
    global_batches(first, 2)
    state = first[0].state_dict()
    grown = ResumableDataLoader(
        range(N + 1), batch_size=2, sampler=EpochShuffleSampler(N + 1, SEED)
    )
    with pytest.warns(RuntimeWarning, match=r"dealt an order of 12 prompts, this run has 13"):
        grown.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaders(1, 2)[0].load_state_dict(state)  # the same prompts: nothing to say
        loaders(1, 2)[0].load_state_dict({"epoch": 0, "batches": 2})  # a checkpoint before it
