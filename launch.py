"""Train a GPT:  python launch.py --config=NAME [--rundir=DIR] [--debug] [--multihost] [--config.FIELD=VALUE ...]

The config is configs/NAME.py with typed overrides from the command line. The run directory (default
runs/NAME-TIMESTAMP, or gs://...) gets config.json, run.json (git commit, dirty tree, command), dataset.json,
metrics.jsonl, tensorboard events, checkpoints/ (--debug: a profile of a few steps instead); an existing one resumes.
"""
import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from etils import epath

import configs
from configs import Config, RunError, UsageError, apply_overrides

ROOT = Path(__file__).resolve().parent


def git_state() -> dict:
    """The commit and whether the tree was dirty; in a copy without .git (tpu.sh copy), from its .mugpt_git."""
    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        except OSError:  # no git on this machine
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain")
    if status is None and (ROOT / ".mugpt_git").exists():
        return json.loads((ROOT / ".mugpt_git").read_text())
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def open_rundir(args, cfg: Config) -> epath.Path:
    """The run directory, local or gs://, with config.json and run.json. One that holds a run already (its
    config.json) is resumed if cfg differs from its config only in RESUMABLE fields; else nothing is written."""
    import checkpoint, data  # not at the top: checkpoint loads jax, and a typo should not wait for that
    rundir = epath.Path(args.rundir or f"runs/{args.config}-{time.strftime('%Y%m%d-%H%M%S')}")
    launch = {"argv": sys.argv, "git": git_state(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        run = {"config_name": args.config, **launch}
        if (rundir / "config.json").exists():
            try:
                saved = dict(json.loads((rundir / "config.json").read_text()))
            except (ValueError, TypeError):
                raise UsageError(f"{rundir}/config.json is not a run's config; pass a new --rundir") from None
            for name, new in dataclasses.asdict(cfg).items():
                if name not in configs.RESUMABLE and (name not in saved or saved[name] != new):
                    was = f"{name}={saved[name]!r}" if name in saved else f"no {name}"
                    raise UsageError(f"{rundir} holds a run with {was}, this launch has {name}={new!r}: "
                                     f"resuming may change only {', '.join(configs.RESUMABLE)}")
            checkpoint.check_resume(rundir, cfg)  # a resume that cannot go on changes nothing here
            if changed := [f"{n}={v!r} (was {saved[n]!r})" for n, v in dataclasses.asdict(cfg).items() if saved.get(n, v) != v]:
                print(f"resuming with {', '.join(changed)}")  # RESUMABLE fields, given now or a config module's default
            run = json.loads((rundir / "run.json").read_text()) if (rundir / "run.json").exists() else {}
            run["resumed"] = run.get("resumed", []) + [launch]
        rundir.mkdir(parents=True, exist_ok=True)
        checkpoint.lock_rundir(rundir)
        checkpoint.record_dataset(rundir, data.read_meta(cfg), data.data_dir(cfg))  # for sample.py; resumes compare
        (rundir / "run.json").write_text(json.dumps(run, indent=1))
        (rundir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))  # last: it marks a run
    except OSError as e:
        raise UsageError(f"cannot write the run directory {rundir}: {e.strerror or e}") from None
    except ImportError as e:  # epath reaches gs:// through fsspec, which needs gcsfs for it
        raise UsageError(f"{rundir}: {e} (pip install gcsfs)") from None
    print(f"run directory {rundir}")
    return rundir


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help=f"one of: {', '.join(configs.available())}")
    ap.add_argument("--rundir", help="run directory (default runs/NAME-TIMESTAMP); an existing one is resumed")
    ap.add_argument("--debug", action="store_true", help="profile a few steps into the run directory, then stop; save no checkpoints")
    ap.add_argument("--multihost", action="store_true", help="jax.distributed.initialize() first (TPU pods, clusters)")
    ap.add_argument("--coordinator_address", help="multi-host: host:port of process 0 (not needed on TPU VMs)")
    ap.add_argument("--num_processes", type=int, help="multi-host: number of processes (not needed on TPU VMs)")
    ap.add_argument("--process_id", type=int, help="multi-host: this process's index (not needed on TPU VMs)")
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # the loop (checkpoint.stop_signals) takes them over while it trains
        signal.signal(s, interrupted)
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = apply_overrides(configs.load(args.config), overrides)
        import jax  # after parsing: a typo should not wait for jax to load

        cfg.split_cpu()
        given = [f for f in ("coordinator_address", "num_processes", "process_id") if getattr(args, f) is not None]
        if given and not args.multihost:  # else each host would train alone, all in one run directory
            raise UsageError(f"--{given[0]} is for multi-host runs: add --multihost")
        if args.multihost:
            if not args.rundir:
                raise UsageError("--multihost needs --rundir: the default name's timestamp differs between hosts")
            if args.coordinator_address and not re.fullmatch(r"\S+:\d+", args.coordinator_address):
                raise UsageError(f"--coordinator_address={args.coordinator_address}: expected HOST:PORT")
            try:
                jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
            except ValueError as e:  # a missing or out-of-range flag, off a TPU VM or SLURM (which supply them)
                raise UsageError(f"--multihost: {e} (off a TPU VM or SLURM: --coordinator_address, --num_processes, "
                                 f"--process_id)") from None
        import checkpoint
        import data
        import train

        if not args.debug:
            checkpoint.quiet_failed_saves()
        with checkpoint.fail_together():  # from here on, an error in one process stops all of them
            cfg.check(jax.device_count())
            data.load_split(cfg, "train"), data.load_split(cfg, "val")  # bad data is reported before the run directory
            # Process 0 checks and writes the run directory; the others only train in it.
            rundir = open_rundir(args, cfg) if jax.process_index() == 0 else epath.Path(args.rundir)
            train.train(cfg, rundir, debug=args.debug)
    except (UsageError, RunError) as e:
        sys.exit(f"error: {e}")


def interrupted(signum: int, _) -> None:
    """SIGINT (Ctrl-C) or SIGTERM outside the training loop, whose own handler saves and stops: one line and out at
    once. Not a KeyboardInterrupt, which JAX's gc callbacks can swallow (the run goes on) and which, cutting an XLA
    compilation short, makes the interpreter's exit segfault (jax 0.10); SIGTERM's default was a silent kill."""
    print(f"\nerror: interrupted ({signal.Signals(signum).name}); a run directory resumes from its last checkpoint "
          f"when given again as --rundir", file=sys.stderr, flush=True)  # \n: past a progress bar's line
    os._exit(1)


if __name__ == "__main__":
    main()
