"""The run directory that launch.py opens (local, or gs://): config.json (the resolved config;
it marks a run), run.json (the git commit, whether the tree was dirty, the command, each resume),
dataset.json, and a lock held while a launch trains there. One that holds a run is resumed."""
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from etils import epath

import configs
from configs import Config
from run.errors import UsageError

# the files that define what a run computes: its forward (what sample.py, eval.py and export.py
# run on a checkpoint), then its training and the batches it reads; run.json records a hash of
# each at every launch
FORWARD = ("model.py", "layers/positions.py", "layers/mudd.py", "configs/__init__.py")
TRAINING = (*FORWARD, "params.py", "train.py", "optimizers.py", "data.py")


def top() -> Path:
    """The top of the repo, or of tpu.sh's copy of it: this file's folder's parent."""
    return Path(__file__).resolve().parents[1]


def code_state() -> dict[str, str]:
    """A short hash of each of TRAINING's files as they are now."""
    return {f: hashlib.sha256((top() / f).read_bytes()).hexdigest()[:12] for f in TRAINING}


def launches(run: dict) -> list:
    """run.json's launches: the first (run.json itself), then each resume's; a hand-edited
    "resumed" that is not a list is kept, as one more entry."""
    resumes = run.get("resumed", [])
    return [run, *(resumes if isinstance(resumes, list) else [resumes])]


def code_changes(run: dict, files: tuple[str, ...] = TRAINING) -> str | None:
    """Which of `files` differ now from the hashes run.json records of the run's last launch, as
    the start of a line; None where none does, or that launch recorded none (before they were)."""
    last = launches(run)[-1]
    code, git = (last.get("code"), last.get("git")) if isinstance(last, dict) else (None, None)
    now = code_state()
    changed = [f for f in files if code.get(f, now[f]) != now[f]] if isinstance(code, dict) else []
    if not changed:
        return None
    commit = git.get("commit") if isinstance(git, dict) else None
    return (f"{', '.join(changed)} changed since this run's last launch (at commit "
            f"{commit[:7] if isinstance(commit, str) else 'unknown'})")


def git_state() -> dict:
    """The commit and whether the tree was dirty; in a copy without .git (tpu.sh copy), from its
    .mugpt_git, at the top of the copy."""
    root = top()

    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError:  # no git on this machine
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain")
    if status is None and (root / ".mugpt_git").exists():
        return json.loads((root / ".mugpt_git").read_text())
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def saved_config(rundir: epath.Path) -> dict:
    """The run's config.json, checked: a JSON object of the fields this code knows (a field added
    to Config since is its default). launch.py, sample.py, eval.py and export.py read it so."""
    path = rundir / "config.json"
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:  # cut short, not UTF-8
        raise UsageError(f"{path} is not JSON ({str(e)[:60]}): not a run's config; restore it "
                         f"or pass a new --rundir") from None
    if not isinstance(saved, dict) or not saved:
        raise UsageError(f"{path} is not a run's config (a JSON object of its fields, here "
                         f"{str(saved)[:20]}); restore it or pass a new --rundir")
    if unknown := sorted(set(saved) - set(Config.__dataclass_fields__)):
        raise UsageError(f"{path} has fields this code does not know ({', '.join(unknown)}): "
                         "a run of another version of mugpt")
    full = {**dataclasses.asdict(Config()), **saved}
    try:
        cfg = Config(**full)  # each field's type
        # and its values, as far as they do not depend on the devices (a hand-edited n_head=0
        # would stop sample.py deep inside the model): on mesh_replica devices a run that ran
        # on a multiple of them passes
        cfg.check(max(cfg.mesh_replica, 1))
    except UsageError as e:
        raise UsageError(f"{path}: {e}; restore it or pass a new --rundir") from None
    return full


def resume_config(path: str, overrides: list[str]) -> tuple[str, Config]:
    """(config name, config) of `python launch.py --rundir=R` with no --config: R's config.json,
    with the overrides given, each of a field a resumed run may change."""
    rundir = epath.Path(path or "")
    if not path or not (rundir / "config.json").exists():
        where = f": {rundir} holds no run to resume (no config.json)" if path else ""
        raise UsageError(f"--config is needed{where}; one of: {', '.join(configs.available())}")
    # a flag misspelled (--max_steps=, --config.max_step=) is named as such, not "cannot change"
    fixed = sorted({configs.override_field(o) for o in overrides} - set(configs.RESUMABLE))
    if fixed:
        raise UsageError(f"{rundir} resumes as its config.json says: {', '.join(fixed)} cannot "
                         f"change (resuming may change only {', '.join(configs.RESUMABLE)})")
    run = read_json(rundir / "run.json")
    return run.get("config_name", ""), configs.apply_overrides(Config(**saved_config(rundir)),
                                                                 overrides)


