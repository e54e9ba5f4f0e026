"""Checkpoints and stopping: the train state saved and restored with orbax, stopping on a signal, and
stopping every process of a multi-host run when one of them fails; and the run's logs, which a resumed
run trims back to its checkpoint.

A checkpoint is RUNDIR/checkpoints/STEP: the model and optimizer state (each process writes its own
shards) and the host-side Tally of the step metrics, so a resumed run continues exactly where the saved one was.
"""
import contextlib
import copy
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath

from configs import Config, RunError, UsageError
from model import GPT


def checkpoint_manager(rundir: epath.Path, cfg: Config, read_only: bool = False) -> ocp.CheckpointManager:
    """RUNDIR/checkpoints/STEP, by orbax: asynchronous (training goes on while it writes), each process
    writing only its own shards. A step is written under a temporary name and renamed when complete (on
    GCS: marked complete by a commit file), so a kill mid-save leaves nothing that latest_step() returns;
    cleanup_tmp_directories removes the leftovers at the next start."""
    options = ocp.CheckpointManagerOptions(preservation_policy=ocp.checkpoint_managers.LatestN(cfg.ckpt_keep),
                                           cleanup_tmp_directories=True, read_only=read_only)
    return ocp.CheckpointManager(checkpoints_dir(rundir), options=options)


def checkpoints_dir(rundir: epath.Path) -> epath.Path:
    """RUNDIR/checkpoints made absolute: orbax refuses a relative path (as launch.py's default runs/NAME is)."""
    path = rundir / "checkpoints"
    return path if path.is_absolute() else path.absolute()


_LOCKS = []  # lock_rundir's open lock files: closing one would release its lock


def lock_rundir(rundir: epath.Path) -> None:
    """One launch at a time in a run directory: a second (the same command in another terminal, a restart
    while the first still runs) would interleave its steps, logs and saves with the first's. An flock, which
    the kernel drops when the process ends however it ends, held until then; none on gs://."""
    if not str(rundir).startswith("gs://"):
        import fcntl

        _LOCKS.append(lock := open(os.path.join(rundir, ".lock"), "w"))
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{rundir} is in use: another launch.py is training there (wait for it, or pass another --rundir)") from None


def saved_steps(rundir: epath.Path) -> list[int]:
    return ocp.path.step.checkpoint_steps(checkpoints_dir(rundir)) if (rundir / "checkpoints").exists() else []


def check_resume(rundir: epath.Path, cfg: Config) -> None:
    """A run stops and saves only between calls of steps_per_call steps, so it resumes only with a K that
    divides its latest checkpoint's step. launch.py asks before it writes anything in the run directory."""
    if (latest := max(saved_steps(rundir), default=0)) % (K := cfg.steps_per_call):
        raise UsageError(f"the checkpoint is at step {latest}, not a multiple of steps_per_call={K}: resume with a divisor of it")


def record_dataset(rundir: epath.Path, meta: dict, where) -> None:
    """RUNDIR/dataset.json: the dataset's meta.json as the run first trained on it. sample.py decodes with it
    whatever becomes of the dataset; a resume on a dataset prepared again (another vocabulary, other token
    counts: other text behind the same ids and offsets) is refused, not trained on. launch.py calls it."""
    path = rundir / "dataset.json"
    try:  # compared once the run has saved a step: a launch that failed before it may bring a new dataset
        old = json.loads(path.read_text()) if path.exists() and saved_steps(rundir) else meta
    except ValueError:  # not JSON (a hand edit, a disk error): this launch's record replaces it
        old = meta
    if old != meta and isinstance(old, dict):  # (JSON but no object: replaced too)
        key = next(k for k in sorted(old.keys() | meta.keys()) if old.get(k) != meta.get(k))
        raise UsageError(f"{where} is not the dataset {rundir} trained on ({key} {str(old.get(key))[:30]} in its dataset.json, "
                         f"{str(meta.get(key))[:30]} now): prepare it as it was, or start a new --rundir")
    path.write_text(json.dumps(meta, indent=1))


@eqx.filter_jit
def all_finite(tree) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if eqx.is_array(x)]).all()


def save_checkpoint(mngr: ocp.CheckpointManager, step: int, model: GPT, opt_state, tally: dict) -> None:
    """Returns once the arrays are copied to host memory (the next step may donate them); a background
    thread writes them. An error of the previous save is raised here. train.py decides when to save, so
    orbax's own save policy is overridden (force). The tally is copied: the thread may write it after the
    loop has appended the next steps' metrics to it."""
    if not all_finite((model, opt_state)):  # the skipped steps should make this impossible
        raise RunError(f"the state after step {step} is not finite; not saved (the last checkpoint is step {mngr.latest_step()})")
    state = ocp.args.StandardSave({"model": eqx.filter(model, eqx.is_array), "opt_state": opt_state})
    mngr.save(step, args=ocp.args.Composite(state=state, tally=ocp.args.JsonSave(copy.deepcopy(tally))), force=True)


