"""The train step and the loop: mesh and FSDP shardings, evaluation, logging; the optimizer is
optimizers.py's. Shapes as in model.py, plus G microbatches per step."""
import dataclasses
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
from configs import Config
from inference import decode, tasks
from fused import fast_paths
from model import GPT
from optimizers import applied_lr, make_optimizer
from params import flops_per_token, init_gpt, partition_specs, policy_table
from run.checkpoint import checkpoint_manager, one_line, resume, save_checkpoint
from run.distributed import stop_signals
from run.errors import RunError, UsageError, out_of_memory
from run.metrics import Logger, Tally, peak_flops
from text import tokenization

# --------------------------------------------------------------------------------------------------
# The mesh: (replica, fsdp) over the devices

BATCH_SPEC = P(None, ("replica", "fsdp"), None)  # (G, B, T): B split over all the devices


def make_mesh(cfg: Config, devices: list | None = None) -> jax.sharding.Mesh:
    """(replica, fsdp) over `devices` (default all): replicas across granules (a multi-slice TPU's
    slices, else the processes), fsdp within, so FSDP's all-gathers stay on fast links. A multiple
    of the granules splits each, a divisor spans several."""
    devices, r = devices or jax.devices(), cfg.mesh_replica
    slices = len({getattr(d, "slice_index", 0) for d in devices}) > 1
    g = len({d.slice_index if slices else d.process_index for d in devices})
    if r % g and g % r:
        granules = "slices" if slices else "processes"
        raise UsageError(f"mesh_replica={r} is neither a multiple nor a divisor of the {g} "
                         f"{granules}")
    m = min(r, g)  # replicas across granules; r // m more within each; fsdp takes the rest
    within, across = (r // m, len(devices) // g // (r // m)), (m, g // m)
    grid = mesh_utils.create_hybrid_device_mesh(within, across, devices,
                                                process_is_granule=not slices,
                                                allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, ("replica", "fsdp"), axis_types=(AxisType.Auto, AxisType.Auto))


# --------------------------------------------------------------------------------------------------
# The objective and the jitted train step

def loss_fn(model: GPT, x_BT: jax.Array, y_BT: jax.Array, cfg: Config,
            keys_B: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """(The objective autodiff trains on, the next-token cross-entropy), float32 means over a batch
    from one readout. Logged is the cross-entropy (loss/...); a term added to the objective (a
    z-loss) trains the model and is logged as objective/.... loss_chunks > 1 takes the readout a
    group of sequences at a time, recomputed in the backward pass (jax.checkpoint): the float32
    (B, T, V) logits never exist whole. keys_B: dropout's, per sequence (None: no dropout)."""
    chunks = cfg.loss_chunks
    h_BTD, _ = jax.vmap(model.hidden, spmd_axis_name=fast_paths.batch_axes())(x_BT, key=keys_B)

    def chunk_losses(h_btD, y_bt):  # sums over the chunk's tokens
        # model.loss: model.cross_entropy (maybe fused); a term on the logits: model.logits
        cross_entropy = jax.vmap(model.loss)(h_btD, y_bt).sum()
        return cross_entropy, cross_entropy  # (objective, cross-entropy): add terms to the first

    if chunks == 1:
        return tuple(s / y_BT.size for s in chunk_losses(h_BTD, y_BT))

    def body(sums, hy):
        return jax.tree.map(jnp.add, sums, jax.checkpoint(chunk_losses)(*hy)), None

    split = lambda a: a.reshape(chunks, -1, *a.shape[1:])  # sequences c * B/chunks ... at a time
    sums = jax.lax.scan(body, (0.0, 0.0), (split(h_BTD), split(y_BT)))[0]
    return tuple(s / y_BT.size for s in sums)


def objective(model: GPT, x_BT: jax.Array, y_BT: jax.Array, cfg: Config) -> jax.Array:
    """loss_fn's objective alone, for mup.py and the tests. Edit loss_fn: the step calls it."""
    return loss_fn(model, x_BT, y_BT, cfg)[0]


def make_train_step(cfg: Config, optimizer, static: GPT, mesh, model_sharding, opt_sharding):
    """The jitted step: G microbatches by lax.scan (gradients summed in float32), averaged over
    the replicas, then the optimizer. Parameters and optimizer state are donated (their memory is
    reused). static: the model's non-array part. Data parallelism over "replica" is written out:
    shard_map and one psum of the loss and gradients (check_vma=False, else autodiff psums each
    gradient where it arises, in many small all-reduces); "fsdp" is left to XLA's partitioner."""
    dp = mesh.shape["replica"] > 1  # XLA's partitioner rejects a shard_map over an axis of size 1
    grads_sharding = jax.tree.map(lambda s: s.spec if dp else s, model_sharding)  # in shard_map

    def replica_grads(params, x_GBT, y_GBT, step):  # one replica's B / mesh_replica sequences
        n = len(x_GBT) * mesh.shape["replica"]  # the mean over microbatches and replicas
        # the objective differentiated, the cross-entropy beside it (has_aux); with dropout, each
        # sequence's key (without, loss_fn is called as a researcher wrote it)
        keys = (dropout_keys(cfg, step, x_GBT, mesh.shape["replica"]),) if cfg.dropout else ()
        mean_losses = lambda model, x, y, *key: tuple(
            v / n for v in loss_fn(model, x, y, cfg, *key))

        def micro(grads, xy):
            (objective, cross_entropy), g = eqx.filter_value_and_grad(mean_losses, has_aux=True)(
                eqx.combine(params, static), *xy)
            return jax.tree.map(jnp.add, grads, g), (objective, cross_entropy)

        zeros = jax.tree.map(jnp.zeros_like, params)
        zeros = jax.lax.with_sharding_constraint(zeros, grads_sharding)
        grads, losses_G = jax.lax.scan(micro, zeros, (x_GBT, y_GBT, *keys))
        losses_and_grads = (tuple(s.sum() for s in losses_G), grads)
        return jax.lax.psum(losses_and_grads, "replica") if dp else losses_and_grads

    if dp:
        batch = P(None, "replica")
        replica_grads = jax.shard_map(replica_grads, mesh=mesh, in_specs=(P(), batch, batch, P()),
                                      out_specs=P(), axis_names={"replica"}, check_vma=False)

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # the int32 batch has no output to reuse it
    @eqx.debug.assert_max_traces(max_traces=1)  # a second trace is a silent recompile: a bug
    def jitted(params, opt_state, x_GBT, y_GBT, step):
        (objective, loss), grads = replica_grads(params, x_GBT, y_GBT, step)
        grad_norm = optax.tree.norm(grads)

        # A non-finite loss or gradient is skipped: the state stays as it was, Adam moments and
        # schedule count included; the host stops after max_nonfinite in a row. The update of
        # finite gradients is finite: Adam's is bounded, and Config.check rejects learning rates
        # beyond float32. lax.cond, not jnp.where: the skipped branch does no work.
        def update():
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            return eqx.apply_updates(params, updates), new_opt_state

        ok = jnp.isfinite(objective) & jnp.isfinite(grad_norm)
        params, opt_state = jax.lax.cond(ok, update, lambda: (params, opt_state))
        shardings = (model_sharding, opt_sharding)
        state = jax.lax.with_sharding_constraint((params, opt_state), shardings)
        metrics = {"loss": loss, "objective": objective, "grad_norm": grad_norm,
                   "skipped": (~ok).astype(jnp.int32), "lr": applied_lr(cfg, state[1])}
        return *state, metrics

    # jax.jit of the arrays rather than eqx.filter_jit of the model: the step's host overhead stays
    # that of a plain jitted function. On several CPU devices of one process the host waits for
    # each step: XLA:CPU devices that share the process's cores deadlocked in a loop run ahead of
    # them. Elsewhere the loop runs ahead, so the host's next batch overlaps the device's step.
    block = mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1

    def step(model: GPT, opt_state, x_GBT, y_GBT, index=0):  # index: the step's (dropout's)
        params = eqx.filter(model, eqx.is_array)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # fast_paths.per_device reads it
            params, opt_state, metrics = jitted(params, opt_state, x_GBT, y_GBT, index)
        if block:
            jax.block_until_ready(metrics)
        return eqx.combine(params, static), opt_state, metrics

    return step


def dropout_keys(cfg: Config, step, x_GBT: jax.Array, replicas: int = 1) -> jax.Array:
    """(G, B) dropout keys for a step's microbatches x_GBT (in the step's shard_map, this replica's
    B rows): row i of data.get_batch's draw gets fold_in(fold_in(key(seed), step), i), the same
    masks whatever the devices, replicas, microbatches or resumes."""
    G, B, _ = x_GBT.shape
    first = jax.lax.axis_index("replica") * B if replicas > 1 else 0  # this replica's first row
    rows_GB = jnp.arange(G)[:, None] * B * replicas + first + jnp.arange(B)
    step_key = jax.random.fold_in(jax.random.key(cfg.seed), step)
    return jax.vmap(jax.vmap(lambda i: jax.random.fold_in(step_key, i)))(rows_GB)


# --------------------------------------------------------------------------------------------------
# Evaluation, setup and the loop

def evaluate(model: GPT, cfg: Config, train_tokens, val_tokens, mesh) -> dict[str, float]:
    """Mean cross-entropy over eval_batches fixed microbatches of each split (the same ones every
    time), and the objective's where it differs."""
    out, sharding = {}, NamedSharding(mesh, P(("replica", "fsdp"), None))
    shape = (cfg.microbatch_size, cfg.block_size)
    for name, tokens, stream in (("train", train_tokens, data.EVAL_TRAIN),
                                 ("val", val_tokens, data.EVAL_VAL)):
        totals = 0.0, 0.0
        for i in range(cfg.eval_batches):
            x, y = data.global_batch(tokens, cfg.seed, stream, i, sharding, shape)
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as the step's
                totals = jax.tree.map(jnp.add, totals, eqx.filter_jit(loss_fn)(model, x, y, cfg))
        objective, out[f"{name}_loss"] = (float(t) / cfg.eval_batches for t in totals)  # one sync
        if objective != out[f"{name}_loss"]:
            out[f"{name}_objective"] = objective
    return out


class Setup(NamedTuple):
    model: GPT
    opt_state: optax.OptState
    step: Callable  # (model, opt_state, x, y) -> (model, opt_state, metrics); make_train_step
    model_sharding: object  # NamedShardings like the model's arrays
    opt_sharding: object


def setup(cfg: Config, mesh: jax.sharding.Mesh, special_ids: tuple[int, ...] = ()) -> Setup:
    """The initial model and optimizer state, sharded over the mesh, and the train step.
    special_ids: the tokenizer's, which the fast paths' check draws among the loss's targets."""
    fast = fast_paths.select(cfg, mesh, lambda gpt, x, y: loss_fn(gpt, x, y, cfg), special_ids)
    table = policy_table(eqx.filter_eval_shape(GPT, cfg, fast), cfg, mesh.shape)  # init, specs, opt
    model_sharding = jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(table))
    # drawn onto its shardings: no device holds the whole model (params.init_gpt)
    model = init_gpt(cfg, jax.random.key(cfg.seed), fast, table, model_sharding)
    optimizer = make_optimizer(cfg, table)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    replicated = lambda _: NamedSharding(mesh, P())
    masked = lambda x: isinstance(x, optax.MaskedNode)  # optax.partition's (Muon's) placeholders
    opt_sharding = optax.tree_map_params(optimizer, lambda x, s: x if masked(x) else s, opt_state,
                                         model_sharding, transform_non_params=replicated,
                                         is_leaf=masked)
    opt_state = eqx.filter_shard(opt_state, opt_sharding)
    static = eqx.filter(model, eqx.is_array, inverse=True)
    step = make_train_step(cfg, optimizer, static, mesh, model_sharding, opt_sharding)
    return Setup(model, opt_state, step, model_sharding, opt_sharding)


def explain_out_of_memory(fn: Callable) -> Callable:
    """fn, with XLA's out-of-memory error (RESOURCE_EXHAUSTED) a RunError saying what to change."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except jax.errors.JaxRuntimeError as e:
            if (oom := out_of_memory(e)) is None:
                raise
            raise RunError(f"out of memory ({oom}): make microbatches smaller "
                           "(a larger --config.grad_accum), recompute more (--config.remat="
                           "save_dots or full) or chunk the loss (--config.loss_chunks)") from None
    return wrapped


@explain_out_of_memory
def train(cfg: Config, rundir: epath.Path, debug: bool = False,
          started: Callable[[], None] = lambda: None) -> dict[str, float] | None:
    """Train from rundir's latest checkpoint or from scratch; the last evaluation, or None (a signal
    stopped it, nothing was left). debug: profile, save none. started(): after the first step."""
    cfg.check(jax.device_count())
    mesh = make_mesh(cfg)
    train_tokens, val_tokens = data.load_split(cfg, "train"), data.load_split(cfg, "val")
    meta = data.read_meta(cfg)
    encode, decode_text = tokenization.load(meta["tokenizer"])  # once a run: preview and tasks
    special = tokenization.special_ids(meta["tokenizer"])  # the fast paths' and preview's checks
    eval_tasks = tasks.Tasks(cfg.eval_tasks.split(","), encode, meta["vocab_size"],
                             cfg.block_size) if cfg.eval_tasks else None
    model, opt_state, step_fn, _, _ = setup(cfg, mesh, special)
    with one_line(f"reading the checkpoints in {rundir}"):
        mngr = checkpoint_manager(rundir, cfg, read_only=debug)
        start, model, opt_state, saved = resume(mngr, model, opt_state, not debug)
    tally = Tally(cfg, saved)
    batch_sharding = NamedSharding(mesh, BATCH_SPEC)
    batch_shape = (cfg.grad_accum, cfg.microbatch_size, cfg.block_size)
    peak = (peak_flops(jax.devices()[0]) or 0) * jax.device_count()  # all devices' (0: unknown)
    flops = flops_per_token(model, cfg.block_size)
    logger = Logger(rundir, start, cfg.wandb_project, dataclasses.asdict(cfg), writes=not debug)
    say = tqdm.write if jax.process_index() == 0 else lambda text: None  # process 0 alone prints
    mfu_against = f"against {peak:.3g} FLOP/s" if peak else "unknown: no datasheet peak"
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    say(f"{n_params:,} parameters, {jax.device_count()} {jax.devices()[0].device_kind} "
        f"device(s), mesh {dict(mesh.shape)}, MFU {mfu_against}"
        + (f"; resuming from the checkpoint of step {start}" if start else ""))

    def log_eval(step: int, tokens_per_s: float | None) -> dict:
        record = evaluate(model, cfg, train_tokens, val_tokens, mesh)
        record |= {"lr": tally.last_lr(), "tokens_per_s": tokens_per_s}
        logger.log(step, record, {f"{split}_{what}": f"{what}/{split}" for split in ("train", "val")
                                  for what in ("loss", "objective")})  # loss/train ...
        tasks.log_in_training(eval_tasks, model, cfg, step, mesh, logger)  # when due
        text = decode.preview(model, cfg, val_tokens[:8].tolist(), decode_text, meta["vocab_size"], special)
        logger.text(step, "sample", f"```\n{text}\n```")  # a markdown code block keeps line breaks
        say(f"step {step}: train {record['train_loss']:.4f}, val {record['val_loss']:.4f}")
        return record

    def save(step: int) -> None:
        tally.fetch()
        tally.check(step)
        with one_line(f"saving a checkpoint to {mngr.directory}"):
            save_checkpoint(mngr, step, model, opt_state, tally.state)

    end = min(start + 8, cfg.max_steps) if debug else cfg.max_steps  # --debug: a profile, stop
    bar = tqdm(initial=start, total=end, desc="train", dynamic_ncols=True, mininterval=1.0,
               disable=jax.process_index() != 0)
    tags = {"loss": "loss/batch", "objective": "objective/batch", "skipped": "skipped_steps",
            **{k: k for k in ("lr", "grad_norm", "tokens_per_s", "mfu")}}
    tokens_per_s, t0, t0_step = None, None, start
    try:  # the step-0 evaluation too: whatever error stops it, the bar and files are closed
        last = log_eval(0, None) if start == 0 else None
        with stop_signals() as caught:
            for step in range(start, end):
                if debug and step == min(start + 5, cfg.max_steps - 1):  # profile (--debug)
                    jax.profiler.start_trace(str(rundir / "profile"))
                done = step + 1
                # read the batch of this step, take the step
                x, y = data.global_batch(train_tokens, cfg.seed, data.TRAIN, step, batch_sharding,
                                         batch_shape)
                model, opt_state, metrics = step_fn(model, opt_state, x, y, step)
                tally.on_device.append(metrics)
                if debug and done == end:
                    jax.block_until_ready(model)
                    jax.profiler.stop_trace()
                    say(f"--debug: the profile of the steps to {done} is in {rundir / 'profile'}; "
                        "stopping, nothing saved")
                if t0 is None:  # time from the end of the first step, not the compilation
                    jax.block_until_ready(metrics)
                    t0, t0_step = time.perf_counter(), done
                    started()  # a step taken: from here on, a failure leaves the run as it is
                # preemption or a signal: JAX's sync point must be asked at every step
                stop = (jax.process_count() > 1 and mngr.reached_preemption(done)) or bool(caught)
                # log the step metrics
                if done % cfg.log_interval == 0 or done == cfg.max_steps:
                    record = tally.record(done)  # the only host sync between evaluations and saves
                    tokens = (done - t0_step) * cfg.batch_size * cfg.block_size
                    tokens_per_s = tokens / (time.perf_counter() - t0) if done > t0_step else None
                    mfu = tokens_per_s * flops / peak if peak and tokens_per_s else None
                    record |= {"tokens_per_s": tokens_per_s, "mfu": mfu}  # "lr": the tally's
                    logger.log(done, record, tags)
                    t0, t0_step = time.perf_counter(), done  # the rate of each log's own steps
                    loss = math.nan if record["loss"] is None else record["loss"]
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}",
                                    tok_s=f"{tokens_per_s or 0:,.0f}",
                                    mfu=f"{mfu:.1%}" if mfu else "n/a", refresh=False)
                    bar.update(done - bar.n)
                    tally.check(done)
                # evaluate: losses, downstream tasks, a text sample
                if done % cfg.eval_interval == 0 or done == cfg.max_steps:
                    last = log_eval(done, tokens_per_s)
                    t0, t0_step = time.perf_counter(), done  # evaluation is not training throughput
                if not debug and (done % cfg.ckpt_interval == 0 or done == cfg.max_steps or stop):
                    save(done)
                    t0, t0_step = time.perf_counter(), done  # nor is a save's (its blocking part)
                # stop on a signal or preemption, saved
                if stop:
                    what = signal.Signals(caught[0]).name if caught else "preemption"
                    then = "checkpoint saved; run the same command to resume"
                    say(f"{what} at step {done}: {'stopping' if debug else then}")
                    return None
        if start >= cfg.max_steps:
            say(f"the checkpoint is at step {start}, max_steps={cfg.max_steps}: nothing to do")
        return last
    finally:
        bar.close()
        logger.close()
        with one_line(f"saving a checkpoint to {mngr.directory}"):
            mngr.close()  # waits for the save in flight
