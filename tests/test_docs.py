"""The docs say what the code does.

* every logged metric is defined in docs/metrics.md;
* ``group.drop_zero_std_groups``: a group of equal scores has advantages 0 only without the KL
  in the reward; with it, GRPO's are of unit scale whatever beta (docs/pipeline.md says so).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from rlkl_lightning import metric_keys
from rlkl_lightning.algorithms import options, rloo
from rlkl_lightning.algorithms.advantages import group_advantages

ROOT = Path(__file__).resolve().parents[1]
#: Logged by the world's SFT (docs/worlds.md), not by a training run.
NOT_A_RUNS_METRIC = {metric_keys.VAL_LOSS}


def test_every_metric_key_is_defined_in_the_metrics_page():
    page = (ROOT / "docs" / "metrics.md").read_text()
    names = {
        value
        for name, value in vars(metric_keys).items()
        if name.isupper() and isinstance(value, str)
    }
    assert metric_keys.TRUST_REGION_MASKED in names
    assert sorted(k for k in names - NOT_A_RUNS_METRIC if f"`{k}`" not in page) == []


def test_every_phase_of_the_peak_memory_keys_is_named_in_the_metrics_page():
    page = (ROOT / "docs" / "metrics.md").read_text()
    generic = metric_keys.peak_memory_of("{r}", "{phase}")
    assert generic == "perf/peak_mem_gb/{phase}/rank{r}"
    (row,) = [line for line in page.splitlines() if line.startswith(f"| `{generic}` |")]
    assert all(f"`{phase}`" in row for phase in metric_keys.MEMORY_PHASES)


def test_a_flat_group_has_kl_advantages_with_the_kl_in_the_reward_and_the_docs_say_so():
    k, kl = 4, torch.tensor([0.5, 1.5, 3.0, 7.0], dtype=torch.float64)  # one group, equal scores
    for beta in (0.01, 0.1, 1.0):
        returns = 0.7 - beta * kl  # the score, then the KL in the reward
        centred = kl - kl.mean()
        want = -beta * k / (k - 1) * centred
        assert torch.allclose(group_advantages(returns, k, "rloo"), want)
        grpo = group_advantages(returns, k, "grpo")
        assert torch.allclose(grpo, -centred / kl.std(), rtol=1e-2)  # eps: 1e-4 on the std
        assert grpo.std() == pytest.approx(1.0, rel=1e-2)  # unit scale, not beta's
    assert torch.equal(group_advantages(torch.full((k,), 0.7), k, "grpo"), torch.zeros(k))
    pipeline = (ROOT / "docs" / "pipeline.md").read_text()
    texts = {
        "docs/pipeline.md": pipeline.split("`group.drop_zero_std_groups`")[1].split("\n- ")[0],
        "GroupOptions": inspect.getdoc(options.GroupOptions),
        "zero_std_groups": inspect.getdoc(rloo.zero_std_groups),
    }
    for where, text in texts.items():
        flat = " ".join(text.split())
        assert "0 anyway" not in flat and "0 whatever the method" not in flat, where
        assert "c - beta" in flat, where  # the returns of a flat group, said


def test_the_aggregation_docs_agree_on_ddp_and_name_gspos_aggregation():
    from rlkl_lightning.algorithms import aggregation

    module = " ".join(inspect.getdoc(aggregation).split())
    page = " ".join((ROOT / "docs" / "pipeline.md").read_text().split())
    for text in (module, page):  # token_mean under DDP: the mean of the ranks' token means
        assert "the mean of the ranks' token means" in text
    assert "the formula over the global minibatch: ``token_mean``" not in module
    assert "| GSPO (Zheng et al. 2025) | `sequence_mean` |" in page


def nav_pages() -> list[str]:
    """Every page of mkdocs.yml's nav, in its order."""
    import yaml

    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        if isinstance(node, dict):
            return [page for value in node.values() for page in walk(value)]
        return []

    return walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])


def test_the_start_page_starts_and_lists_every_page_of_the_site():
    page = (ROOT / "docs" / "index.md").read_text()
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings[:4] == ["## Install", "## Two commands", "## Quickstart", "## Where next"]
    assert "make study" in page and "make test" in page and "train.py fit --config" in page
    pages = nav_pages()
    assert pages[0] == "index.md" and len(pages) > 30
    assert [p for p in pages[1:] if f"]({p})" not in page] == []
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert set(pages) <= on_disk


def test_the_readme_lists_every_page_of_the_guide():
    """The README's docs list names every page of the site but the reports and the API's parts."""
    readme = (ROOT / "README.md").read_text()
    listed = readme.split("## Documentation", 1)[1]
    pages = [p for p in nav_pages() if "/" not in p or p == "reference/index.md"]
    assert "extending.md" in pages
    assert [p for p in pages if f"](docs/{p})" not in listed] == []


