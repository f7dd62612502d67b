"""A user's mistake on the command line ends with the project's message, alone and last.

``rlkl_lightning.cli.main`` prints ``error: MESSAGE`` on stderr and exits with status 2 for the
package's own errors and the parser's; ``--verbose`` or ``RLKL_VERBOSE=1`` give the traceback,
and an exception that is not a user's mistake keeps it.
"""

from __future__ import annotations

import time

import pytest
import yaml
from helpers.cli_runs import cli_error, tiny_cli_config, train_py

SHIPPED = "configs/ppo_adaptive.yaml"


def test_a_config_error_prints_a_few_lines_ending_with_the_message(tmp_path):
    option = "--model.init_args.penalty.init_coef=nan"  # was 55 lines of usage and a validator note
    message = (
        "`model.init_args.penalty.init_coef` must be a finite number (NaN and inf are refused), "
        "got nan"
    )
    status, output = train_py(
        ["fit", "--config", SHIPPED, option, f"--trainer.logger.init_args.save_dir={tmp_path}"]
    )
    lines = output.rstrip("\n").splitlines()
    assert status == 2
    assert lines[-1] == f"error: {message}"
    assert len(lines) <= 15, output
    assert "Traceback" not in output and "usage:" not in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kl.target=nan"], "`kl.target` must be a finite number (NaN and inf are refused)"),
        (["--kl.target=-inf"], "`kl.target` must be a finite number (NaN and inf are refused)"),
        (
            ["--kl.controller.init_args.horizon=inf"],
            "`kl.controller.init_args.horizon` (AdaptiveKLController) must be a finite number "
            "(NaN and inf are refused), got inf",
        ),
        (
            ["--kl.controller.init_args.horizon=abc"],
            "`kl.controller.init_args.horizon` (AdaptiveKLController) must be a number, got abc",
        ),
        (
            ["--kl.controller.init_args.horizn=5"],
            "`kl.controller.init_args` has no argument 'horizn': AdaptiveKLController takes "
            "['horizon', 'min_kl_coef', 'max_kl_coef']",
        ),
        (  # --print_config checks the components before it prints
            ["--kl.controller=adaptve", "--print_config"],
            "`kl.controller` must be one of ('fixed', 'adaptive', 'exponential', 'pi', 'logpid') "
            "or the dotted path of a KL control law (a KLLaw subclass, or a class of the "
            "KLController protocol) (mypackage.module.Name), got 'adaptve'",
        ),
        (  # 0.4.0's gain options: the message names the new place
            ["--kl.horizon=2000"],
            "`kl.horizon` moved into the law's arguments: `kl.controller: {class_path: "
            "AdaptiveKLController, init_args: {horizon: 2000}}` (command line: "
            "`--kl.controller=AdaptiveKLController --kl.controller.init_args.horizon=2000`; "
            "docs/controllers.md)",
        ),
        (
            ["--kl.controller=pi", "--kl.kp=0.3"],
            "`kl.kp` moved into the law's arguments: `kl.controller: {class_path: PIKLController, "
            "init_args: {kp: 0.3}}` (command line: `--kl.controller=PIKLController "
            "--kl.controller.init_args.kp=0.3`; docs/controllers.md)",
        ),
        (
            ["--model.init_args.optimization.lr=nan"],
            "`model.init_args.optimization.lr` must be a finite number (NaN and inf are refused), "
            "got nan",
        ),
        (
            ["--data.init_args.batch_size=inf"],
            "`data.init_args.batch_size` must be an integer (NaN and inf are refused), got inf",
        ),
        (  # an Optional float: the parser's note was a Union of two refusals
            ["--kl.min_kl_coef=nan"],
            "`kl.min_kl_coef` must be a finite number (NaN and inf are refused), got nan",
        ),
        (["--kl.min_batches=inf"], "`kl.min_batches` must be an integer (NaN and inf are refused)"),
        (["--kl.controller=pid"], "`kl.controller` must be one of ('fixed', 'adaptive',"),
        (["--kl.unit=nats"], "`kl.unit` must be one of ('sequence', 'token'), got 'nats'"),
        (["--kl.target=0"], "`kl.target` must be a finite number > 0, got 0.0"),
        (
            ["--model.init_args.sampling.max_new_tokens=0"],
            "`model.init_args.sampling.max_new_tokens` must be an integer >= 1, got 0",
        ),
        (
            ["--model.init_args.penalty.estimator=k4"],
            "`model.init_args.penalty.estimator` must be one of ('k1', 'k2', 'k3', 'exact') or the "
            "dotted path of an Estimator (or a class or function that makes one from its "
            "init_args) (mypackage.module.Name), got 'k4'",
        ),
        (  # a flat option of 0.1.0 names its place in the groups
            ["--model.init_args.init_kl_coef=0.3"],
            "`model.init_args.init_kl_coef` is now `model.init_args.penalty.init_coef`",
        ),
        # The module's KL penalty (`penalty`, `kl` until 0.4.0) and the run's KL control (`kl`).
        (
            ["--model.init_args.kl.placement=loss"],
            "`model.init_args.kl.placement` is now `model.init_args.penalty.placement`: renamed "
            "in 0.5.0; the top-level `kl` is the run's KL control (docs/options.md)",
        ),
        (
            ["--kl.placement=loss"],
            "`kl.placement` is the module's KL penalty: `model.init_args.penalty.placement`; the "
            "top-level `kl` is the run's KL control (docs/options.md)",
        ),
        (
            ["--kl.init_coef=0.3"],
            "`kl.init_coef` is the module's KL penalty: `model.init_args.penalty.init_coef`;",
        ),
        (
            ["--model.init_args.penalty.target=3"],
            "`model.init_args.penalty.target` is the run's KL control: `kl.target` (top level); "
            "the module's `penalty` is its KL penalty (docs/options.md)",
        ),
        (
            ["--model.init_args.kl.target=3"],
            "`model.init_args.kl.target` is the run's KL control: `kl.target` (top level);",
        ),
        (
            ["--model.init_args.placement=loss"],
            "`model.init_args.placement` is `model.init_args.penalty.placement`",
        ),
        (
            ["--data.init_args.batch_size=0"],
            "`data.init_args.batch_size` must be >= 1 or None, got 0",
        ),
        (
            ["--data.init_args.test_heldout=x.txt", "--data.init_args.heldout=null"],
            "`data.init_args.test_heldout` needs `data.init_args.heldout`",
        ),
        (["--model.init_args.policy=/no/such/model"], "`policy`: model path '/no/such/model'"),
        (["--model.init_args.polcy=x"], "`model` (rlkl_lightning.PPOModule): Option 'polcy'"),
        (["--trainer.max_stepz=3"], "unrecognized arguments: --trainer.max_stepz=3"),
        (  # a group's misspelt option: the group's options, the nearest first
            ["--model.init_args.sampling.max_new_tokenz=5"],
            "`model.init_args.sampling` has no option `max_new_tokenz` (did you mean "
            "`max_new_tokens`?); its options: max_prompt_tokens, max_new_tokens, temperature, "
            "top_k, top_p, stop_at_eos",
        ),
        (
            ["--model.init_args.group.advantage=grpo"],
            "`model.init_args.group`: PPOModule has no group `group`; its groups: sampling, "
            "optimization, objective, penalty, models, safeguards, logging, engine, ppo",
        ),
        (  # the drift monitor's and the controller callback's options, before any model loads
            ["--kl.min_batches=0", "--print_config"],
            "`kl.min_batches` must be an int >= 1 (None: window + min(2 x window, 20)), got 0",
        ),
        (["--kl.window=0"], "`kl.window` must be an int >= 1, got 0"),
        (["--kl.hold_after_refresh=-1"], "`kl.hold_after_refresh` must be an int >= 0 (batches)"),
        # A value of the wrong type names its full path and the type (was `Parser key "lr":`).
        (
            ["--model.init_args.optimization.lr=abc"],
            "`model.init_args.optimization.lr` must be a number, got abc",
        ),
        (["--data.init_args.batch_size=abc"], "`data.init_args.batch_size` must be an integer"),
        (  # TRL's loss names say which aggregation is theirs (docs/pipeline.md)
            ["--model.init_args.objective.aggregation=dapo"],
            "`model.init_args.objective.aggregation` must be one of ('token_mean', "
            "'sequence_mean', 'fixed_length', 'batch_token_mean'), got 'dapo': TRL's loss_type "
            "'dapo' is `objective.aggregation: batch_token_mean` here",
        ),
        (
            ["--model.init_args.objective.aggregation=dr_grpo"],
            "`model.init_args.objective.aggregation` must be one of ('token_mean', "
            "'sequence_mean', 'fixed_length', 'batch_token_mean'), got 'dr_grpo': TRL's "
            "loss_type 'dr_grpo' is `objective.aggregation: fixed_length` here",
        ),
        (
            ["--model.init_args.penalty.trust_region=nan"],
            "`model.init_args.penalty.trust_region` must be a finite number or null (NaN and inf "
            "are refused), got nan",
        ),
        (
            ["--model.init_args.penalty.trust_region=abc"],
            "`model.init_args.penalty.trust_region` must be a number or null, got abc",
        ),
        (  # a class the parser expects, named as a user gives one (was "must be class  or ...")
            ["--model.init_args.reward=VaderSentimentReward"],
            "`model.init_args.reward` must be a RewardModel (the dotted path of one, or a "
            "{class_path, init_args} block) or null, got VaderSentimentReward",
        ),
        (["--weights_only=false"], "`weights_only` must be true or unset"),
        (["--ckpt_path=last"], "`--ckpt_path last`: there is no checkpoint to resume"),
    ],
)
def test_cli_errors_end_with_the_projects_message(args, message, tiny_lm_dir, tmp_path, capfd):
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    printed = cli_error(["fit", "--config", str(config), *args], capfd)
    assert printed.startswith(message), printed
    assert "\n" not in printed.strip() and "Given value" not in printed
    # PPOModule's and PromptDataModule's errors were wrapped in a Union error quoting the whole
    # config after two tracebacks (70-80 lines); the model's errors come after "Seed set to 0".


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"model": {"init_args": {"kl": {"placement": "loss"}}}},
            "`model.init_args.kl.placement` is now `model.init_args.penalty.placement`: renamed "
            "in 0.5.0; the top-level `kl` is the run's KL control (docs/options.md)",
        ),
        (
            {"kl": {"init_coef": 0.3}},
            "`kl.init_coef` is the module's KL penalty: `model.init_args.penalty.init_coef`; the "
            "top-level `kl` is the run's KL control (docs/options.md)",
        ),
        (
            {"model": {"init_args": {"penalty": {"target": 3.0}}}},
            "`model.init_args.penalty.target` is the run's KL control: `kl.target` (top level); "
            "the module's `penalty` is its KL penalty (docs/options.md)",
        ),
        (
            {"model": {"init_args": {"kl": {"window": 5}}}},
            "`model.init_args.kl.window` is the run's KL control: `kl.window` (top level); "
            "the module's `penalty` is its KL penalty (docs/options.md)",
        ),
        (
            {"model": {"init_args": {"sampling": {"max_new_tokenz": 5}}}},
            "`model.init_args.sampling` has no option `max_new_tokenz` (did you mean "
            "`max_new_tokens`?); its options: max_prompt_tokens, max_new_tokens, temperature, "
            "top_k, top_p, stop_at_eos",
        ),
    ],
)
def test_a_kl_option_in_the_other_kl_group_of_a_config_names_its_place(
    given, message, tiny_lm_dir, tmp_path, capfd
):
    import yaml

    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    mistake = tmp_path / "mistake.yaml"
    mistake.write_text(yaml.safe_dump(given))
    printed = cli_error(["fit", "--config", str(config), "--config", str(mistake)], capfd)
    assert printed == message


