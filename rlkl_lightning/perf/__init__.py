"""Optional speed-ups, each behind one option and applied in one place by the pipeline.

Nothing here imports the rest of the package; every speed-up is tested against the plain path.
"""
