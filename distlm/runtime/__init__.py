"""The running job's processes, with no model: the bare distributed context (context.py), the
process group's start with its heartbeat and the hosts' placement (process_group.py), the
heartbeat that names the ranks a hung collective waits for, stop signals, and the check that
every rank was launched with the same settings and data (agreement.py).

Layer: may import distlm's core (errors, choices, config, mesh), ``distlm.launch`` and
``distlm.backends``; never models, parallel, data, checkpoint, observe or training.
"""
