"""Checkpoints: the train state saved and restored with orbax.

A checkpoint is RUNDIR/checkpoints/STEP: the model and optimizer state (each process writes its
own shards) and the host-side Tally of the step metrics (run/metrics.py), so a resumed run continues
exactly where the saved one was. sample.py restores the model alone (restore_model).

A restore checks a checkpoint's files against the record of what its save wrote (run/written.py), so
that damage (a file cut short or lost, metadata altered) is told from a checkpoint of another
model (check_fits), and each restored array against the checksum its save recorded (fingerprints):
bytes changed inside the array data, which zstd keeps no checksum of, read as other numbers.
resume() sets a damaged one aside and goes back to the newest intact one; the run's record of the
steps it saved (run/written.py's SAVED) tells a lost checkpoint from a run that never saved one.
"""
import asyncio
import contextlib
import copy
import dataclasses
import errno
import json
import logging
import shutil
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

import configs
import optimizers
from configs import Config
from run.errors import RunError, UsageError
from model import GPT
from run.written import (SAVED, all_gone, damage, files, record_pending, recorded_steps,
                         step_metadata_damage)


class Checkpoints(ocp.CheckpointManager):
    """orbax's manager of a run's checkpoints, which knows the config the run trains: each save
    records it, each restore compares it (check_config)."""

    def __init__(self, directory: epath.Path, options: ocp.CheckpointManagerOptions, cfg: Config):
        super().__init__(directory, options=options)
        self.config = cfg


def checkpoint_manager(rundir: epath.Path, cfg: Config, read_only: bool = False) -> Checkpoints:
    """RUNDIR/checkpoints/STEP, by orbax: asynchronous (training goes on while it writes), each
    process writing only its own shards. A step is written under a temporary name and renamed when
    complete (on GCS: marked complete by a commit file), so a kill mid-save leaves nothing that
    latest_step() returns; cleanup_tmp_directories removes the leftovers at the next start."""
    directory = checkpoints_dir(rundir)
    # orbax calls it once the files are written, before it renames the step into place
    written = ocp.AsyncOptions(post_finalization_callback=lambda: record_pending(directory))
    # lightweight_initialize: the manager does not read every step's metadata when it starts,
    # where one malformed _CHECKPOINT_METADATA stopped it (and so every resume and sample.py);
    # resume() checks each step's, sets a damaged one aside, and only then reloads
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(cfg.ckpt_keep),
        cleanup_tmp_directories=True, read_only=read_only, async_options=written,
        lightweight_initialize=True)
    return Checkpoints(directory, options, cfg)


def checkpoints_dir(rundir: epath.Path) -> epath.Path:
    """RUNDIR/checkpoints made absolute: orbax refuses a relative path (as launch.py's default
    runs/NAME is)."""
    path = rundir / "checkpoints"
    return path if path.is_absolute() else path.absolute()


def saved_steps(rundir: epath.Path) -> list[int]:
    if not (rundir / "checkpoints").exists():
        return []
    if not (rundir / "checkpoints").is_dir():
        raise UsageError(f"{rundir / 'checkpoints'} is a file, where a run keeps its checkpoints' "
                         "folder: move it, or pass another --rundir")
    return sorted(ocp.path.step.checkpoint_steps(checkpoints_dir(rundir)))  # orbax's: unsorted


@jax.jit
def fingerprints(tree) -> list[jax.Array]:
    """Per array: [all finite (0 or 1), sum of its bit patterns, sum weighted by position, sum of
    each element's bits and position hashed], the sums as uint32 (mod 2**32). Integer sums are
    exact in any order, so the result is the same however the array is sharded (a checkpoint may
    be restored on another device count). A change of one element changes the first sum; the
    second catches elements swapped or changed together; both are linear, so changes that cancel
    in them (two sign flips: each adds 2**31 times an odd number) show in the third, whose hash
    (murmur3's finaliser) spreads every element's change over the whole word. Computed where the
    arrays are, from the arrays themselves: the checkpoint is not read again."""
    def one(x):
        if x.dtype == jnp.bool_:
            bits = x.astype(jnp.uint32)
        else:
            bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        bits = bits.astype(jnp.uint32)
        position = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
        finite = jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else True
        return jnp.stack([jnp.uint32(finite), bits.sum(dtype=jnp.uint32),
                          (bits * (2 * position + 1)).sum(dtype=jnp.uint32),
                          mixed(bits ^ (position * jnp.uint32(0x9E3779B9))).sum(dtype=jnp.uint32)])

    return [one(x) for x in jax.tree.leaves(tree)]


