"""Training: the Trainer's loop (trainer.py) and its update (step.py), the start of a run
(startup.py: launcher, validation, process group, meshes), what is checked before any
rendezvous (validation.py), the model a run builds (builder.py), validation on held-out data
(evaluation.py), statistics and MFU (stats.py), and the start-up log, memory and divergence
reports.

Layer: the core of a run; it may import everything below it (runtime, backends, models,
data, parallel, checkpoint, observe) and no tool (plan, bench, doctor, parity, report) nor
the entry point ``distlm.train``.
"""
