"""Train a GPT:  python launch.py --config=NAME [--rundir=DIR] [--config.FIELD=VALUE ...]

The config is configs/NAME.py with typed overrides from the command line. The run directory
(default runs/NAME-TIMESTAMP, or gs://...) gets config.json, run.json (git commit, dirty tree,
command), dataset.json, metrics.jsonl, tensorboard events and checkpoints/; an existing one
resumes.
"""
import argparse
import os
import signal
import sys

from etils import epath

import configs
from configs import apply_overrides
from run.errors import RunError, UsageError
from run.rundir import open_rundir

MULTIHOST = ("coordinator_address", "num_processes", "process_id")  # jax.distributed's arguments
# JAX preallocates 75% of a GPU's memory; the 1.5B unrolled step needs about 58 GiB, at that cap
# on an 80 GiB H100 (BENCHMARKS.md). 0.9 leaves the rest to the CUDA context and cuDNN/cuBLAS
# workspaces outside XLA's pool. Only a GPU's allocator reads it; a value the user set wins.
GPU_MEMORY_FRACTION = "0.9"


def default_memory_fraction() -> None:
    """Before jax's GPU backend starts (it reads the variable then): bench.py calls it too."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="On TPU VMs and under SLURM, --multihost alone will do.")
    ap.add_argument("--config", required=True, help=f"one of: {', '.join(configs.available())}")
    ap.add_argument("--rundir", help="default runs/NAME-TIMESTAMP; an existing one is resumed")
    ap.add_argument("--debug", action="store_true",
                    help="profile a few steps into the run directory and stop, saving nothing")
    ap.add_argument("--multihost", action="store_true",
                    help="jax.distributed.initialize() first (TPU pods, clusters)")
    ap.add_argument("--coordinator_address", help="multi-host: host:port of process 0")
    ap.add_argument("--num_processes", type=int, help="multi-host: the number of processes")
    ap.add_argument("--process_id", type=int, help="multi-host: this process's index")
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # the training loop takes them over while it runs
        signal.signal(s, interrupted)
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = apply_overrides(configs.load(args.config), overrides)
        given = [f for f in MULTIHOST if getattr(args, f) is not None]
        if given and not args.multihost:  # else each host would train alone, in one run directory
            raise UsageError(f"--{given[0]} is for multi-host runs: add --multihost")
        if args.multihost and not args.rundir:
            raise UsageError("--multihost needs --rundir: the default's timestamp differs by host")
        default_memory_fraction()
        import jax  # after parsing: a typo should not wait for jax to load

        from run import distributed

        if args.multihost:  # before anything else starts jax's backends
            distributed.join(*(getattr(args, f) for f in MULTIHOST))
        from run import checkpoint
        import data
        import params
        import train

        if not args.debug:
            checkpoint.quiet_failed_saves()
        with distributed.fail_together():  # from here on, an error in one process stops them all
            cfg.check(jax.device_count())
            # bad data is reported before the run directory is written
            data.load_split(cfg, "train"), data.load_split(cfg, "val")
            params.check(cfg)  # an edited model.py's parameter without a policy row, say
            # Process 0 checks and writes the run directory; the others only train in it.
            rundir = (open_rundir(args.rundir, args.config, cfg) if jax.process_index() == 0
                      else epath.Path(args.rundir))
            train.train(cfg, rundir, debug=args.debug)
    except (UsageError, RunError) as e:
        sys.exit(f"error: {e}")


def interrupted(signum: int, _) -> None:
    """SIGINT (Ctrl-C) or SIGTERM outside the training loop, whose own handler saves and stops: one
    line and out at once. Not a KeyboardInterrupt, which JAX's gc callbacks can swallow (the run
    goes on) and which, cutting an XLA compilation short, makes the interpreter's exit segfault
    (jax 0.10); SIGTERM's default was a silent kill."""
    name = signal.Signals(signum).name
    print(f"\nerror: interrupted ({name}); a run directory resumes from its last checkpoint "
          f"when given again as --rundir", file=sys.stderr, flush=True)  # \n: past a progress bar
    os._exit(1)


if __name__ == "__main__":
    main()
