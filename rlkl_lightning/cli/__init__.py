"""The command line of rlkl_lightning: ``python train.py fit --config configs/ppo_adaptive.yaml``.

- :mod:`~rlkl_lightning.cli.app`: :class:`~rlkl_lightning.cli.app.RLKLCLI` (LightningCLI with
  the ``kl`` group) and :func:`~rlkl_lightning.cli.app.main`, the entry point of ``train.py``
  and ``python -m rlkl_lightning.cli``;
- :mod:`~rlkl_lightning.cli.errors`: a user's mistake ends the run with its message alone;
- :mod:`~rlkl_lightning.cli.console`: what a run prints (its progress bar, no stray notes);
- :mod:`~rlkl_lightning.cli.run_settings`: a resume that would change the trajectory is refused;
- :mod:`~rlkl_lightning.cli.run_end`: ``last.ckpt`` is the run's end, and extending a run trains;
- :mod:`~rlkl_lightning.cli.migrate`: ``python -m rlkl_lightning.cli migrate OLD.yaml`` prints an
  older run config as today's.

The library (``kl``, ``algorithms``, ``models``, ``data``, ``perf``) does not import this
package (``tests/system/test_layering.py``).
"""

from rlkl_lightning.cli.app import RLKLCLI, main

__all__ = ["RLKLCLI", "main"]
