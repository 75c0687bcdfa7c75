"""A trained checkpoint out of distlm: one safetensors file under distlm's names
(safetensors.py) or a Hugging Face model directory (hf.py), written where nothing else is
overwritten (target.py); ``python -m distlm.export`` is cli.py.

Layer: reads checkpoints offline, with no process group; it may import the core,
``distlm.checkpoint`` and ``distlm.models``, never training or parallel.
"""
