"""The command line of rlkl_lightning: ``python train.py fit --config configs/ppo_adaptive.yaml``.

- :mod:`~rlkl_lightning.cli.app`: :class:`~rlkl_lightning.cli.app.RLKLCLI` (LightningCLI with
  the ``kl`` group) and :func:`~rlkl_lightning.cli.app.main`, the entry point of ``train.py``
  and ``python -m rlkl_lightning.cli``;
- :mod:`~rlkl_lightning.cli.run_settings`: a resume that would change the trajectory is refused;
- :mod:`~rlkl_lightning.cli.run_end`: ``last.ckpt`` is the run's end, and extending a run trains;
- :mod:`~rlkl_lightning.cli.help`: ``fit --help`` ends with the modules' groups and fields;
- :mod:`~rlkl_lightning.cli.migrate`: ``python -m rlkl_lightning.cli migrate OLD.yaml`` prints an
  older run config as today's.

What a run prints (:mod:`~rlkl_lightning.console`) and the message a user's mistake ends it with
(:mod:`~rlkl_lightning.errors`) are shared modules below this package, which the world's own
command line uses too. The library (``kl``, ``algorithms``, ``models``, ``data``, ``perf``,
``world``) does not import this package (``tests/system/test_layering.py``).
"""

from rlkl_lightning.cli.app import RLKLCLI, main

__all__ = ["RLKLCLI", "main"]
