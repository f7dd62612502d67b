"""``python -m rlkl_lightning.cli migrate``: a config of 0.1.0 or 0.4.0 parses as today's does.

Each old config is converted by the command and parsed by ``train.py``'s parser
(``--print_config``), and the values it prints are those of the same run written by hand in
today's layout.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlkl_lightning.cli import main
from rlkl_lightning.cli.migrate import migrate_text

ROOT = Path(__file__).resolve().parents[2]

TODAY = """\
model:
  class_path: rlkl_lightning.PPOModule
  init_args:
    policy: {policy}
    sampling:
      max_prompt_tokens: 8
      max_new_tokens: 4
    optimization:
      lr: 1.0e-4
      ppo_epochs: 1
    penalty:
      init_coef: 0.2
      placement: loss
    logging:
      log_samples_every: 0
data:
  class_path: rlkl_lightning.data.PromptDataModule
  init_args:
    prompts: {policy}/prompts.txt
kl:
  target: 1.0  # the run's KL control keeps its name
  controller:  # with the law's arguments (0.5.0)
    class_path: AdaptiveKLController
    init_args:
      horizon: 100.0
"""

#: 0.2.0-0.4.0: the groups, the KL penalty's named `kl`, the law's gain in the run's `kl`.
GROUPS_040 = TODAY.replace("    penalty:\n", "    kl:  # where the KL goes\n").replace(
    TODAY[TODAY.index("  controller:") :], "  horizon: 100.0\n  kp: 0.9  # not read by adaptive\n"
)

FLAT_010 = """\
# 0.1.0: the modules' options were flat
model:
  class_path: rlkl_lightning.PPOModule
  init_args:
    policy: {policy}
    max_prompt_tokens: 8
    max_new_tokens: 4
    lr: 1.0e-4
    ppo_epochs: 1
    init_kl_coef: 0.2
    kl_placement: loss
    log_samples_every: 0
data:
  class_path: rlkl_lightning.data.PromptDataModule
  init_args:
    prompts: {policy}/prompts.txt
kl:
  target: 1.0
  horizon: 100.0