def restore_checkpoint(mngr: ocp.CheckpointManager, model: GPT, opt_state,
                       step: int | None = None) -> tuple[GPT, optax.OptState, dict]:
    """The checkpoint of `step` (default: the latest complete one; sample.py --step picks another), onto
    the shardings of `model` and `opt_state` (fresh from setup(), on this run's mesh, which may differ from
    the saving run's), so the restored arrays are what the compiled step expects and it does not retrace.
    Their buffers are freed first: two copies of the state may not fit in device memory."""
    params, static = eqx.partition(model, eqx.is_array)  # static: eqx.nn.Shared's marker of the tied array
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type),
                          {"model": params, "opt_state": opt_state})
    step = mngr.latest_step() if step is None else step
    # An edited model.py meets an older checkpoint here: name the arrays that differ, not orbax's tree dump
    ours, saved = shapes(target), shapes(ocp.StandardCheckpointer().metadata(mngr.directory / str(step) / "state").item_metadata)
    if diff := [f"{k} {saved.get(k, 'absent')} there, {ours.get(k, 'absent')} here" for k in sorted(ours | saved) if ours.get(k) != saved.get(k)]:
        raise UsageError(f"the checkpoint of step {step} does not fit the model that model.py and the config build: "
                         f"{'; '.join(diff[:3])}{'; ...' if diff[3:] else ''} (run.json names the commit it was trained at)")
    jax.tree.map(lambda x: x.delete(), (params, opt_state))
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), tally=ocp.args.JsonRestore())
    restored = mngr.restore(step, args=args)
    return eqx.combine(restored.state["model"], static), restored.state["opt_state"], restored.tally


