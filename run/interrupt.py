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
HELD: list | None = None  # inside held(): the signals that came, delivered on leaving


def exit_on_signals(then: str) -> dict:
    """Installs the handler of SIGNALS, whose line ends with `then` (what to do next); returns the
    handlers it replaced."""
    def interrupted(signum: int, _) -> None:
        if HELD is not None:
            HELD.append(signum)
            return
        for undo in UNDO:
            undo()
        sys.stdout.flush()  # \n: past a progress bar
        print(f"\nerror: interrupted ({signal.Signals(signum).name}); {then}", file=sys.stderr,
              flush=True)
        os._exit(1)
    return {s: signal.signal(s, interrupted) for s in SIGNALS}


@contextlib.contextmanager
def held():
    """SIGNALS acted on only on leaving, with UNDO as it is then: around a write and the
    registration of its undo, so that no signal falls between them. The handler defers them
    itself: blocking them (pthread_sigmask) holds them for the calling thread only, and once JAX
    has started its threads one of those takes the signal, whose handler then runs at once."""
    global HELD
    HELD = []
    try:
        yield
    finally:
        came, HELD = HELD, None
        if came:
            signal.raise_signal(came[0])
