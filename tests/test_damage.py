"""Damage rather than interruption: checkpoints cut short, lost or altered, a full disk, and a run
directory read by someone else. Real orbax, real launches, a real (tmpfs) filesystem."""
import fcntl
import itertools
import json
import os
import re
import shutil
import subprocess

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import train
from run.checkpoint import checkpoint_manager, resume, save_checkpoint, say_dropped
from run.errors import UsageError
from conftest import tiny
from run.metrics import Logger
from test_checkpoint import (STEPS, assert_one_line_error, committed_steps, final_state,
                             launch_args, records, run, tiny_config)
from run.written import damage, record, record_pending


@pytest.fixture(scope="module")
def straight(shakespeare, tmp_path_factory, env):
    """STEPS steps without interruption, checkpoints at STEPS/2 and STEPS: (its run directory, to
    be copied and damaged, its metrics.jsonl, tensorboard's scalars and the final state)."""
    rundir = tmp_path_factory.mktemp("straight") / "run"
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}"), env)
    assert r.returncode == 0, r.stderr
    assert committed_steps(rundir) == [STEPS // 2, STEPS]
    state = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    return rundir, records(rundir), tensorboard_scalars(rundir), state


def tensorboard_scalars(rundir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as tensorboard's server reads the run: its plugin accumulator,
    which drops what a START session log says came after the checkpoint a launch resumed from."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(rundir))
    acc.Reload()
    return {tag: [(e.step, float(e.tensor_proto.float_val[0])) for e in acc.Tensors(tag)]
            for tag in ("loss/batch", "loss/val", "loss/train")}


def largest(directory) -> list:
    """The checkpoint's array data files (orbax's OCDBT), largest first."""
    data = (directory / "state").glob("ocdbt.process_*/d/*")
    return sorted(data, key=lambda p: -p.stat().st_size)


def truncate(ckpt):
    path = largest(ckpt)[0]
    os.truncate(path, 1000)
    return f"{path.relative_to(ckpt)} has 1000 bytes, "


def delete(ckpt):
    path = largest(ckpt)[1]
    path.unlink()
    return f"{path.relative_to(ckpt)} is missing"


def alter_metadata(ckpt):
    """Ten bytes of the tree metadata overwritten, its size kept: orbax then reads a tree that
    lacks arrays, and without the checksum this read as a checkpoint of another model."""
    path = ckpt / "state" / "_METADATA"
    data = bytearray(path.read_bytes())
    data[100:110] = b"#" * 10
    path.write_bytes(bytes(data))
    return "state/_METADATA differs from what was written (CRC32)"


def flip(ckpt, finite: bool) -> str:
    """Bytes inverted in the middle of the largest array data file, where they decompress to other
    numbers, finite or not as asked, the record of the files then written again: as damage that
    record cannot see (a file over its checksummed size, bytes changed before it was written).
    zstd keeps no checksum of its own. Where the arrays lie in orbax's files varies from save to
    save, so the place is found by reading (orbax alone, no check of ours)."""
    path = largest(ckpt)[0]
    data = path.read_bytes()
    for where, n in itertools.product((0.5, 0.3, 0.7, 0.4, 0.6, 0.2, 0.8), (64, 16, 4)):
        i = int(where * len(data))
        path.write_bytes(data[:i] + bytes(b ^ 0xFF for b in data[i:i + n]) + data[i + n:])
        try:
            arrays = jax.tree.leaves(ocp.StandardCheckpointer().restore(ckpt / "state"))
        except Exception:  # zstd found the damage: not the case asked for
            continue
        if all(np.isfinite(np.asarray(x)).all() for x in arrays) == finite:
            record(epath.Path(ckpt))
            return "differs from the checksum its save recorded" if finite else "is not finite"
    raise AssertionError("no place found to damage")


def flip_reads_finite(ckpt):
    return flip(ckpt, finite=True)


def flip_reads_nonfinite(ckpt):
    return flip(ckpt, finite=False)


def delete_record(ckpt):
    """Without its record a checkpoint is damaged (not a checkpoint the check skips)."""
    (ckpt / "written.json").unlink()
    return "its written.json is missing"


def malformed_record(ckpt):
    """A record that is JSON but not {file: [size, CRC32]}: damaged, not a traceback."""
    (ckpt / "written.json").write_text("null")
    return "its written.json is unreadable (not {file: [size, CRC32]})"


def empty_record(ckpt):
    """A record of no files is no save's (it read as intact, and the missing arrays then blamed
    model.py, stopping the resume instead of falling back)."""
    (ckpt / "written.json").write_text("{}")
    return "its written.json lists no files"


def malformed_step_metadata(ckpt):
    """orbax's own metadata of the step (handlers, commit time: not in the record, orbax writes it
    after), JSON of another shape: the manager read it for every step when it started, and stopped
    every resume with one line and no fallback."""
    (ckpt / "_CHECKPOINT_METADATA").write_text("[]")
    return "its _CHECKPOINT_METADATA is not orbax's metadata of a step"


def an_older_step(ckpt):
    """The step before's checkpoint, whole, under this step's name (a backup copied back to the
    wrong place): every file as written, but resumed as this step its batches and LR (the
    optimizer's count) would be another step's."""
    shutil.rmtree(ckpt)
    shutil.copytree(ckpt.parent / str(STEPS // 2), ckpt)
    return f"it holds the checkpoint of step {STEPS // 2} (copied under another name)"


@pytest.mark.parametrize("damage_it", [truncate, delete, alter_metadata, flip_reads_finite,
                                       flip_reads_nonfinite, delete_record, malformed_record, empty_record,
                                       malformed_step_metadata, an_older_step])
def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_intact_one(
        straight, tmp_path, env, damage_it):
    """The straight run's directory with its last checkpoint damaged, and the same command again:
    one line names the step and the file, the checkpoint is kept as STEP.damaged, and the run
    trains again from the one before to the end: metrics.jsonl, tensorboard's scalars (each step
    once) and the final state are the straight run's."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    expected = damage_it(rundir / "checkpoints" / str(STEPS))
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}"), env)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: the checkpoint of step {STEPS} is damaged: "
                        f"{warnings[0].split(': ', 2)[-1]}",
                        f"warning: resuming from the newest intact checkpoint, step {STEPS // 2}"]
    assert expected in warnings[0] and warnings[0].endswith(f"; renamed {STEPS}.damaged")
    assert_resumed_as_straight(r, rundir, straight)
    assert (rundir / "checkpoints" / f"{STEPS}.damaged" / "state").is_dir()
    assert damage(epath.Path(rundir / "checkpoints" / str(STEPS))) is None  # saved again, whole


def test_debug_names_a_damaged_checkpoint_and_leaves_it_where_it_is(straight, tmp_path, env):
    """--debug's look at a run changes none of its files: a damaged newest checkpoint is named in
    the same line, its steps are profiled from the one before, and it keeps its name (it was
    renamed STEP.damaged, which the next run then saved again over)."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    expected = truncate(rundir / "checkpoints" / str(STEPS))
    r = run(launch_args(rundir, "--debug", f"--config.max_steps={STEPS}"), env)
    assert r.returncode == 0, r.stderr
    assert f"warning: the checkpoint of step {STEPS} is damaged: " in r.stderr
    assert expected in r.stderr and "left as it is (--debug renames nothing)" in r.stderr
    assert f"resuming from the checkpoint of step {STEPS // 2}" in r.stdout
    assert sorted(p.name for p in (rundir / "checkpoints").iterdir()) == \
        sorted(p.name for p in (straight[0] / "checkpoints").iterdir())
    assert damage(epath.Path(rundir / "checkpoints" / str(STEPS))) is not None


def assert_resumed_as_straight(r, rundir, straight, start=STEPS // 2):
    """Resumed at `start`, saying which metrics lines it drops, and ended as the straight run."""
    assert f"resuming from the checkpoint of step {start}" in r.stdout
    dropped = sum(line["step"] > start for line in straight[1])
    assert f"note: metrics.jsonl: {dropped} line(s) after step {start} (or unreadable) are " \
           f"dropped" in r.stderr
    assert committed_steps(rundir) == [STEPS // 2, STEPS]
    assert records(rundir) == straight[1]
    assert tensorboard_scalars(rundir) == straight[2]
    final = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    for a, b in zip(final, straight[3], strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_lost_newest_checkpoint_is_named_and_the_run_resumes_from_the_one_before(
        straight, tmp_path, env):
    """The newest step directory deleted: the run's checkpoints.json names it, and the run goes
    on from the one before, as the straight run."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    shutil.rmtree(rundir / "checkpoints" / str(STEPS))
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}"), env)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: the checkpoint of step {STEPS} is missing from "
                        f"{rundir / 'checkpoints'} (the run saved it, checkpoints.json says)",
                        f"warning: resuming from the newest intact checkpoint, step {STEPS // 2}"]
    assert_resumed_as_straight(r, rundir, straight)


def unchanged(rundir) -> dict:
    return {n: (rundir / n).read_bytes() for n in ("config.json", "run.json", "metrics.jsonl",
                                                   "dataset.json")}


def test_all_checkpoints_lost_is_refused_in_one_line_and_restart_trains_again(
        straight, tmp_path, env):
    """checkpoints/ deleted: the launch refuses (with another max_steps, which config.json would
    otherwise keep) and writes nothing; with --restart it trains from step 0, keeping the old
    metrics.jsonl aside and saying so, and ends as the straight run."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    shutil.rmtree(rundir / "checkpoints")
    before = unchanged(rundir)
    r = run(launch_args(rundir, f"--config.max_steps={2 * STEPS}"), env)
    assert_one_line_error(r, f"{rundir} saved checkpoints up to step {STEPS} (checkpoints.json) "
                             f"and none is left in {rundir / 'checkpoints'}: copy them back, or "
                             f"pass --restart")
    assert "warning" not in r.stderr  # the one line says it all
    assert unchanged(rundir) == before
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}", "--restart"), env)
    assert r.returncode == 0, r.stderr
    kept = [p.name for p in rundir.iterdir() if p.name.startswith("metrics.jsonl.before-")]
    assert len(kept) == 1 and f"--restart: {rundir / 'metrics.jsonl'} kept as {kept[0]}" in r.stdout
    assert (rundir / kept[0]).read_bytes() == before["metrics.jsonl"]
    assert records(rundir) == straight[1]
    final = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    for a, b in zip(final, straight[3], strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_intact_checkpoint_is_one_line_and_keeps_them(straight, tmp_path, env):
    """Every checkpoint damaged: one line and exit 1, both kept, the logs, config.json and run.json
    untouched; the next launch says the same rather than train from step 0 over the run's logs."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    truncate(rundir / "checkpoints" / str(STEPS))
    flip_reads_finite(rundir / "checkpoints" / str(STEPS // 2))  # found by the restore's check
    before = unchanged(rundir)
    for _ in range(2):  # (another max_steps: config.json would keep it)
        r = run(launch_args(rundir, f"--config.max_steps={2 * STEPS}"), env)
        assert_one_line_error(r, f"no intact checkpoint in {rundir / 'checkpoints'}, only damaged "
                                 f"ones ({STEPS}.damaged, {STEPS // 2}.damaged): copy them back")
    assert sorted(p.name for p in (rundir / "checkpoints").iterdir()) == [
        f"{STEPS}.damaged", f"{STEPS // 2}.damaged"]
    assert unchanged(rundir) == before
    # --restart there is refused too (damaged ones may be copied back): its logs are not set aside
    r = run(launch_args(rundir, f"--config.max_steps={2 * STEPS}", "--restart"), env)
    assert_one_line_error(r, f"no intact checkpoint in {rundir / 'checkpoints'}, only damaged")
    assert unchanged(rundir) == before and not list(rundir.glob("*.before-*"))


def test_a_launch_refused_before_its_first_step_leaves_the_run_as_it_was(straight, tmp_path, env):
    """A resume whose task file is missing stops before it trains: config.json and run.json are as
    they were (the next plain resume would otherwise fail the same way). A run that lost its
    config.json is refused, not taken for a new run that resumes its checkpoints under new
    settings."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    before = unchanged(rundir)
    r = run(["launch.py", f"--rundir={rundir}", f"--config.max_steps={2 * STEPS}",
             "--config.eval_tasks=nosuchtask", f"--config.eval_tasks_interval={STEPS}",
             f"--config.eval_interval={STEPS}"], env)
    assert_one_line_error(r, "task 'nosuchtask' is neither a file nor one of")
    assert unchanged(rundir) == before
    r = run(["launch.py", f"--rundir={rundir}", f"--config.max_steps={STEPS - 1}"], env)
    assert_one_line_error(r, f"the checkpoint of {rundir} is at step {STEPS}, past max_steps="
                             f"{STEPS - 1}: pass --config.max_steps={STEPS} or more")
    assert unchanged(rundir) == before
    (rundir / "config.json").unlink()
    r = run(launch_args(rundir, f"--config.max_steps={2 * STEPS}"), env)
    assert_one_line_error(r, f"{rundir} holds a run's checkpoints but no config.json: restore")
    assert not (rundir / "config.json").exists() and (rundir / "run.json").read_bytes() == before["run.json"]


def test_a_save_never_records_an_older_checkpoint_again(straight, tmp_path):
    """A committed step that lost its commit file (a partial copy) and whose tally was altered:
    the record its save wrote still tells, after orbax's hook of the next save ran (it rewrote the
    record from the files as they were, and the altered tally was then restored without a word)."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    ckpt = epath.Path(rundir / "checkpoints" / str(STEPS // 2))
    tally = ckpt / "tally" / "metadata"
    tally.write_text(tally.read_text().replace('"skipped": 0', '"skipped": 7'))
    (ckpt / "commit_success.txt").unlink()
    record_pending(ckpt.parent)  # as at each save
    assert damage(ckpt) == "tally/metadata differs from what was written (CRC32)"


def test_a_config_json_edit_is_checked_against_the_checkpoint(straight, tmp_path, env):
    """config.json edited by hand to compute in bfloat16 (the command line's
    --config.compute_dtype is refused: the run trained in float32): the checkpoint's own record of
    its config refuses it in one line, and nothing is written."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    config = json.loads((rundir / "config.json").read_text()) | {"compute_dtype": "bfloat16"}
    (rundir / "config.json").write_text(json.dumps(config))
    before = unchanged(rundir)
    r = run(["launch.py", f"--rundir={rundir}"], env)
    assert_one_line_error(r, f"the checkpoint of step {STEPS} is another run's: it was trained "
                             f"with compute_dtype='float32' there, 'bfloat16' here")
    assert unchanged(rundir) == before and committed_steps(rundir) == [STEPS // 2, STEPS]


def test_a_resume_stopped_before_its_first_step_keeps_every_metrics_line(straight, tmp_path, env):
    """The newest checkpoint away for a moment (a copy still coming back): the launch falls back to
    the one before, which trims metrics.jsonl to it, and Ctrl-C stops it before its first step
    (sent the moment the Logger has trimmed: later, a tiny step may finish first). Its lines are
    all there, for the resume from the newest once it is back."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    (rundir / "checkpoints" / str(STEPS)).rename(tmp_path / "away")
    before = unchanged(rundir)
    script = ("import os, signal, sys, time, launch, train\n"
              "class Sent(train.Logger):\n"
              "    def __init__(self, *a, **k):\n"
              "        super().__init__(*a, **k)\n"
              "        os.kill(os.getpid(), signal.SIGINT)\n"
              "        time.sleep(0.5)\n"
              "train.Logger = Sent\n"
              "launch.main(sys.argv[1:])\n")
    r = run(["-c", script, *launch_args(rundir, f"--config.max_steps={STEPS}")[1:]], env)
    assert_one_line_error(r, "interrupted (SIGINT)")
    assert unchanged(rundir) == before


def test_a_file_under_a_steps_name_is_one_line_and_kept(straight, tmp_path, env):
    """A file (notes, say) named as a step the run has yet to save: orbax lists folders only, and
    the save of that step replaced it without a word."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    (rundir / "checkpoints" / str(2 * STEPS)).write_text("my notes")
    before = unchanged(rundir)
    r = run(launch_args(rundir, f"--config.max_steps={2 * STEPS}"), env)
    assert_one_line_error(r, f"{rundir / 'checkpoints' / str(2 * STEPS)} is not a checkpoint's "
                             f"folder (a file, or a link to nothing): move it out")
    assert unchanged(rundir) == before
    assert (rundir / "checkpoints" / str(2 * STEPS)).read_text() == "my notes"


def test_a_checkpoint_of_another_model_is_not_called_damaged(tmp_path):
    """An intact checkpoint that another model.py cannot take keeps its one line (naming the arrays)
    and its name."""
    cfg, edited = tiny(), tiny(mlp_ratio=8)
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(tmp_path), cfg)
    save_checkpoint(mngr, 3, s.model, s.opt_state, {})
    mngr.wait_until_finished()
    s2 = train.setup(edited, train.make_mesh(edited))
    with pytest.raises(UsageError, match="the checkpoint of step 3 does not fit the model .* "
                                         "model.blocks.mlp.down"):
        resume(checkpoint_manager(epath.Path(tmp_path), edited), s2.model, s2.opt_state)
    assert committed_steps(tmp_path) == [3]


def test_a_checkpoint_of_another_dtype_is_not_called_damaged(tmp_path):
    """model.py edited to store a parameter in bfloat16: the float32 checkpoints are intact, of
    another model. One line naming the array and both dtypes, each step kept under its name (orbax
    cast the array, its sums differed from the saved ones, and every step was renamed damaged)."""
    cfg = tiny()
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(tmp_path), cfg)
    for step in (2, 3):
        save_checkpoint(mngr, step, s.model, s.opt_state, {})
    mngr.wait_until_finished()
    s2 = train.setup(cfg, train.make_mesh(cfg))
    up = s2.model.blocks.mlp.up
    model = eqx.tree_at(lambda m: m.blocks.mlp.up, s2.model, up.astype(jnp.bfloat16))
    with pytest.raises(UsageError, match=re.escape(
            f"does not fit the model that model.py and the config build: model.blocks.mlp.up "
            f"{up.shape} float32 there, {up.shape} bfloat16 here (run.json")):
        resume(checkpoint_manager(epath.Path(tmp_path), cfg), model, s2.opt_state)
    assert committed_steps(tmp_path) == [2, 3]
    assert not [p.name for p in tmp_path.glob("checkpoints/*damaged*")]


@pytest.fixture
def tmpfs(tmp_path):
    """A small real filesystem (tmpfs), which only root (with CAP_SYS_ADMIN) may mount."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                             capture_output=True, text=True) if os.geteuid() == 0 else None
    if mounted is None or mounted.returncode:
        pytest.skip("a full disk needs a tmpfs, which needs root and mount: "
                    + (mounted.stderr.strip() if mounted else f"running as uid {os.geteuid()}"))
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_once_freed(straight, tmpfs,
                                                                         env):
    """On a tmpfs with room for the run's files and one checkpoint, not two: the second save stops
    the run with one line naming the directory and the space; the first checkpoint is intact. With
    the filesystem made larger (space freed), the same command trains to the end as the straight
    run did."""
    one = sum(p.stat().st_size for p in (straight[0] / "checkpoints" / "8").rglob("*")
              if p.is_file())
    # (tmpfs rounds each file up to a 4 KiB page: the logs and the checkpoint's ~20 files)
    size = (int(1.5 * one) + 160 * 1024) // 4096 * 4096
    subprocess.run(["mount", "-o", f"remount,size={size}", str(tmpfs)], check=True)
    rundir = tmpfs / "run"
    args = launch_args(rundir, f"--config.max_steps={STEPS}", "--config.ckpt_interval=4")
    r = run(args, env)
    assert_one_line_error(r, f"no space for the checkpoint of step 8 in {rundir / 'checkpoints'}: "
                             f"it needs ")
    # it needs what the checkpoint of step 4 took
    needed, free = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) bytes", r.stderr))
    assert needed == sum(p.stat().st_size for p in (rundir / "checkpoints" / "4").rglob("*")
                         if p.is_file()) and free < needed
    assert "are free (the checkpoints up to step 4 are intact): free some and run the same " \
           "command to resume" in r.stderr
    assert committed_steps(rundir) == [4]
    assert damage(epath.Path(rundir / "checkpoints" / "4")) is None
    subprocess.run(["mount", "-o", "remount,size=8m", str(tmpfs)], check=True)
    r = run(args, env)
    assert r.returncode == 0, r.stderr
    assert "resuming from the checkpoint of step 4" in r.stdout
    assert records(rundir) == straight[1]
    final = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    for a, b in zip(final, straight[3], strict=True):
        np.testing.assert_array_equal(a, b)


def listing(root) -> list[tuple]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*"))


def test_sample_reads_a_read_only_run_directory_without_the_lock(straight, tmp_path,
                                                                 env):
    """Someone else's run: a copy without write permission, its training lock held and a save in
    flight (orbax's temporary directory), as by a live launch. sample.py samples from it and leaves
    every file and time stamp as it was (root may write despite the permissions: the listing is
    what shows nothing was written)."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    in_flight = rundir / "checkpoints" / f"{2 * STEPS}.orbax-checkpoint-tmp"
    shutil.copytree(rundir / "checkpoints" / str(STEPS) / "state", in_flight / "state")
    lock = open(rundir / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    subprocess.run(["chmod", "-R", "a-w", str(rundir)], check=True)
    try:
        before = listing(rundir)
        r = run(["sample.py", f"--rundir={rundir}", "--num_samples=1", "--max_new_tokens=8"],
                env)
        assert r.returncode == 0, r.stderr
        assert f"{rundir} step {STEPS}: 8 tokens" in r.stdout
        assert listing(rundir) == before
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(rundir)], check=True)
        lock.close()


def test_sample_names_a_damaged_checkpoint_and_the_others(straight, tmp_path, env):
    """sample.py leaves a damaged checkpoint as it is (the run may be someone else's) and says
    which steps it could read instead."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    expected = truncate(rundir / "checkpoints" / str(STEPS))
    r = run(["sample.py", f"--rundir={rundir}", "--num_samples=1", "--max_new_tokens=8"], env)
    assert_one_line_error(r, f"the checkpoint of step {STEPS} is damaged: {expected}")
    assert r.stderr.strip().endswith(f"were written (pass --step=: there are also {STEPS // 2})")
    assert committed_steps(rundir) == [STEPS // 2, STEPS]


def test_a_checkpoint_zstd_refuses_is_one_line_and_nothing_after_it(straight, tmp_path, env):
    """Every array data file's zstd frame broken, the record written again (damage it cannot see):
    the first read that fails is the one line, and orbax's reads of the other arrays, abandoned
    in flight, print nothing after it (their errors at the exit were tracebacks in some runs).
    Eight reads in one process, so the old noise was all but certain."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    ckpt = rundir / "checkpoints" / str(STEPS)
    damaged = list((ckpt / "state").glob("ocdbt.process_*/d/*"))
    assert damaged, f"no array data file under {ckpt / 'state'}: orbax's layout changed?"
    for path in damaged:
        data = path.read_bytes()
        path.write_bytes(bytes(b ^ 0xFF for b in data[:4]) + data[4:])
    record(epath.Path(ckpt))
    probe = ("import gc, sys; from etils import epath; from run import reading\n"
             f"rundir = epath.Path({str(rundir)!r}); cfg = reading.read_config(rundir)\n"
             "for _ in range(8):\n"
             "    try: reading.restore_model(rundir, cfg, None)\n"
             "    except reading.UsageError as e: print(e); gc.collect()\n")
    r = run(["-c", probe], env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    said = r.stdout.splitlines()
    assert len(said) == 8 and all("is damaged: reading it failed" in s and "ZSTD" in s
                                  for s in said), r.stdout


def test_malformed_step_metadata_leaves_the_other_checkpoints_readable(straight, tmp_path, env):
    """orbax's metadata of one step malformed (the types wrong): sample.py of that step is one line
    naming the others, sample.py --step= of an intact one samples (it was a traceback), and a
    resume sets the malformed one aside even when it is older than the one it resumes from."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    malformed = {"item_handlers": 3, "metrics": [], "init_timestamp_nsecs": "x"}
    metadata = rundir / "checkpoints" / str(STEPS) / "_CHECKPOINT_METADATA"
    metadata.write_text(json.dumps(malformed))
    r = run(TOOLS["sample"](rundir, None), env)
    assert_one_line_error(r, f"the checkpoint of step {STEPS} is damaged: its _CHECKPOINT_METADATA")
    assert r.stderr.strip().endswith(f"(pass --step=: there are also {STEPS // 2})")
    r = run([*TOOLS["sample"](rundir, None), f"--step={STEPS // 2}"], env)
    assert r.returncode == 0 and f"{rundir} step {STEPS // 2}: " in r.stdout, r.stderr
    shutil.rmtree(rundir)
    shutil.copytree(straight[0], rundir)
    (rundir / "checkpoints" / str(STEPS // 2) / "_CHECKPOINT_METADATA").write_text("[]")
    r = run(launch_args(rundir, f"--config.max_steps={STEPS + 4}"), env)
    assert f"resuming from the checkpoint of step {STEPS}" in r.stdout, r.stderr
    assert f"warning: the checkpoint of step {STEPS // 2} is damaged: its _CHECKPOINT_METADATA" \
           in r.stderr and (rundir / "checkpoints" / f"{STEPS // 2}.damaged").is_dir()


def test_a_resume_drops_metrics_lines_a_crash_left_unreadable(tmp_path, capsys):
    """After a power loss a filesystem may keep an appended line's length but not its bytes (zeros);
    a resume at step 20 drops it and any other line that is not a record (a step that is no
    integer: Infinity stopped the launch with an OverflowError, 3.5 read as step 3), keeping the
    steps up to 20 once each; a whole record that lost only its newline is a record (as
    say_dropped counts)."""
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 10, "loss": 1.0}', "\0" * 25, '{"step": 20, "loss": 2.0}', "[]",
             '{"step": Infinity}', '{"step": 3.5}', '{"step": "4"}', '{"step": 30, "loss": 3.0}']
    path.write_text("".join(line + "\n" for line in lines))
    say_dropped(epath.Path(tmp_path), 20)
    assert "note: metrics.jsonl: 6 line(s) after step 20 (or unreadable)" in capsys.readouterr().err
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "metrics.jsonl").write_text(lines[0] + "\n" + lines[2])  # no newline at its end
    kept = Logger(epath.Path(cut), 20)
    kept.close()
    assert (cut / "metrics.jsonl").read_text() == lines[0] + "\n" + lines[2] + "\n"
    logger = Logger(epath.Path(tmp_path), 20)
    logger.log(30, {"loss": 4.0}, {})
    logger.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 10, "loss": 1.0}, {"step": 20, "loss": 2.0}, {"step": 30, "loss": 4.0}]


def test_metrics_jsonl_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    """Bytes no kill or crash leaves: refused naming the file and line (a resume said "reading the
    checkpoints failed"), by the resume's note and by the Logger alike; the file as it was."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 10, "loss": 1.0}\n{"step": 20, "note": "\xff"}\n')
    before = path.read_bytes()
    message = f"^{path}, line 2: not UTF-8 text, so not a record mugpt wrote: delete that line"
    with pytest.raises(UsageError, match=message):
        say_dropped(epath.Path(tmp_path), 20)
    with pytest.raises(UsageError, match=message):
        Logger(epath.Path(tmp_path), 20)
    assert path.read_bytes() == before


TOOLS = {  # each command that reads a run directory, as a user runs it
    "launch": lambda rundir, out: ["launch.py", f"--rundir={rundir}"],
    "launch --config": lambda rundir, out: launch_args(rundir, f"--config.max_steps={STEPS}"),
    "sample": lambda rundir, out: ["sample.py", f"--rundir={rundir}", "--max_new_tokens=4"],
    "export": lambda rundir, out: ["export.py", f"--rundir={rundir}", f"--out={out}"],
    "eval": lambda rundir, out: ["eval.py", f"--rundir={rundir}", f"--tasks={out}.jsonl"],
}


def cut_short(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    return f"{path} is not JSON"


def null(path):
    path.write_text("null")
    return f"{path} is not a run's config"


def unknown_field(path):
    path.write_text(json.dumps({**json.loads(path.read_text()), "from_the_future": 1}))
    return f"{path} has fields this code does not know (from_the_future)"


def no_heads(path):
    """A value no run can have (hand-edited): sample.py stopped on a ZeroDivisionError."""
    path.write_text(json.dumps({**json.loads(path.read_text()), "n_head": 0}))
    return f"{path}: n_head=0 must be at least 1; restore it or pass a new --rundir"


def list_value(path):
    """A list where a number belongs (hand-edited): a TypeError in Config.check."""
    path.write_text(json.dumps({**json.loads(path.read_text()), "learning_rate": [0.002]}))
    return f"{path}: learning_rate=[0.002] must be a number; restore it or pass a new --rundir"


@pytest.mark.parametrize("tool,fault", [(t, cut_short) for t in TOOLS] + [
    ("launch", null), ("sample", null), ("launch --config", unknown_field), ("sample", no_heads),
    ("export", no_heads), ("launch", list_value), ("sample", list_value)])
def test_a_bad_config_json_is_one_line_in_each_tool_and_nothing_is_written(
        straight, tmp_path, env, tool, fault):
    """config.json cut short, null, or with a field this code does not know: each command says so
    in one line naming the file (launch.py as sample.py does: it does not drop the field)."""
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    (tmp_path / "out.jsonl").write_text('{"text": "two words"}\n')
    message = fault(rundir / "config.json")
    before = listing(rundir)
    r = run(TOOLS[tool](rundir, tmp_path / "out"), env)
    assert_one_line_error(r, message)
    assert listing(rundir) == before and not (tmp_path / "out").exists()


def bad_run_json(rundir):
    (rundir / "run.json").write_text('{"config_name": ')
    return f"{rundir / 'run.json'} is not JSON"


def bad_dataset_json(rundir):
    (rundir / "dataset.json").write_text("[]")
    return f"{rundir / 'dataset.json'} is not a JSON object"


def emptied_dataset_json(rundir):
    """{}: the resume's check of the dataset passed whatever the dataset, and wrote a new one."""
    (rundir / "dataset.json").write_text("{}")
    return f"{rundir / 'dataset.json'} is empty, not the record of the dataset {rundir} trained on"


def bad_tokenizer(rundir):
    meta = json.loads((rundir / "dataset.json").read_text())
    meta["tokenizer"] = {"kind": "hf", "json": '{"version": "1.0", "model": '}
    (rundir / "dataset.json").write_text(json.dumps(meta))
    return f"{rundir / 'dataset.json'} is not a dataset record whose tokenizer loads"


def fewer_ids(rundir):
    """A vocab_size below its tokenizer's: the export cut the readout to it, and its tokenizer
    then gave ids the model had no row for."""
    meta = json.loads((rundir / "dataset.json").read_text())
    ids, meta["vocab_size"] = meta["vocab_size"], 40
    (rundir / "dataset.json").write_text(json.dumps(meta))
    return f"{rundir / 'dataset.json'}: vocab_size=40 does not lie between its tokenizer's {ids} ids"


@pytest.mark.parametrize("tool,fault", [("launch", bad_run_json), ("sample", bad_dataset_json),
                                        ("launch --config", bad_dataset_json),
                                        ("launch --config", emptied_dataset_json),
                                        ("eval", bad_tokenizer), ("export", bad_tokenizer),
                                        ("export", fewer_ids)])
def test_a_bad_run_record_is_one_line_naming_the_file(straight, tmp_path, env, tool, fault):
    rundir = tmp_path / "run"
    shutil.copytree(straight[0], rundir)
    (tmp_path / "out.jsonl").write_text('{"text": "two words"}\n')
    message = fault(rundir)
    before = listing(rundir)
    r = run(TOOLS[tool](rundir, tmp_path / "out"), env)
    assert_one_line_error(r, message)
    assert listing(rundir) == before and not (tmp_path / "out").exists()


def test_eval_refuses_a_malformed_task_file_in_one_line(straight, tmp_path, env):
    (tmp_path / "out.jsonl").write_text('{"context": "a", "choices": [" b", " c"], "label": 2}\n')
    r = run(TOOLS["eval"](straight[0], tmp_path / "out"), env)
    assert_one_line_error(r, f"task file {tmp_path / 'out.jsonl'}, line 1, example 1: label "
                             f"must be an integer from 0 to 1")


def test_resume_with_the_run_directory_alone_equals_the_straight_run(straight, tmp_path, env):
    """STEPS/2 steps, then `launch.py --rundir=R --config.max_steps=STEPS`: config.json supplies
    the rest, and the run ends as the straight one."""
    rundir = tmp_path / "run"
    r = run(launch_args(rundir, f"--config.max_steps={STEPS // 2}"), env)
    assert r.returncode == 0, r.stderr
    r = run(["launch.py", f"--rundir={rundir}", f"--config.max_steps={STEPS}"], env)
    assert r.returncode == 0, r.stderr
    assert f"resuming with max_steps={STEPS} (was {STEPS // 2})" in r.stdout
    assert records(rundir) == straight[1]
    final = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    for a, b in zip(final, straight[3], strict=True):
        np.testing.assert_array_equal(a, b)