def shapes(tree) -> dict[str, tuple]:
    """{"model.blocks.mlp.up": shape, ...}: the arrays of a tree of modules, optax states or orbax's metadata."""
    name = lambda k: str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
    return {".".join(map(name, path)): tuple(x.shape) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@contextlib.contextmanager
def one_line(what: str):
    """Orbax's I/O errors (a full disk, a lost bucket), often raised from its background thread, as one line."""
    try:
        yield
    except (RunError, UsageError):
        raise
    except (OSError, ValueError, RuntimeError) as e:
        raise RunError(f"{what} failed: {(str(e) or type(e).__name__).splitlines()[0]}") from None


@contextlib.contextmanager
def stop_signals():
    """SIGTERM (a preemption notice) and SIGINT (Ctrl-C) only set a flag: the loop finishes its step, saves
    and returns. A second signal acts as usual. With several processes JAX's preemption service takes
    SIGTERM instead, so that all of them stop at the same step."""
    caught = []

    def handler(signum, _):
        caught.append(signum)
        signal.signal(signum, previous[signum])

    previous = {s: signal.signal(s, handler) for s in ((signal.SIGTERM, signal.SIGINT) if jax.process_count() == 1 else ())}
    try:
        yield caught
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def quiet_failed_saves() -> None:
    """train.py reports a failed checkpoint save (a full disk) in one line. Orbax would also log it as
    several tracebacks, asyncio one more for each of its concurrent write tasks that failed alike, and each
    tensorstore write still in flight one when it finds orbax's event loop closed; --debug shows them."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    default = sys.unraisablehook
    sys.unraisablehook = lambda u: None if isinstance(u.exc_value, RuntimeError) and \
        str(u.exc_value) == "Event loop is closed" else default(u)


FAILED = "mugpt/failed/"  # key prefix in the coordination service: FAILED + process index -> its error


@contextlib.contextmanager
def fail_together():
    """With several processes, the first to fail stops all of them and each prints why. The failing one
    posts its error to the coordination service of jax.distributed, where a thread in every process looks
    each second; it prints `error: process I failed: ...` and exits. Without it the others would wait in
    their next collective until the service declared the failed process dead: 100 s without heartbeats
    after a crash, 300 s (the shutdown barrier) after a normal exit. A process that dies without a word
    (kill -9, a lost host) is still left to the heartbeats."""
    if jax.process_count() == 1:
        yield
        return
    client = jax._src.distributed.global_state.client  # as orbax reaches it: jax has no public accessor
    me, done = jax.process_index(), threading.Event()

    def leave(message: str):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if me == 0:  # process 0 hosts the service: it leaves last, or the others log its loss as a crash
            time.sleep(2.0)
        os._exit(1)  # a normal exit would wait at jax's shutdown barrier for the processes still running

    def watch():
        try:
            while not done.wait(1.0):
                for key, reason in client.key_value_dir_get(FAILED):
                    leave(f"process {key.rsplit('/', 1)[1]} failed: {reason}")
        except Exception as e:  # the service is gone with process 0
            leave(f"lost jax.distributed's coordination service on process 0: {str(e).splitlines()[0]}")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    except BaseException as e:
        done.set()
        thread.join()  # ends within a second: it must not read this process's own error as another's
        if not isinstance(e, (UsageError, RunError)):
            traceback.print_exc()
        reason = str(e) if isinstance(e, (UsageError, RunError)) else f"{type(e).__name__}: {e}".splitlines()[0]
        client.key_value_set(f"{FAILED}{me}", reason)
        leave(reason)
    finally:
        done.set()
        thread.join()


class Logger:
    """Scalars to tensorboard event files and metrics.jsonl in the run directory (local or gs://), written
    by process 0 alone (every process has the same numbers). A run resumed at step `start` first drops
    what was logged after that step (it came after the checkpoint), so both read as one uninterrupted run.
    A local metrics.jsonl grows by one appended line per log. GCS objects cannot be appended to: there the
    whole file is rewritten, at most once a minute and at the end (a kill loses at most that minute of
    lines, which the tensorboard events still hold), not at every log (O(lines^2) bytes over a run)."""

    def __init__(self, rundir: epath.Path, start: int):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if jax.process_index() != 0:  # process 0 alone writes; on the others every method does nothing
            self.log = self.text = self.close = lambda *args: None
            return
        self.event, self.summary = event_pb2.Event, summary_pb2.Summary
        self.tb = EventFileWriter(str(rundir))
        # Tensorboard discards the events of steps >= a START session log's step that came before it: after
        # the checkpoint resumed from (all, if none was saved). Its server takes a run's first START for no
        # restart, so a fresh run writes one too.
        start_log = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self.tb.add_event(self.event(wall_time=time.time(), step=start + 1 if start else 0, session_log=start_log))
        self.path, self.local = rundir / "metrics.jsonl", not str(rundir).startswith("gs://")
        old = self.path.read_text().splitlines(keepends=True) if start and self.path.exists() else []
        # (a kill mid-append can leave a last line without its newline: it is dropped)
        self.lines = [line for line in old if line.endswith("\n") and json.loads(line)["step"] <= start]
        self.rewrite()

    def rewrite(self) -> None:
        """The whole file, written aside and renamed into place: a kill never leaves half of it."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(self.lines))
        tmp.replace(self.path)
        self.written = time.monotonic()

    def log(self, step: int, record: dict[str, float], tags: dict[str, str]) -> None:
        """Write record as one JSON line, and each value named in tags (record key -> tensorboard tag)."""
        self.lines.append(json.dumps({"step": step, **record}) + "\n")
        if self.local:
            with self.path.open("a") as f:
                f.write(self.lines[-1])
        elif time.monotonic() - self.written > 60:
            self.rewrite()
        values = [self.summary.Value(tag=tag, simple_value=record[k]) for k, tag in tags.items() if record.get(k) is not None]
        self.tb.add_event(self.event(wall_time=time.time(), step=step, summary=self.summary(value=values)))
        self.tb.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        """Text for tensorboard's text plugin (markdown). Every process computes it: sampling takes them all."""
        from tensorboard.plugins.text.summary_v2 import text_pb

        self.tb.add_event(self.event(wall_time=time.time(), step=step, summary=text_pb(tag, text)))
        self.tb.flush()

    def close(self) -> None:
        if not self.local:
            self.rewrite()
        self.tb.close()


class Tally:
    """The step metrics on the host: fetched from the device only at log points and saves (a fetch waits), saved
    with each checkpoint so a resumed run logs exactly what an uninterrupted one would; counts skipped steps."""

    def __init__(self, cfg: Config, saved: dict | None = None):
        self.cfg, self.on_device = cfg, []  # metrics of the steps not fetched yet
        # since_log: fetched metrics of the steps after the last multiple of log_interval; streak: skipped in a row
        self.state = saved or {"since_log": [], "streak": 0, "skipped": 0}

    def fetch(self) -> None:
        for call in jax.device_get(self.on_device):  # each call's metrics: (K,) arrays, an entry a step
            for m in ({k: v[i].item() for k, v in call.items()} for i in range(len(call["loss"]))):
                self.state["since_log"].append(m)
                self.state["streak"] = self.state["streak"] + 1 if m["skipped"] else 0
                self.state["skipped"] += m["skipped"]
        self.on_device = []

    def record(self, step: int) -> dict:
        """Mean loss over the applied steps since the last log, the last grad norm, the skipped count."""
        self.fetch()
        steps = self.state["since_log"]
        losses = [m["loss"] for m in steps if not m["skipped"]]
        if step % self.cfg.log_interval == 0:  # an off-interval last step keeps them for a longer resumed run
            self.state["since_log"] = []
        return {"loss": float(np.mean(losses)) if losses else None, "grad_norm": steps[-1]["grad_norm"],
                "skipped": self.state["skipped"]}

    def check(self, step: int) -> None:
        if self.state["streak"] >= self.cfg.max_nonfinite:
            raise RunError(f"{self.state['streak']} steps in a row up to step {step} had a non-finite loss or "
                           f"gradient and were skipped (max_nonfinite={self.cfg.max_nonfinite}): the run has diverged")
