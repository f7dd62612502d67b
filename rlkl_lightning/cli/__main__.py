"""``python -m rlkl_lightning.cli fit --config FILE``: the same as ``python train.py``.

``python -m rlkl_lightning.cli migrate OLD.yaml > NEW.yaml`` prints a run config of an older
version as today's (:mod:`rlkl_lightning.cli.migrate`).
"""

import sys

from rlkl_lightning.cli.app import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["migrate"]:
        from rlkl_lightning.cli.migrate import main as migrate

        migrate(sys.argv[2:])
    else:
        main()
