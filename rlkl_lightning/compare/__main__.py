"""``python -m rlkl_lightning.compare``: run the study (see :mod:`rlkl_lightning.compare`)."""

from rlkl_lightning.compare import main

if __name__ == "__main__":  # a run's process imports this module again (multiprocessing)
    main()
