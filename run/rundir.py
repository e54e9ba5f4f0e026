"""The run directory that launch.py opens (local, or gs://): config.json (the resolved config;
it marks a run), run.json (the git commit, whether the tree was dirty, the command, each resume),
dataset.json, and a lock held while a launch trains there. One that holds a run is resumed."""
import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from etils import epath

import configs
from configs import Config
from run.errors import UsageError

ROOT = Path(__file__).resolve().parent


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


def open_rundir(path: str | None, config_name: str, cfg: Config) -> epath.Path:
    """The run directory (default runs/CONFIG_NAME-TIMESTAMP) with config.json and run.json, locked
    for this launch. One that holds a run is resumed; if it cannot be, nothing is written."""
    import data  # not at the top: it loads numpy, and a typo should not wait for that
    rundir = epath.Path(path or f"runs/{config_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    launch = {"argv": sys.argv, "git": git_state(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        if (rundir / "config.json").exists():
            run = resumed(rundir, cfg, launch)
        else:
            run = {"config_name": config_name, **launch}
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
    import optimizers  # not at the top: launch.py reads this module before jax loads
    ckpts = rundir / "checkpoints"
    steps = [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()] if ckpts.exists() else []
    old = dataclasses.replace(cfg, **{n: saved[n] for n in configs.RESUMABLE})
    optimizers.check_extension(old, cfg, max(steps, default=0))
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
    from run.checkpoint import saved_steps

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

