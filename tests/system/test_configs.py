"""Every YAML in configs/ is a test case: run for two batches with tiny local overrides.

Run configs are found in every folder but ``configs/base/`` (the shared blocks they start
from) and composed with their bases as ``train.py`` composes them. The real-model configs need
the Hugging Face hub and the vLLM ones the vLLM environment, so they are only parsed here
(tests/vllm runs those); the study configs are parsed here and run end to end (``--quick``) in
compare/test_study.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlkl_lightning import RLOOModule
from rlkl_lightning.cli import main
from rlkl_lightning.config_files import compose
from rlkl_lightning.defaults import defaults_of
from rlkl_lightning.kl.laws import KL_LAWS, law_name

ROOT = Path(__file__).resolve().parents[2]
BASES = sorted((ROOT / "configs" / "base").rglob("*.yaml"))
CONFIGS = sorted(set((ROOT / "configs").rglob("*.yaml")) - set(BASES))
NEEDS_HUB = {"ppo_gpt2_imdb.yaml", "ppo_qwen_lora_bf16.yaml"}
NEEDS_VLLM = {"ppo_vllm.yaml", "grpo_vllm.yaml"}
NEEDS_SERVER = {"ppo_remote_reward.yaml"}  # trained against a loopback server below
#: The run configs that train offline with the native engine: each trains two batches here.
NATIVE_RUNS = sorted(
    c.name
    for c in CONFIGS
    if not c.name.startswith("compare")
    and c.name not in {"sft.yaml", *NEEDS_HUB, *NEEDS_VLLM, *NEEDS_SERVER}
)


def scalar_tags(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (version,) = log_dir.glob("*/version_*")
    acc = EventAccumulator(str(version))
    acc.Reload()
    return set(acc.Tags()["scalars"]) | {f"text:{t}" for t in acc.Tags()["tensors"]}


def test_the_configs_are_all_here():
    names = {c.name for c in CONFIGS}
    assert {"ppo_adaptive.yaml", "ppo_fixed.yaml", "sft.yaml", "compare.yaml"} <= names
    assert {"ppo_exponential.yaml", "ppo_pi.yaml", "ppo_logpid.yaml", "compare_laws.yaml"} <= names
    assert {"rloo_adaptive.yaml", "rloo_adaptive_kl_loss.yaml", "compare_algorithms.yaml"} <= names
    assert "grpo_adaptive.yaml" in names
    assert "ppo_reference_reset.yaml" in names
    assert NEEDS_HUB <= names and NEEDS_VLLM <= names
    assert {"world.yaml", "ppo.yaml", "rloo.yaml", "exact.yaml"} <= {b.name for b in BASES}
    assert len(NATIVE_RUNS) == 12 and "exact_ppo.yaml" in NATIVE_RUNS


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_opens_with_what_it_runs_and_the_command(config):
    head = config.read_text().split("\n\n")[0]
    assert head.startswith("# "), "a config opens with a comment saying what it runs"
    assert config.name in head, "and the exact command"
    assert "here" in head, "and how long it took here (or why it did not run here)"


@pytest.mark.parametrize("base", BASES, ids=[b.name for b in BASES])
def test_every_base_says_what_it_holds_and_that_it_is_no_run(base):
    head = base.read_text().split("\n")[0]
    assert head.startswith("# ") and "Not a run" in base.read_text().split("\n\n")[0]


def test_a_run_that_adds_a_callback_over_a_base_lists_them_all_in_their_order():
    """Lists replace lists across files (never merged by position): the budget and the refresh
    runs add their callback over base/world.yaml's checkpoint by listing both, theirs first."""

    def classes(config):
        return [c["class_path"].rpartition(".")[2] for c in config["trainer"]["callbacks"]]

    base = compose(ROOT / "configs" / "base" / "world.yaml")
    assert classes(base) == ["ModelCheckpoint"]
    budget = compose(ROOT / "configs" / "ppo_budget.yaml")
    assert classes(budget) == ["CapabilityBudget", "ModelCheckpoint"]
    refresh = compose(ROOT / "configs" / "ppo_reference_reset.yaml")
    assert classes(refresh) == ["ReferenceRefresh", "ModelCheckpoint"]
    for run in (budget, refresh):  # the base's checkpoint, as the base has it
        assert run["trainer"]["callbacks"][1] == base["trainer"]["callbacks"][0]
    assert budget["trainer"]["callbacks"][0]["init_args"] == {"budget": 1.15}
    assert refresh["trainer"]["callbacks"][0]["init_args"] == {"every": 20}


