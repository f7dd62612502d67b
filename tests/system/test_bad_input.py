"""Bad input and numeric faults: one test per row of the README table "Bad input and faults".

Each case gives a clear error naming the option and the allowed values, or a warning where
continuing is right, and never a corrupted run: a batch with a non-finite KL, reward, loss,
gradient or value is skipped with the weights, the optimizer and beta untouched, counted and
warned, and the next batch trains normally.
"""

from __future__ import annotations

import math
import re
import shutil
import warnings

import pytest
import torch
import yaml
from helpers.cli_runs import cli_error
from helpers.cli_runs import law as law_block
from helpers.trainers import cpu_trainer, fit_on_prompts
from lightning.pytorch import LightningModule, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from rlkl_lightning import (
    AdaptiveKLController,
    KLControllerCallback,
    KLDriftMonitor,
    PIKLController,
    PPOModule,
)
from rlkl_lightning.algorithms.resume import check_process_count
from rlkl_lightning.checkpoints import check_checkpoint
from rlkl_lightning.data import PromptDataModule
from rlkl_lightning.kl.settings import KLSettings
from rlkl_lightning.models.loading import load_tokenizer
from rlkl_lightning.rewards import FunctionReward

PROMPTS = ["the film was", "this book is", "the food", "it was really", "a story", "the plot"]
BATCH = 4


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def good_fraction(prompt: str, response: str) -> float:
    words = response.split()
    return sum(w == "good" for w in words) / max(len(words), 1)


GROUPS = (
    "sampling",
    "optimization",
    "objective",
    "penalty",
    "models",
    "safeguards",
    "logging",
    "ppo",
)


def ppo_args(path, **overrides):
    """The module's arguments; a group's override (a dict) is merged into its fields."""
    args = dict(
        policy=str(path),
        reward=FunctionReward(good_fraction),
        penalty={"init_coef": 0.2},
        sampling={"max_prompt_tokens": 8, "max_new_tokens": 4},
        optimization={"ppo_epochs": 1, "num_minibatches": 1, "lr": 1e-2},
        logging={"log_samples_every": 0},
    )
    for key, value in overrides.items():
        merge = key in GROUPS and isinstance(value, dict)
        args[key] = {**args.get(key, {}), **value} if merge else value
    return args


def fit(module, n_batches, callbacks=(), prompts=PROMPTS, **settings):
    data = [prompts[i % len(prompts)] for i in range(n_batches * BATCH)]
    return fit_on_prompts(module, data, BATCH, callbacks, **settings)


def adaptive():
    return AdaptiveKLController(init_kl_coef=0.2, target=1.0, horizon=40)


# ---- controller and KL options ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target": 0.0}, r"`kl.target` must be a finite number > 0, got 0.0"),
        ({"target": -1.0}, r"`kl.target` must be a finite number > 0"),
        ({"target": math.nan}, r"`kl.target` must be a finite number > 0, got nan"),
        ({"unit": "per_token"}, r"`kl.unit` must be one of \('sequence', 'token'\)"),
        ({"controller": "pid"}, r"`kl.controller` must be one of \('fixed', 'adaptive'"),
    ],
)
def test_cli_kl_group_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KLSettings(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"controller": law_block("adaptive", horizon=0.0)},
            r"`horizon` must be a finite number > 0 \(samples\), got 0.0",
        ),
        ({"controller": law_block("adaptive", horizon=-5.0)}, r"`horizon` must be a finite"),
        ({"controller": law_block("exponential", k=math.nan)}, r"`k` must be a finite number > 0"),
        ({"controller": law_block("pi", kp=-1.0)}, r"`kp` must be a finite number >= 0"),
        (
            {"controller": "pid"},
            r"`kl.controller` must be one of \('fixed', .*'logpid'\) or the dotted path "
            r".* got 'pid'",
        ),
        ({"min_kl_coef": 0.0}, r"^`kl.min_kl_coef` must be a finite number > 0"),
        (
            {"min_kl_coef": 0.5},
            r"^the module's starting beta \(`model.init_args.penalty.init_coef`\) "
            r"must lie in \[`kl.min_kl_coef`, `kl.max_kl_coef`\] = \[0.5, None\], got 0.2",
        ),
        (
            {"min_kl_coef": 0.5, "max_kl_coef": 0.1},
            r"^`kl.min_kl_coef` must be <= `kl.max_kl_coef`",
        ),
        ({"window": 0}, r"`kl.window` must be an int >= 1"),
        ({"high": 0.5}, r"`kl.high` must be > 1"),
        ({"min_batches": 0}, r"`kl.min_batches` must be an int >= 1 \(None: window \+ min\(2 x"),
        ({"hysteresis": 1.5}, r"`kl.hysteresis` must lie in \[0, 1\), got 1.5"),
    ],
)
def test_cli_kl_group_law_and_monitor_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KLSettings(**kwargs).callbacks(init_kl_coef=0.2)