def test_a_misspelt_law_is_reported_before_the_policy_loads(tmp_path):
    """Through train.py: the law is checked before the module (and its weights) are built."""
    status, output = train_py(
        ["fit", "--config", SHIPPED, "--kl.controller=adaptve"]
        + [f"--model.init_args.policy={tmp_path / 'no_such_model'}"]
        + [f"--trainer.logger.init_args.save_dir={tmp_path}"]
    )
    assert status == 2
    last = output.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: `kl.controller` must be one of ('fixed', 'adaptive', ")
    assert last.endswith("got 'adaptve'")
    # A gain out of range is the law's too, before the model.
    status, output = train_py(
        ["fit", "--config", SHIPPED, "--kl.controller.init_args.horizon=-5"]
        + [f"--model.init_args.policy={tmp_path / 'no_such_model'}"]
        + [f"--trainer.logger.init_args.save_dir={tmp_path}"]
    )
    assert output.rstrip("\n").splitlines()[-1] == (
        "error: AdaptiveKLController: `horizon` must be a finite number > 0 (samples), got -5.0"
    )
    # So is the module's own component, checked by its group before the module is built.
    status, output = train_py(
        ["fit", "--config", SHIPPED, "--model.init_args.penalty.estimator=k9"]
        + [f"--model.init_args.policy={tmp_path / 'no_such_model'}"]
        + [f"--trainer.logger.init_args.save_dir={tmp_path}"]
    )
    last = output.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: `model.init_args.penalty.estimator` must be one of ('k1',")


def test_an_empty_prompts_file_and_a_checkpoint_directory_are_named(tiny_lm_dir, tmp_path, capfd):
    config = str(tiny_cli_config(tiny_lm_dir, tmp_path))
    empty = tmp_path / "empty.txt"
    empty.write_text("")  # `datasets` failed on it with its SchemaInferenceError
    message = cli_error(["fit", "--config", config, f"--data.init_args.prompts={empty}"], capfd)
    assert (
        message == f"PromptDataModule: `prompts` {str(empty)!r} is empty; allowed: a file of texts"
    )
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "last.ckpt").write_bytes(b"")
    message = cli_error(["fit", "--config", config, f"--ckpt_path={folder}"], capfd)
    assert message.startswith(f"`ckpt_path` {str(folder)!r} is a directory, not a checkpoint file")
    assert f"resume from another checkpoint in {str(folder)!r} (last.ckpt)" in message


def test_a_hub_name_fails_in_seconds_when_the_hub_cannot_be_reached(
    tiny_lm_dir, tmp_path, capfd, monkeypatch
):
    from huggingface_hub import constants

    from rlkl_lightning.models import loading

    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: closed
    monkeypatch.setattr(loading, "_HUB_REACHABLE", {})
    start = time.monotonic()
    printed = cli_error(["fit", "--config", str(config), "--model.init_args.policy=no/such"], capfd)
    assert time.monotonic() - start < 10
    assert printed.startswith(
        "`policy`: 'no/such' is not a local directory, not in the Hugging Face cache, and the "
        "hub (http://127.0.0.1:9) cannot be reached: "
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no probe at all
    printed = cli_error(["fit", "--config", str(config), "--model.init_args.policy=no/such"], capfd)
    assert "and the hub is off (HF_HUB_OFFLINE is set); allowed: a local directory" in printed


def test_verbose_raises_with_the_traceback(tiny_lm_dir, tmp_path, monkeypatch):
    from argparse import ArgumentError

    from rlkl_lightning.cli import main

    config = str(tiny_cli_config(tiny_lm_dir, tmp_path))
    with pytest.raises(ValueError, match=r"`kl.target` must be a finite number > 0"):
        main(["fit", "--config", config, "--kl.target=0", "--verbose"])
    monkeypatch.setenv("RLKL_VERBOSE", "1")
    with pytest.raises(ArgumentError, match=r"Expected a <class 'float'>. Got value: nan"):
        main(["fit", "--config", config, "--kl.target=nan"])


def test_an_error_that_is_not_a_users_mistake_keeps_its_traceback(tiny_lm_dir, tmp_path):
    from rlkl_lightning.cli import app as cli

    config = str(tiny_cli_config(tiny_lm_dir, tmp_path))

    class Broken(cli.RLKLCLI):
        def before_fit(self):
            raise ValueError("not ours: raised outside the package")  # this file is a test

    original = cli.RLKLCLI
    cli.RLKLCLI = Broken
    try:
        with pytest.raises(ValueError, match="not ours"):
            cli.main(["fit", "--config", config])
    finally:
        cli.RLKLCLI = original


@pytest.mark.parametrize(
    ("init_args", "message"),
    [
        ({"every": 1.5}, "`trainer.callbacks[0].init_args.every` must be an integer, got 1.5"),
        (
            {"alpha": "abc"},
            "`trainer.callbacks[0].init_args.alpha` must be a number or null, got abc",
        ),
    ],
)
def test_a_callback_option_of_the_wrong_type_names_its_path(
    init_args, message, tiny_lm_dir, tmp_path, capfd
):
    refresh = {"class_path": "rlkl_lightning.ReferenceRefresh", "init_args": init_args}
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}
    config = tiny_cli_config(tiny_lm_dir, tmp_path, trainer={"callbacks": [refresh, checkpoint]})
    assert cli_error(["fit", "--config", str(config)], capfd) == message


def test_a_law_named_by_its_short_name_takes_its_arguments_on_the_command_line(capsys):
    """`--kl.controller=pi --kl.controller.init_args.kp=0.3`: the short name is the class, and
    --print_config shows that law's arguments alone (not every law's gains)."""
    from rlkl_lightning.cli import main

    args = ["fit", "--config", SHIPPED, "--kl.controller", "pi", "--kl.controller.init_args.kp=0.3"]
    with pytest.raises(SystemExit) as done:
        main([*args, "--print_config"])
    assert done.value.code in (0, None)
    kl = yaml.safe_load(capsys.readouterr().out)["kl"]
    assert kl["controller"]["class_path"].endswith("PIKLController")
    assert kl["controller"]["init_args"] == {
        "kp": 0.3,
        "ki": 0.05,
        "error_clip": 1.0,
        "min_kl_coef": None,
        "max_kl_coef": None,
    }
    assert not {"horizon", "k", "kp", "ki"} & set(kl)


# A `class_path` that does not import, at any depth: the parser's own reason, one line.
@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {
                "model": {
                    "init_args": {"reward": {"class_path": "rlkl_lightning.rewards.VadrReward"}}
                }
            },
            "`model.init_args.reward` (rlkl_lightning.rewards.VadrReward): module "
            "'rlkl_lightning.rewards' has no attribute 'VadrReward'",
        ),
        (
            {
                "model": {
                    "init_args": {"gold_reward": {"class_path": "rlkl_lightning.world.gold.Gld"}}
                }
            },
            "`model.init_args.gold_reward` (rlkl_lightning.world.gold.Gld): module "
            "'rlkl_lightning.world.gold' has no attribute 'Gld'",
        ),
        (  # an argument the component does not take, one level further down
            {
                "model": {
                    "init_args": {
                        "gold_reward": {
                            "class_path": "rlkl_lightning.world.gold.GoldSentimentReward",
                            "init_args": {"txt": "prompt"},
                        }
                    }
                }
            },
            "`model.init_args.gold_reward` (rlkl_lightning.world.gold.GoldSentimentReward): "
            "Option 'txt' is not accepted",
        ),
        (
            {"kl": {"controller": {"class_path": "rlkl_lightning.kl.controllers.AdaptivKL"}}},
            "`kl.controller` (AdaptivKL): module 'rlkl_lightning.kl.controllers' has no "
            "attribute 'AdaptivKL'",
        ),
        (
            {
                "model": {
                    "init_args": {"penalty": {"estimator": {"class_path": "rlkl_lightning.kl.K9"}}}
                }
            },
            "`model.init_args.penalty.estimator` must be one of ('k1', 'k2', 'k3', 'exact')",
        ),
        (
            {"model": {"init_args": {"ppo": {"advantage": "rlkl_lightning.algorithms.GAEE"}}}},
            "`model.init_args.ppo.advantage` must be one of ('gae',) or the dotted path",
        ),
        (
            {"data": {"class_path": "rlkl_lightning.data.PromptDataModul"}},
            "`data` (rlkl_lightning.data.PromptDataModul): module 'rlkl_lightning.data' has no "
            "attribute 'PromptDataModul'",
        ),
    ],
)
def test_a_mistyped_class_path_at_any_depth_keeps_the_parsers_reason(
    given, message, tiny_lm_dir, tmp_path, capfd
):
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    mistake = tmp_path / "mistake.yaml"
    mistake.write_text(yaml.safe_dump(given))
    printed = cli_error(["fit", "--config", str(config), "--config", str(mistake)], capfd)
    assert printed.startswith(message), printed
    assert "\n" not in printed.strip()
    assert "has no attribute" in printed or "is not accepted" in printed  # the real reason


