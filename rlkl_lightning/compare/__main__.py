"""``python -m rlkl_lightning.compare``: run the study (see :mod:`rlkl_lightning.compare`).

A user's mistake (a bad option, a directory that is not a world) ends with ``error: MESSAGE``
alone and exit status 2, as ``train.py``'s; ``--verbose`` or ``RLKL_VERBOSE=1`` raise it with
its traceback instead.
"""

import os
import sys

from rlkl_lightning.compare import main
from rlkl_lightning.errors import VERBOSE_ENV, user_message


def command(argv: list[str]) -> None:
    """Run the study on ``argv``; a user's mistake is one line on stderr and status 2."""
    verbose = "--verbose" in argv or os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    try:
        main([a for a in argv if a != "--verbose"])
    except Exception as error:
        message = None if verbose else user_message(error)
        if message is None:
            raise
        sys.stdout.flush()
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":  # a run's process imports this module again (multiprocessing)
    command(sys.argv[1:])
