"""The train step and the loop: mesh and FSDP shardings, AdamW, evaluation, logging.

Shapes as in model.py, plus G microbatches per step.
"""
import json
import math
import time
from pathlib import Path
from typing import Callable, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from tqdm import tqdm

import data
from configs import Config
from model import GPT, Policy, init_gpt, partition_specs, policy_table

BATCH_SPEC = P(None, ("replica", "fsdp"), None)  # (G, B, T): every device holds B / devices sequences


def make_mesh(cfg: Config) -> jax.sharding.Mesh:
    n = jax.device_count()
    return jax.make_mesh((cfg.mesh_replica, n // cfg.mesh_replica), ("replica", "fsdp"),
                         axis_types=(AxisType.Auto, AxisType.Auto))


def lr_schedule(cfg: Config):
    """Linear warmup from learning_rate / warmup_steps to learning_rate, then cosine decay to min_lr
    at max_steps (and min_lr after)."""

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = cfg.learning_rate * (step + 1) / max(cfg.warmup_steps, 1)
        frac = jnp.clip((step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1), 0.0, 1.0)
        cosine = cfg.min_lr + 0.5 * (cfg.learning_rate - cfg.min_lr) * (1 + jnp.cos(math.pi * frac))
        return jnp.where(step < cfg.warmup_steps, warm, cosine)

    return lr


def scale_by_policy(cfg: Config, table) -> optax.GradientTransformation:
    """The last link of the optimizer: -lr_t * lr_mult * update, and for decayed parameters the
    independent decay -weight_decay * (lr_t / learning_rate) * p. optax.adamw would multiply the
    decay by each parameter's LR multiplier too (Wortsman et al. 2023 on independent decay)."""
    schedule = lr_schedule(cfg)

    def update(updates, state, params):
        lr = schedule(state.count)
        decay = cfg.weight_decay * lr / cfg.learning_rate

        def one(u, p, policy: Policy):
            return -lr * policy.lr_mult * u - (decay * p if policy.decay else 0.0)

        updates = jax.tree.map(one, updates, params, table)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(lambda _: optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)), update)


def make_optimizer(cfg: Config, table) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.scale_by_adam(cfg.beta1, cfg.beta2, cfg.adam_eps),
                       scale_by_policy(cfg, table))


