"""Llama's torch parts, which ``distlm.models.llama.FAMILY`` loads when first asked."""

from distlm.models.llama.hf import ADAPTER
from distlm.models.llama.model import LlamaCausalLM

MODEL = LlamaCausalLM
HF_ADAPTERS = (ADAPTER,)
