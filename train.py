"""The train step and the loop: mesh and FSDP shardings, AdamW, evaluation, logging.

Shapes as in model.py, plus G microbatches per step and K steps per call (steps_per_call).
"""
import functools
import math
import signal
import time
from typing import Callable, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from etils import epath
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from tqdm import tqdm

import data
from checkpoint import (Logger, Tally, check_resume, checkpoint_manager, one_line, restore_checkpoint, save_checkpoint,
                        stop_signals)
from configs import Config, RunError, UsageError
from model import GPT, Policy, count_params, flops_per_token, init_gpt, partition_specs, policy_table
import sample

BATCH_SPEC = P(None, ("replica", "fsdp"), None)  # (G, B, T): every device holds B / devices sequences


def make_mesh(cfg: Config, devices: list | None = None) -> jax.sharding.Mesh:
    """(replica, fsdp) over `devices` (default all): replicas across granules (a multi-slice TPU's slices, else the processes),
    fsdp within, so FSDP's all-gathers stay on fast links. A multiple of the granules splits each, a divisor spans several."""
    devices, r = devices or jax.devices(), cfg.mesh_replica
    slices = len({getattr(d, "slice_index", 0) for d in devices}) > 1
    g = len({d.slice_index if slices else d.process_index for d in devices})
    if r % g and g % r:
        raise UsageError(f"mesh_replica={r} is neither a multiple nor a divisor of the {g} {'slices' if slices else 'processes'}")
    m = min(r, g)  # replicas across granules; r // m more within each, and fsdp takes the rest of a granule
    within, across = (r // m, len(devices) // g // (r // m)), (m, g // m)
    grid = mesh_utils.create_hybrid_device_mesh(within, across, devices, process_is_granule=not slices,
                                                allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, ("replica", "fsdp"), axis_types=(AxisType.Auto, AxisType.Auto))


def lr_schedule(cfg: Config):
    """Linear warmup from learning_rate / warmup_steps to learning_rate, then cosine decay to min_lr at max_steps."""
    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = cfg.learning_rate * (step + 1) / max(cfg.warmup_steps, 1)
        frac = jnp.clip((step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1), 0.0, 1.0)
        cosine = cfg.min_lr + 0.5 * (cfg.learning_rate - cfg.min_lr) * (1 + jnp.cos(math.pi * frac))
        return jnp.where(step < cfg.warmup_steps, warm, cosine)

    return lr


def scale_by_policy(cfg: Config, table) -> optax.GradientTransformation:
    """The last link of the optimizer: -lr_t * lr_mult * update, and for decayed parameters the
    independent decay -weight_decay * (lr_t / learning_rate) * p, whatever lr and lr_mult (muP's 1/m
    included). optax.adamw would multiply the decay by each parameter's LR multiplier too (Wortsman
    et al. 2023 on independent decay)."""
    schedule = lr_schedule(cfg)

    def update(updates, state, params):
        lr = schedule(state.count)
        decay = cfg.weight_decay * lr / cfg.learning_rate

        def one(u, p, policy: Policy):
            return -lr * policy.lr_mult * u - (decay * p if policy.decay else 0.0)

        updates = jax.tree.map(one, updates, params, table)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(lambda _: optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)), update)


def scale_by_adam(cfg: Config, table) -> optax.GradientTransformation:
    """optax.scale_by_adam (its state too) with eps = adam_eps * eps_mult per parameter (CompleteP): Adam's
    m / (sqrt(v) + eps) of gradients divided by c is that of the gradients with eps * c in place of eps."""
    adam = optax.scale_by_adam(cfg.beta1, cfg.beta2, cfg.adam_eps)

    def update(grads, state, params=None):
        return adam.update(jax.tree.map(lambda g, policy: g / policy.eps_mult, grads, table), state, params)

    return optax.GradientTransformation(adam.init, update)


