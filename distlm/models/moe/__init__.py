"""Mixtures of experts on Llama's blocks (Qwen3-MoE, Mixtral, DeepSeek-V3's router): the
family's record.

config.py (config and published archs) and sizes.py are torch-free; model.py is the
single-device model, hf.py its Hugging Face adapters (Qwen3-MoE and Mixtral), parts.py what
``FAMILY`` loads with torch.
"""

from distlm.models.family import CAUSAL_LM, ModelFamily
from distlm.models.llama import LLAMA_ARCH_FIELDS, LLAMA_FLAGS, LLAMA_SIZE_FIELDS, ROPE_SCALING_TYPES
from distlm.models.moe.config import ARCHS, MoEConfig
from distlm.models.moe.sizes import SIZES

EXPERT_FIELDS = ("n_experts", "moe_ffn_dim", "moe_every", "n_shared_experts", "qk_norm")

FAMILY = ModelFamily(
    name="qwen3_moe",
    task=CAUSAL_LM,
    config_class=MoEConfig,
    archs=ARCHS,
    flags={**LLAMA_FLAGS, "num_experts": "n_experts", "moe_top_k": "top_k", "moe_ffn_dim": "moe_ffn_dim",
           "moe_every": "moe_every", "moe_shared_experts": "n_shared_experts", "moe_router": "router",
           "moe_aux_loss_coef": "aux_loss_coef", "moe_bias_update_rate": "bias_update_rate"},
    sizes=SIZES,
    parts="distlm.models.moe.parts",
    flag_values={"rope_scaling": ROPE_SCALING_TYPES},
    flag_implies={"decoder_attention_heads": ("kv_heads", "n_kv_heads")},
    size_fields=LLAMA_SIZE_FIELDS + EXPERT_FIELDS,
    arch_fields=LLAMA_ARCH_FIELDS + EXPERT_FIELDS,
)