def test_beta_out_of_range_or_nan_is_rejected(tiny_lm_dir):
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"`penalty\.init_coef` must be a finite number >= 0"):
            PPOModule(**ppo_args(tiny_lm_dir, penalty={"init_coef": bad}))
    # The adaptive laws multiply beta: 0 could never move, and the error says to use `fixed`.
    for law in ("adaptive", "exponential", "pi", "logpid"):
        with pytest.raises(
            ValueError,
            match=r"^the module's starting beta \(`model.init_args.penalty.init_coef`\) must be a "
            r"finite number > 0, got 0.0: the .* law multiplies "
            r"beta, and from 0 it could never move; for no KL penalty use the fixed law",
        ):
            KLSettings(controller=law).callbacks(init_kl_coef=0.0)


def test_cli_beta_zero_with_the_fixed_law_trains_without_a_kl_penalty(tiny_lm_dir, tmp_path):
    from rlkl_lightning.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    args = {
        k: v for k, v in ppo_args(tiny_lm_dir, penalty={"init_coef": 0}).items() if k != "reward"
    }
    cli = main(
        ["fit", "--model=rlkl_lightning.PPOModule", f"--model.init_args={yaml.safe_dump(args)}"]
        + ["--data=rlkl_lightning.data.PromptDataModule", f"--data.prompts={prompts}"]
        + ["--data.heldout=null", f"--data.batch_size={BATCH}", "--kl.controller=fixed"]
        + ["--trainer.max_steps=2", "--trainer.enable_progress_bar=false"]
        + [f"--trainer.logger.init_args.save_dir={tmp_path}"]
    )
    metrics = cli.trainer.callback_metrics
    assert cli.model.kl_coef == 0.0 and float(metrics["objective/kl_coef"]) == 0.0
    assert float(metrics["objective/non_score_reward"]) == 0.0
    assert float(metrics["objective/kl"]) != 0.0  # the KL is there, it is just not penalised


@pytest.mark.parametrize(
    ("old", "message"),
    [
        ({"kl": {"placement": "loss"}}, "PPOModule: `kl` is now `penalty` (docs/options.md"),
        ({"init_kl_coef": 0.3}, "PPOModule: `init_kl_coef` is now `penalty.init_coef` ("),
        ({"top_p": 0.9}, "PPOModule: `top_p` is now `sampling.top_p` (docs/options.md"),
    ],
)
def test_an_old_argument_name_in_python_names_the_new_one(old, message):
    with pytest.raises(TypeError) as raised:
        PPOModule(policy="/no/such/model", **old)  # refused before any model loads
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_a_subclass_keeps_an_argument_of_its_own_with_an_old_name(tiny_lm_dir):
    class Tempered(PPOModule):
        def __init__(self, temperature: float = 1.0, **kwargs):
            super().__init__(
                **kwargs, sampling={"temperature": temperature, "max_prompt_tokens": 8}
            )

    module = Tempered(temperature=0.5, policy=str(tiny_lm_dir))
    assert module.sampling.temperature == 0.5


