"""`jaxinfra train`: the training loop — data, sharded steps, evaluation, checkpoints, logs, export.

It resumes from the latest checkpoint in <out_dir>/checkpoints by itself, with the data iterator where
it stopped, so a killed run continues with the same batches and (on CPU) the same losses bit for bit."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfra.checkpoint import export_hf
from jaxinfra.checkpoint.manager import TrainCheckpointer
from jaxinfra.config import ModelConfig
from jaxinfra.data import DataLoader
from jaxinfra.loading import load_config, load_model, load_tokenizer
from jaxinfra.lora import add_lora, save_peft
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer
from jaxinfra.train.config import RunConfig, dump_run_config
from jaxinfra.train.eagle import train_eagle
from jaxinfra.train.logger import MetricsLogger, plot_losses
from jaxinfra.train.optimizer import make_schedule
from jaxinfra.train.run_steps import RunData, run_steps
from jaxinfra.train.step import Trainer, TrainState, per_device_bytes
from jaxinfra.train.throughput import device_memory_gib, device_peak_tflops, flops_per_token
from sharding import get_rules, make_mesh


@dataclasses.dataclass
class TrainResult:
    out_dir: Path
    start_step: int  # 0, or the checkpoint step this run resumed from
    final_step: int
    eval_loss: float | None
    unigram_entropy: float  # nats/token of the training split's token frequencies
    base_eval_loss: float | None = None  # LoRA runs: the held-out loss before training (the base model's)


def model_source(cfg: RunConfig) -> tuple[ModelConfig, Tokenizer, bool]:
    """(model config, tokenizer, whether to start from the model's weights rather than random init).

    `model` is a model YAML file (a shape to initialise), or whatever jaxinfra.loading takes: an HF
    directory or a training run directory (continue from its weights), or a preset (random init)."""
    path = Path(cfg.model)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        model_cfg, pretrained = ModelConfig.from_yaml(path), False
        tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else Tokenizer.byte_level()
    else:
        model_cfg, pretrained = load_config(cfg.model), path.is_dir()
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer: {tokenizer.vocab_size} tokens do not fit the model's vocab_size {model_cfg.vocab_size}"
        )
    return model_cfg, tokenizer, pretrained


def _evaluate(trainer: Trainer, params: Any, data: DataLoader, num_batches: int, global_rows: int) -> float:
    data.restart()
    loss_sum, count = 0.0, 0.0
    for _, rows in zip(range(num_batches), data):
        s, n = trainer.eval_step(params, trainer.place_local_batch(rows, global_rows))
        loss_sum, count = loss_sum + float(s), count + float(n)
    if count == 0:
        raise ValueError("data: the held-out split packs into fewer rows than one global batch")
    return loss_sum / count


def _export(cfg: RunConfig, trainer: Trainer, params: Any, model_cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    """The whole model to <out_dir>/hf, or a LoRA run's adapters to <out_dir>/adapter (PEFT's format)."""
    host = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        model = trainer.model_def.build(jax.tree.map(jnp.asarray, host))
        if cfg.lora is not None:
            save_peft(model, Path(cfg.out_dir) / "adapter", base_model=cfg.model)
            return
        export_hf(model, Path(cfg.out_dir) / "hf", dtype=model_cfg.dtype)
        tokenizer.save(Path(cfg.out_dir) / "hf")


class StepProfiler:
    """jax.profiler trace of `num_steps` steps from `start` into `logdir` (TensorBoard's profile tab)."""

    def __init__(self, num_steps: int, start: int, logdir: Path) -> None:
        self.first, self.last, self.logdir = start, start + num_steps - 1, logdir
        self.active = False
        self.enabled = num_steps > 0

    def before(self, step: int) -> None:
        if self.enabled and step == self.first and not self.active:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir))
            self.active = True

    def after(self, step: int, metrics: dict[str, jax.Array]) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(metrics)
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def train(cfg: RunConfig, progress: bool = True) -> TrainResult:
    """Run (or resume) the training run described by `cfg`; returns where it ended. With
    `eagle_target`, train an EAGLE head instead (jaxinfra.train.eagle; no resume)."""
    if cfg.eagle_target is not None:
        head_dir, loss, entropy = train_eagle(cfg, progress)
        return TrainResult(head_dir.parent, 0, cfg.steps, loss, entropy)
    out = Path(cfg.out_dir)
    chief = jax.process_index() == 0
    model_cfg, tokenizer, pretrained = model_source(cfg)
    mesh = make_mesh(cfg.mesh)
    seq_len, rows = cfg.data.seq_len, cfg.batch_size
    data = RunData.open(cfg, tokenizer, rows)
    train_data, valid_data = data.train, data.valid

    if cfg.lora is not None and not pretrained:
        raise ValueError(
            f"lora: adapters train on pretrained weights; model {cfg.model!r} is not an HF or run directory"
        )
    abstract = nnx.eval_shape(lambda: LlamaModel(model_cfg, nnx.Rngs(cfg.seed), cfg.attn_impl))
    model = load_model(cfg.model, attn_impl=cfg.attn_impl) if pretrained else abstract
    if cfg.lora is not None:
        add_lora(model, cfg.lora, nnx.Rngs(cfg.seed))
    trainer = Trainer(model, mesh, get_rules(cfg.sharding), cfg)
    checkpoints = TrainCheckpointer(out / "checkpoints", cfg.checkpoint)
    start = checkpoints.latest_step() or 0
    if start:
        if checkpoints.stacked_layers(start) != trainer.model_def.scan:
            layout = "stacked layers" if trainer.model_def.scan else "one array per layer"
            raise ValueError(
                f"{out}: the checkpoint at step {start} does not hold {layout}; resume with "
                f"scan_layers={str(not cfg.scan_layers).lower()}"
            )
        target = trainer.abstract_state()
        params, opt_state = checkpoints.restore(start, target.params, target.opt_state, train_data)
        step0 = jax.device_put(jnp.asarray(start, jnp.int32), NamedSharding(mesh, PartitionSpec()))
        state = TrainState(step0, params, opt_state)
    elif pretrained:
        state = trainer.init_state()
    else:
        state = trainer.init_state(
            lambda: trainer.model_def.params_of(LlamaModel(model_cfg, nnx.Rngs(cfg.seed), cfg.attn_impl))
        )
    if chief:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_run_config(cfg))
        (out / "model").mkdir(exist_ok=True)
        (out / "model" / "config.json").write_text(json.dumps(model_cfg.to_hf(), indent=2))
        tokenizer.save(out / "model")

    logger = MetricsLogger(out, cfg.steps, start, chief, progress)
    schedule = make_schedule(cfg.optim)
    flops = flops_per_token(model_cfg, seq_len)
    peak = cfg.peak_tflops or device_peak_tflops()
    state_gib = per_device_bytes(state) / 2**30
    base_loss = None
    if cfg.lora is not None and valid_data and start == 0:  # adapters start as a no-op: the base model's loss
        base_loss = _evaluate(trainer, state.params, valid_data, cfg.eval_batches, rows)
        logger.log(0, "eval", {"loss": base_loss, "perplexity": math.exp(min(base_loss, 50.0))})
    profiler = StepProfiler(cfg.profile_steps, cfg.profile_start, out / "tb")
    if trainer.pipeline is not None and chief:
        pp = trainer.pipeline
        print(
            f"pipeline: {pp.stages} stages x {pp.microbatches} microbatches, {cfg.pipeline_schedule} "
            f"({pp.repeats} chunk(s) of layers per stage), bubble fraction {pp.bubble_fraction():.3f}"
        )

    def step(i: int) -> dict[str, jax.Array]:
        nonlocal state
        profiler.before(i)
        state, metrics = trainer.step(state, trainer.place_local_batch(next(train_data), rows))
        profiler.after(i, metrics)
        return metrics

    def record(fetched: list[dict[str, Any]], i: int, seconds: float) -> dict[str, float | list[float]]:
        tokens = sum(float(m["tokens"]) for m in fetched)
        out: dict[str, float | list[float]] = {
            "loss": float(np.mean([m["loss"] for m in fetched])),
            "grad_norm": float(fetched[-1]["grad_norm"]),
            "lr": float(schedule(i)),
            "tokens_per_s": tokens / seconds,
            "state_gib": state_gib,
            **device_memory_gib(),
        }
        if "expert_tokens" in fetched[-1]:  # MoE: router losses and per-expert load over the window
            load = np.sum([m["expert_tokens"] for m in fetched], axis=0)
            out.update(
                moe_aux_loss=float(np.mean([m["moe_aux_loss"] for m in fetched])),
                moe_z_loss=float(np.mean([m["moe_z_loss"] for m in fetched])),
                expert_imbalance=float(np.mean([m["expert_imbalance"] for m in fetched])),
                expert_tokens=load.sum(axis=0).tolist(),  # summed over MoE layers and the window
            )
        if peak:
            out["mfu"] = flops * tokens / seconds / (peak * 1e12 * jax.device_count())
        return out

    def evaluate() -> dict[str, float]:
        assert valid_data is not None
        loss = _evaluate(trainer, state.params, valid_data, cfg.eval_batches, rows)
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    def checkpoint(done: int) -> None:
        if done % cfg.checkpoint.every == 0 or done == cfg.steps:
            checkpoints.save(done, state.params, state.opt_state, train_data)

    # A window also closes at each checkpoint, so a run resumed there logs the same windows (and the
    # same averaged losses) as one that never stopped.
    at_checkpoint = lambda done: done % cfg.checkpoint.every == 0
    evaluation = run_steps(
        cfg, start, logger, step, record, evaluate if valid_data else None, checkpoint, at_checkpoint
    )
    eval_loss = evaluation.get("loss")
    profiler.close()
    checkpoints.wait()
    checkpoints.close()
    logger.close()
    data.close()
    if cfg.export_hf and start < cfg.steps:
        _export(cfg, trainer, state.params, model_cfg, tokenizer)
    if chief and (out / "metrics.jsonl").is_file():
        plot_losses(out / "metrics.jsonl", out / "loss.png", {"unigram entropy": data.entropy})
    return TrainResult(out, start, cfg.steps, eval_loss, data.entropy, base_loss)
