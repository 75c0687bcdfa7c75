"""The mixture of experts' torch parts, which ``distlm.models.moe.FAMILY`` loads when first asked."""

from distlm.models.moe.hf import MIXTRAL_ADAPTER, QWEN3_MOE_ADAPTER
from distlm.models.moe.model import MoECausalLM

MODEL = MoECausalLM
HF_ADAPTERS = (QWEN3_MOE_ADAPTER, MIXTRAL_ADAPTER)
