"""Seeing inside a run: rank 0's lines (printer.py, log_lines.py), trackers, --log-file, the
profiler window, straggler statistics and run.json; observer.py ties them to the loop.

Layer: needs only the bare distributed context. It may import distlm's core (errors, choices,
config), ``distlm.runtime`` and ``distlm.backends.hardware``; never models, parallel, data,
checkpoint or training.
"""
