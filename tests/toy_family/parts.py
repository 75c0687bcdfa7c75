"""The toy family's torch parts: its single-device model."""

import torch
from torch import nn

from distlm.models.contract import TransformerLM


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


class ToyCausalLM(TransformerLM):
    task = "causal_lm"

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.embed = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(ToyBlock(config.dim) for _ in range(config.n_layers))
            self.norm = nn.LayerNorm(config.dim)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.materialise_unless_meta(torch.get_default_device())

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def init_buffers(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


MODEL = ToyCausalLM
HF_ADAPTERS = ()