"""


def _migrate(path: Path) -> str:
    """``python -m rlkl_lightning.cli migrate PATH``'s output."""
    done = subprocess.run(
        [sys.executable, "-m", "rlkl_lightning.cli", "migrate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def _printed(path: Path, capsys) -> dict:
    """The values ``train.py fit --config PATH --print_config`` prints."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("old", [FLAT_010, GROUPS_040], ids=["0.1.0", "0.4.0"])
def test_an_old_config_converted_parses_to_todays_values(old, tiny_lm_dir, tmp_path, capsys):
    (tmp_path / "old.yaml").write_text(old.format(policy=tiny_lm_dir))
    (tmp_path / "today.yaml").write_text(TODAY.format(policy=tiny_lm_dir))
    (tmp_path / "new.yaml").write_text(_migrate(tmp_path / "old.yaml"))
    wanted = _printed(tmp_path / "today.yaml", capsys)
    assert wanted["model"]["init_args"]["penalty"]["placement"] == "loss"
    assert _printed(tmp_path / "new.yaml", capsys) == wanted


def test_a_renamed_group_is_renamed_in_place_with_its_comments(tiny_lm_dir):
    old = GROUPS_040.format(policy=tiny_lm_dir)
    old = old[: old.index("  horizon:")]  # no law's gain to move: only the group's name changes
    assert migrate_text(old) == old.replace("    kl:  # where", "    penalty:  # where")
    flow = "model: {init_args: {kl: {placement: loss}}}  # mine\nkl: {target: 2.0}\n"
    assert migrate_text(flow) == flow.replace("{kl:", "{penalty:")


def test_the_laws_gains_move_into_the_law_and_a_gain_it_did_not_read_is_dropped():
    new = yaml.safe_load(migrate_text(GROUPS_040.format(policy="gpt2")))
    assert new["kl"] == {
        "target": 1.0,
        "controller": {"class_path": "AdaptiveKLController", "init_args": {"horizon": 100.0}},
    }
    pi = yaml.safe_load(migrate_text("kl:\n  controller: pi\n  kp: 0.77\n  ki: 0.067\n"))
    assert pi["kl"]["controller"]["init_args"] == {"kp": 0.77, "ki": 0.067}
    unread = yaml.safe_load(migrate_text("kl:\n  controller: logpid\n  horizon: 9.0\n"))
    assert unread["kl"] == {"controller": "logpid"}


def test_flat_options_are_moved_and_the_lost_comments_said():
    new = migrate_text(FLAT_010.format(policy="gpt2"), "old.yaml")
    assert new.startswith("# old.yaml, migrated by `python -m rlkl_lightning.cli migrate` (")
    init_args = yaml.safe_load(new)["model"]["init_args"]
    assert init_args["penalty"] == {"init_coef": 0.2, "placement": "loss"}
    assert init_args["sampling"] == {"max_prompt_tokens": 8, "max_new_tokens": 4}
    assert list(init_args) == ["policy", "sampling", "optimization", "penalty", "logging"]


@pytest.mark.parametrize("name", ["ppo_adaptive.yaml", "rloo_adaptive_kl_loss.yaml"])
def test_a_config_of_today_is_left_as_it_is(name):
    text = (ROOT / "configs" / name).read_text()
    assert migrate_text(text) == text


SFT_OWN_OPTIONS = """\
model:
  class_path: rlkl_lightning.world.sft.SFTModule
  init_args:
    lr: 0.003  # SFTModule's own, never a flat option of 0.1.0
    weight_decay: 0.01
"""


@pytest.mark.parametrize(
    "text",
    [
        SFT_OWN_OPTIONS,
        "model.class_path: rlkl_lightning.world.sft.SFTModule\nmodel.init_args.lr: 0.003\n",
    ],
    ids=["nested", "dotted"],
)
def test_a_module_without_groups_keeps_its_own_lr(text):
    # `--print_config` of configs/sft.yaml prints SFTModule's `lr`: moved into an `optimization`
    # group SFTModule lacks, the migrated config was refused
    assert migrate_text(text) == text


def test_a_file_that_is_not_a_config_is_one_line(tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    done = subprocess.run(
        [sys.executable, "-m", "rlkl_lightning.cli", "migrate", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == f"error: `migrate`: {bad} must be a YAML mapping (a run config)\n"


def test_the_budgets_steps_per_validation_become_steps_per_batch_and_old_gains_are_dropped():
    old = {
        "trainer": {
            "val_check_interval": 5,
            "callbacks": [
                {
                    "class_path": "rlkl_lightning.CapabilityBudget",
                    "init_args": {
                        "budget": 1.3,
                        "rate": 0.1,
                        "max_raise": 0.2,
                        "max_step": 0.5,
                        "gain": 0.5,
                        "tau": 20.0,
                    },
                },
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"},
            ],
        }
    }
    new = yaml.safe_load(migrate_text(yaml.safe_dump(old)))
    budget, checkpoint = new["trainer"]["callbacks"]
    assert budget["init_args"] == {"budget": 1.3, "raise_per_batch": 0.04, "fall_per_batch": 0.1}
    assert checkpoint == old["trainer"]["callbacks"][1]
    from rlkl_lightning import CapabilityBudget

    CapabilityBudget(**budget["init_args"])  # today's arguments
    old["trainer"]["val_check_interval"] = 0.5  # a share of an epoch: no whole-batch step
    new = yaml.safe_load(migrate_text(yaml.safe_dump(old)))
    assert new["trainer"]["callbacks"][0]["init_args"] == {"budget": 1.3}


#: 0.4.0 in dotted keys over a base (the layout of today's shipped configs).
DOTTED_040 = """\
config: today.yaml  # the base
model.init_args.kl.init_coef: 0.3  # beta
model.init_args.top_p: 0.9
kl.controller: pi
kl.kp: 0.5
kl.horizon: 100.0  # not read by pi
"""

DOTTED_TODAY = """\
config: today.yaml
model.init_args.penalty.init_coef: 0.3
model.init_args.sampling.top_p: 0.9
kl.controller:
  class_path: PIKLController
  init_args:
    kp: 0.5
"""


def test_dotted_keys_are_migrated_as_nested_ones_are(tiny_lm_dir, tmp_path, capsys):
    (tmp_path / "today.yaml").write_text(TODAY.format(policy=tiny_lm_dir))
    (tmp_path / "old.yaml").write_text(DOTTED_040)
    (tmp_path / "wanted.yaml").write_text(DOTTED_TODAY)
    (tmp_path / "new.yaml").write_text(_migrate(tmp_path / "old.yaml"))
    wanted = _printed(tmp_path / "wanted.yaml", capsys)
    assert wanted["model"]["init_args"]["penalty"]["init_coef"] == 0.3
    assert wanted["kl"]["controller"]["init_args"]["kp"] == 0.5
    assert _printed(tmp_path / "new.yaml", capsys) == wanted
    renamed = DOTTED_040[: DOTTED_040.index("kl.controller")]  # no law's gain: keys renamed
    assert migrate_text(renamed) == renamed.replace(".kl.init_coef", ".penalty.init_coef").replace(
        ".top_p", ".sampling.top_p"
    )
    both = "model.init_args.lr: 0.1\nmodel.init_args.optimization.lr: 0.2\n"
    assert yaml.safe_load(migrate_text(both)) == {"model.init_args.optimization.lr": 0.2}
    whole = "model.init_args.kl: {init_coef: 0.3}\n"
    assert migrate_text(whole) == "model.init_args.penalty: {init_coef: 0.3}\n"
