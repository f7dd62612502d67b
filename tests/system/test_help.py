"""``train.py fit --help`` answers: it ends with the modules' groups, each field and its default."""

from __future__ import annotations

from dataclasses import fields

import pytest

from rlkl_lightning.algorithms.options import MODULE_GROUPS


def test_fit_help_ends_with_every_group_and_field_of_the_modules(capsys):
    from rlkl_lightning.cli import main

    with pytest.raises(SystemExit) as done:
        main(["fit", "--help"])
    assert done.value.code in (0, None)
    text = capsys.readouterr().out
    usage, _, page = text.partition("The modules of rlkl_lightning (")
    assert "--trainer.max_steps" in usage and page  # after the parser's own help
    lines = page.splitlines()
    assert "`--model.init_args.GROUP.FIELD=VALUE`" in " ".join(lines[:4])
    flat = " ".join(line.strip() for line in lines)
    for group, cls in MODULE_GROUPS.items():
        found = [x for x in lines if x.startswith(f"  {group}: ") or x.startswith(f"  {group} (")]
        assert len(found) == 1, group
        for field in fields(cls):
            assert f"{field.name}=" in flat, f"{group}.{field.name}"
    assert "  ppo (PPOModule): advantage=gae, " in page
    assert "  group (RLOOModule): responses_per_prompt=4, " in page
    assert "  sampling: max_prompt_tokens=64, max_new_tokens=24, temperature=1.0, " in page
    assert "  arguments: policy=default, tokenizer=null, " in page
    assert max(len(x) for x in lines) <= 100


def test_the_top_level_help_and_a_class_help_do_not_repeat_the_page(capsys):
    from rlkl_lightning.cli import main

    for args in (["--help"], ["fit", "--model.help", "rlkl_lightning.PPOModule"]):
        with pytest.raises(SystemExit):
            main(args)
        assert "The modules of rlkl_lightning" not in capsys.readouterr().out, args