def mixed(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser (Appleby): each input bit flips about half the output's."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def checksums(state: dict) -> dict[str, list[int]]:
    """{"model.blocks.mlp.up": [finite, sum, weighted sum, hashed sum], ...} of a state's arrays,
    fetched."""
    names = list(shapes(state))
    return dict(zip(names, (v.tolist() for v in jax.device_get(fingerprints(state))),
                    strict=True))


def verify(step: int, state: dict, saved: dict | None) -> None:
    """Damaged if an array restored is not finite or differs from the checksum saved with it.
    Its buffers are freed first: the run goes on to restore an older checkpoint. saved None: a
    checkpoint of a mugpt from before checksums, checked for finite values only (said in a line),
    so that upgrading never sets a run's checkpoints aside."""
    now = checksums(state)
    nonfinite = [n for n in now if not now[n][0]]  # named first: the likelier cause of trouble
    if saved is None:
        print(f"note: the checkpoint of step {step} has no checksums (saved by an older mugpt): "
              "its arrays are checked for finite values only", file=sys.stderr)
        saved = now
    # a checkpoint saved before the hashed sum holds three numbers an array: those are compared
    differs = [n for n in now if n not in saved or now[n][:len(saved[n])] != saved[n]]
    bad = next(iter(nonfinite + differs), None)
    if bad is None:
        return
    jax.tree.map(lambda x: x.delete(), state)
    why = ("is not finite" if not now[bad][0] else "has no checksum recorded" if bad not in saved
           else "differs from the checksum its save recorded")
    raise Damaged(f"the checkpoint of step {step} is damaged: its array {bad} {why}")


def save_checkpoint(mngr: Checkpoints, step: int, model: GPT, opt_state,
                    tally: dict) -> None:
    """Returns once the arrays are copied to host memory (the next step may donate them); a
    background thread writes them. An error of the previous save is raised here. train.py decides
    when to save, so orbax's own save policy is overridden (force). The tally is copied: the thread
    may write it after the loop has appended the next steps' metrics to it."""
    state = {"model": eqx.filter(model, eqx.is_array), "opt_state": opt_state}
    sums = checksums(state)
    if not all(finite for finite, *_ in sums.values()):  # the skipped steps should prevent it
        raise RunError(f"the state after step {step} is not finite; not saved "
                       f"(the last checkpoint is step {mngr.latest_step()})")
    mngr.wait_until_finished()  # (as mngr.save would): the space the last save took is known
    check_space(mngr, step, state)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              tally=ocp.args.JsonSave(copy.deepcopy(tally)),
                              checksums=ocp.args.JsonSave(sums),
                              config=ocp.args.JsonSave({**trained_as(mngr.config), "step": step}))
    mngr.save(step, args=args, force=True)


def restore_checkpoint(mngr: Checkpoints, model: GPT, opt_state,
                       step: int | None = None) -> tuple[GPT, optax.OptState, dict]:
    """The checkpoint of `step` (default: the latest complete one), onto the shardings of `model`
    and `opt_state` (fresh from setup(), on this run's mesh, which may differ from the saving
    run's), so the restored arrays are what the compiled step expects and it does not retrace.
    Their buffers are freed first: two copies of the state may not fit in device memory."""
    params, static = eqx.partition(model, eqx.is_array)  # static: eqx.nn.Shared's tie marker
    target = abstract({"model": params, "opt_state": opt_state})
    step = mngr.latest_step() if step is None else step
    with damage_as_one_line(mngr, step):
        check_fits(mngr, step, target)
        check_config(mngr, step, resuming=True)
        jax.tree.map(lambda x: x.delete(), (params, opt_state))
        recorded = (mngr.directory / str(step) / "checksums").exists()  # else an older mugpt's
        items = dict(checksums=ocp.args.JsonRestore()) if recorded else {}
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                  tally=ocp.args.JsonRestore(), **items)
        restored = mngr.restore(step, args=args)
    verify(step, restored.state, (restored.checksums or {}) if recorded else None)
    model = eqx.combine(restored.state["model"], static)
    return model, restored.state["opt_state"], restored.tally


