"""Training: sharded train step, optimizer, memory accounting."""

from jaxinfra.train.step import TrainConfig, Trainer, TrainState, lm_loss, make_optimizer, per_device_bytes

__all__ = ["TrainConfig", "TrainState", "Trainer", "lm_loss", "make_optimizer", "per_device_bytes"]