def read_json(path: epath.Path) -> dict:
    """A run's JSON record (run.json, dataset.json): {} if absent; a corrupt one is one line."""
    if not path.exists():
        return {}
    try:
        out = json.loads(path.read_text())
    except ValueError as e:
        out, why = None, f"not JSON ({str(e)[:60]})"
    if not isinstance(out, dict):
        raise UsageError(f"{path} is {why if out is None else 'not a JSON object'}: restore it, "
                         f"or delete it (a new one is written)")
    return out


def open_rundir(path: str | None, config_name: str, cfg: Config, restart: bool = False,
                saves: bool = True) -> tuple[epath.Path, Callable[[], None]]:
    """The run directory (default runs/CONFIG_NAME-TIMESTAMP) with config.json and run.json, locked
    for this launch, and a function that puts the folder back as it was (train.py may still refuse
    the run, or fail before its first step: launch.py calls it then). One that holds a run is
    resumed; if it cannot be, nothing is written. restart: a run whose checkpoints are all lost
    trains from step 0, its logs and record of checkpoints kept aside. saves False (--debug):
    checked as a launch is, but only the lock is written, and no room is needed for a checkpoint."""
    import data  # not at the top: it loads numpy, and a typo should not wait for that
    rundir = epath.Path(path or f"runs/{config_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    launch = {"argv": sys.argv, "git": git_state(), "code": code_state(),
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    # and metrics.jsonl, which the Logger trims to the checkpoint resumed from before the first step
    names = ("run.json", "dataset.json", "config.json", "metrics.jsonl")
    try:
        if (rundir / "config.json").exists():
            run = resumed(rundir, cfg, launch)
        else:
            check_no_orphans(rundir)
            run = {"config_name": config_name, **launch}
        meta = data.read_meta(cfg)
        check_dataset(rundir, meta, data.data_dir(cfg))
        if saves:
            check_space(rundir, cfg)
        before = {n: (rundir / n).read_bytes() for n in names if (rundir / n).exists()}
        existed = rundir.exists()
        entries = {p.name for p in rundir.iterdir()} if existed else set()
        rundir.mkdir(parents=True, exist_ok=True)
        lock_rundir(rundir)
        # --debug's few steps are a profile, no part of the run: its files stay as they were (a
        # new folder's config.json would fix the config of the run trained there next)
        renamed = set_aside(rundir) if restart and saves else []
        if saves:
            (rundir / "dataset.json").write_text(json.dumps(meta, indent=1))
            (rundir / "run.json").write_text(json.dumps(run, indent=1))
            config = json.dumps(dataclasses.asdict(cfg), indent=1)
            (rundir / "config.json").write_text(config)  # last: it marks a run
    except OSError as e:
        raise UsageError(f"cannot write the run directory {rundir}: {e.strerror or e}") from None
    except ImportError as e:  # epath reaches gs:// through fsspec, which needs gcsfs for it
        raise UsageError(f"{rundir}: {e} (pip install gcsfs)") from None
    print(f"run directory {rundir}")
    if cfg.max_steps < cfg.warmup_steps:
        print(f"warning: max_steps={cfg.max_steps} ends before warmup_steps={cfg.warmup_steps} "
              f"does: the learning rate never reaches learning_rate={cfg.learning_rate}",
              file=sys.stderr, flush=True)

    def undo():
        for aside, name in renamed:  # --restart's, back
            (rundir / aside).rename(rundir / name)
        for name, old in before.items():
            (rundir / name).write_bytes(old)
        # what this launch added (the lock, the step-0 evaluation's logs, an empty checkpoints/):
        # a launch that failed before its first step (model.py's edit, say) leaves no trace
        for path in rundir.iterdir():
            if path.name not in entries:
                path.rmtree() if path.is_dir() else path.unlink()
        if not existed:
            rundir.rmdir()
    return rundir, undo


def check_space(rundir: epath.Path, cfg: Config) -> None:
    """Room for the next checkpoint before anything is written: the size of the last one, or for a
    run without one its parameters and Adam's two moments, uncompressed (orbax compresses)."""
    from run import checkpoint, written

    written.recorded_steps(rundir)  # a corrupt record is refused here, before anything is written
    if str(rundir).startswith("gs://"):
        return
    steps = checkpoint.saved_steps(rundir)
    last = rundir / "checkpoints" / str(steps[-1]) if steps else None
    needed = (sum(p.stat().length for p in written.files(last).values()) if last
              else checkpoint.first_checkpoint_bytes(cfg))
    where = next(p for p in (rundir, *rundir.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < needed:
        raise UsageError(f"no space for a checkpoint in {rundir}: one needs {needed:,} bytes, "
                         f"{free:,} are free: free some, or pass another --rundir")


def check_writable(flag: str, path: str) -> None:
    """A folder a command writes after minutes of work (bench.py's --checkpoint and --rundir),
    checked first: the nearest part of its path that exists must be a folder this user can write
    in (a file there was a NotADirectoryError traceback at the end)."""
    where = Path(path).absolute()
    while not where.exists():
        where = where.parent
    if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}={path}: {where} is not a folder this user can write in; name "
                         f"another {flag}")


def check_no_orphans(rundir: epath.Path) -> None:
    """A folder without config.json but with a run's checkpoints is a run that lost its record:
    taken as a new run, its checkpoints would be resumed under whatever config is given now. One
    with a run's other files (a run's, or files of that name from elsewhere) would have them
    replaced."""
    from run import checkpoint, written

    if checkpoint.saved_steps(rundir) or (rundir / written.SAVED).exists():
        raise UsageError(f"{rundir} holds a run's checkpoints but no config.json: restore its "
                         f"config.json (the run's settings), or pass another --rundir")
    if held := [n for n in ("run.json", "dataset.json", "metrics.jsonl") if (rundir / n).exists()]:
        raise UsageError(f"{rundir} holds {', '.join(held)} but no config.json: a new run would "
                         f"replace them; restore its config.json (the run's settings), or pass "
                         f"another --rundir")


def set_aside(rundir: epath.Path) -> list[tuple[str, str]]:
    """--restart: the run's metrics.jsonl and its record of checkpoints renamed NAME.before-STAMP,
    said in one line; only where no checkpoint is left to resume from. Returns (new name, name)
    of each, for a refused launch to put back."""
    from run import checkpoint, written

    if steps := checkpoint.saved_steps(rundir):
        raise UsageError(f"--restart: {rundir} has checkpoints (steps "
                         f"{', '.join(map(str, steps))}); without --restart it resumes from them")
    stamp, renamed = time.strftime("%Y%m%d-%H%M%S"), []
    for name in ("metrics.jsonl", written.SAVED):
        if (rundir / name).exists():
            (rundir / name).rename(rundir / f"{name}.before-{stamp}")
            renamed.append((f"{name}.before-{stamp}", name))
            print(f"--restart: {rundir / name} kept as {name}.before-{stamp}")
    return renamed


def resumed(rundir: epath.Path, cfg: Config, launch: dict) -> dict:
    """The run's run.json with this launch added, if cfg differs from its config.json only in
    RESUMABLE fields (given now, or a config module's default); else a UsageError naming each
    field that differs."""
    saved, new = saved_config(rundir), dataclasses.asdict(cfg)
    differ = [f"{n}={saved[n]!r} there, {v!r} here" for n, v in new.items()
              if n not in configs.RESUMABLE and saved[n] != v]
    if differ:
        raise UsageError(f"{rundir} holds a run with {'; '.join(differ)}: resuming may change "
                         f"only {', '.join(configs.RESUMABLE)} (or pass --rundir alone)")
    import optimizers  # not at the top: launch.py reads this module before jax loads
    from run import checkpoint

    old = dataclasses.replace(cfg, **{n: saved[n] for n in configs.RESUMABLE})
    newest = max(checkpoint.saved_steps(rundir), default=0)
    if newest > cfg.max_steps:  # config.json would say fewer steps than the model has had
        raise UsageError(f"the checkpoint of {rundir} is at step {newest}, past max_steps="
                         f"{cfg.max_steps}: pass --config.max_steps={newest} or more (a run does "
                         "not train backwards; an earlier checkpoint: export.py --step=N)")
    optimizers.check_extension(old, cfg, newest)
    changed = [f"{n}={v!r} (was {saved[n]!r})" for n, v in new.items() if saved[n] != v]
    if changed:
        print(f"resuming with {', '.join(changed)}")
    run = read_json(rundir / "run.json")
    if changes := code_changes(run):  # an edit meant for this run, or not: said, not refused
        print(f"note: {changes}: the run goes on with the code as it is now")
    return {**run, "resumed": launches(run)[1:] + [launch]}


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


def check_dataset(rundir: epath.Path, meta: dict, where) -> None:
    """RUNDIR/dataset.json is the dataset's meta.json as the run first trained on it (open_rundir
    writes it). sample.py decodes with it whatever becomes of the dataset; a resume on a dataset
    prepared again (another vocabulary, other token counts: other text behind the same ids and
    offsets) is refused."""
    from run.checkpoint import saved_steps

    path = rundir / "dataset.json"
    # compared once the run has saved a step: a launch that failed before may bring a new one
    old = read_json(path) if saved_steps(rundir) else meta
    if not old and path.exists():  # emptied ({}): the check would pass whatever the dataset
        raise UsageError(f"{path} is empty, not the record of the dataset {rundir} trained on: "
                         f"restore it, or delete it (a new one is written)")
    if old and old != meta:
        key = next(k for k in sorted(old.keys() | meta.keys()) if old.get(k) != meta.get(k))
        was, now = str(old.get(key))[:30], str(meta.get(key))[:30]
        raise UsageError(f"{where} is not the dataset {rundir} trained on ({key} {was} in its "
                         f"dataset.json, {now} now): prepare it as it was, or start a new "
                         f"--rundir")