def resume(mngr: Checkpoints, model: GPT, opt_state, set_aside: bool = True
           ) -> tuple[int, GPT, optax.OptState, dict | None]:
    """(step, model, opt_state, tally) of the newest intact checkpoint, or (0, model, opt_state,
    None) for a run that has saved none. A damaged one is said in one line and renamed
    STEP.damaged (orbax ignores that name), never deleted: its files may yet be copied back
    (set_aside False, --debug's look that changes no file: said, and left where it is). The
    newest step the run recorded (written.SAVED) that is gone is named. With none left of a run
    that saved some, it stops (NothingToResume): trained from step 0, it would overwrite the logs
    of the run they hold."""
    first, found = jax.process_index() == 0, (0, model, opt_state, None)
    rundir = mngr.directory.parent
    listed = list(mngr.directory.iterdir()) if mngr.directory.exists() else []
    # orbax lists folders only: a file (or a link to nothing) under a step's name would be saved over
    if stray := [p for p in listed if p.name.isdigit() and not p.is_dir()]:
        raise UsageError(f"{stray[0]} is not a checkpoint's folder (a file, or a link to nothing): "
                         f"move it out of {mngr.directory}; the run would save its step over it")
    steps, recorded = sorted(mngr.all_steps(), reverse=True), recorded_steps(rundir)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("mugpt: checkpoints listed")  # before any rename
    newest = max(recorded + steps[:1], default=0)
    renamed = (mngr.directory / f"{newest}.damaged").exists()  # said when it was renamed
    if steps and newest not in steps and not renamed and first:  # (none left: an error, below)
        print(f"warning: the checkpoint of step {newest} is missing from {mngr.directory} (the "
              f"run saved it, {SAVED} says)", file=sys.stderr, flush=True)
    left = []  # damaged, not renamed (set_aside False)
    for step in steps:
        try:
            if found[0]:  # older than the one resumed: its orbax metadata alone, which reload reads
                if problem := step_metadata_damage(mngr.directory / str(step)):
                    raise Damaged(f"the checkpoint of step {step} is damaged: {problem}")
            else:
                found = step, *restore_checkpoint(mngr, model, opt_state, step)
        except Damaged as e:
            aside = None  # --debug's look: the step stays where it is
            if set_aside:
                names = (f"{step}.damaged{n or ''}" for n in range(1000))  # again: .damaged1
                aside = next(n for n in names if not (mngr.directory / n).exists())
            else:
                left.append(str(step))
            if first and aside:  # process 0 alone renames; the others find the same damage
                (mngr.directory / str(step)).rename(mngr.directory / aside)
            if first:
                done = f"renamed {aside}" if aside else "left as it is (--debug renames nothing)"
                print(f"warning: {e}; {done}", file=sys.stderr, flush=True)
    agree(found[0])
    mngr.reload()  # forget the renamed steps: the run saves them again
    if found[0] and found[0] != newest and first:
        print(f"warning: resuming from the newest intact checkpoint, step {found[0]}",
              file=sys.stderr, flush=True)
    damaged = left + [p.name for p in mngr.directory.iterdir() if ".damaged" in p.name] \
        if mngr.directory.exists() else []
    if not found[0] and damaged:
        raise NothingToResume(f"no intact checkpoint in {mngr.directory}, only damaged ones "
                              f"({', '.join(sorted(damaged))}): copy them back from elsewhere, "
                              f"or delete them and pass --restart to train from step 0")
    if not found[0] and (gone := all_gone(rundir, mngr.directory)):
        raise NothingToResume(f"{gone}: copy them back, or pass --restart to train it again from "
                              f"step 0")
    if first:
        say_dropped(rundir, found[0])
    return found


