"""Builders, recordings and helpers shared by the tests: imported as ``helpers.<module>``.

``tests/`` is on ``sys.path`` under pytest (``tests/conftest.py`` lives there), and the tests
that start ``train.py`` processes put it on their ``PYTHONPATH``, so configs name these
classes as ``helpers.<module>.<Class>``. Nothing here is collected (no ``test_`` prefix).
"""
