"""How the processes of a run start and stop together: joining a multi-host run (join), stopping
every process when one of them fails (fail_together), and stopping at the end of a step on a signal
(stop_signals).
"""
import contextlib
import os
import re
import signal
import sys
import threading
import time
import traceback

import jax

from run.errors import RunError, UsageError


def join(coordinator_address: str | None, num_processes: int | None,
         process_id: int | None) -> None:
    """jax.distributed.initialize, with launch.py's flags checked: on a TPU VM or under SLURM jax
    finds all three itself; elsewhere a missing or out-of-range one is a UsageError naming them."""
    if coordinator_address and not re.fullmatch(r"\S+:\d+", coordinator_address):
        raise UsageError(f"--coordinator_address={coordinator_address}: expected HOST:PORT")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    except ValueError as e:
        raise UsageError(f"--multihost: {e} (off a TPU VM or SLURM: --coordinator_address, "
                         f"--num_processes, --process_id)") from None


FAILED = "mugpt/failed/"  # key prefix in the coordination service: FAILED + process index -> error


@contextlib.contextmanager
def fail_together():
    """With several processes, the first to fail stops all of them and each prints why. The failing
    one posts its error to the coordination service of jax.distributed, where a thread in every
    process looks each second; it prints `error: process I failed: ...` and exits. Without it the
    others would wait in their next collective until the service declared the failed process dead:
    100 s without heartbeats after a crash, 300 s (the shutdown barrier) after a normal exit. A
    process that dies without a word (kill -9, a lost host) is still left to the heartbeats."""
    if jax.process_count() == 1:
        yield
        return
    client = jax._src.distributed.global_state.client  # as orbax reaches it: no public accessor
    me, done = jax.process_index(), threading.Event()

    def leave(message: str):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if me == 0:  # process 0 hosts the service: it leaves last, or the others log a crash
            time.sleep(2.0)
        os._exit(1)  # a normal exit would wait at jax's shutdown barrier for the others

    def watch():
        try:
            while not done.wait(1.0):
                for key, reason in client.key_value_dir_get(FAILED):
                    leave(f"process {key.rsplit('/', 1)[1]} failed: {reason}")
        except Exception as e:  # the service is gone with process 0
            first = str(e).splitlines()[0]
            leave(f"lost jax.distributed's coordination service on process 0: {first}")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    except BaseException as e:
        done.set()
        thread.join()  # within a second: it must not read this process's own error as another's
        if isinstance(e, (UsageError, RunError)):
            reason = str(e)
        else:  # a bug: its traceback here, its one line in every process
            traceback.print_exc()
            reason = f"{type(e).__name__}: {e}".splitlines()[0]
        client.key_value_set(f"{FAILED}{me}", reason)
        leave(reason)
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def stop_signals():
    """SIGTERM (a preemption notice) and SIGINT (Ctrl-C) only set a flag: the loop finishes its
    step, saves and returns. A second signal acts as usual. With several processes JAX's preemption
    service takes SIGTERM instead, so that all of them stop at the same step."""
    caught = []

    def handler(signum, _):
        caught.append(signum)
        signal.signal(signum, previous[signum])

    ours = (signal.SIGTERM, signal.SIGINT) if jax.process_count() == 1 else ()
    previous = {s: signal.signal(s, handler) for s in ours}
    try:
        yield caught
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
