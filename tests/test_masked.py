import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlkl_lightning.masked import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    valid_mask,
    zero_padding,
)

GARBAGE = 1e6


def _padded(seed: int = 0, b: int = 5, t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float64 values and a right-padded mask with rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=torch.float64) * 3 + 1
    lengths = torch.tensor([7, 1, 4, 6, 2])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return x, mask


def test_all_ones_mask_equals_plain_torch():
    x, _ = _padded()
    ones = torch.ones_like(x, dtype=torch.bool)
    torch.testing.assert_close(masked_sum(x, ones), x.sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(masked_mean(x, ones), x.mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(masked_mean(x, ones, dim=1), x.mean(dim=1), rtol=0, atol=1e-12)
    torch.testing.assert_close(masked_mean(x, ones, dim=0), x.mean(dim=0), rtol=0, atol=1e-12)
    torch.testing.assert_close(masked_var(x, ones), x.var(), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        masked_var(x, ones, unbiased=False), x.var(unbiased=False), rtol=0, atol=1e-12
    )
    eps = 1e-8
    expected = (x - x.mean()) / torch.sqrt(x.var() + eps)
    torch.testing.assert_close(masked_whiten(x, ones, eps=eps), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        masked_whiten(x, ones, shift_mean=False, eps=eps), expected + x.mean(), rtol=0, atol=1e-12
    )


def test_values_match_the_valid_entries_taken_out():
    x, mask = _padded()
    flat = x[mask]
    torch.testing.assert_close(masked_sum(x, mask), flat.sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(masked_mean(x, mask), flat.mean(), rtol=0, atol=1e-12)
    torch.testing.assert_close(masked_var(x, mask), flat.var(), rtol=0, atol=1e-12)
    whitened = masked_whiten(x, mask)
    torch.testing.assert_close(
        whitened[mask], (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8), rtol=0, atol=1e-12
    )
    assert torch.all(whitened[~mask] == 0)
    # Whitened valid entries have mean 0 and unbiased variance ~1.
    assert abs(float(whitened[mask].mean())) < 1e-12
    assert abs(float(whitened[mask].var()) - 1) < 1e-8


@pytest.mark.parametrize("garbage", [GARBAGE, float("nan"), float("inf")])
def test_padding_garbage_never_changes_results(garbage):
    x, mask = _padded()
    dirty = x.masked_fill(~mask, garbage)
    clean = x.masked_fill(~mask, 0.0)
    for fn in (masked_sum, masked_mean, masked_var, masked_whiten):
        torch.testing.assert_close(fn(dirty, mask), fn(clean, mask), rtol=0, atol=0)
    torch.testing.assert_close(
        masked_mean(dirty, mask, dim=1), masked_mean(clean, mask, dim=1), rtol=0, atol=0
    )
    # Gradients of padded entries are exactly 0, never nan.
    for fn in (masked_mean, masked_var, masked_whiten):
        leaf = dirty.clone().requires_grad_(True)
        out = fn(leaf, mask)
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        assert torch.all(leaf.grad[~mask] == 0), fn.__name__
        assert torch.isfinite(leaf.grad).all(), fn.__name__


def test_masked_mean_along_dim_equals_a_python_loop():
    x, mask = _padded()
    per_row = masked_mean(x, mask, dim=1)
    expected = torch.stack([x[i][mask[i]].mean() for i in range(x.shape[0])])
    torch.testing.assert_close(per_row, expected, rtol=0, atol=1e-12)
    # Along dim 0 (columns): every column of this mask has at least one valid entry.
    per_col = masked_mean(x, mask, dim=0)
    expected = torch.stack([x[:, j][mask[:, j]].mean() for j in range(x.shape[1])])
    torch.testing.assert_close(per_col, expected, rtol=0, atol=1e-12)
    sums = masked_sum(x, mask, dim=1)
    torch.testing.assert_close(sums, torch.stack([x[i][mask[i]].sum() for i in range(5)]))


def test_float_mask_and_half_precision_input():
    x, mask = _padded()
    torch.testing.assert_close(masked_mean(x, mask.double()), masked_mean(x, mask))
    # bfloat16 input: statistics accumulate in float32, the result comes back in bfloat16.
    out = masked_whiten(x.to(torch.bfloat16), mask)
    assert out.dtype == torch.bfloat16
    ref = masked_whiten(x.to(torch.bfloat16).float(), mask)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_zero_padding_keeps_nan_out_of_values_and_gradients():
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0], requires_grad=True)
    valid = torch.tensor([True, False, False, True])
    out = zero_padding(x, valid)
    assert out.tolist() == [1.0, 0.0, 0.0, -2.0]
    (out * torch.tensor([3.0, float("nan"), 5.0, 7.0])).sum().backward()
    assert x.grad.tolist() == [3.0, 0.0, 0.0, 7.0]


def test_valid_mask_checks_shapes_and_names_the_caller_and_arguments():
    x = torch.zeros(2, 3)
    assert valid_mask(x, torch.tensor([[1, 0, 1], [0, 0, 1]]), "f").dtype == torch.bool
    assert valid_mask(x, None, "f", batch_by_time=True) is None
    with pytest.raises(ValueError, match=r"^f: `kl` must have shape \[B, T\], got \(3,\)$"):
        valid_mask(torch.zeros(3), None, "f", name="kl", batch_by_time=True)
    with pytest.raises(ValueError, match=r"^f: `b` must have the same shape as `a`, got `a` "):
        valid_mask(x, torch.ones(2, 3), "f", name="a", others=[("b", torch.zeros(3, 2))])
    with pytest.raises(ValueError, match=r"^f: `mask` must have the same shape as `a`, got "):
        valid_mask(x, torch.ones(3, 2), "f", name="a")
    halves = torch.full((2, 3), 0.5)
    assert valid_mask(x, halves, "f").all()  # nonzero is valid ...
    with pytest.raises(ValueError, match="^f: `mask` must be bool or hold only 0 and 1$"):
        valid_mask(x, halves, "f", zero_one=True)  # ... unless only 0 and 1 are allowed


def test_errors():
    x, mask = _padded()
    with pytest.raises(ValueError, match="same shape"):
        masked_mean(x, mask[:, :3])
    with pytest.raises(ValueError, match="same shape"):
        masked_whiten(x, mask[0])
    empty = torch.zeros_like(mask)
    for fn in (masked_mean, masked_var, masked_whiten):
        with pytest.raises(ValueError, match="no valid entries"):
            fn(x, empty)
    row_empty = mask.clone()
    row_empty[1] = False
    with pytest.raises(ValueError, match="dim=1"):
        masked_mean(x, row_empty, dim=1)
    single = torch.zeros_like(mask)
    single[0, 0] = True
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, single)
    assert masked_var(x, single, unbiased=False) == 0
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, single)
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(x, mask, eps=-1.0)
    assert masked_sum(x, empty) == 0