def test_unknown_estimator_names_the_allowed_ones(tiny_lm_dir):
    with pytest.raises(
        ValueError,
        match=r"`penalty\.estimator` must be one of \('k1', 'k2', 'k3', 'exact'\) or the dotted "
        r"path of an Estimator .*, got 'k4'$",
    ):
        PPOModule(**ppo_args(tiny_lm_dir, penalty={"estimator": "k4"}))


@pytest.mark.parametrize(
    ("option", "bad", "allowed"),
    [
        ("optimization.ppo_epochs", 0, "an integer >= 1"),
        ("optimization.num_minibatches", 1.5, "an integer >= 1"),
        ("optimization.lr", math.nan, "a finite number > 0"),
        ("sampling.temperature", 0.0, "a finite number > 0"),
        ("sampling.top_p", 0.0, r"in \(0, 1\]"),
        ("ppo.gamma", 1.5, r"in \[0, 1\]"),
        ("objective.cliprange", -0.2, "a finite number > 0"),
        ("optimization.max_grad_norm", 0.0, "None or a number > 0"),
        ("optimization.lr_schedule", "cosine", r"one of \('constant', 'linear'\)"),
        ("safeguards.max_skipped_in_a_row", 0, "None or an integer >= 1"),
        ("penalty.placement", "both", r"one of \('reward', 'loss'\)"),
        ("penalty.loss_estimator", "exact", r"one of \('k1', 'k2', 'k3'\) or the dotted path .*"),
        ("penalty.loss_weight_clip", 0.5, "None or a finite number >= 1"),
        ("logging.kl_token_threshold", 0.0, "None or a number > 0"),
        ("penalty.trust_region", math.inf, "None or a number > 0"),
        ("engine.kind", "sglang", r"one of \('native', 'compiled', 'vllm'\) or the dotted path .*"),
        ("engine.correction", "tis", r"one of \('none', 'token_tis', 'sequence_mis'\)"),
        ("engine.correction_threshold", 1.0, "a finite number > 1"),
        ("engine.gpu_memory_utilization", 0.0, r"in \(0, 1\]"),
    ],
)
def test_ppo_options_name_the_option_and_allowed_values(tiny_lm_dir, option, bad, allowed):
    group, field = option.split(".")
    with pytest.raises(ValueError, match=rf"`{re.escape(option)}` must be {allowed}, got"):
        PPOModule(**ppo_args(tiny_lm_dir, **{group: {field: bad}}))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"correction": "token_tis"}, r"`engine\.correction` applies to `engine\.kind='vllm'`"),
        ({"sleep_mode": True}, r"`engine\.sleep_mode` applies to `engine\.kind='vllm'`"),
        (
            {"kind": "vllm", "compiled_decode": True},
            r"`engine\.compiled_decode` applies to `engine\.kind='native'`",
        ),
    ],
)
def test_engine_options_that_need_another_engine_are_refused(options, message):
    from rlkl_lightning.algorithms.options import Engine

    with pytest.raises(ValueError, match=message):
        Engine(**options)


