"""``python -m rlkl_lightning.cli fit --config FILE``: the same as ``python train.py``."""

from rlkl_lightning.cli.app import main

if __name__ == "__main__":
    main()