def test_distributed_flag_is_a_noop_without_a_process_group():
    assert not dist.is_initialized()
    x, mask = _padded()
    torch.testing.assert_close(
        masked_whiten(x, mask, distributed=True), masked_whiten(x, mask, distributed=False)
    )


# ---- two real processes (gloo) ------------------------------------------------------


def _whiten_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        x, mask = _padded()
        x = x.masked_fill(~mask, GARBAGE)
        rows = slice(0, 3) if rank == 0 else slice(3, 5)  # uneven halves
        local_x = x[rows].clone().requires_grad_(True)
        local_mask = mask[rows]
        out = masked_whiten(local_x, local_mask)
        weights = torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape)[rows]
        (out * weights).sum().backward()
        local_only = masked_whiten(x[rows], local_mask, distributed=False)

        # A rank with no valid entry still takes part and gets zeros.
        no_valid = torch.zeros_like(local_mask) if rank == 1 else local_mask
        out_no_valid = masked_whiten(x[rows], no_valid)

        # Too few valid entries globally: every rank raises (none is left waiting).
        one_valid = torch.zeros_like(local_mask)
        if rank == 0:
            one_valid[0, 0] = True
        try:
            masked_whiten(x[rows], one_valid)
            raised = False
        except ValueError:
            raised = True
        torch.save(
            {
                "out": out.detach(),
                "grad": local_x.grad,
                "local_only": local_only,
                "out_no_valid": out_no_valid,
                "raised": raised,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_distributed_whitening_equals_whitening_the_full_batch(tmp_path):
    # fork lets the children reuse the imported torch (~0.1 s instead of ~8 s with spawn).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _whiten_worker,
        args=(2, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method=method,
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    x, mask = _padded()
    x = x.masked_fill(~mask, GARBAGE)
    full_x = x.clone().requires_grad_(True)
    full = masked_whiten(full_x, mask)
    weights = torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape)
    (full * weights).sum().backward()

    got = torch.cat([r["out"] for r in results])
    torch.testing.assert_close(got, full.detach(), rtol=0, atol=1e-12)
    grad = torch.cat([r["grad"] for r in results])
    torch.testing.assert_close(grad, full_x.grad, rtol=0, atol=1e-10)
    # The local statistics differ, so the test above could fail.
    local = torch.cat([r["local_only"] for r in results])
    assert (local - full.detach()).abs().max() > 0.1

    ref = masked_whiten(x[:3], mask[:3])
    torch.testing.assert_close(results[0]["out_no_valid"], ref, rtol=0, atol=1e-12)
    assert torch.all(results[1]["out_no_valid"] == 0)
    assert results[0]["raised"] and results[1]["raised"]


def _legacy_all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The collective ``masked_whiten`` used before: ``torch.distributed.nn``'s, deprecated."""
    import warnings

    from torch.distributed.nn.functional import all_reduce

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return all_reduce(t, op=dist.ReduceOp.SUM)


def _collective_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import warnings

    from rlkl_lightning import masked

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        x, mask = _padded(seed=rank + 1)
        weights = torch.linspace(-1, 2, x.numel(), dtype=x.dtype).reshape(x.shape)
        results = {}
        for name, reduce in (("new", masked._all_reduce_sum), ("old", _legacy_all_reduce_sum)):
            masked._all_reduce_sum = reduce
            leaf = x.clone().requires_grad_(True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = masked_whiten(leaf, mask)
                (out * weights).sum().backward()
            results[name] = (out.detach(), leaf.grad, [str(w.message) for w in caught])
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_the_functional_collective_gives_todays_values_and_gradients_bit_for_bit(tmp_path):
    """``masked_whiten``'s all-reduce: torch's functional collective against the deprecated one."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _collective_worker,
        args=(2, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method=method,
    )
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        (new, new_grad, new_warnings), (old, old_grad, _) = results["new"], results["old"]
        assert torch.equal(new, old) and torch.equal(new_grad, old_grad)
        assert new_grad.abs().sum() > 0
        assert new_warnings == []  # the deprecated collective warned on every rank