def test_the_install_sections_name_every_extra_and_what_make_setup_installs():
    """README.md and docs/index.md name every extra of pyproject.toml, and their pinned install
    line (`-c constraints.txt`) installs the extras `make setup` installs."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([a-z][a-z0-9_-]*) = \[", section, re.MULTILINE)
    assert {"dev", "docs", "serve"} <= set(extras)
    setup = re.search(r"-e '(\.\[[a-z,]+\])'", (ROOT / "Makefile").read_text()).group(1)
    for path in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        install = path.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
        assert [e for e in extras if f"`{e}`" not in install] == [], path.name
        pinned = [line for line in install.splitlines() if "-c constraints.txt" in line]
        assert pinned and all(f"-e '{setup}'" in line for line in pinned), (path.name, setup)


def test_the_package_maps_name_every_subpackage_and_every_file_listed_one_by_one():
    """docs/index.md's "file by file" names every module of the folders it lists by file (the
    package's top level, cli/, kl/, algorithms/); it and the README's map name every
    subpackage."""
    package = ROOT / "rlkl_lightning"
    index = (ROOT / "docs" / "index.md").read_text()
    by_file = index.split("## The package, file by file", 1)[1].split("\n## ", 1)[0]
    readme_map = (ROOT / "README.md").read_text().split("## Map of the package", 1)[1]
    readme_map = readme_map.split("\n## ", 1)[0]
    subpackages = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    assert [f"{d}/" for d in subpackages if f"{d}/" not in by_file] == []
    assert [f"{d}/" for d in subpackages if f"{d}/" not in readme_map] == []
    modules = [
        f.relative_to(package).as_posix()
        for folder in (package, package / "cli", package / "kl", package / "algorithms")
        for f in sorted(folder.glob("*.py"))
        if f.name not in {"__init__.py", "__main__.py"}
    ]
    unnamed = [m for m in modules if not re.search(rf"\b{re.escape(Path(m).name)}\b", by_file)]
    assert unnamed == []


def test_every_registered_component_is_named_on_its_page():
    """Names read from the registries: a new law, estimator, advantage or engine needs its docs."""
    from rlkl_lightning.algorithms.advantage_estimators import ADVANTAGES
    from rlkl_lightning.algorithms.engines import ENGINES
    from rlkl_lightning.kl.estimators import ESTIMATORS
    from rlkl_lightning.kl.laws import LAWS

    pages = {
        "controllers.md": LAWS.names(),
        "kl.md": ESTIMATORS.names(),
        "pipeline.md": tuple(n for registry in ADVANTAGES.values() for n in registry.names()),
        "engines.md": ENGINES.names(),
    }
    named = {n for names in pages.values() for n in names}
    assert {"logpid", "exact", "grpo", "vllm", "compiled"} <= named
    missing = {
        page: [n for n in names if f"`{n}`" not in (ROOT / "docs" / page).read_text()]
        for page, names in pages.items()
    }
    assert missing == {page: [] for page in pages}


def test_the_custom_scalars_chart_is_what_the_docs_say():
    """The chart holds the KL, its average and the target: no band (the README said one)."""
    from types import SimpleNamespace

    from rlkl_lightning.kl.drift_monitor import KLDriftMonitor

    charts = []
    experiment = SimpleNamespace(add_custom_scalars=charts.append)
    trainer = SimpleNamespace(
        is_global_zero=True, loggers=[SimpleNamespace(experiment=experiment)], callbacks=[]
    )
    KLDriftMonitor(target=6.0).on_fit_start(trainer, None)
    [(curves_kind, curves)] = [v for chart in charts for v in chart["KL control"].values()]
    assert curves_kind == "Multiline"
    assert curves == ["objective/kl", metric_keys.MONITOR_AVG_KL, metric_keys.MONITOR_TARGET]
    said = "Custom Scalars tab draws the KL, its moving average and its target in one chart"
    for path in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = " ".join(path.read_text().split())
        assert said in text and "target and band in the Custom Scalars" not in text, path


def test_an_argument_a_law_does_not_take_is_refused_as_the_docs_say():
    """docs/controllers.md says so; 0.4.0's docs said it of a misplaced gain the code warned of."""
    from rlkl_lightning.kl.laws import LAWS, law_spec
    from rlkl_lightning.kl.settings import KLSettings

    for name in LAWS.names():
        foreign = "k" if name == "adaptive" else "horizon"  # another law's gain
        spec = {"class_path": law_spec(name)["class_path"], "init_args": {foreign: 3.0}}
        with pytest.raises(
            ValueError,
            match=rf"`kl.controller.init_args` has no argument "
            rf"'{foreign}': \w+ takes \[",
        ):
            KLSettings(controller=spec).kl_controller(0.1)
    page = " ".join((ROOT / "docs" / "controllers.md").read_text().split())
    assert "An argument the law does not take is refused, naming the arguments it takes" in page
    for path in ("docs/controllers.md", "docs/extending.md", "rlkl_lightning/kl/settings.py"):
        text = " ".join((ROOT / path).read_text().split())
        assert "for a law that does not read it is refused" not in text, path
        assert "read it (`kl.kp` with `logpid`, which used to ignore it silently) is" not in text


def test_the_yaml_examples_name_the_modules_groups_by_their_names_today():
    """A YAML block of the docs that gives the module a group renamed since (``kl`` ->
    ``penalty`` in 0.5.0) is one the CLI refuses; an example that says so in words is prose."""
    import re

    import yaml

    from rlkl_lightning.migrations import RENAMED_GROUPS

    stale = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S):
            try:
                config = yaml.safe_load(block)
            except yaml.YAMLError:
                continue
            model = config.get("model") if isinstance(config, dict) else None
            init = model.get("init_args") if isinstance(model, dict) else None
            if isinstance(init, dict):
                stale += [f"{page.name}: model.init_args.{g}" for g in RENAMED_GROUPS if g in init]
    assert stale == []


def test_every_test_the_docs_name_exists():
    """A table's third column names the tests that show each behaviour: renamed or deleted,
    the name would point at nothing. Option names that start with ``test_`` are short."""
    defined = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^\s*def (test_\w+)", path.read_text(), re.MULTILINE))
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in re.findall(r"`(test_\w+)(?:\[[^\]`]*\])?`", page.read_text()):
            if name.count("_") >= 3 and name not in defined:
                missing.append(f"{page.name}: {name}")
    assert missing == []
