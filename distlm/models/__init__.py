"""Single-device models, one folder per family (roberta, llama, moe), each a ``ModelFamily``
record (family.py) listed once in registry.py; the contract every model meets (contract.py),
the training objective (loss.py), sizes and FLOP counts (sizes.py, flops.py) and Hugging Face
conversion (hf/).

Parallelism is applied from outside (distlm.parallel), guided by each model class's
``tp_plan``; nothing here imports torch's distributed package. This package, the registry and
each family's record are torch-free, so that the command line checks ``--arch`` before torch
loads.

Layer: may import distlm's core (errors, choices) and ``distlm.data`` (the loss's ignore index);
never runtime, parallel, checkpoint, observe or training.
"""

from distlm.models.registry import arch_config, arch_names, build_model, family_of_arch

__all__ = ["arch_config", "arch_names", "build_model", "family_of_arch"]