def make_optimizer(cfg: Config, table) -> optax.GradientTransformation:
    """Clip by global norm, Adam, LR and decay. The clip is optax.clip_by_global_norm (its state too) as a scalar
    multiplier, which XLA fuses into Adam's moment updates (optax's divide took a pass of its own, ~0.5 ms a CPU step)."""
    def clip(grads, state, params=None, grad_norm=None):  # the step passes its norm: XLA cannot reuse it in a cond
        norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
        return (jax.tree.map(lambda g: g * jnp.minimum(1.0, cfg.grad_clip / norm), grads) if cfg.grad_clip else grads), state

    return optax.chain(optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), clip), scale_by_adam(cfg, table),
                       scale_by_policy(cfg, table))


def loss_fn(model: GPT, x_BT: jax.Array, y_BT: jax.Array, chunks: int = 1, parts: int = 1) -> jax.Array:
    """Mean next-token cross-entropy in float32 over a vmapped batch, divided by parts (a step sums its microbatches'
    and replicas' losses). The readout and loss take their gradients in the forward (head_loss): the float32 (B, T, V)
    logits are not kept for the backward (124M, H100: 73 -> 71 ms a step); chunks > 1 keeps them from existing whole."""
    head = eqx.tree_at(lambda m: m.blocks, model, None)  # what model.logits reads: final norm, readout
    return head_loss((head, jax.vmap(model.hidden)(x_BT)), y_BT, chunks, 1 / (y_BT.size * parts))


def head_loss_and_grads(head_and_h: tuple[GPT, jax.Array], y_BT: jax.Array, chunks: int, scale: float):
    """scale times the summed loss of head.logits(h), and its gradients, for sequences c, c + chunks, ... at a time
    (each chunk spread over the devices); d loss / d logits = scale (softmax - onehot). Its loss alone: XLA drops the
    rest. scale (the mean's divisor) is applied in this forward so training's cotangent is 1: no backward pass over
    (B, T, D) to multiply (CPU step -0.5 to -1.3 ms). Liger Kernel's fused linear cross-entropy (arXiv 2410.10989)."""
    (params, static), h_BTD = eqx.partition(head_and_h[0], eqx.is_array), head_and_h[1]

    def chunk(acc, hy):
        logits_BTV, pullback = jax.vjp(lambda p, h: jax.vmap(eqx.combine(p, static).logits)(h), params, hy[0])
        lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
        loss = (lse_BT - jnp.take_along_axis(logits_BTV, hy[1][..., None], -1)[..., 0]).sum() * scale
        d_head, d_h = pullback(scale * (jnp.exp(logits_BTV - lse_BT[..., None]) - jax.nn.one_hot(hy[1], logits_BTV.shape[-1])))
        return (acc[0] + loss, jax.tree.map(jnp.add, acc[1], d_head)), d_h

    split = lambda a: a.reshape(-1, chunks, *a.shape[1:]).swapaxes(0, 1)
    (loss, d_head), d_h = jax.lax.scan(chunk, (0.0, jax.tree.map(jnp.zeros_like, params)), (split(h_BTD), split(y_BT)))
    return loss, (d_head, d_h.swapaxes(0, 1).reshape(h_BTD.shape))


head_loss = eqx.filter_custom_vjp(lambda head_and_h, *args: head_loss_and_grads(head_and_h, *args)[0])
head_loss.def_fwd(lambda perturbed, *args: head_loss_and_grads(*args))
head_loss.def_bwd(lambda grads, g, perturbed, *args: jax.tree.map(lambda d: (g * d).astype(d.dtype), grads))


