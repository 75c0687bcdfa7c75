"""distlm: one Trainer over DDP, FSDP, tensor parallel and ZeRO-1."""

from distlm.config import TrainConfig
from distlm.trainer import Trainer

__all__ = ["Trainer", "TrainConfig"]
