"""value_model_thread: the separate value model in a second thread, the same numbers.

The option runs the value model's forward and backward passes in a helper thread beside the
policy's (rlkl_lightning/value_thread.py). The tests run with one torch thread (conftest.py),
so both paths compute every operation with one thread: every logged number and every weight
must then be the same bit for bit, and the value model must really have run in the helper.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from conftest import fit_on_prompts
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy

from rlkl_lightning import PPOModule
from rlkl_lightning.rewards import FunctionReward
from rlkl_lightning.value_thread import ValueThread


class Record(Callback):
    """Every logged number of every batch."""

    def __init__(self):
        self.batches: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _train(tiny_lm_dir, value_model_thread: bool, batches: int = 2, patch=None):
    seed_everything(0, verbose=False)
    module = PPOModule(
        policy=str(tiny_lm_dir),
        value_model=str(tiny_lm_dir),
        value_model_thread=value_model_thread,
        reward=FunctionReward(lambda p, r: float(len(r.split()))),
        max_prompt_tokens=16,
        max_new_tokens=6,
        ppo_epochs=2,
        num_minibatches=2,
        grad_accum_steps=2,
        lr=1e-2,
        log_samples_every=0,
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
    fit_on_prompts(module, prompts, callbacks=[record])
    return module, record.batches, threads, before


def test_training_logs_the_same_numbers_bit_for_bit(tiny_lm_dir):
    plain, plain_logs, plain_threads, _ = _train(tiny_lm_dir, False)
    threaded, logs, threads, _ = _train(tiny_lm_dir, True)
    # 2 batches x 2 epochs x 2 minibatches x 2 micro-batches value forwards with gradients
    assert len(threads) == len(plain_threads) == 16
    assert set(threads) != set(plain_threads)
    assert all(name.startswith("rlkl-value") for name in threads)
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


def test_a_non_finite_value_loss_skips_the_batch(tiny_lm_dir):
    """The gate sees the value loss before any backward pass: nothing is trained."""

    def poison(module):
        honest = module._value_loss

        def first_is_nan(mb, hidden):
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


def test_bad_settings_are_refused(tiny_lm_dir):
    kw = dict(
        policy=str(tiny_lm_dir), reward=FunctionReward(lambda p, r: 0.0), max_prompt_tokens=16
    )
    with pytest.raises(ValueError, match="`value_model_thread`=True needs a separate"):
        PPOModule(value_model_thread=True, **kw)
    module = PPOModule(value_model=str(tiny_lm_dir), value_model_thread=True, **kw)
    module.trainer = Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False)
    with pytest.raises(ValueError, match="single-device strategy, got DDPStrategy"):
        module.on_fit_start()