def test_k1_in_the_loss_is_refused_unless_asked_for_on_purpose():
    """k1 as a loss has expected gradient 0 (docs/kl.md); the exact study runs it on purpose."""
    from rlkl_lightning.algorithms.options import KLPenalty

    with pytest.raises(
        ValueError,
        match=r"^`penalty.loss_estimator` k1 with `penalty.placement: loss` has expected gradient"
        r" 0, .*use k2 or k3 .*`penalty.allow_no_gradient: true` runs it on purpose\)$",
    ):
        KLPenalty(placement="loss", loss_estimator="k1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KLPenalty(placement="loss", loss_estimator="k1", allow_no_gradient=True)
        KLPenalty(placement="loss")  # k2
        KLPenalty(placement="loss", loss_estimator="k3")
        KLPenalty(placement="reward", loss_estimator="k1")  # not differentiated
    with pytest.raises(ValueError, match=r"`penalty.allow_no_gradient` must be True or False"):
        KLPenalty(allow_no_gradient="yes")


@pytest.mark.parametrize("value", [None, [1, 2], 3])
def test_a_group_that_is_not_a_mapping_is_named_in_python(tiny_lm_dir, value):
    with pytest.raises(ValueError, match=r"^`sampling` must be a mapping of its options \['max_"):
        PPOModule(**ppo_args(tiny_lm_dir, sampling=value))


def test_truncated_sampling_warns_that_the_kl_is_biased(tiny_lm_dir):
    with pytest.warns(
        RuntimeWarning, match=r"`sampling\.top_k`/`sampling\.top_p` truncate the sampling"
    ):
        PPOModule(**ppo_args(tiny_lm_dir, sampling={"top_k": 5}))


class LogsKL(LightningModule):
    """Logs a fixed per-sequence KL and response length, like PPOModule does."""

    def __init__(self, kl: float, length: float):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.kl, self.length, self.kl_coef = kl, length, 0.1

    def training_step(self, batch, batch_idx):
        self.log("objective/kl", self.kl)
        self.log("objective/kl_per_token", self.kl / self.length)
        self.log("objective/response_tokens", self.length)
        return self.layer(batch[0]).sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def unit_warnings(module, callbacks) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cpu_trainer(callbacks).fit(module)
    return [str(w.message) for w in record if "with unit=" in str(w.message)]


def test_target_that_looks_like_the_wrong_unit_warns_once():
    # 0.05 "per sequence" over 30-token responses: 0.0017 nats per token.
    controller = KLControllerCallback(AdaptiveKLController(0.1, target=0.05, horizon=1000))
    monitor = KLDriftMonitor(target=0.05, window=2)
    messages = unit_warnings(LogsKL(0.04, 30.0), [controller, monitor])
    assert len(messages) == 1  # the controller warns; the monitor with the same target does not
    assert messages[0].startswith("KLControllerCallback: target=0.05 with unit='sequence' is")
    assert "set unit='token' (allowed units: 'sequence', 'token')" in messages[0]
    # A per-sequence target of 6 nats "per token": the monitor alone warns too.
    (message,) = unit_warnings(LogsKL(3.0, 30.0), [KLDriftMonitor(target=6.0, unit="token")])
    assert "KLDriftMonitor: target=6 with unit='token' is 180 nats per sequence" in message
    # A plausible target does not warn.
    controller = KLControllerCallback(AdaptiveKLController(0.1, target=6.0, horizon=1000))
    assert unit_warnings(LogsKL(5.0, 30.0), [controller, KLDriftMonitor(target=6.0)]) == []


# ---- models, tokenizer, context ----------------------------------------------------------------


def test_missing_model_path_names_the_option(tiny_lm_dir, tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match=r"`policy`: model path .*no_such_model' does not exist"):
        PPOModule(**ppo_args(missing))
    with pytest.raises(ValueError, match=r"`reference`: model path .* does not exist; allowed:"):
        PPOModule(**ppo_args(tiny_lm_dir, reference=missing))
    with pytest.raises(ValueError, match=r"`ppo\.value_model`: model path .* does not exist"):
        PPOModule(**ppo_args(tiny_lm_dir, ppo={"value_model": missing}))
    with pytest.raises(ValueError, match=r"`tokenizer`: .*no_such_model' does not exist"):
        PPOModule(**ppo_args(tiny_lm_dir, tokenizer=missing))


def test_unreadable_model_directory_names_the_option(tiny_lm_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_lm_dir, broken)
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"`policy`: could not load a causal LM from .*broken"):
        PPOModule(**ppo_args(broken, tokenizer=str(tiny_lm_dir)))


def test_reference_with_another_vocabulary_is_rejected(tiny_lm_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config.from_pretrained(tiny_lm_dir)
    config.vocab_size += 7
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "other_vocab")
    with pytest.raises(ValueError, match=r"`reference` must share the policy's vocabulary"):
        PPOModule(**ppo_args(tiny_lm_dir, reference=str(tmp_path / "other_vocab")))


