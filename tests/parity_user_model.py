"""A model of the user's own for ``python -m distlm.parity --model parity_user_model:build``:
a two-block Llama over the built-in corpus's 260-symbol byte dictionary."""

from distlm.models.registry import build_model


def build():
    return build_model("llama_tiny", vocab_size=260, padding_idx=1, n_layers=2, dropout=0.0, attention_dropout=0.0)
