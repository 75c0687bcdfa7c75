"""Llama 2 / Llama 3 causal LMs: the family's record.

config.py (config and published archs) and sizes.py are torch-free; model.py is the
single-device model, hf.py its Hugging Face adapter, parts.py what ``FAMILY`` loads with torch.
"""

from distlm.models.family import CAUSAL_LM, ModelFamily
from distlm.models.llama.config import ARCHS, LlamaConfig
from distlm.models.llama.sizes import SIZES

LLAMA_FLAGS = {
    "decoder_layers": "n_layers", "decoder_embed_dim": "dim", "decoder_ffn_embed_dim": "ffn_dim",
    "decoder_attention_heads": "n_heads", "kv_heads": "n_kv_heads", "head_dim": "head_size",
    "multiple_of": "multiple_of", "ffn_dim_multiplier": "ffn_dim_multiplier", "rope_theta": "rope_theta",
    "rope_scaling": "rope_type", "rope_factor": "rope_factor", "rope_low_freq_factor": "rope_low_freq_factor",
    "rope_high_freq_factor": "rope_high_freq_factor", "rope_original_max_seq_len": "rope_original_max_seq_len",
    "tie_word_embeddings": "tie_word_embeddings",
    "dropout": "dropout", "attention_dropout": "attention_dropout", "max_positions": "max_seq_len",
    "norm_eps": "norm_eps",
}
"""fairseq's decoder flags and distlm's Llama flags, and the settings every family has under
Llama's field names; the families built on Llama's blocks take them too."""

ROPE_SCALING_TYPES = {"none": "default", "llama3": "llama3"}
"""--rope-scaling's names (``choices.ROPE_SCALINGS``) for the config's ``rope_type``."""

LLAMA_ARCH_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_size", "tie_word_embeddings")
LLAMA_SIZE_FIELDS = LLAMA_ARCH_FIELDS + ("max_seq_len", "multiple_of", "ffn_dim_multiplier")

FAMILY = ModelFamily(
    name="llama",
    task=CAUSAL_LM,
    config_class=LlamaConfig,
    archs=ARCHS,
    flags=LLAMA_FLAGS,
    sizes=SIZES,
    parts="distlm.models.llama.parts",
    flag_values={"rope_scaling": ROPE_SCALING_TYPES},
    flag_implies={"decoder_attention_heads": ("kv_heads", "n_kv_heads")},
    size_fields=LLAMA_SIZE_FIELDS,
    arch_fields=LLAMA_ARCH_FIELDS,
)
