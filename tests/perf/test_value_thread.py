"""ppo.value_model_thread: the separate value model in a second thread, the same numbers.

The option runs the value model's forward and backward passes in a helper thread beside the
policy's, and the product for the policy's LM head weight gradient there too
(rlkl_lightning/perf/value_thread.py). The tests run with one torch thread (conftest.py),
so both paths compute every operation with one thread: every logged number and every weight
must then be the same bit for bit, and the value model must really have run in the helper.
"""

from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch
from helpers.trainers import fit_on_prompts
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from torch.optim.optimizer import register_optimizer_step_post_hook

from rlkl_lightning import PPOModule
from rlkl_lightning.models import logprobs
from rlkl_lightning.models.forward import HeadProducts
from rlkl_lightning.perf.onednn import available as onednn_available
from rlkl_lightning.perf.value_thread import ValueThread, value_thread_on
from rlkl_lightning.rewards import FunctionReward


class Record(Callback):
    """Every logged number of every batch."""

    def __init__(self):
        self.batches: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _train(
    tiny_lm_dir, value_model_thread: bool, batches=2, patch=None, grad_accum_steps=2, **settings
):
    seed_everything(0, verbose=False)
    module = PPOModule(
        policy=str(tiny_lm_dir),
        ppo={"value_model": str(tiny_lm_dir), "value_model_thread": value_model_thread},
        models={"cpu_matmul": settings.pop("cpu_matmul", "auto")},
        reward=FunctionReward(lambda p, r: float(len(r.split()))),
        sampling={"max_prompt_tokens": 16, "max_new_tokens": 6},
        optimization={
            "ppo_epochs": 2,
            "num_minibatches": 2,
            "grad_accum_steps": grad_accum_steps,
            "lr": 1e-2,
        },
        logging={"log_samples_every": 0},
    )
    threads: list[str] = []  # where the value model ran while gradients were on
    module.value_trunk.base_model.register_forward_hook(
        lambda *_: (
            threads.append(threading.current_thread().name) if torch.is_grad_enabled() else None
        )
    )
    if patch is not None:
        patch(module)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    prompts = ["the film was", "this book is", "the food", "a story"] * (2 * batches)
    record = Record()
    fit_on_prompts(module, prompts, callbacks=[record], **settings)
    return module, record.batches, threads, before


ONEDNN = pytest.mark.skipif(not onednn_available(), reason="no oneDNN float32 linear kernel")


