"""Benchmark suites of distlm, run as ``python -m distlm.bench SUITE``.

``scaling`` (``distlm/bench/scaling.py``) measures tokens/s, the split of an update into
compute, exposed communication and optimizer, memory per rank, MFU and scaling
efficiency over a list of world sizes, driving the real Trainer; its rows are what
``python -m distlm.plan --calibrate`` reads.
"""