@pytest.mark.parametrize(
    "args",
    [
        ["--model.init_args.reward.class_path=rlkl_lightning.rewards.VadrReward"],
        ["--model.init_args.reward=rlkl_lightning.rewards.VadrReward"],
    ],
)
def test_a_mistyped_reward_on_the_command_line_keeps_the_parsers_reason(
    args, tiny_lm_dir, tmp_path, capfd
):
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    printed = cli_error(["fit", "--config", str(config), *args], capfd)
    assert printed == (
        "`model.init_args.reward` (rlkl_lightning.rewards.VadrReward): module "
        "'rlkl_lightning.rewards' has no attribute 'VadrReward'"
    )


@pytest.mark.parametrize(
    ("text", "got"),
    [
        ("sampling:\n", "None: an empty block; give an option under it or remove it"),
        ("sampling: [1, 2]\n", "[1, 2]"),
        ("sampling: 3\n", "3"),
    ],
)
def test_a_group_block_that_is_not_a_mapping_is_named_in_one_line(
    text, got, tiny_lm_dir, tmp_path, capfd
):
    """`sampling:` with every key commented out is null: 71 lines and two tracebacks before."""
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    mistake = tmp_path / "mistake.yaml"
    mistake.write_text("model:\n  init_args:\n    " + text + "    # top_p: 0.9\n")
    printed = cli_error(["fit", "--config", str(config), "--config", str(mistake)], capfd)
    assert printed == (
        "`model.init_args.sampling` must be a mapping of its options ['max_new_tokens', "
        "'max_prompt_tokens', 'stop_at_eos', 'temperature', 'top_k', 'top_p'] (or a Sampling), "
        f"got {got}"
    )


