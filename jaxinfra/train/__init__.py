"""Training: sharded train step, optimizer, memory accounting."""

from jaxinfra.train.optimizer import OptimConfig, make_optimizer
from jaxinfra.train.step import TrainConfig, Trainer, TrainState, lm_loss, per_device_bytes

__all__ = ["OptimConfig", "TrainConfig", "TrainState", "Trainer", "lm_loss", "make_optimizer", "per_device_bytes"]