def test_tokenizer_without_pad_token_uses_eos_and_warns(tiny_lm_dir, tmp_path):
    tok = load_tokenizer(str(tiny_lm_dir))
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "no_pad")
    with pytest.warns(RuntimeWarning, match=r"`tokenizer`: tokenizer .* has no pad token; using"):
        loaded = load_tokenizer(str(tmp_path / "no_pad"))
    assert loaded.pad_token == loaded.eos_token == "<eos>"
    assert loaded.padding_side == "left"
    loaded.eos_token = None
    loaded.pad_token = None
    loaded.save_pretrained(tmp_path / "neither")
    with pytest.raises(ValueError, match=r"`policy`: tokenizer .* neither a pad nor an eos token"):
        load_tokenizer(str(tmp_path / "neither"), option="policy")


def test_max_new_tokens_that_do_not_fit_the_context(tiny_lm_dir):
    with pytest.raises(
        ValueError,
        match=r"`sampling.max_prompt_tokens` \(60\) \+ `sampling.max_new_tokens` \(8\) = 68 "
        r"tokens do not fit the policy's context of 64 positions; lower them so that their sum "
        r"is <= 64",
    ):
        PPOModule(**ppo_args(tiny_lm_dir, sampling={"max_prompt_tokens": 60, "max_new_tokens": 8}))


def test_prompts_longer_than_max_prompt_tokens_are_cut_on_the_left_and_warn(tiny_lm_dir):
    seed_everything(0)
    module = PPOModule(**ppo_args(tiny_lm_dir, sampling={"max_prompt_tokens": 3}))
    long_prompts = ["the film was very good and the plot was nice", "a story"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(module, 2, prompts=long_prompts)
    cut = [w for w in record if "longer than `sampling.max_prompt_tokens`=3" in str(w.message)]
    assert len(cut) == 1 and cut[0].category is RuntimeWarning  # warned once
    assert module.batches_seen == 2 and module.skipped_batches == 0
    ids, mask = module._encode_prompts(long_prompts)
    assert ids.shape[1] == 3  # the last three tokens: "was nice" ends the kept prompt
    assert module.tokenizer.decode(ids[0]) == "plot was nice"


# ---- data --------------------------------------------------------------------------------------


def test_unreadable_data_file_names_the_option(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match=r"`prompts` file '.*prompts.jsonl' line 2 is not JSON"):
        PromptDataModule(prompts=str(bad), heldout=None).setup("fit")


# ---- the reward model --------------------------------------------------------------------------


def test_reward_of_the_wrong_shape_stops_the_run_with_a_clear_error(tiny_lm_dir):
    pairs = FunctionReward(lambda prompts, responses: [0.0, 1.0], batched=True)
    module = PPOModule(**ppo_args(tiny_lm_dir, reward=pairs))
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"`reward` must return one finite score per .*shape \[4\]"
    ):
        fit(module, 2)
    assert module.batches_seen == 0
    assert all(torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())


# ---- numeric faults: skip the batch, keep weights and beta, warn, count -------------------------