def test_print_config_refuses_a_value_the_group_refuses(tiny_lm_dir, tmp_path, capfd):
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    args = ["fit", "--config", str(config), "--model.init_args.sampling.top_p=1.5"]
    printed = cli_error([*args, "--print_config"], capfd)
    assert printed == "`model.init_args.sampling.top_p` must be in (0, 1], got 1.5"
    assert capfd.readouterr().out == ""  # nothing printed as if it were a config


@pytest.mark.parametrize(
    ("args", "rows"),
    [
        (
            ["--data.init_args.batch_size=2", "--model.init_args.optimization.num_minibatches=3"],
            "2 (data.init_args.batch_size)",
        ),
    ],
)
def test_more_minibatches_than_a_batch_has_rows_are_refused(
    args, rows, tiny_lm_dir, tmp_path, capfd
):
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    printed = cli_error(["fit", "--config", str(config), *args], capfd)
    assert printed == (
        f"`model.init_args.optimization.num_minibatches` must be at most the rows of a batch, "
        f"{rows}, got 3: 1 of its optimizer steps would have no rows and still move the weights "
        "(AdamW's moments and weight decay)"
    )


def test_rloo_counts_the_responses_of_a_batch_as_its_rows(tiny_lm_dir, tmp_path, capfd):
    """2 prompts x 4 responses are 8 rows: 8 minibatches pass, 9 are refused."""
    from rlkl_lightning.cli import main

    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    rloo = ["--model=rlkl_lightning.RLOOModule", "--model.init_args.policy", str(tiny_lm_dir)]
    rloo += ["--data.init_args.batch_size=2", "--model.init_args.group.responses_per_prompt=4"]
    printed = cli_error(
        ["fit", "--config", str(config), *rloo, "--model.init_args.optimization.num_minibatches=9"],
        capfd,
    )
    assert "a batch, 8 (data.init_args.batch_size x model.init_args.group.responses_per_" in printed
    with pytest.raises(SystemExit) as done:
        main(
            ["fit", "--config", str(config), *rloo]
            + ["--model.init_args.optimization.num_minibatches=8", "--print_config"]
        )
    assert done.value.code in (0, None)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "CapabilityBudget: `data.init_args.heldout` must name the held-out text"),
        (
            {"data": {"heldout": "PROMPTS"}, "trainer": {"limit_val_batches": 0}},
            "CapabilityBudget: `trainer.limit_val_batches` must be > 0",
        ),
        (
            {"data": {"heldout": "PROMPTS"}, "trainer": {"val_check_interval": 5}},
            "CapabilityBudget: `trainer.val_check_interval` must be at most the run's length "
            "(2 batches), got 5",
        ),
    ],
)
def test_a_budget_that_would_never_act_is_refused_in_one_line(
    settings, message, tiny_lm_dir, tmp_path, capfd
):
    """Without its held-out text, with validation off, or validating less often than the run
    lasts, the budget never moved the target and nothing said so (exit 0)."""
    budget = {"class_path": "rlkl_lightning.CapabilityBudget", "init_args": {"budget": 1.2}}
    trainer = {
        "callbacks": [budget],
        "check_val_every_n_epoch": None,
        **settings.get("trainer", {}),
    }
    data = {k: str(tmp_path / "prompts.txt") for k in settings.get("data", {})}
    config = tiny_cli_config(tiny_lm_dir, tmp_path, trainer=trainer, data=data)
    said = cli_error(["fit", "--config", str(config)], capfd)
    assert said.startswith(message) and "\n" not in said, said
