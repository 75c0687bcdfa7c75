"""Single-device models.

Parallelism is applied from outside (distlm.parallel), guided by each model class's
``tp_plan``; nothing here imports torch's distributed package.
``distlm.models.hf`` converts configs and weights to and from Hugging Face's models.
"""

from distlm.models.llama import LlamaCausalLM, LlamaConfig
from distlm.models.registry import ARCHS, arch_config, arch_family, arch_task, build_model
from distlm.models.roberta import RobertaConfig, RobertaMaskedLM

__all__ = [
    "ARCHS",
    "arch_config",
    "arch_family",
    "arch_task",
    "build_model",
    "LlamaCausalLM",
    "LlamaConfig",
    "RobertaConfig",
    "RobertaMaskedLM",
]