def test_the_default_world_runs_say_only_what_differs():
    """Each default-world run starts from a base and holds at most a screenful of its own."""
    for name in NATIVE_RUNS:
        raw = yaml.safe_load((ROOT / "configs" / name).read_text())
        assert "config" in raw, f"{name} does not start from a base"
        assert "seed_everything" not in raw and "data" not in raw, name  # the bases hold those


def _defaults(target) -> dict[str, Any]:
    # Through **kwargs into the parents' signatures: PPOModule's defaults include RLPipeline's.
    found = defaults_of(target)
    return {name: d for name, d in found.items() if d is not inspect.Parameter.empty}


def _fields(group: Any) -> dict[str, Any]:
    """The fields of an option group (a dataclass instance) with their values."""
    return {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}


def _restated(args: dict, defaults: dict[str, Any], where: str) -> list[str]:
    """``where + name: value`` for every argument equal to its default (into nested classes
    and into the modules' option groups, whose defaults are the default group's fields)."""
    found = []
    for name, value in args.items():
        default = defaults.get(name)
        group = dataclasses.is_dataclass(default) and not isinstance(default, type)
        if isinstance(value, dict) and "class_path" in value:
            module, _, cls = value["class_path"].rpartition(".")
            target = getattr(importlib.import_module(module), cls)
            inner = _fields(default) if group and type(default) is target else _defaults(target)
            found += _restated(value.get("init_args") or {}, inner, f"{where}{name}.")
        elif isinstance(value, dict) and group:  # a group written as a block of its fields
            found += _restated(value, _fields(default), f"{where}{name}.")
        elif name in defaults and value == defaults[name]:
            found.append(f"{where}{name}: {value!r}")
    return found


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_configs_write_no_default_again(config):
    from lightning.pytorch import Trainer

    if config.name.startswith("compare"):  # a study config
        data = yaml.safe_load(config.read_text())
        from rlkl_lightning.compare import StudyConfig

        fields = dataclasses.fields(StudyConfig)
        defaults = {
            f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in fields
        }
        found = _restated(data, defaults, "")
    else:
        data = compose(config)  # with its bases
        sections = {key: data[key] for key in ("model", "data") if key in data}
        found = _restated(sections, {}, "") + _restated(
            data["trainer"], _defaults(Trainer), "trainer"
        )
        # The `kl` group (KLSettings in cli/app.py) stays explicit while its defaults are reworked.
    assert not found, f"{config.name} repeats the defaults {found}"


LAW_CLASSES = {
    "fixed": "FixedKLController",
    "adaptive": "AdaptiveKLController",
    "exponential": "ExponentialKLController",
    "pi": "PIKLController",
    "logpid": "LogPIDKLController",
}


