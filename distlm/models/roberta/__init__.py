"""RoBERTa, the masked LM of fairseq and Hugging Face: the family's record.

config.py (config and published archs) and sizes.py are torch-free; model.py is the
single-device model, hf.py its Hugging Face adapter, parts.py what ``FAMILY`` loads with torch.
"""

from distlm.models.family import MASKED_LM, ModelFamily
from distlm.models.roberta.config import ARCHS, RobertaConfig
from distlm.models.roberta.sizes import SIZES

FAMILY = ModelFamily(
    name="roberta",
    task=MASKED_LM,
    config_class=RobertaConfig,
    archs=ARCHS,
    # fairseq's architecture flags, and the settings every family has under this family's field names.
    flags={"encoder_layers": "n_layers", "encoder_embed_dim": "dim", "encoder_ffn_embed_dim": "ffn_dim",
           "encoder_attention_heads": "n_heads", "activation_dropout": "activation_dropout",
           "dropout": "dropout", "attention_dropout": "attention_dropout", "max_positions": "max_positions",
           "norm_eps": "layer_norm_eps"},
    sizes=SIZES,
    parts="distlm.models.roberta.parts",
    size_fields=("dim", "n_layers", "n_heads", "ffn_dim", "max_positions"),
    arch_fields=("dim", "n_layers", "n_heads", "ffn_dim"),
    positions_from_samples=("roberta_base", "roberta_large"),
)