class NothingToResume(RunError):
    """A run that has trained, with no checkpoint left to resume from: launch.py writes nothing."""


def say_dropped(rundir: epath.Path, start: int) -> None:
    """The metrics.jsonl lines that run/metrics.py's Logger drops at this start (logged after the
    checkpoint: the run logs those steps again), said in one line: none goes silently."""
    from run.metrics import logged_step, read_lines

    lines = read_lines(rundir / "metrics.jsonl")
    if dropped := sum(not 0 <= logged_step(line) <= start for line in lines):
        print(f"note: metrics.jsonl: {dropped} line(s) after step {start} (or unreadable) are "
              f"dropped: they came after the checkpoint, and the run logs those steps again",
              file=sys.stderr, flush=True)


def agree(step: int) -> None:
    """Each process reads only its own shards: damage found by reading (a checkpoint without
    RECORD) may stop some processes only. Waits for process 0's renames too."""
    if jax.process_count() > 1:
        steps = set(multihost_utils.process_allgather(np.int32(step)).tolist())
        if len(steps) > 1:
            raise RunError(f"the processes found different checkpoints intact (steps "
                           f"{sorted(steps)}): rename the damaged one STEP.damaged")


def restore_model(mngr: Checkpoints, model: GPT, step: int | None = None) -> GPT:
    """The model alone of the checkpoint of `step` (default: the latest), onto the shardings of
    `model`: for sampling, which needs no optimizer state (twice the model's memory under Adam) and
    so no setup(). `model`'s arrays may be shapes alone (jax.ShapeDtypeStruct, on the default
    device unless they name a sharding); its buffers are freed first, as restore_checkpoint frees
    the state's."""
    array_or_shape = lambda x: isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
    params, static = eqx.partition(model, array_or_shape)
    target = abstract({"model": params})
    step = mngr.latest_step() if step is None else step
    with damage_as_one_line(mngr, step):
        check_fits(mngr, step, target)
        check_config(mngr, step)
        jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, params)
        # partial_restore: the saved arrays that target lacks (opt_state) are not read. Not through
        # mngr: a manager that has saved holds the state's handler, which restores whole trees.
        restore = ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(state_dir(mngr, step), args=restore)
        saved = None  # an older mugpt's checkpoint: finite values only
        if (mngr.directory / str(step) / "checksums").exists():
            with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
                saved = checkpointer.restore(mngr.directory / str(step) / "checksums")
    verify(step, restored, saved)
    return eqx.combine(restored["model"], static)


