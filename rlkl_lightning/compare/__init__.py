"""The study: training configs side by side, over seeds, with curves and a report.

``python -m rlkl_lightning.compare --config configs/compare.yaml`` (or ``rlkl-compare``) runs
every configured ``train.py`` config once per seed, each as its own process and TensorBoard run
(:mod:`.runs`, showing its progress with :mod:`.progress`), reads the event files back
(:mod:`.events`) and writes ``curves.png``, ``report.md`` and ``summary.json`` into the output
directory (:mod:`.report`). ``configs/compare.yaml`` puts fixed and adaptive KL control side by
side, ``configs/compare_laws.yaml`` all four control laws, ``configs/compare_algorithms.yaml``
PPO and RLOO; ``configs/compare_exact.yaml`` (``report: exact``) every KL placement on the
exact world, judged against the exact optimum (:mod:`.exact`).
"""

from rlkl_lightning.compare.config import StudyConfig
from rlkl_lightning.compare.runs import RunProgress
from rlkl_lightning.compare.study import main, parse_args

__all__ = ["RunProgress", "StudyConfig", "main", "parse_args"]