@pytest.mark.parametrize("name", NATIVE_RUNS)
def test_training_configs_train_two_batches(name, tiny_lm_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = compose(ROOT / "configs" / name)  # as train.py composes it with its bases
    options = config["model"]["init_args"]
    exact = options.get("policy") == "exact"  # the exact world: its own model and prompts
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is", "the food", "a story"] * 4))
    tiny = [f"--model.policy={tiny_lm_dir}", "--model.sampling.max_prompt_tokens=8"]
    tiny += ["--model.sampling.max_new_tokens=6", "--model.logging.log_samples_every=1"]
    tiny += [f"--data.prompts={prompts}", f"--data.heldout={prompts}", "--data.batch_size=4"]
    if "test_heldout" in config["data"].get("init_args", {}):
        tiny.append(f"--data.test_heldout={prompts}")
    cli = main(
        ["fit", "--config", str(ROOT / "configs" / name)]
        + ([] if exact else tiny)
        + ["--trainer.max_steps=32"]
        + ([] if exact else ["--trainer.val_check_interval=2"])
        + [f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]
    )
    module = cli.model
    assert module.batches_seen == 2  # max_steps = 2 batches x 16 optimizer steps
    controller, monitor = cli.trainer.callbacks[:2]
    # The callbacks count responses: a batch's prompts, times RLOO's responses per prompt.
    per_prompt = module.group.responses_per_prompt if isinstance(module, RLOOModule) else 1
    batch = config["data"]["init_args"]["batch_size"] if exact else 4
    assert (
        controller.n_samples == monitor.n_samples == module.samples_seen == 2 * batch * per_prompt
    )
    callbacks = [c["class_path"].rpartition(".")[2] for c in config["trainer"]["callbacks"]]
    law, named = controller.controller, config["kl"]["controller"]
    if "CapabilityBudget" in callbacks:  # the budget sets the target of both at validation
        budget = next(c for c in cli.trainer.callbacks if type(c).__name__ == "CapabilityBudget")
        assert budget.n_evaluations == 1 and monitor.target == law.target == budget.target
    else:
        assert monitor.target == config["kl"]["target"]  # given once, shared
    assert type(law).__name__ == LAW_CLASSES[law_name(named)]
    gains = named.get("init_args", {}) if isinstance(named, dict) else {}
    assert gains and type(law).__name__ == named["class_path"] or not gains
    for gain, value in gains.items():  # the config's gains reach the law
        assert getattr(law, gain) == value
    if law_name(named) == "fixed":
        assert module.kl_coef == module.penalty.init_coef
    else:
        assert controller.controller.target == monitor.target
        assert module.kl_coef != module.penalty.init_coef
    tags = scalar_tags(tmp_path / "runs")
    for tag in ("objective/kl", "objective/kl_coef", "objective/score", "kl_monitor/target"):
        assert tag in tags
    assert ("loss/kl" in tags) == (options.get("penalty", {}).get("placement") == "loss")
    grpo = options.get("group", {}).get("advantage") == "grpo"
    assert ("objective/frac_reward_zero_std" in tags) == grpo
    refreshes = "reference/refreshes" in tags  # logged with a ReferenceRefresh callback
    assert refreshes == ("ReferenceRefresh" in callbacks)
    diagnostics = "kl_tokens/max_kl" in tags  # logged with logging.kl_token_threshold
    assert diagnostics == ("kl_token_threshold" in options.get("logging", {}))
    if exact:  # no validation, no checkpoints: ExactMetrics logs the exact world's numbers
        assert any(tag.startswith("exact/") for tag in tags), tags
        assert not list((tmp_path / "runs").glob("*/version_0/checkpoints/*.ckpt"))
        return
    assert {"val/perplexity", "val/perplexity_ref", "text:samples/text_summary"} <= tags
    # The README's `--ckpt_path last` finds the run's end (rloo/grpo kept no last.ckpt).
    (last,) = (tmp_path / "runs").glob("*/version_0/checkpoints/last.ckpt")
    assert torch.load(last, weights_only=True)["rlkl_counters"]["batches_seen"] == 2


def test_sft_config_trains_and_exports_a_loadable_model(tiny_lm_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(["the film was good", "this book is bad", "the food"] * 8))
    export = tmp_path / "export"
    main(
        ["fit", "--config", str(ROOT / "configs" / "sft.yaml")]
        + [f"--model.tokenizer={tiny_lm_dir}", f"--data.tokenizer={tiny_lm_dir}"]
        + ["--model.n_layer=1", "--model.n_embd=16", "--model.n_head=2"]
        + [f"--model.export_dir={export}", f"--data.train_files={texts}"]
        + [f"--data.val_files={texts}", "--trainer.max_steps=2", "--trainer.val_check_interval=2"]
        + [f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]
    )
    assert AutoModelForCausalLM.from_pretrained(export).config.n_layer == 1
    assert "val/perplexity" in scalar_tags(tmp_path / "runs")


def test_the_remote_reward_config_trains_against_a_loopback_server(tiny_lm_dir, tmp_path):
    from helpers.fault_server import FaultServer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is"] * 4))
    with FaultServer() as server:
        cli = main(
            ["fit", "--config", str(ROOT / "configs" / "ppo_remote_reward.yaml")]
            + [f"--model.policy={tiny_lm_dir}", "--model.sampling.max_prompt_tokens=8"]
            + ["--model.sampling.max_new_tokens=4", f"--model.reward.init_args.url={server.url}"]
            + [f"--data.prompts={prompts}", "--data.heldout=null", "--data.batch_size=4"]
            + ["--trainer.max_steps=16", f"--trainer.logger.init_args.save_dir={tmp_path}"]
        )
        assert len(server.scoring_requests()) == 1  # one batch of 4, one request
    assert cli.model.batches_seen == 1 and cli.model.reward.url == server.url
    assert "reward/failed_fraction" in scalar_tags(tmp_path)


def test_real_model_config_parses(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / "ppo_gpt2_imdb.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["policy"] == "gpt2"
    reward = printed["model"]["init_args"]["reward"]
    assert reward["class_path"] == "rlkl_lightning.rewards.SequenceClassifierReward"
    assert printed["kl"] == {**printed["kl"], "target": 6.0, "unit": "sequence"}


@pytest.mark.parametrize("name", ["ppo_vllm.yaml", "grpo_vllm.yaml"])
def test_vllm_configs_parse_without_vllm(name, capsys):
    """The engine starts at fit start, so parsing needs no vLLM (tests/vllm runs them)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / name), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    engine = printed["model"]["init_args"]["engine"]
    assert engine.get("init_args", engine)["kind"] == "vllm"


def test_lora_bf16_config_parses_and_its_peft_and_chat_settings_build(capsys):
    from rlkl_lightning.models.lora import peft_config

    config = ROOT / "configs" / "ppo_qwen_lora_bf16.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model, data = printed["model"]["init_args"], printed["data"]["init_args"]
    assert model["policy"] == "Qwen/Qwen2.5-0.5B-Instruct"
    models = model["models"].get("init_args", model["models"])  # the group's fields
    assert models["gradient_checkpointing"] is True
    lora = peft_config(models["peft"])  # the YAML's fields make a valid LoraConfig
    assert type(lora).__name__ == "LoraConfig" and lora.r == 16
    assert data["chat_template"] is True and data["system_prompt"]
    assert printed["trainer"]["precision"] == "bf16-mixed"
    assert printed["kl"] == {**printed["kl"], "target": 6.0, "unit": "sequence"}


def test_study_config_parses_and_names_existing_run_configs(monkeypatch):
    from rlkl_lightning.compare import parse_args

    monkeypatch.chdir(ROOT)
    study, _ = parse_args(["--config", "configs/compare.yaml"])
    assert set(study.runs) == {"fixed", "adaptive"}
    assert all((ROOT / path).is_file() for path in study.runs.values())
    study, _ = parse_args(["--config", "configs/compare_laws.yaml"])
    configs = {name: compose(ROOT / p) for name, p in study.runs.items()}
    assert {name: law_name(c["kl"]["controller"]) for name, c in configs.items()} == {
        law: law for law in KL_LAWS
    }  # every law, once, each under its own name
    # The law runs differ in their `kl` group alone (and the logger's name, for a run alone).
    for config in configs.values():
        config["trainer"]["logger"]["init_args"]["name"] = "-"
        config.pop("kl")
    assert all(config == configs["adaptive"] for config in configs.values())
    study, _ = parse_args(["--config", "configs/compare_algorithms.yaml"])
    assert study.runs == {
        "ppo": "configs/ppo_adaptive.yaml",
        "rloo": "configs/rloo_adaptive.yaml",
        "rloo_kl_loss": "configs/rloo_adaptive_kl_loss.yaml",
        "grpo": "configs/grpo_adaptive.yaml",
    }


def test_a_reward_named_by_class_path_in_the_config_is_the_one_used(
    tiny_lm_dir, tmp_path, monkeypatch
):
    from helpers.tiny_models import save_tiny_classifier

    from rlkl_lightning.rewards import SequenceClassifierReward

    monkeypatch.chdir(tmp_path)
    save_tiny_classifier(tmp_path / "clf")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is"] * 4))
    reward = {
        "class_path": "rlkl_lightning.rewards.SequenceClassifierReward",
        "init_args": {"model": str(tmp_path / "clf"), "label": "POSITIVE", "score": "prob"},
    }
    cli = main(
        ["fit", "--config", str(ROOT / "configs" / "ppo_fixed.yaml")]
        + [f"--model.policy={tiny_lm_dir}", "--model.sampling.max_prompt_tokens=8"]
        + ["--model.sampling.max_new_tokens=4", f"--model.reward={yaml.safe_dump(reward)}"]
        + [f"--data.prompts={prompts}", "--data.heldout=null", "--data.batch_size=4"]
        + ["--trainer.max_steps=16", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    )
    assert isinstance(cli.model.reward, SequenceClassifierReward)
    score = float(cli.trainer.callback_metrics["objective/score"])
    assert 0.0 < score < 1.0  # a probability: the classifier scored the batch


@pytest.mark.slow  # a train.py process: make test-slow
def test_an_rloo_run_prints_no_warning(tiny_lm_dir, tmp_path):
    """The README says a warning on the console means something is wrong: RLOO and GRPO runs
    printed Lightning's note on their own ``on_before_batch_transfer``, which is the design."""
    from helpers.cli_runs import train_py

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is", "the food", "a story"]))
    status, output = train_py(
        ["fit", "--config", str(ROOT / "configs" / "grpo_adaptive.yaml")]
        + [f"--model.policy={tiny_lm_dir}", "--model.sampling.max_prompt_tokens=8"]
        + ["--model.sampling.max_new_tokens=4", f"--data.prompts={prompts}"]
        + [f"--data.heldout={prompts}", "--data.batch_size=4", "--trainer.max_steps=16"]
        + [f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]
    )
    assert status == 0, output
    assert not re.findall(r"^.*\.py:\d+: .*$", output, flags=re.MULTILINE), output


def _parser():
    """train.py's parser, as ``main`` builds it, without parsing or running anything."""
    from rlkl_lightning.cli import app

    class Built(Exception):
        pass

    class ParserOnly(app.RLKLCLI):
        def parse_arguments(self, parser, args) -> None:
            raise Built(parser)

    cli_class, app.RLKLCLI = app.RLKLCLI, ParserOnly
    try:
        app._cli(["fit"])
    except Built as built:
        return built.args[0]
    finally:
        app.RLKLCLI = cli_class
    raise AssertionError("the CLI parsed without calling parse_arguments")


@pytest.mark.slow  # a sweep: every config parsed twice
def test_a_config_composed_with_its_bases_reads_as_the_parser_reads_the_file(tmp_path):
    """``compose`` (the study's and the scripts' view of a config) agrees with train.py's."""
    parser = _parser()
    for config in CONFIGS:
        if config.name.startswith("compare") or config.name == "sft.yaml":
            continue
        composed = tmp_path / config.name
        composed.write_text(yaml.safe_dump(compose(config)))
        seen = [parser.parse_args(["fit", "--config", str(p)])["fit"] for p in (config, composed)]
        for namespace in seen:
            namespace.pop("config", None)
        assert seen[0] == seen[1], config.name


@pytest.mark.parametrize(
    "name",
    ["ppo_fixed.yaml", "ppo_pi.yaml", "ppo_logpid.yaml", "ppo_budget.yaml", "exact_ppo.yaml"],
)
def test_a_printed_config_runs_as_the_same_config(name, tmp_path, capsys):
    """What ``--print_config`` writes (a run's saved ``config.yaml`` is the same dump) parses
    back to itself: a law given by its short name (``kl.controller: fixed``) is written as that
    name, where it was written as "Unable to serialize instance fixed" and refused on reuse."""

    def printed(path: Path) -> str:
        with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as done:
            warnings.simplefilter("always")
            main(["fit", "--config", str(path), "--print_config"])
        assert done.value.code in (0, None)
        assert not [str(w.message) for w in caught if "serialize" in str(w.message)]
        return capsys.readouterr().out

    first = printed(ROOT / "configs" / name)
    assert "Unable to serialize" not in first
    (tmp_path / "printed.yaml").write_text(first)
    assert printed(tmp_path / "printed.yaml") == first
    law = yaml.safe_load(first)["kl"]["controller"]
    if name in ("ppo_fixed.yaml", "ppo_logpid.yaml"):
        assert law == name.removeprefix("ppo_").removesuffix(".yaml")


def test_the_kl_group_as_a_file_of_its_own_trains(tiny_lm_dir, tmp_path):
    """``kl: my_kl.yaml`` (docs/configs.md): the group's values come from the file, where the
    parser's ``__path__`` beside them made the components' check fail with a TypeError."""
    from helpers.cli_runs import tiny_cli_config

    law = {"class_path": "PIKLController", "init_args": {"kp": 0.3}}
    (tmp_path / "cli_configs").mkdir()
    (tmp_path / "cli_configs" / "my_kl.yaml").write_text(
        yaml.safe_dump({"controller": law, "target": 3.0, "window": 7})
    )
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "kl": "my_kl.yaml"}))
    cli = main(["fit", "--config", str(config)])
    controller, monitor = cli.trainer.callbacks[:2]
    assert type(controller.controller).__name__ == "PIKLController"
    assert controller.controller.kp == 0.3 and controller.target == 3.0
    assert monitor.window == 7 and controller.n_batches == 2