@pytest.mark.parametrize(
    "grad_accum_steps, cpu_matmul",
    [(1, "default"), (2, "default"), pytest.param(2, "onednn", marks=ONEDNN)],
)
def test_training_logs_the_same_numbers_bit_for_bit(
    tiny_lm_dir, monkeypatch, grad_accum_steps, cpu_matmul
):
    head: list[str] = []  # where the LM head's weight gradients were computed
    product = logprobs._weight_gradient

    def recorded(*args):
        head.append(threading.current_thread().name)
        return product(*args)

    monkeypatch.setattr(logprobs, "_weight_gradient", recorded)
    updates: list[tuple[str, int]] = []  # AdamW's updates: thread, number of parameters
    fused = torch._fused_adamw_

    def recorded_update(params, *args, **kwargs):
        updates.append((threading.current_thread().name, len(params)))
        return fused(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", recorded_update)
    plain, plain_logs, plain_threads, _ = _train(
        tiny_lm_dir, False, 2, None, grad_accum_steps, cpu_matmul=cpu_matmul
    )
    plain_head, head[:] = head[:], []
    plain_updates, updates[:] = updates[:], []
    threaded, logs, threads, _ = _train(
        tiny_lm_dir, True, 2, None, grad_accum_steps, cpu_matmul=cpu_matmul
    )
    # 2 batches x 2 epochs x 2 minibatches x micro-batches: value forwards with gradients
    steps = 8 * grad_accum_steps
    assert len(threads) == len(plain_threads) == len(head) == len(plain_head) == steps
    assert set(plain_threads) == set(plain_head) == {"MainThread"}
    assert all(name.startswith("rlkl-value") for name in threads)
    # The head's product goes to the helper where the sum it enters does not depend on the
    # order (the first micro-batch of each minibatch); else it is computed in place.
    assert head == ["rlkl-value_0", "MainThread"][:grad_accum_steps] * 8
    # 8 optimizer steps; with the thread, the value model's parameters are the helper's.
    n = plain_updates[0][1]
    assert plain_updates == [("MainThread", n)] * 8
    helper_part = {k for name, k in updates if name.startswith("rlkl-value")}
    assert len(helper_part) == 1 and 0 < (k := helper_part.pop()) < n
    assert sorted(updates) == sorted([("MainThread", n - k), ("rlkl-value_0", k)] * 8)
    assert len(logs) == len(plain_logs) == 2
    for ours, theirs in zip(logs, plain_logs, strict=True):
        assert ours.keys() == theirs.keys()
        assert ours["progress/skipped_batches"] == 0
        for key, value in theirs.items():
            if key.startswith("perf/"):  # clock times
                continue
            assert ours[key] == value or (math.isnan(value) and math.isnan(ours[key])), key
    for (name, a), b in zip(
        plain.state_dict().items(), threaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.get_num_threads() == 1  # restored


def test_bf16_mixed_gives_the_same_numbers_bit_for_bit(tiny_lm_dir):
    """Under autocast too: the helper runs the value model in the caller's autocast state."""
    plain, plain_logs, _, _ = _train(tiny_lm_dir, False, 1, None, 1, precision="bf16-mixed")
    threaded, logs, threads, _ = _train(tiny_lm_dir, True, 1, None, 1, precision="bf16-mixed")
    assert len(threads) == 4 and all(name.startswith("rlkl-value") for name in threads)
    for key, value in plain_logs[0].items():
        if not key.startswith("perf/"):
            assert logs[0][key] == value or (math.isnan(value) and math.isnan(logs[0][key])), key
    for (name, a), b in zip(
        plain.state_dict().items(), threaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_non_finite_value_loss_skips_the_batch(tiny_lm_dir):
    """The gate sees the value loss before any backward pass: nothing is trained."""

    def poison(module):
        honest = module._value_loss

        def first_is_nan(mb, hidden=None):
            loss, clipfrac = honest(mb, hidden)
            return loss * float("nan"), clipfrac

        module._value_loss = first_is_nan

    module, logs, _, before = _train(tiny_lm_dir, True, batches=1, patch=poison)
    assert logs[0]["progress/skipped_batches"] == 1
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in module.parameters())


def test_handoff_gives_the_gradients_of_one_backward_pass():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 1)
    x = torch.randn(4, 5)

    def value_side():
        return b(x).square().mean()

    plain = (a(x).sum() + 0.5 * value_side()) * 0.25
    plain.backward()
    expected = [p.grad.clone() for p in (*a.parameters(), *b.parameters())]
    for p in (*a.parameters(), *b.parameters()):
        p.grad = None
    with ValueThread("cpu") as helper:
        side = helper.submit(value_side)
        main = a(x).sum()
        total = (main + 0.5 * helper.handoff(side.result())) * 0.25
        assert total == plain
        total.backward()
        helper.wait()
    got = [p.grad for p in (*a.parameters(), *b.parameters())]
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize("chunk", [None, 4])  # 4: the chunked head, a last chunk of 2 rows
@pytest.mark.parametrize("tied", [True, False])
def test_deferred_head_gradient_equals_autograd(tied, chunk):
    """The head's weight gradient from the helper sums into ``.grad`` as autograd sums it.

    Chunked, the helper recomputes the chunks' logits for the weight gradient itself.
    """
    torch.manual_seed(0)
    weight = torch.randn(11, 4, requires_grad=True)
    hidden, tokens = torch.randn(2, 3, 4, requires_grad=True), torch.randint(11, (2, 3))

    def loss(defer):
        head = logprobs.token_logprobs(hidden, weight, tokens, 0.7, HeadProducts, defer, chunk)
        return head.square().sum() + (weight.sin().sum() if tied else 0.0)

    grads = {}
    for name, threaded, runs in [("plain", False, 1), ("helper", True, 1), ("twice", True, 2)]:
        weight.grad = hidden.grad = None
        with ValueThread("cpu") as helper:
            for _ in range(runs):  # the second run finds .grad set: computed in place
                loss(helper.defer if threaded else None).backward()
                helper.wait()
        grads[name] = (weight.grad.clone(), hidden.grad.clone())
    weight.grad = hidden.grad = None
    for _ in range(2):
        loss(None).backward()
    grads["plain twice"] = (weight.grad, hidden.grad)
    for a, b in zip(grads["helper"], grads["plain"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(grads["twice"], grads["plain twice"], strict=True):
        assert torch.equal(a, b)
    whole = logprobs.token_logprobs(hidden, weight, tokens, 0.7, chunk_rows=6)  # one chunk
    whole = whole.square().sum() + (weight.sin().sum() if tied else 0.0)
    for a, b in zip(grads["helper"], torch.autograd.grad(whole, (weight, hidden)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_helper_errors_reach_the_caller_and_threads_are_restored():
    threads = torch.get_num_threads()

    def fails():
        raise RuntimeError("value model broke")

    with pytest.raises(RuntimeError, match="value model broke"):
        with ValueThread("cpu") as helper:
            helper.submit(fails).result()
    assert torch.get_num_threads() == threads
    with ValueThread("cpu") as helper, torch.no_grad():
        assert helper.submit(torch.is_grad_enabled).result() is False
    with ValueThread("cpu") as helper, torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = helper.submit(lambda: torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype).result()
        assert dtype == torch.bfloat16


@pytest.mark.parametrize("torch_threads, helper", [(2, True), (1, False)])
def test_the_default_runs_the_thread_where_it_helps(tiny_lm_dir, torch_threads, helper):
    """ppo.value_model_thread=None: on with a separate value model on a CPU with 2+ threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        module, batches, threads, _ = _train(tiny_lm_dir, None, batches=1)
    finally:
        torch.set_num_threads(before)
    assert module.ppo.value_model_thread is None and len(batches) == 1
    main = threading.current_thread().name
    assert threads and any(t != main for t in threads) == helper


@pytest.mark.parametrize(
    ("setting", "separate", "strategy", "device", "threads", "on"),
    [
        (None, True, "single", "cpu", 2, True),  # where it helps
        (None, False, "single", "cpu", 2, False),  # the value head shares the policy's passes
        (None, True, "ddp", "cpu", 2, False),
        (None, True, "single", "cuda", 2, False),
        (None, True, "single", "cpu", 1, False),
        (False, True, "single", "cpu", 2, False),
        (True, True, "single", "cpu", 1, True),  # asked for: kept
        (False, True, "ddp", "cpu", 2, False),
    ],
)
def test_the_speed_up_decides_when_the_value_thread_runs(
    setting, separate, strategy, device, threads, on
):
    """``value_thread_on``: PPO's ``ppo.value_model_thread``, None decided beside the speed-up."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    made = SingleDeviceStrategy("cpu") if strategy == "single" else DDPStrategy()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert value_thread_on(setting, separate, made, device, "PPOModule") is on
    finally:
        torch.set_num_threads(before)
    if strategy == "ddp":
        with pytest.raises(ValueError, match=r"^PPOModule: `ppo\.value_model_thread`=True needs"):
            value_thread_on(True, separate, made, device, "PPOModule")


def test_bad_settings_are_refused(tiny_lm_dir):
    kw = dict(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: 0.0),
        sampling={"max_prompt_tokens": 16},
    )
    with pytest.raises(
        ValueError,
        match=r"`ppo\.value_model_thread` must be False or None without a separate "
        r"`ppo\.value_model`",
    ):
        PPOModule(ppo={"value_model_thread": True}, **kw)
    module = PPOModule(ppo={"value_model": str(tiny_lm_dir), "value_model_thread": True}, **kw)
    module.trainer = Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False)
    with pytest.raises(ValueError, match="single-device strategy, got DDPStrategy"):
        module.on_fit_start()


def _two_nets(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 5), torch.nn.Linear(6, 1)


def _set_grads(nets, step):
    gen = torch.Generator().manual_seed(step)
    for net in nets:
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 3


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipped, and not clipped
def test_split_clipping_equals_torch(max_norm):
    nets = _two_nets()
    params = [p for net in nets for p in net.parameters()]
    params[1].grad = None  # a parameter without a gradient
    _set_grads(nets, 0)
    params[1].grad = None
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm)
    clipped = [p.grad.clone() if p.grad is not None else None for p in params]
    _set_grads(nets, 0)
    params[1].grad = None
    with ValueThread("cpu", nets[1].parameters()) as helper:
        norm = helper.clip_grad_norm(params, max_norm)
    assert torch.equal(norm, expected)
    for p, g in zip(params, clipped, strict=True):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    # Gradients of two dtypes: torch's own clipping (it orders the norms by dtype).
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    extra.grad = torch.full((3,), 2.0, dtype=torch.float64)
    _set_grads(nets, 0)
    params[1].grad = None
    with ValueThread("cpu", nets[1].parameters()) as helper:
        mixed = helper.clip_grad_norm([*params, extra], max_norm)
    extra.grad = torch.full((3,), 2.0, dtype=torch.float64)
    _set_grads(nets, 0)
    params[1].grad = None
    assert torch.equal(mixed, torch.nn.utils.clip_grad_norm_([*params, extra], max_norm))


@pytest.mark.parametrize("optimizer", ["AdamW", "Adam", "AdamW-fused", "SGD"])
def test_split_step_equals_one_step(optimizer):
    """Both halves' updates equal one step's, hooks and LR-scheduler bookkeeping included."""
    runs = {}
    for split in (False, True):
        nets = _two_nets()
        params = [p for net in nets for p in net.parameters()]
        name, _, fused = optimizer.partition("-")
        kwargs = {"fused": True} if fused else {}
        opt = getattr(torch.optim, name)(params, lr=0.1, weight_decay=0.01, **kwargs)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        seen: list[str] = []
        hook = register_optimizer_step_post_hook(lambda *_, seen=seen: seen.append("post"))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the scheduler's "step() before optimizer.step()"
                for step in range(3):
                    _set_grads(nets, step)
                    if split:
                        with ValueThread("cpu", nets[1].parameters()) as helper:
                            helper.step(opt)
                    else:
                        opt.step()
                    sched.step()
        finally:
            hook.remove()
        assert seen == ["post"] * 3
        assert opt.param_groups[0]["params"] == params
        runs[split] = [p.detach().clone() for p in params], opt.state_dict()
    (plain, plain_state), (split_params, split_state) = runs[False], runs[True]
    for a, b in zip(plain, split_params, strict=True):
        assert torch.equal(a, b)
    for key, state in plain_state["state"].items():
        for field, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(split_state["state"][key][field])
            )
