"""Ctrl-C (SIGINT) or SIGTERM outside a training loop (whose own handler saves and stops at the end
of a step: run/distributed.stop_signals): one line and out at once, after putting back what UNDO
holds. Not a KeyboardInterrupt, which JAX's gc callbacks can swallow (the run goes on) and which,
cutting an XLA compilation short, makes the interpreter's exit segfault (jax 0.10); SIGTERM's
default was a silent kill. No jax here: the handler is in place before a command parses its
arguments."""
import contextlib
import os
import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM)
UNDO: list = []  # what a signal puts back first (launch.py: the run directory as it was)


def exit_on_signals(then: str) -> dict:
    """Installs the handler of SIGNALS, whose line ends with `then` (what to do next); returns the
    handlers it replaced."""
    def interrupted(signum: int, _) -> None:
        for undo in UNDO:
            undo()
        sys.stdout.flush()  # \n: past a progress bar
        print(f"\nerror: interrupted ({signal.Signals(signum).name}); {then}", file=sys.stderr,
              flush=True)
        os._exit(1)
    return {s: signal.signal(s, interrupted) for s in SIGNALS}


@contextlib.contextmanager
def held():
    """SIGNALS delivered only on leaving, with UNDO as it is then: around a write and the
    registration of its undo, so that no signal falls between them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
