"""Train a GPT:  python launch.py --config=NAME [--rundir=DIR] [--config.FIELD=VALUE ...]

The config is configs/NAME.py with typed overrides from the command line. The run directory
(default runs/NAME-TIMESTAMP, or gs://...) gets config.json, run.json (git commit, dirty tree,
command), dataset.json, metrics.jsonl, tensorboard events and checkpoints/; an existing one
resumes.
"""
import argparse
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from etils import epath

import configs
from configs import Config, RunError, UsageError, apply_overrides

ROOT = Path(__file__).resolve().parent
MULTIHOST = ("coordinator_address", "num_processes", "process_id")  # jax.distributed's arguments


def git_state() -> dict:
    """The commit and whether the tree was dirty; in a copy without .git (tpu.sh copy), from its
    .mugpt_git."""
    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        except OSError:  # no git on this machine
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain")
    if status is None and (ROOT / ".mugpt_git").exists():
        return json.loads((ROOT / ".mugpt_git").read_text())
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def open_rundir(args, cfg: Config) -> epath.Path:
    """The run directory, local or gs://, with config.json and run.json, locked for this launch.
    One that holds a run (its config.json) is resumed; if it cannot be, nothing is written."""
    import data  # not at the top: it loads jax, and a typo should not wait for that
    rundir = epath.Path(args.rundir or f"runs/{args.config}-{time.strftime('%Y%m%d-%H%M%S')}")
    launch = {"argv": sys.argv, "git": git_state(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        if (rundir / "config.json").exists():
            run = resumed(rundir, cfg, launch)
        else:
            run = {"config_name": args.config, **launch}
        rundir.mkdir(parents=True, exist_ok=True)
        lock_rundir(rundir)
        record_dataset(rundir, data.read_meta(cfg), data.data_dir(cfg))
        (rundir / "run.json").write_text(json.dumps(run, indent=1))
        config = json.dumps(dataclasses.asdict(cfg), indent=1)
        (rundir / "config.json").write_text(config)  # last: it marks a run
    except OSError as e:
        raise UsageError(f"cannot write the run directory {rundir}: {e.strerror or e}") from None
    except ImportError as e:  # epath reaches gs:// through fsspec, which needs gcsfs for it
        raise UsageError(f"{rundir}: {e} (pip install gcsfs)") from None
    print(f"run directory {rundir}")
    return rundir


def resumed(rundir: epath.Path, cfg: Config, launch: dict) -> dict:
    """The run's run.json with this launch added, if cfg differs from its config.json only in
    RESUMABLE fields (given now, or a config module's default); else a UsageError."""
    try:
        saved = dict(json.loads((rundir / "config.json").read_text()))
        if not saved:
            raise ValueError("empty")
    except (ValueError, TypeError):
        message = f"{rundir}/config.json is not a run's config; pass a new --rundir"
        raise UsageError(message) from None
    new = dataclasses.asdict(cfg)
    # a field added to Config since the run was saved is its default there (a new option, off)
    saved = {**dataclasses.asdict(Config()), **saved}
    for name, value in new.items():
        if name not in configs.RESUMABLE and saved[name] != value:
            raise UsageError(f"{rundir} holds a run with {name}={saved[name]!r}, this launch has "
                             f"{name}={value!r}: resuming may change only "
                             f"{', '.join(configs.RESUMABLE)}")
    changed = [f"{n}={v!r} (was {saved[n]!r})" for n, v in new.items() if saved.get(n, v) != v]
    if changed:
        print(f"resuming with {', '.join(changed)}")
    path = rundir / "run.json"
    run = json.loads(path.read_text()) if path.exists() else {}
    return {**run, "resumed": run.get("resumed", []) + [launch]}


_LOCKS = []  # lock_rundir's open lock files: closing one would release its lock


def lock_rundir(rundir: epath.Path) -> None:
    """One launch at a time in a run directory: a second (the same command in another terminal, a
    restart while the first runs) would interleave its steps, logs and saves with the first's. An
    flock, which the kernel drops when the process ends however it ends; none on gs://."""
    if not str(rundir).startswith("gs://"):
        _LOCKS.append(lock := open(os.path.join(rundir, ".lock"), "w"))
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{rundir} is in use: another launch.py is training there "
                             f"(wait for it, or pass another --rundir)") from None


def record_dataset(rundir: epath.Path, meta: dict, where) -> None:
    """RUNDIR/dataset.json: the dataset's meta.json as the run first trained on it. sample.py
    decodes with it whatever becomes of the dataset; a resume on a dataset prepared again (another
    vocabulary, other token counts: other text behind the same ids and offsets) is refused."""
    from checkpoint import saved_steps

    path = rundir / "dataset.json"
    try:  # compared once the run has saved a step: a launch that failed before may bring a new one
        old = json.loads(path.read_text()) if path.exists() and saved_steps(rundir) else meta
    except ValueError:  # not JSON (a hand edit, a disk error): this launch's record replaces it
        old = meta
    if old != meta and isinstance(old, dict):  # (JSON but no object: replaced too)
        key = next(k for k in sorted(old.keys() | meta.keys()) if old.get(k) != meta.get(k))
        was, now = str(old.get(key))[:30], str(meta.get(key))[:30]
        raise UsageError(f"{where} is not the dataset {rundir} trained on ({key} {was} in its "
                         f"dataset.json, {now} now): prepare it as it was, or start a new "
                         f"--rundir")
    path.write_text(json.dumps(meta, indent=1))


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
        import jax  # after parsing: a typo should not wait for jax to load

        import distributed

        if args.multihost:  # before anything else starts jax's backends
            distributed.join(*(getattr(args, f) for f in MULTIHOST))
        import checkpoint
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
            first = jax.process_index() == 0
            rundir = open_rundir(args, cfg) if first else epath.Path(args.rundir)
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