def make_train_step(optimizer, static: GPT, mesh, model_sharding, opt_sharding, loss_chunks: int = 1):
    """The jitted step: G microbatches by lax.scan (grads summed in float32), averaged over the replicas, clip,
    AdamW; K steps a call by lax.scan over K batches. Parameters and optimizer state are donated (their memory
    is reused). static: the model's non-array part. Data parallelism over "replica" is written out: shard_map
    and one psum of the loss and gradients (check_vma=False, else autodiff psums each gradient where it arises,
    in many small all-reduces); "fsdp" is left to XLA's partitioner (whole, the CPU step took ~6% longer)."""
    dp = mesh.shape["replica"] > 1  # XLA's partitioner rejects a shard_map over an axis of size 1
    grads_sharding = jax.tree.map(lambda s: s.spec if dp else s, model_sharding)  # specs inside shard_map

    def one_step(state, xy):
        (params, opt_state), (x_GBT, y_GBT) = state, xy

        def replica_grads(params, x_GBT, y_GBT):  # one replica's B / mesh_replica sequences
            # the mean over microbatches and replicas is taken inside each loss, not by a pass over the grads
            n = len(x_GBT) * mesh.shape["replica"]
            mean_loss = lambda model, x, y: loss_fn(model, x, y, loss_chunks, n)

            def micro(grads, xy):
                loss, g = eqx.filter_value_and_grad(mean_loss)(eqx.combine(params, static), *xy)
                return jax.tree.map(jnp.add, grads, g), loss

            zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grads_sharding)
            grads, losses_G = jax.lax.scan(micro, zeros, (x_GBT, y_GBT))
            return jax.lax.psum((losses_G.sum(), grads), "replica") if dp else (losses_G.sum(), grads)

        if dp:
            replica_grads = jax.shard_map(replica_grads, mesh=mesh, in_specs=(P(), P(None, "replica"), P(None, "replica")),
                                          out_specs=P(), axis_names={"replica"}, check_vma=False)
        loss, grads = replica_grads(params, x_GBT, y_GBT)
        grad_norm = optax.tree.norm(grads)

        # A non-finite loss or gradient is skipped: the state stays as it was, Adam moments and schedule
        # count included; the host stops after max_nonfinite in a row. The update of finite gradients is
        # finite: Adam's is bounded, and Config.check rejects learning rates beyond float32. lax.cond, not
        # jnp.where, whose select reads and writes the whole state once more (~1.5 ms of a CPU step).
        def update():
            updates, new_opt_state = optimizer.update(grads, opt_state, params, grad_norm=grad_norm)
            return eqx.apply_updates(params, updates), new_opt_state

        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.lax.cond(ok, update, lambda: (params, opt_state))
        params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), (model_sharding, opt_sharding))
        return (params, opt_state), {"loss": loss, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # the int32 batch has no output to reuse it
    @eqx.debug.assert_max_traces(max_traces=1)  # a second trace is a silent recompile: a bug
    def jitted(params, opt_state, x, y):
        """x, y (G, B, T): one step. (K, G, B, T): K steps by lax.scan (steps_per_call), metrics (K,)."""
        state = (params, opt_state)
        state, metrics = one_step(state, (x, y)) if x.ndim == 3 else jax.lax.scan(one_step, state, (x, y))
        return *state, metrics

    # jax.jit of the arrays, not eqx.filter_jit of the model: Equinox's wrapper flattens the model at every
    # call and blocks on a marker output, ~1.3 ms of a 33 ms CPU step. Blocking is needed for several CPU
    # devices alone: XLA:CPU devices that share a process's cores deadlocked in a loop run ahead of them
    # (BENCHMARKS.md). Elsewhere the loop runs ahead, so the host's next batch overlaps the device's step.
    block = mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1

    def step(model: GPT, opt_state, x, y):
        params, opt_state, metrics = jitted(eqx.filter(model, eqx.is_array), opt_state, x, y)
        return eqx.combine(params, static), opt_state, jax.block_until_ready(metrics) if block else metrics

    return step


eval_loss = eqx.filter_jit(loss_fn)


# Dense bf16 peak FLOP/s per device from the datasheets, matched against jax's device_kind in order.
PEAK_FLOPS = [("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("v4", 275e12), ("v5 lite", 197e12),
              ("v5e", 197e12), ("v5p", 459e12), ("v5", 459e12)]


def peak_flops(device) -> float | None:
    """None where no datasheet peak is known (a CPU): MFU is then reported as unknown, not guessed."""
    return next((peak for name, peak in PEAK_FLOPS if name in device.device_kind), None)


def evaluate(model: GPT, cfg: Config, splits: dict, sharding) -> dict[str, float]:
    """Mean loss over eval_batches fixed microbatches of each split (the same ones at every eval)."""
    out = {}
    for name, (tokens, stream) in splits.items():
        total = 0.0
        for i in range(cfg.eval_batches):
            x, y = data.global_batch(tokens, cfg.seed, stream, i, sharding, (cfg.microbatch_size, cfg.block_size))
            total += eval_loss(model, x, y, cfg.loss_chunks)
        out[f"{name}_loss"] = float(total) / cfg.eval_batches  # one host sync per split
    return out


class Setup(NamedTuple):
    model: GPT
    opt_state: optax.OptState
    step: Callable  # (model, opt_state, x, y) -> (model, opt_state, metrics), jitted; make_train_step
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
    static = eqx.filter(model, eqx.is_array, inverse=True)
    step = make_train_step(optimizer, static, mesh, model_sharding, opt_sharding, cfg.loss_chunks)
    return Setup(model, opt_state, step, model_sharding, opt_sharding)


def explain_out_of_memory(fn: Callable) -> Callable:
    """fn, with XLA's out-of-memory error (a RESOURCE_EXHAUSTED traceback from inside JAX) turned into a RunError,
    one line that says what to change."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise RunError(f"out of memory ({str(e).splitlines()[0]}): make microbatches smaller (a larger "
                           "--config.grad_accum), recompute more (--config.remat=save_dots or full) or chunk the loss "
                           "(--config.loss_chunks)") from None
    return wrapped


@explain_out_of_memory
def train(cfg: Config, rundir: epath.Path, debug: bool = False) -> dict[str, float] | None:
    """Train from the latest checkpoint in rundir, or from scratch; returns the last evaluation (None if
    a signal stopped the run or nothing was left to do). With debug nothing is saved, only profiled."""
    cfg.check(jax.device_count())
    mesh = make_mesh(cfg)
    train_tokens, val_tokens = data.load_split(cfg, "train"), data.load_split(cfg, "val")
    model, opt_state, step_fn, _, _ = setup(cfg, mesh)
    with one_line(f"reading the checkpoints in {rundir}"):
        check_resume(rundir, cfg)
        mngr = checkpoint_manager(rundir, cfg, read_only=debug)
        start = mngr.latest_step() or 0
        model, opt_state, saved = restore_checkpoint(mngr, model, opt_state) if start else (model, opt_state, None)
    tally = Tally(cfg, saved)
    batch_sharding, batch_shape = NamedSharding(mesh, P(None, *BATCH_SPEC)), (cfg.grad_accum, cfg.microbatch_size, cfg.block_size)
    eval_sharding = NamedSharding(mesh, P(("replica", "fsdp"), None))
    eval_splits = {"train": (train_tokens, data.EVAL_TRAIN), "val": (val_tokens, data.EVAL_VAL)}
    schedule, peak = jax.jit(lr_schedule(cfg)), peak_flops(jax.devices()[0])  # jit: one compile, not one per op
    logger = Logger(rundir, start)
    say = tqdm.write if jax.process_index() == 0 else lambda text: None  # process 0 alone prints
    say(f"{count_params(model):,} parameters, "
        f"{jax.device_count()} {jax.devices()[0].device_kind} device(s), mesh {dict(mesh.shape)}, "
        f"MFU {'against ' + format(peak, '.3g') + ' FLOP/s' if peak else 'unknown: no datasheet peak for this device'}"
        + (f"; resuming from the checkpoint of step {start}" if start else ""))

    def log_eval(step: int, tokens_per_s: float | None) -> dict:
        record = {**evaluate(model, cfg, eval_splits, eval_sharding), "lr": float(schedule(step)), "tokens_per_s": tokens_per_s}
        logger.log(step, record, {"train_loss": "loss/train", "val_loss": "loss/val"})
        # A short sample from the start of the val split, in a markdown code block to keep its line breaks.
        logger.text(step, "sample", f"```\n{sample.preview(model, cfg, val_tokens[:8].tolist())}\n```")
        say(f"step {step}: train {record['train_loss']:.4f}, val {record['val_loss']:.4f}")
        return record

    def save(step: int) -> None:
        tally.fetch()
        tally.check(step)
        with one_line(f"saving a checkpoint to {mngr.directory}"):
            save_checkpoint(mngr, step, model, opt_state, tally.state)

    end = min(start + 8 * cfg.steps_per_call, cfg.max_steps) if debug else cfg.max_steps  # --debug: a profile, then stop
    bar = tqdm(initial=start, total=end, desc="train", dynamic_ncols=True, mininterval=1.0, disable=jax.process_index() != 0)
    tokens_per_s, t0, t0_step = None, None, start
    try:  # the step-0 evaluation too: whatever error stops the run in it, the bar and the files are closed
        last = log_eval(0, None) if start == 0 else None
        with stop_signals() as caught:
            for step in range(start, end, K := cfg.steps_per_call):  # K steps a call
                if debug and step == min(start + 5 * K, cfg.max_steps - K):
                    jax.profiler.start_trace(str(rundir / "profile"))
                done = step + K
                batch = data.global_batch(train_tokens, cfg.seed, data.TRAIN, range(step, done), batch_sharding, batch_shape)
                model, opt_state, metrics = step_fn(model, opt_state, *batch)
                tally.on_device.append(metrics)
                if debug and done == end:
                    jax.block_until_ready(model)
                    jax.profiler.stop_trace()
                    say(f"--debug: the profile of the steps to {done} is in {rundir / 'profile'}; stopping, nothing saved")
                if t0 is None:  # time from the end of the first step, so compilation is not counted
                    jax.block_until_ready(metrics)
                    t0, t0_step = time.perf_counter(), done
                # JAX's preemption sync point must be asked about every step (a list: no short-circuit)
                synced = jax.process_count() > 1 and any([mngr.reached_preemption(s) for s in range(step + 1, done + 1)])
                stop = bool(caught) or synced
                if done % cfg.log_interval == 0 or done == cfg.max_steps:
                    record = tally.record(done)  # the only host sync between evaluations and saves
                    elapsed = time.perf_counter() - t0
                    tokens_per_s = (done - t0_step) * cfg.batch_size * cfg.block_size / elapsed if done > t0_step else None
                    mfu = tokens_per_s * flops_per_token(cfg) / (peak * jax.device_count()) if peak and tokens_per_s else None
                    record |= {"lr": float(schedule(done - 1)), "tokens_per_s": tokens_per_s, "mfu": mfu}
                    logger.log(done, record, {"loss": "loss/batch", "lr": "lr", "grad_norm": "grad_norm",
                                              "skipped": "skipped_steps", "tokens_per_s": "tokens_per_s", "mfu": "mfu"})
                    bar.set_postfix(loss=f"{math.nan if record['loss'] is None else record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                    tok_s=f"{tokens_per_s or 0:,.0f}", mfu=f"{mfu:.1%}" if mfu else "n/a", refresh=False)
                    bar.update(done - bar.n)
                    tally.check(done)
                if done % cfg.eval_interval == 0 or done == cfg.max_steps:
                    last = log_eval(done, tokens_per_s)
                    t0, t0_step = time.perf_counter(), done  # evaluation time is not training throughput
                if not debug and (done % cfg.ckpt_interval == 0 or done == cfg.max_steps or stop):
                    save(done)
                if stop:
                    say(f"{signal.Signals(caught[0]).name if caught else 'preemption'} at step {done}: "
                        + ("checkpoint saved; run the same command to resume" if not debug else "stopping"))
                    return None
        if start >= cfg.max_steps:
            say(f"the checkpoint is at step {start}, max_steps={cfg.max_steps}: nothing to do")
        return last
    finally:
        bar.close()
        logger.close()
        with one_line(f"saving a checkpoint to {mngr.directory}"):
            mngr.close()  # waits for the save in flight