class FaultyPPO(PPOModule):
    """Injects one numeric fault into batch ``fault_batch`` and records every batch."""

    def __init__(self, fault: str, fault_batch: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.fault, self.fault_batch = fault, fault_batch
        self.rows: list[dict] = []
        self._undo: list = []

    def _state(self) -> dict:
        optimizer = self.optimizers().optimizer
        return {
            "weights": {n: p.detach().clone() for n, p in self.named_parameters()},
            "adam_steps": sum(float(s["step"]) for s in optimizer.state.values()),
            "beta": self.kl_coef,
        }

    def on_train_batch_start(self, batch, batch_idx):
        self.rows.append({"before": self._state()})
        if batch_idx == self.fault_batch:
            self._inject()

    def on_train_batch_end(self, outputs, batch, batch_idx):  # after the callbacks' hooks
        for undo in self._undo:
            undo()
        self._undo.clear()
        self.rows[-1]["after"] = self._state()

    def _inject(self) -> None:
        nan, inf = math.nan, math.inf
        if self.fault in ("reward_nan", "reward_raises"):
            reward = self.reward

            def broken(prompts, responses):
                if self.fault == "reward_raises":
                    raise RuntimeError("reward server unavailable")
                return [nan] * len(prompts)

            self.reward = FunctionReward(broken, batched=True)
            self._undo.append(lambda: setattr(self, "reward", reward))
        elif self.fault == "kl_nan":  # the reference model produces nan (e.g. bad hardware)
            weight = self.reference.transformer.wte.weight
            saved = weight.detach().clone()
            weight.data.fill_(nan)
            self._undo.append(lambda: weight.data.copy_(saved))
        elif self.fault in ("loss_nan", "values_nan"):
            # loss_nan: values are fine during the rollout but nan in the update's forward.
            only_in_update = self.fault == "loss_nan"

            def hook(module, inputs, output):
                if torch.is_grad_enabled() or not only_in_update:
                    return output * nan

            self._undo.append(self.value_head.register_forward_hook(hook).remove)
        elif self.fault == "grad_inf":
            param = self.policy.transformer.h[0].mlp.c_fc.weight
            handle = param.register_hook(lambda grad: torch.full_like(grad, inf))
            self._undo.append(handle.remove)
        else:
            raise AssertionError(self.fault)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("reward_nan", r"the reward model failed: .* non-finite scores at indices \[0, 1, 2, 3\]"),
        ("reward_raises", "the reward model failed: reward server unavailable"),
        ("kl_nan", "the KL to the reference is not finite"),
        ("values_nan", "log-probs, values, advantages or returns are not finite"),
        ("loss_nan", "the loss is not finite"),
        ("grad_inf", "the gradient norm is not finite"),
    ],
)
def test_non_finite_batch_is_skipped_with_weights_and_beta_kept(tiny_lm_dir, fault, reason):
    seed_everything(0)
    module = FaultyPPO(fault, **ppo_args(tiny_lm_dir))
    controller, monitor = KLControllerCallback(adaptive()), KLDriftMonitor(target=1.0, window=4)
    with pytest.warns(RuntimeWarning, match=rf"PPOModule: skipping batch 2: {reason}") as record:
        trainer = fit(module, 3, callbacks=[controller, monitor])
    skip_warnings = [w for w in record if "PPOModule: skipping" in str(w.message)]
    assert len(skip_warnings) == 1
    assert "kl_coef is unchanged (1 batches skipped so far)" in str(skip_warnings[0].message)

    faulty, normal = module.rows[1], [module.rows[0], module.rows[2]]
    # The faulty batch changed nothing: weights, optimizer steps, beta.
    assert faulty["after"]["weights"].keys() == faulty["before"]["weights"].keys()
    for name, value in faulty["before"]["weights"].items():
        assert torch.equal(faulty["after"]["weights"][name], value), name
    assert faulty["after"]["adam_steps"] == faulty["before"]["adam_steps"]
    assert faulty["after"]["beta"] == faulty["before"]["beta"]
    # The batches around it trained and moved beta (so the checks above could fail).
    for row in normal:
        assert row["after"]["adam_steps"] > row["before"]["adam_steps"]
        assert row["after"]["beta"] != row["before"]["beta"]
        moved = row["after"]["weights"]["policy.transformer.h.0.mlp.c_fc.weight"]
        assert not torch.equal(
            moved, row["before"]["weights"]["policy.transformer.h.0.mlp.c_fc.weight"]
        )
    # Counted everywhere; the run ends healthy.
    assert (module.batches_seen, module.skipped_batches, module.samples_seen) == (2, 1, 8)
    assert (controller.n_batches, controller.n_skipped) == (3, 1)
    assert (monitor.n_batches, monitor.n_skipped, len(monitor.values)) == (3, 1, 2)
    assert float(trainer.callback_metrics["progress/skipped_batches"]) == 1.0
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_a_run_whose_batches_are_all_skipped_stops_with_an_error(tiny_lm_dir):
    always_nan = FunctionReward(lambda prompts, responses: [math.nan] * len(prompts), True)
    module = PPOModule(
        **ppo_args(tiny_lm_dir, reward=always_nan, safeguards={"max_skipped_in_a_row": 3})
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    with (
        pytest.warns(RuntimeWarning, match="skipping batch 1"),
        pytest.raises(
            RuntimeError,
            match=r"3 batches in a row were skipped, the last because the reward model failed"
            r".*`safeguards\.max_skipped_in_a_row`=3",
        ),
    ):
        fit(module, 10)
    assert (module.batches_seen, module.skipped_batches) == (0, 3)
    assert all(torch.equal(v, before[k]) for k, v in module.policy.state_dict().items())


def test_skips_that_alternate_with_trained_batches_never_stop_the_run(tiny_lm_dir):
    calls = []

    def every_other(prompts, responses):
        calls.append(1)
        return [math.nan if len(calls) % 2 else 0.5] * len(prompts)

    reward = FunctionReward(every_other, batched=True)
    module = PPOModule(
        **ppo_args(tiny_lm_dir, reward=reward, safeguards={"max_skipped_in_a_row": 2})
    )
    with pytest.warns(RuntimeWarning, match="skipping batch"):
        fit(module, 6)
    assert (module.batches_seen, module.skipped_batches, module.skipped_in_a_row) == (3, 3, 0)


# ---- checkpoints -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_lm_dir, tmp_path_factory):
    """A checkpoint of 1 batch of PPO with an adaptive controller and a drift monitor."""
    out = tmp_path_factory.mktemp("ckpt")
    seed_everything(0)
    module = PPOModule(**ppo_args(tiny_lm_dir))
    callbacks = [
        KLControllerCallback(adaptive()),
        KLDriftMonitor(target=1.0, window=4),
        ModelCheckpoint(dirpath=out, save_last=True),
    ]
    fit(module, 1, callbacks=callbacks)
    return out / "last.ckpt"


def test_corrupt_checkpoint_files_give_a_clear_error(trained_checkpoint, tmp_path):
    check_checkpoint(trained_checkpoint)  # a good one passes
    data = trained_checkpoint.read_bytes()
    cases = {
        "truncated.ckpt": (data[: len(data) // 2], "cannot be read: it is truncated or corrupt"),
        "junk.ckpt": (b"not a checkpoint at all", "cannot be read: it is truncated or corrupt"),
        "empty.ckpt": (b"", "is empty"),
    }
    for name, (content, problem) in cases.items():
        (tmp_path / name).write_bytes(content)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.ckpt")
    cases["foreign.ckpt"] = (None, r"is not a Lightning checkpoint \(no \['state_dict'")
    cases["missing.ckpt"] = (None, "does not exist")
    for name, (_, problem) in cases.items():
        with pytest.raises(ValueError, match=rf"`ckpt_path` '.*{name}' {problem}") as info:
            check_checkpoint(tmp_path / name)
        assert "allowed: a checkpoint file written by Lightning" in str(info.value)
    # The message points at the other checkpoints in the directory.
    assert "(empty.ckpt, foreign.ckpt, junk.ckpt, truncated.ckpt)" in str(info.value)


def test_cli_ckpt_path_last_pointing_at_a_corrupt_file_stops_before_training(
    tiny_lm_dir, tmp_path, capfd
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    (ckpt_dir / "last.ckpt").write_bytes(b"\x00" * 64)  # e.g. a disk that filled up
    (ckpt_dir / "epoch=0-step=2.ckpt").write_bytes(b"")
    config = {
        "trainer": {
            "accelerator": "cpu",
            "default_root_dir": str(tmp_path),  # the CLI saves its config.yaml there
            "max_steps": 1,
            "logger": False,
            "enable_progress_bar": False,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(ckpt_dir), "save_last": True},
                }
            ],
        },
        "model": {
            "class_path": "rlkl_lightning.PPOModule",
            "init_args": {k: v for k, v in ppo_args(tiny_lm_dir).items() if k != "reward"},
        },
        "data": {
            "class_path": "rlkl_lightning.data.PromptDataModule",
            "init_args": {"prompts": str(prompts), "heldout": None, "batch_size": BATCH},
        },
        "kl": {"controller": law_block("adaptive", horizon=100.0), "target": 1.0},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    message = cli_error(["fit", "--config", str(path), "--ckpt_path", "last"], capfd)
    assert re.match(r"`ckpt_path` '.*last.ckpt' cannot be read", message)
    assert "resume from another checkpoint in" in message
    assert "(epoch=0-step=2.ckpt)" in message


def test_checkpoint_of_another_model_names_the_mismatch(trained_checkpoint, tmp_path):
    from helpers.tiny_models import make_tiny_lm

    wider = make_tiny_lm(tmp_path / "wider", n_embd=48)
    module = PPOModule(**ppo_args(wider))
    with pytest.raises(ValueError, match=r"checkpoint \(`ckpt_path`\) was not written for this"):
        fit(module, 1, ckpt_path=trained_checkpoint, max_epochs=2)
    assert module.batches_seen == 0


def test_checkpoint_of_another_controller_law_is_rejected(tiny_lm_dir, trained_checkpoint):
    module = PPOModule(**ppo_args(tiny_lm_dir))
    controller = KLControllerCallback(PIKLController(0.2, target=1.0, kp=0.1, ki=0.1))
    with pytest.raises(ValueError, match=r"the state is for law 'adaptive', this .* law is 'pi'"):
        fit(module, 1, callbacks=[controller], ckpt_path=trained_checkpoint, max_epochs=2)
    assert module.batches_seen == 1  # the restored counter; no new batch ran


def test_resume_with_another_number_of_processes_warns_about_rollout_rng(
    tiny_lm_dir, trained_checkpoint, tmp_path
):
    ckpt = torch.load(trained_checkpoint, weights_only=True)
    ckpt["rlkl_rng"]["cpu"] = ckpt["rlkl_rng"]["cpu"] * 2  # as written by 2 processes
    torch.save(ckpt, tmp_path / "two.ckpt")
    module = PPOModule(**ppo_args(tiny_lm_dir))
    controller = KLControllerCallback(adaptive())
    with pytest.warns(RuntimeWarning, match="RNG states of 2 processes but this run has 1"):
        fit(module, 1, callbacks=[controller], ckpt_path=tmp_path / "two.ckpt", max_epochs=2)
    assert module.batches_seen == 2 and controller.n_batches == 2  # resumed and trained on


def test_resume_with_another_number_of_processes_under_an_untested_set_up_is_refused_by_name(
    tiny_lm_dir, trained_checkpoint, tmp_path, monkeypatch
):
    ckpt = torch.load(trained_checkpoint, weights_only=True)
    ckpt["rlkl_rng"]["cpu"] = ckpt["rlkl_rng"]["cpu"] * 2  # as written by 2 processes
    torch.save(ckpt, tmp_path / "two.ckpt")
    module = PPOModule(**ppo_args(tiny_lm_dir))
    monkeypatch.setattr(module.rollout_engine, "shares_weights", False)  # as vLLM's
    pattern = (
        r"written by 2 processes and this run has 1, under an engine with weights of its own "
        r"\(vLLM\); .* `--trainer.devices` x `--trainer.num_nodes` = 2$"
    )
    with pytest.raises(ValueError, match=pattern) as info:
        fit(
            module,
            1,
            callbacks=[KLControllerCallback(adaptive())],
            ckpt_path=tmp_path / "two.ckpt",
            max_epochs=2,
        )
    assert "\n" not in str(info.value)
    assert module.batches_seen == 1  # restored, nothing trained


@pytest.mark.parametrize("where", [None, "FSDP"])
def test_the_process_count_check_passes_an_equal_count_and_ddp(where):
    states = {"cpu": [torch.zeros(1)] * 2}
    check_process_count(states, 2, where, "PPOModule")  # the same number: any set-up
    check_process_count(None, 3, where, "PPOModule")  # a fresh run
    if where is None:
        check_process_count(states, 3, where, "PPOModule")  # DDP, native engine: supported
    else:
        with pytest.raises(ValueError, match="under FSDP"):
            check_process_count(states, 3, where, "PPOModule")
