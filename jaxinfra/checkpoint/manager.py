"""Training checkpoints with orbax: params, optimizer state and every process's data-iterator state,
saved asynchronously every N steps, the last K kept; restored against sharded abstract targets, so a
run may resume on a different mesh or sharding preset than the one that saved it.

Orbax writes each step into a temporary directory and renames it when complete, so a save that is
interrupted never shows up as a step and never replaces the previous good one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every N steps (and at the end)
    keep: int = 3  # keep the last K
    async_save: bool = True  # write in a background thread while training goes on

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint.every and checkpoint.keep must be >= 1, got {self.every}, {self.keep}")


class _FrozenDataState:
    """The iterator's state at save time, so a background write cannot see a later position."""

    def __init__(self, state: bytes) -> None:
        self.state = state

    def get_state(self) -> bytes:
        return self.state


def _manager(directory: Path, cfg: CheckpointConfig, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=not read_only, read_only=read_only
    )
    handlers = {
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
    }
    return ocp.CheckpointManager(directory.absolute(), options=options, item_handlers=handlers)


class TrainCheckpointer:
    """Save/restore (params, opt_state, data iterator) by step under `directory`."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig = CheckpointConfig()) -> None:
        self.manager = _manager(Path(directory), cfg)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, params: Any, opt_state: Any, data: Any) -> None:
        """Start writing step `step` (returns while the arrays are written in the background)."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                data=grain.checkpoint.CheckpointSave(_FrozenDataState(data.get_state())),
            ),
            force=True,
        )

    def restore(self, step: int, abstract_params: Any, abstract_opt_state: Any, data: Any) -> tuple[Any, Any]:
        """Params and optimizer state laid out as the abstract targets' shardings; `data` is set in place."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_params),
                opt_state=ocp.args.StandardRestore(abstract_opt_state),
                data=grain.checkpoint.CheckpointRestore(data),
            ),
        )
        return restored["params"], restored["opt_state"]

    def stacked_layers(self, step: int) -> bool:
        return _stacked(self.manager, step)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _stacked(manager: ocp.CheckpointManager, step: int) -> bool:
    """Whether the step's params hold the decoder layers stacked (scan_layers) or one entry per layer."""
    layers = manager.item_metadata(step)["params"]["layers"]
    return not all(str(key).isdigit() for key in layers.keys())  # noqa: SIM118 - tree metadata, not a dict


def restore_params(
    directory: str | Path, abstract_params: Callable[[bool], Any], step: int | None = None
) -> tuple[Any, int, bool]:
    """Only the parameters of a training checkpoint (latest step by default), e.g. for serving:
    (params, step, whether the layers are stacked). `abstract_params(stacked)` gives the target."""
    manager = _manager(Path(directory), CheckpointConfig(async_save=False), read_only=True)
    step = manager.latest_step() if step is None else step
    if step is None:
        raise ValueError(f"{directory}: no checkpoint")
    if step not in manager.all_steps():
        raise ValueError(f"{directory}: no checkpoint at step {step} (have {list(manager.all_steps())})")
    stacked = _stacked(manager, step)
    target = abstract_params(stacked)
    restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    manager.close()
    return restored["params"], step, stacked
