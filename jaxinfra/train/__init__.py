"""Training: sharded train step, optimizer, memory accounting."""

from jaxinfra.train.step import OptimConfig, TrainConfig, Trainer, TrainState, lm_loss, make_optimizer, per_device_bytes

__all__ = ["OptimConfig", "TrainConfig", "TrainState", "Trainer", "lm_loss", "make_optimizer", "per_device_bytes"]