def abstract(tree):
    """Each array as its shape, dtype and sharding (the default device's where it names none):
    what orbax restores into."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=one if x.sharding is None else x.sharding,
        weak_type=x.weak_type), tree)


def check_fits(mngr: Checkpoints, step: int, target: dict) -> None:
    """An edited model.py meets an older checkpoint here: the arrays that differ are named, not
    dumped as orbax's trees. Only the saved parts that target asks for are compared. Dtypes too:
    orbax would cast a float32 array into a bfloat16 parameter, whose sums then differ from those
    saved, and verify would call every intact checkpoint damaged and set it aside."""
    metadata = ocp.StandardCheckpointer().metadata(state_dir(mngr, step))
    ours = shapes(target, dtypes=True)
    saved = {k: v for k, v in shapes(metadata.item_metadata, dtypes=True).items()
             if k.split(".")[0] in target}

    def said(layout, other):  # its shape, and its dtype where the shapes agree
        if layout is None:
            return "absent"
        return f"{layout[0]} {layout[1]}" if other and other[0] == layout[0] else f"{layout[0]}"

    diff = [f"{k} {said(saved.get(k), ours.get(k))} there, {said(ours.get(k), saved.get(k))} here"
            for k in sorted(ours | saved) if ours.get(k) != saved.get(k)]
    if diff:
        raise UsageError(f"the checkpoint of step {step} does not fit the model that model.py and "
                         f"the config build: {'; '.join(diff[:3])}{'; ...' if diff[3:] else ''} "
                         f"(run.json names the commit it was trained at)")


# Fields a reader may set otherwise than the run trained with, besides the ones a resume may
# change (configs.RESUMABLE): sample.py's and the export's float32 reads a bfloat16 run's model,
# and a run whose dataset is gone decodes with its dataset.json (a resume checks the data itself)
READ_OTHERWISE = ("compute_dtype", "dataset")


def trained_as(cfg: Config) -> dict:
    """The config a checkpoint records (as JSON reads it back), whole: what its arrays are the
    model and optimizer state of, and the schedule they were trained on."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def check_config(mngr: Checkpoints, step: int, resuming: bool = False) -> None:
    """A checkpoint whose arrays fit the model but whose config is not this run's (copied from
    another run, or config.json edited: ALiBi's arrays are RoPE's, MHA's with one key/value head
    and SharedKV's with two have the same qkv) is refused in one line naming the fields, never
    read as this run's model. A field one of them lacks (a mugpt of another version) is not
    compared; a checkpoint saved before configs were recorded is said in a note. resuming: the
    training run's own fields too (READ_OTHERWISE), and a WSD schedule changed past its stable
    phase is refused against the checkpoint's, whatever config.json says now. A checkpoint under
    another step's name (a copy gone wrong) is damaged: its data and LR would be another step's."""
    path = mngr.directory / str(step) / "config"
    if not path.exists():
        print(f"note: the checkpoint of step {step} records no config (saved by an older mugpt): "
              f"it is read as the model of {mngr.directory.parent / 'config.json'}",
              file=sys.stderr, flush=True)
        return
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
        saved = checkpointer.restore(path)
    if saved.get("step", step) != step:
        raise Damaged(f"the checkpoint of step {step} is damaged: it holds the checkpoint of step "
                      f"{saved['step']} (copied under another name)")
    now, skip = trained_as(mngr.config), (*configs.RESUMABLE, *(() if resuming else READ_OTHERWISE))
    differ = [f"{k}={saved[k]!r} there, {now[k]!r} here" for k in sorted(saved.keys() & now.keys())
              if k not in skip and saved[k] != now[k]]
    if differ:
        raise UsageError(f"the checkpoint of step {step} is another run's: it was trained with "
                         f"{'; '.join(differ[:3])}{'; ...' if differ[3:] else ''}: move it out "
                         f"of {mngr.directory}, or read it with the config it was trained with")
    if resuming:  # launch.py checked config.json's schedule, which an edit may have changed
        schedule = {k: saved[k] for k in ("max_steps", "decay_fraction", "decay_shape") if k in saved}
        optimizers.check_extension(dataclasses.replace(mngr.config, **schedule), mngr.config, step)


class Damaged(RunError):
    """A checkpoint that cannot be read completely."""


@contextlib.contextmanager
def damage_as_one_line(mngr: ocp.CheckpointManager, step: int):
    """Damaged: the files of the checkpoint of `step` do not match its RECORD, or reading them
    failed (a checkpoint saved before there were records). check_fits's UsageError, a structure
    that differs, passes, and so does XLA's error (out of memory: nothing wrong with the files)."""
    if problem := damage(mngr.directory / str(step)):
        raise Damaged(f"the checkpoint of step {step} is damaged: {problem}")
    try:
        yield
    except (UsageError, RunError):
        raise
    except Exception as e:
        # orbax raises a plain Exception from tensorstore's ValueError, which names the file
        read = (OSError, ValueError, KeyError)
        cause = next((c for c in (e, e.__cause__) if isinstance(c, read)), None)
        if cause is None:
            raise
        first = (str(cause) or type(cause).__name__).splitlines()[0]
        raise Damaged(f"the checkpoint of step {step} is damaged: reading it failed: "
                      f"{first}") from None


