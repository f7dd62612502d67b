"""``python -m rlkl_lightning.compare``: run the study (see :mod:`rlkl_lightning.compare`)."""

from rlkl_lightning.compare import main

main()