def loss_fn(model: GPT, x_BT: jax.Array, y_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32; the batch is added here, by vmap."""
    logits_BTV = jax.vmap(model)(x_BT)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, y_BT).mean()


def make_train_step(optimizer, model_sharding, opt_sharding):
    """One jitted step: G microbatches by lax.scan (grads summed in float32), clip, AdamW. The model
    and optimizer state are donated, so their memory is reused for the new ones."""

    @eqx.filter_jit(donate="all")
    @eqx.debug.assert_max_traces(max_traces=1)  # a second trace is a silent recompile: a bug
    def step(model, opt_state, x_GBT, y_GBT):
        params = eqx.filter(model, eqx.is_array)

        def micro(grads, xy):
            loss, g = eqx.filter_value_and_grad(loss_fn)(model, *xy)
            return jax.tree.map(jnp.add, grads, g), loss

        zeros = eqx.filter_shard(jax.tree.map(jnp.zeros_like, params), model_sharding)
        grads, losses_G = jax.lax.scan(micro, zeros, (x_GBT, y_GBT))
        grads = jax.tree.map(lambda g: g / x_GBT.shape[0], grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.filter_shard(eqx.apply_updates(model, updates), model_sharding)
        opt_state = eqx.filter_shard(opt_state, opt_sharding)
        return model, opt_state, {"loss": losses_G.mean(), "grad_norm": optax.tree.norm(grads)}

    return step


@eqx.filter_jit
def eval_loss(model: GPT, x_BT: jax.Array, y_BT: jax.Array) -> jax.Array:
    return loss_fn(model, x_BT, y_BT)


def flops_per_token(cfg: Config) -> float:
    """Model FLOPs per token, forward + backward: 6N + 12·L·D·T (PaLM, Chowdhery et al. 2022, app. B).
    N counts the weights that take part in matmuls: blocks and readout, not the embedding lookup;
    12·L·D·T is the attention scores and their use, over the full T x T (causal masking not deducted)."""
    N = cfg.n_layer * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.mlp_width) + cfg.d_model * cfg.model_vocab
    return 6 * N + 12 * cfg.n_layer * cfg.d_model * cfg.block_size


# Dense bf16 peak FLOP/s per device from the datasheets, matched against jax's device_kind in order.
PEAK_FLOPS = [("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("v4", 275e12), ("v5 lite", 197e12),
              ("v5e", 197e12), ("v5p", 459e12), ("v5", 459e12)]


def peak_flops(device) -> float | None:
    """None where no datasheet peak is known (a CPU): MFU is then reported as unknown, not guessed."""
    return next((peak for name, peak in PEAK_FLOPS if name in device.device_kind), None)


class Logger:
    """Scalars to tensorboard event files and metrics.jsonl in the run directory."""

    def __init__(self, rundir: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.event, self.summary = event_pb2.Event, summary_pb2.Summary
        self.tb = EventFileWriter(str(rundir))
        self.jsonl = open(rundir / "metrics.jsonl", "a")

    def log(self, step: int, record: dict[str, float], tags: dict[str, str]) -> None:
        """Write record as one JSON line, and each value named in tags (record key -> tensorboard tag)."""
        self.jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self.jsonl.flush()
        values = [self.summary.Value(tag=tag, simple_value=record[k]) for k, tag in tags.items() if record.get(k) is not None]
        self.tb.add_event(self.event(wall_time=time.time(), step=step, summary=self.summary(value=values)))
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()
        self.jsonl.close()


def evaluate(model: GPT, cfg: Config, splits: dict, sharding) -> dict[str, float]:
    """Mean loss over eval_batches fixed microbatches of each split (the same ones at every eval)."""
    out = {}
    for name, (tokens, stream) in splits.items():
        total = 0.0
        for i in range(cfg.eval_batches):
            x, y = data.get_batch(tokens, cfg.seed, stream, i, cfg.microbatch_size, cfg.block_size)
            total += eval_loss(model, *jax.device_put((x, y), sharding))
        out[f"{name}_loss"] = float(total) / cfg.eval_batches  # one host sync per split
    return out


class Setup(NamedTuple):
    model: GPT
    opt_state: optax.OptState
    step: Callable  # (model, opt_state, x_GBT, y_GBT) -> (model, opt_state, metrics), jitted
    model_sharding: object  # NamedShardings like the model's arrays
    opt_sharding: object


def setup(cfg: Config, mesh: jax.sharding.Mesh) -> Setup:
    """The initial model and optimizer state, sharded over the mesh, and the train step."""
    model = init_gpt(cfg, jax.random.key(cfg.seed))
    model_sharding = jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(model, cfg))
    model = eqx.filter_shard(model, model_sharding)
    optimizer = make_optimizer(cfg, policy_table(model, cfg))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    opt_sharding = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, model_sharding,
                                         transform_non_params=lambda _: NamedSharding(mesh, P()))
    opt_state = eqx.filter_shard(opt_state, opt_sharding)
    return Setup(model, opt_state, make_train_step(optimizer, model_sharding, opt_sharding), model_sharding, opt_sharding)


def train(cfg: Config, rundir: Path, debug: bool = False) -> dict[str, float]:
    """Train from scratch; returns the last evaluation."""
    cfg.check(jax.device_count())
    mesh = make_mesh(cfg)
    train_tokens, val_tokens = data.load_split(cfg, "train"), data.load_split(cfg, "val")
    model, opt_state, step_fn, _, _ = setup(cfg, mesh)
    batch_sharding = NamedSharding(mesh, BATCH_SPEC)
    eval_sharding = NamedSharding(mesh, P(("replica", "fsdp"), None))
    eval_splits = {"train": (train_tokens, data.EVAL_TRAIN), "val": (val_tokens, data.EVAL_VAL)}
    schedule, peak = lr_schedule(cfg), peak_flops(jax.devices()[0])
    tokens_per_step = cfg.batch_size * cfg.block_size
    logger = Logger(rundir)
    print(f"{sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))):,} parameters, "
          f"{jax.device_count()} {jax.devices()[0].device_kind} device(s), mesh {dict(mesh.shape)}, "
          f"MFU {'against ' + format(peak, '.3g') + ' FLOP/s' if peak else 'unknown: no datasheet peak for this device'}")

    def log_eval(step: int, tokens_per_s: float | None) -> dict:
        record = {**evaluate(model, cfg, eval_splits, eval_sharding), "lr": float(schedule(step)),
                  "tokens_per_s": tokens_per_s}
        logger.log(step, record, {"train_loss": "loss/train", "val_loss": "loss/val"})
        bar.write(f"step {step}: train {record['train_loss']:.4f}, val {record['val_loss']:.4f}")
        return record

    bar = tqdm(total=cfg.max_steps, desc="train", dynamic_ncols=True, mininterval=1.0)
    last = log_eval(0, None)
    pending, tokens_per_s, t0, t0_step = [], None, None, 0
    for step in range(cfg.max_steps):
        if debug and step == min(5, cfg.max_steps - 1):
            jax.profiler.start_trace(str(rundir / "profile"))
        x, y = data.get_batch(train_tokens, cfg.seed, data.TRAIN, step, cfg.batch_size, cfg.block_size)
        x, y = (a.reshape(cfg.grad_accum, cfg.microbatch_size, cfg.block_size) for a in (x, y))
        model, opt_state, metrics = step_fn(model, opt_state, *jax.device_put((x, y), batch_sharding))
        pending.append(metrics)
        done = step + 1
        if debug and done == min(8, cfg.max_steps):
            jax.block_until_ready(model)
            jax.profiler.stop_trace()
        if t0 is None:  # time from the end of the first step, so compilation is not counted
            jax.block_until_ready(metrics)
            t0, t0_step, pending = time.perf_counter(), done, []
        if done % cfg.log_interval == 0 or done == cfg.max_steps:
            if pending:
                host = jax.device_get(pending)  # the only host sync between evaluations
                elapsed = time.perf_counter() - t0
                tokens_per_s = (done - t0_step) * tokens_per_step / elapsed if done > t0_step else None
                mfu = tokens_per_s * flops_per_token(cfg) / (peak * jax.device_count()) if peak and tokens_per_s else None
                record = {"loss": float(np.mean([m["loss"] for m in host])), "lr": float(schedule(step)),
                          "grad_norm": float(host[-1]["grad_norm"]), "tokens_per_s": tokens_per_s, "mfu": mfu}
                logger.log(done, record, {"loss": "loss/batch", "lr": "lr", "grad_norm": "grad_norm",
                                          "tokens_per_s": "tokens_per_s", "mfu": "mfu"})
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                tok_s=f"{tokens_per_s or 0:,.0f}", mfu=f"{mfu:.1%}" if mfu else "n/a", refresh=False)
                pending = []
            bar.update(done - bar.n)
        if done % cfg.eval_interval == 0 or done == cfg.max_steps:
            last = log_eval(done, tokens_per_s)
            t0, t0_step = time.perf_counter(), done  # evaluation time is not training throughput
    bar.close()
    logger.close()
    return last
