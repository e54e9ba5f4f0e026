"""What a checkpoint's save wrote: each file's size, and the CRC32 of the small ones (orbax's
metadata), recorded in the step's RECORD just before orbax commits the step, and checked when it
is restored (run/checkpoint.py): a file cut short or lost, or metadata altered, is damage, told
apart from a readable checkpoint of another model. And the run's own record of the steps it saved
(RUNDIR/checkpoints.json), which outlives the step directories: a lost checkpoint is then told from
one never saved.
"""
import json
import zlib

import jax
import orbax.checkpoint as ocp
from etils import epath

from run.errors import UsageError

RECORD = "written.json"  # in each checkpoint: {file: [bytes, CRC32 or None]}
# Files up to this size (orbax's metadata) are checksummed as well. A checksum reads the file back,
# which for the array data (all but a few KB of a checkpoint) would cost a read of the whole
# checkpoint at each save; their sizes catch what a partial copy or a full disk does to them.
CHECKSUMMED = 1 << 20
SAVED = "checkpoints.json"  # in the run directory: {"saved": [step, ...]}, each step once written


def files(directory: epath.Path) -> dict[str, epath.Path]:
    """{path relative to directory: path} of every file below it (rglob's "**" is refused on
    GCS)."""
    directory = epath.Path(directory)  # (train.train may be given a pathlib.Path)
    return {str((top / f).relative_to(directory)): top / f
            for top, _, names in directory.walk() for f in names}


def record_pending(directory: epath.Path) -> None:
    """Write RECORD into each step being saved: a temporary directory, or on GCS (written in
    place, marked complete by a commit file) a step directory without that file nor RECORD yet.
    A local step without its commit file is a committed one that lost it (a partial copy): its
    RECORD, the only check of its tally and metadata, is never written again from its files."""
    if jax.process_index() != 0 or not directory.exists():  # process 0 sees every process's files
        return
    in_place = str(directory).startswith("gs://")
    for step_dir in directory.iterdir():
        pending = (in_place and step_dir.name.isdigit() and not (step_dir / RECORD).exists()
                   and not (step_dir / "commit_success.txt").exists())
        if ocp.path.step.TMP_DIR_SUFFIX in step_dir.name or pending:
            record(step_dir)
            # before orbax's rename: a kill between the two leaves a step recorded but not
            # committed, which the next launch reports as lost (it was) and falls back from
            remember(directory.parent, int(step_dir.name.split(".")[0]))


def recorded_steps(rundir: epath.Path) -> list[int]:
    """The steps the run has saved, as SAVED records them ([] if it has none)."""
    path = rundir / SAVED
    try:
        saved = json.loads(path.read_text())["saved"] if path.exists() else []
        if not all(isinstance(s, int) for s in saved):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is corrupt (not {{\"saved\": [steps]}}): delete it to resume "
                         f"from the checkpoints left") from None
    return saved


def all_gone(rundir: epath.Path, directory: epath.Path) -> str | None:
    """What to say of a run whose saved steps (SAVED) are none of them left in directory; None for
    a run that saved none (the caller has found none in directory)."""
    if saved := recorded_steps(rundir):
        return f"{rundir} saved checkpoints up to step {max(saved)} ({SAVED}) and none is left in {directory}"
    return None


def remember(rundir: epath.Path, step: int) -> None:
    """Add step to SAVED, written aside and renamed into place: a kill never leaves half of it."""
    steps = sorted(set(recorded_steps(rundir)) | {step})
    tmp = rundir / (SAVED + ".tmp")
    tmp.write_text(json.dumps({"saved": steps}))
    tmp.replace(rundir / SAVED)


def record(step_dir: epath.Path) -> None:
    """RECORD of the items' files (orbax adds the commit time to the step's own metadata file
    after this)."""
    written = {}
    for name, path in sorted(files(step_dir).items()):
        if "/" in name:
            size = path.stat().length
            written[name] = [size, zlib.crc32(path.read_bytes()) if size <= CHECKSUMMED else None]
    (step_dir / RECORD).write_text(json.dumps(written))


def damage(step_dir: epath.Path) -> str | None:
    """The first of the checkpoint's files that differs from its RECORD; None if none does. A
    checkpoint without RECORD is damaged too: the file lost, or a copy that left it behind. So is
    one whose orbax metadata orbax cannot read (step_metadata_damage)."""
    if problem := step_metadata_damage(step_dir):
        return problem
    if not (step_dir / RECORD).exists():
        return f"its {RECORD} is missing"
    try:
        written = json.loads((step_dir / RECORD).read_text())
    except ValueError:
        return f"its {RECORD} is unreadable"
    shape_ok = lambda v: (isinstance(v, list) and len(v) == 2  # noqa: E731  [size, crc or null]
                          and all(isinstance(x, int) or x is None for x in v) and v[0] is not None)
    if not isinstance(written, dict) or not all(map(shape_ok, written.values())):
        return f"its {RECORD} is unreadable (not {{file: [size, CRC32]}})"
    if not written:  # every save writes files: a record of none is not a save's
        return f"its {RECORD} lists no files"
    have = files(step_dir)
    for name, (size, crc) in written.items():
        if name not in have:
            return f"{name} is missing"
        if (length := have[name].stat().length) != size:
            return f"{name} has {length} bytes, {size} were written"
        if crc is not None and zlib.crc32(have[name].read_bytes()) != crc:
            return f"{name} differs from what was written (CRC32)"
    return None


def step_metadata_damage(step_dir: epath.Path) -> str | None:
    """What is wrong with orbax's metadata of the step (_CHECKPOINT_METADATA: its handlers, its
    commit time), which orbax writes after RECORD, so RECORD cannot check it; None if orbax reads
    it (or it is absent: orbax then takes the directory's time). One that is JSON of another shape
    ([], a number for a handler) stopped every manager that listed the step."""
    try:
        ocp.path.step.Metadata(step=0, path=epath.Path(step_dir)).commit_timestamp
    except Exception as e:  # whatever orbax's parser raises for the JSON it was given
        first = (str(e) or type(e).__name__).splitlines()[0][:80]
        return f"its _CHECKPOINT_METADATA is not orbax's metadata of a step ({first})"
    return None