def check_space(mngr: Checkpoints, step: int, state: dict) -> None:
    """A save that cannot fit on a local disk stops the run before it writes anything, the earlier
    checkpoints untouched. It needs what the last one took (orbax compresses), else the arrays'
    bytes."""
    directory = mngr.directory
    if str(directory).startswith("gs://") or not directory.exists():
        return
    last = mngr.latest_step()
    sizes = [p.stat().length for p in files(directory / str(last)).values()] if last else []
    needed = sum(sizes) or sum(x.nbytes for x in jax.tree.leaves(state) if eqx.is_array(x))
    free = shutil.disk_usage(directory).free
    size = lambda n: f"{n / 2**20:,.1f} MiB" if n >= 2**30 else f"{n:,} bytes"  # never "1 of 1"
    if free < needed:
        kept = f"the checkpoints up to step {last} are intact" if last else "none saved yet"
        raise RunError(f"no space for the checkpoint of step {step} in {directory}: it needs "
                       f"{size(needed)}, {size(free)} are free ({kept}): free some and run the "
                       f"same command to resume")


def first_checkpoint_bytes(cfg: Config) -> int:
    """What the first checkpoint of cfg's model may take: its parameters and Adam's two moments,
    float32, uncompressed (launch.py checks the disk has room before it writes anything)."""
    from params import init_gpt

    shapes_ = jax.eval_shape(lambda: eqx.filter(init_gpt(cfg, jax.random.key(0)), eqx.is_array))
    return 3 * 4 * sum(x.size for x in jax.tree.leaves(shapes_))


def state_dir(mngr: ocp.CheckpointManager, step: int) -> epath.Path:
    """Where save_checkpoint's "state" item of a step is: the model and optimizer arrays."""
    return mngr.directory / str(step) / "state"


def shapes(tree, dtypes: bool = False) -> dict[str, tuple]:
    """{"model.blocks.mlp.up": shape, ...}: the arrays of a tree of modules, optax states or
    orbax's metadata; dtypes: (shape, dtype name) each."""
    def name(k):
        return str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    layout = lambda x: (tuple(x.shape), np.dtype(x.dtype).name) if dtypes else tuple(x.shape)
    return {".".join(map(name, path)): layout(x) for path, x in leaves}


@contextlib.contextmanager
def one_line(what: str):
    """Orbax's I/O errors (a full disk, a lost bucket), often raised from its background thread, as
    one line."""
    try:
        yield
    except (RunError, UsageError):
        raise
    except (OSError, ValueError, RuntimeError) as e:
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            raise RunError(f"{what} failed: no space left on device (the earlier checkpoints are "
                           f"intact): free some and run the same command to resume") from None
        raise RunError(f"{what} failed: {(str(e) or type(e).__name__).splitlines()[0]}") from None


def quiet_failed_saves() -> None:
    """train.py reports a failed checkpoint save (a full disk) or read in one line. Orbax would
    also log it as several tracebacks, asyncio one more for each of its concurrent write tasks
    that failed alike, each tensorstore write still in flight one when it finds orbax's event
    loop closed, and a write made but never started a RuntimeWarning at the interpreter's exit,
    after (so hiding) the one-line error; --debug shows them."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
    default = sys.unraisablehook

    def hook(u):
        e = u.exc_value
        closed = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        # each read still in flight when another failed, in a damaged checkpoint without RECORD
        unread = str(e).startswith("Encountered error while reading array index")
        if not (closed or unread):
            default(u)

    sys.unraisablehook = hook
    # and one that ends after orbax closed its loop hands the loop its result from tensorstore's
    # thread: the RuntimeError was printed from C++ as a traceback, past every hook (under load)
    post = asyncio.BaseEventLoop.call_soon_threadsafe
    if not getattr(post, "quiet", False):
        def call_soon_threadsafe(loop, *args, **kwargs):
            try:  # not a test of is_closed() first: the loop may close between it and the call
                return post(loop, *args, **kwargs)
            except RuntimeError:
                if loop.is_closed():
                    return None
                raise
        call_soon_threadsafe.quiet = True
        asyncio.BaseEventLoop.call_soon_threadsafe = call_soon_threadsafe
