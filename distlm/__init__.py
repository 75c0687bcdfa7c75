"""distlm: one Trainer over DDP, FSDP, tensor parallel and ZeRO-1."""

__all__ = ["Trainer", "TrainConfig"]


def __getattr__(name: str):
    # Lazy, so that `import distlm.data` or `distlm.launch` does not pull in the trainer
    # (and with it every strategy) in data-loader workers and launcher-only tools.
    if name == "Trainer":
        from distlm.training.trainer import Trainer

        return Trainer
    if name == "TrainConfig":
        from distlm.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'distlm' has no attribute {name!r}")
