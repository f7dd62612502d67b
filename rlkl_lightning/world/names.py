"""The worlds' model names, ``"default"`` and ``"exact"``, registered with the models.

They are registered in :mod:`rlkl_lightning.models.named` when this module is imported, which
``rlkl_lightning/__init__.py`` does: the names resolve wherever the package is used
(``policy: default`` in a config, ``PPOModule(policy="default")`` in Python), and the models
package never imports the world. Each world is built on first use.
"""

from __future__ import annotations

from pathlib import Path

from rlkl_lightning.models.named import register_model_name


def default_world_model() -> Path:
    """``"default"``: the default world's SFT model (``world.build.default_model_dir``)."""
    from rlkl_lightning.world.build import default_model_dir

    return default_model_dir()


def exact_world_model() -> Path:
    """``"exact"``: the exact world's reference (``world.exact.exact_model_dir``)."""
    from rlkl_lightning.world.exact import exact_model_dir

    return exact_model_dir()


register_model_name("default", default_world_model)
register_model_name("exact", exact_world_model)
