"""Checkpoints, resume, preemption and faults: real orbax, real subprocesses, real signals."""
import dataclasses
import importlib.util
import json
import random
import shutil
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

import configs
import train
from run.checkpoint import checkpoint_manager, restore_checkpoint, restore_model, save_checkpoint
from run.errors import UsageError
from conftest import ROOT, TINY_RUN, tiny
from run.metrics import Logger
from params import init_gpt

TINY = [*TINY_RUN, "--config.eval_batches=2", "--config.log_interval=4",
        "--config.eval_interval=8", "--config.ckpt_interval=8"]
STEPS = 16


def start(args: list[str], env: dict, prefix: tuple = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(args: list[str], env: dict, prefix: tuple = ()) -> subprocess.CompletedProcess:
    proc = start(args, env, prefix)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def tiny_config(*overrides: str) -> configs.Config:
    return configs.apply_overrides(configs.load("shakespeare_char_cpu"), [*TINY[1:], *overrides])


def launch_args(rundir, *overrides: str) -> list[str]:
    return ["launch.py", *TINY, f"--rundir={rundir}", *overrides]


def records(rundir) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    lines = (rundir / "metrics.jsonl").read_text().splitlines()
    wall_clock = ("tokens_per_s", "mfu")
    return [{k: v for k, v in json.loads(line).items() if k not in wall_clock} for line in lines]


def final_state(rundir, cfg: configs.Config) -> list[np.ndarray]:
    """The model and optimizer arrays of the latest checkpoint."""
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(rundir), cfg, read_only=True)
    model, opt_state, _ = restore_checkpoint(mngr, s.model, s.opt_state)
    return [np.asarray(x) for x in jax.tree.leaves((model, opt_state))]


def committed_steps(rundir) -> list[int]:
    ckpts = rundir / "checkpoints"
    if not ckpts.exists():
        return []
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())


def save_in_flight(rundir) -> bool:
    """Orbax writes a step as STEP.orbax-checkpoint-tmp and renames it when complete."""
    ckpts = rundir / "checkpoints"
    return ckpts.exists() and any("tmp" in p.name for p in ckpts.iterdir())


def assert_one_line_error(r: subprocess.CompletedProcess, message: str) -> None:
    """A non-zero exit, no traceback, and the message as the last line of stderr (a progress bar
    may precede it)."""
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, r.stderr
    assert sum(line.startswith("error: ") for line in r.stderr.splitlines()) == 1, r.stderr


@pytest.fixture(scope="module")
def straight(shakespeare, tmp_path_factory, env):
    """STEPS steps without interruption."""
    rundir = tmp_path_factory.mktemp("straight") / "run"
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}"), env)
    assert r.returncode == 0, r.stderr
    assert committed_steps(rundir) == [STEPS // 2, STEPS]
    return records(rundir), final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))


def test_stop_and_resume_equals_straight_run(straight, tmp_path, env):
    """STEPS/2 steps, then the same command with max_steps=STEPS: the same per-step losses and
    evals in metrics.jsonl, and bitwise the same final parameters and optimizer state."""
    rundir = tmp_path / "run"
    r = run(launch_args(rundir, f"--config.max_steps={STEPS // 2}"), env)
    assert r.returncode == 0, r.stderr
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}"), env)
    assert r.returncode == 0, r.stderr
    assert f"resuming from the checkpoint of step {STEPS // 2}" in r.stdout
    # the one field that changed
    assert f"resuming with max_steps={STEPS} (was {STEPS // 2})" in r.stdout
    assert records(rundir) == straight[0]
    final = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    for a, b in zip(final, straight[1], strict=True):
        np.testing.assert_array_equal(a, b)
    run_info = json.loads((rundir / "run.json").read_text())
    assert f"--config.max_steps={STEPS // 2}" in run_info["argv"] and len(run_info["resumed"]) == 1


def test_resume_in_more_microbatches_trains_as_the_straight_run(straight, tmp_path, env):
    """Half the run in one microbatch, the rest in two with the loss in two chunks (a resume after
    running out of memory, or on fewer devices): the straight run's training losses and final
    state, up to float rounding. The evaluation after the change reads microbatches of half the
    size, a smaller sample."""
    rundir = tmp_path / "run"
    r = run(launch_args(rundir, f"--config.max_steps={STEPS // 2}"), env)
    assert r.returncode == 0, r.stderr
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}", "--config.grad_accum=2",
                        "--config.loss_chunks=2"), env)
    assert r.returncode == 0, r.stderr
    assert f"resuming from the checkpoint of step {STEPS // 2}" in r.stdout
    got = records(rundir)
    assert [g["step"] for g in got] == [s["step"] for s in straight[0]]
    for g, s in zip(got, straight[0]):
        if "val_loss" in g and g["step"] > STEPS // 2:
            assert np.isfinite(g["val_loss"]) and g["lr"] == pytest.approx(s["lr"])
        else:
            assert g == pytest.approx(s, rel=1e-5), g["step"]
    final = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    for a, b in zip(final, straight[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_sigkill_at_random_moments_then_resume_equals_straight_run(straight, tmp_path, env):
    """A checkpoint every step, and SIGKILL at 5 random moments: each once the run has reached a
    random step, then either as soon as a save is in flight (orbax's temporary directory exists) or
    after a random delay. The same command each time, then once more to the end: metrics.jsonl and
    the final state are the straight run's."""
    rundir, rng = tmp_path / "run", random.Random(0)
    command = launch_args(rundir, f"--config.max_steps={STEPS}", "--config.ckpt_interval=1")
    kills, during_save, resumed_from = 0, 0, []
    for i, target in enumerate([*sorted(rng.sample(range(2, STEPS - 1), 5)), None]):
        if target and committed_steps(rundir)[-1:] >= [target]:
            # the last run saved past this target before its kill landed: kill this one once it
            # has resumed and saved a step of its own (not before it says where it resumed)
            target = committed_steps(rundir)[-1] + 1
        proc = start(command, env)
        while target and proc.poll() is None:
            if committed_steps(rundir)[-1:] >= [target] and (i % 2 or save_in_flight(rundir)):
                time.sleep(rng.uniform(0.0, 0.2) if i % 2 else 0.0)
                proc.kill()
                kills += 1
                break
            time.sleep(0.002)
        out = proc.communicate(timeout=600)[0]
        during_save += proc.returncode == -signal.SIGKILL and save_in_flight(rundir)
        if "resuming from the checkpoint of step" in out:
            after = out.split("resuming from the checkpoint of step ")[1]
            resumed_from.append(int(after.split()[0]))
    print(f"{kills} SIGKILLs, {during_save} of them during a save; "
          f"resumed from steps {resumed_from}")
    assert proc.returncode == 0 and kills == 5 and during_save >= 1 and len(resumed_from) == 5
    assert records(rundir) == straight[0]
    losses = [(r["step"], pytest.approx(r["loss"])) for r in straight[0] if "loss" in r]
    assert tensorboard_losses(rundir) == losses


def tensorboard_losses(rundir) -> list[tuple[int, float]]:
    """(step, loss) as tensorboard's server reads the run: its plugin accumulator, which drops the
    events that a START session log says came after the checkpoint a launch resumed from."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(rundir))
    acc.Reload()
    return [(e.step, float(e.tensor_proto.float_val[0])) for e in acc.Tensors("loss/batch")]


def test_a_second_launch_in_a_live_run_directory_is_refused(shakespeare, tmp_path, env):
    """The same command twice at once: the second stops with one line and writes nothing; once the
    first is SIGKILLed (no cleanup), the directory is free again."""
    rundir, long = tmp_path / "run", "--config.max_steps=1000000"
    first = start(launch_args(rundir, long), env)
    try:
        # metrics.jsonl: the Logger's, written after the lock is taken
        while not (rundir / "metrics.jsonl").exists() and first.poll() is None:
            time.sleep(0.05)
        before = {name: (rundir / name).read_text() for name in ("config.json", "run.json")}
        # (without the lock it would train and exit 0)
        second = run(launch_args(rundir, f"--config.max_steps={STEPS}"), env)
        assert_one_line_error(second, f"{rundir} is in use: another launch.py")
        assert {name: (rundir / name).read_text() for name in before} == before
    finally:
        first.kill()
        first.communicate()
    r = run(launch_args(rundir, f"--config.max_steps={STEPS // 4}"), env)
    assert r.returncode == 0, r.stderr


def test_tensorboard_drops_what_was_logged_after_the_checkpoint(straight, tmp_path, env):
    """A run's last checkpoint lost (removed here, as a kill before orbax commits it loses it): the
    same command resumes from the one before, and tensorboard shows each step once, with the
    straight run's values."""
    rundir = tmp_path / "run"
    assert run(launch_args(rundir, f"--config.max_steps={STEPS}"), env).returncode == 0
    shutil.rmtree(rundir / "checkpoints" / str(STEPS))
    r = run(launch_args(rundir, f"--config.max_steps={STEPS}"), env)
    assert r.returncode == 0, r.stderr
    assert f"resuming from the checkpoint of step {STEPS // 2}" in r.stdout
    losses = [(r["step"], pytest.approx(r["loss"])) for r in straight[0] if "loss" in r]
    assert tensorboard_losses(rundir) == losses
    final = final_state(rundir, tiny_config(f"--config.max_steps={STEPS}"))
    for a, b in zip(final, straight[1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_metrics_jsonl_appends_and_a_resume_drops_a_torn_line_and_later_steps(tmp_path):
    """Locally each log appends (the file is never replaced: same inode); a resume at step 20 keeps
    the lines up to 20 and drops both the later one and a last line a kill cut short (no
    newline)."""
    path = tmp_path / "metrics.jsonl"
    logger = Logger(epath.Path(tmp_path), 0)
    inode = path.stat().st_ino
    for step in (10, 20, 30):
        logger.log(step, {"loss": 1.0}, {"loss": "loss/batch"})
        assert path.stat().st_ino == inode
    logger.close()
    path.write_text(path.read_text() + '{"step": 40, "lo')  # killed mid-line
    logger = Logger(epath.Path(tmp_path), 20)
    logger.log(30, {"loss": 2.0}, {})
    logger.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 10, "loss": 1.0}, {"step": 20, "loss": 1.0}, {"step": 30, "loss": 2.0}]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_current_step_and_exits_0(shakespeare, tmp_path, env, signum):
    """(With tied embeddings: their eqx.nn.Shared holds a non-array leaf that saving must leave
    out.)"""
    rundir = tmp_path / "run"
    proc = start(launch_args(rundir, "--config.max_steps=100000", "--config.ckpt_interval=100000",
                             "--config.log_interval=1", "--config.tie_embeddings=true"), env)
    logged = lambda: (rundir / "metrics.jsonl").exists() and len(records(rundir)) >= 4
    while proc.poll() is None and not logged():
        time.sleep(0.05)
    proc.send_signal(signum)
    t = time.monotonic()
    out, err = proc.communicate(timeout=120)
    print(f"{signal.Signals(signum).name}: exited {time.monotonic() - t:.2f} s after the signal")
    assert proc.returncode == 0, err
    last = max(r["step"] for r in records(rundir))  # log_interval=1: every step finished is logged
    assert committed_steps(rundir) == [last]
    assert f"{signal.Signals(signum).name} at step {last}" in out


def test_checkpoint_restores_onto_another_mesh(tmp_path, env):
    """Saved on 8 simulated devices, restored on 2, trained and saved there, restored on 8: each
    restore holds exactly the saved arrays, sharded over the new mesh as fresh arrays are, and
    trains on without a retrace (the probe asserts all of it). Without the persistent compilation
    cache: an 8-device step loaded from it (XLA:CPU, jax 0.10.2) ran its independent collectives in
    different orders on different devices and hung in 3 of 4 tries here; compiled afresh it never
    did."""
    env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    for devices in (8, 2, 8):
        probe = [str(ROOT / "tests/ckpt_probe.py"), str(devices)]
        r = run([*probe, str(tmp_path / "run"), str(tmp_path / "saved.npz")], env)
        assert r.returncode == 0, r.stderr
    assert committed_steps(tmp_path / "run") == [2, 4, 6]


def test_nonfinite_step_is_skipped_and_leaves_the_state_as_it_was():
    cfg = tiny()
    s = train.setup(cfg, train.make_mesh(cfg))
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (1, 8, cfg.block_size)).astype(np.int32)
    y = np.roll(x, -1, axis=2)
    up = s.model.blocks.mlp.up.at[0, 0, 0].set(jnp.inf)
    model = eqx.tree_at(lambda m: m.blocks.mlp.up, s.model, up)
    before = [np.asarray(a) for a in jax.tree.leaves((model, s.opt_state))]
    # (the step donates its inputs: compared with copies)
    model, opt_state, metrics = s.step(model, s.opt_state, x, y)
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves((model, opt_state)), before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    model = eqx.tree_at(lambda m: m.blocks.mlp.up, model, model.blocks.mlp.up.at[0, 0, 0].set(0.0))
    model, opt_state, metrics = s.step(model, opt_state, x, y)
    assert int(metrics["skipped"]) == 0
    assert int(opt_state[1].count) == 1  # applied: Adam's count moved


@pytest.mark.parametrize("skipped,stops", [(range(12, 22), True), (range(12, 21), False),
                                            (range(1, 4), True)])
def test_a_streak_of_skipped_steps_between_two_checks_stops_the_run(skipped, stops):
    """train.py checks the streak at log points and saves only: steps 12-21 skipped in a row
    (log_interval=10, max_nonfinite=10) end before the check at 30, which once saw a streak of 0
    and let the run go on; 1-3 with max_nonfinite=3, ended before the check at 10, likewise.
    Nine in a row do not stop it."""
    from run.errors import RunError
    from run.metrics import Tally
    limit = 3 if skipped.start == 1 else 10
    tally = Tally(tiny(log_interval=10, max_nonfinite=limit))
    raised = []
    for step in range(1, 41):
        tally.on_device.append({"loss": np.float32(1.0), "grad_norm": np.float32(1.0),
                                "lr": np.float32(0.1), "skipped": np.int32(step in skipped)})
        if step % 10 == 0:  # as train.py: record, then check, at each log point
            tally.record(step)
            try:
                tally.check(step)
            except RunError as e:
                raised.append((step, str(e)))
    n = len(skipped)
    want = [(10 * -(-skipped[-1] // 10), f"{n} steps in a row by step")] if stops else []
    assert [(s, e[:len(want[0][1])]) for s, e in raised[:1]] == want[:1], raised


def test_a_logged_loss_is_the_mean_over_the_applied_steps_since_the_last_log():
    """loss/batch at a log point: the mean cross-entropy of the steps since the previous log,
    skipped steps left out (their loss is not finite); grad_norm the last step's; skipped the
    count so far. A last step off the interval keeps its steps for the next log."""
    from run.metrics import Tally
    tally = Tally(tiny(log_interval=4))
    losses = [5.0, 4.0, np.nan, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5]  # step 3 skipped
    logged = {}
    for step, loss in enumerate(losses, 1):
        tally.on_device.append({"loss": np.float32(loss), "grad_norm": np.float32(step),
                                "lr": np.float32(0.1), "skipped": np.int32(np.isnan(loss))})
        if step % 4 == 0 or step == len(losses):
            logged[step] = tally.record(step)
    assert logged[4]["loss"] == pytest.approx((5.0 + 4.0 + 3.0) / 3)
    assert logged[8]["loss"] == pytest.approx((2.5 + 2.0 + 1.5 + 1.0) / 4)
    assert logged[9]["loss"] == pytest.approx(0.5)
    assert [logged[s]["grad_norm"] for s in (4, 8, 9)] == [4.0, 8.0, 9.0]
    assert [logged[s]["skipped"] for s in (4, 8, 9)] == [1, 1, 1]
    assert tally.state["since_log"] and tally.record(12)["loss"] == pytest.approx(0.5)


def test_too_many_nonfinite_steps_stop_the_run_and_keep_a_finite_checkpoint(shakespeare, tmp_path,
                                                                            env):
    """alpha_out=1e39 is inf in float32: every loss is non-finite, so every step is skipped. After
    max_nonfinite=3 the run stops with one line; the checkpoint of step 2 holds the untouched
    initial parameters (drawn again here) and zero Adam moments. The logged "lr", the last
    applied update's, is 0: none was (not the schedule of the step, which no update used)."""
    rundir = tmp_path / "run"
    overrides = ["--config.alpha_out=1e39", "--config.max_nonfinite=3", "--config.log_interval=1",
                 "--config.ckpt_interval=2", "--config.max_steps=50"]
    r = run(launch_args(rundir, *overrides), env)
    assert_one_line_error(r, "3 steps in a row by step 3 had a non-finite loss or gradient")
    steps = [rec for rec in records(rundir) if "skipped" in rec]
    got = [(rec["step"], rec["skipped"], rec["loss"]) for rec in steps]
    assert got == [(1, 1, None), (2, 2, None), (3, 3, None)]
    assert all(rec["lr"] == 0.0 for rec in records(rundir)), records(rundir)  # none applied
    assert committed_steps(rundir) == [2]
    cfg = tiny_config(*overrides)
    state = final_state(rundir, cfg)
    assert all(np.isfinite(a).all() for a in state)
    initial = eqx.filter(init_gpt(cfg, jax.random.key(cfg.seed)), eqx.is_array)
    init = [np.asarray(a) for a in jax.tree.leaves(initial)]
    for a, b in zip(state[:len(init)], init, strict=True):
        np.testing.assert_array_equal(a, b)
    assert all((a == 0).all() for a in state[len(init):])  # Adam moments and counts


def test_debug_profiles_a_few_steps_then_stops_without_saving(shakespeare, tmp_path, env):
    """--debug: a jax.profiler trace of steps 6-8 in RUNDIR/profile, then the launch ends (it
    trained on to max_steps before, with nothing saved: a day's run lost to a flag meant for a
    quick look). It writes none of the run's files: a new folder gets no config.json (which
    fixed the config of the run trained there next), a run's config.json and run.json stay as
    they were (they said max_steps=100000)."""
    rundir, files = tmp_path / "run", ("config.json", "run.json", "dataset.json", "metrics.jsonl")
    args = launch_args(rundir, "--debug", "--config.max_steps=100000", "--config.log_interval=1")
    r = run(args, env)
    assert r.returncode == 0, r.stderr
    assert f"--debug: the profile of the steps to 8 is in {rundir / 'profile'}" in r.stdout
    assert committed_steps(rundir) == [] and not [n for n in files if (rundir / n).exists()]
    assert not list(rundir.rglob("events.out.tfevents*"))
    assert list((rundir / "profile").rglob("*.xplane.pb"))
    trained = tmp_path / "trained"
    assert run(launch_args(trained, "--config.max_steps=4"), env).returncode == 0
    before = {n: (trained / n).read_bytes() for n in files}
    r = run(launch_args(trained, "--debug", "--config.max_steps=100000"), env)
    assert r.returncode == 0 and "the profile of the steps to 12" in r.stdout, r.stderr
    assert {n: (trained / n).read_bytes() for n in files} == before


def test_a_logger_that_does_not_write_leaves_the_run_directory_as_it_was(tmp_path):
    """Logger(writes=False), for --debug: no metrics.jsonl, no tensorboard events."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n{"step": 20}\n')
    logger = Logger(epath.Path(tmp_path), 10, writes=False)
    logger.log(11, {"loss": 2.0}, {"loss": "loss/batch"})
    logger.text(11, "sample", "text")
    logger.close()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 10, "loss": 1.0}\n{"step": 20}\n'


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_startup_is_one_line_and_the_run_resumes(shakespeare, tmp_path, env,
                                                                 signum):
    """Ctrl-C or SIGTERM right after the run directory is written: during restore, compilation and
    the step-0 evaluation, before the loop's own handler. One line (SIGTERM killed silently), no
    traceback, and the new run's files written at its start removed again (its config.json fixed
    the config of the next run there); the same command then trains."""
    rundir = tmp_path / "run"
    unbuffered = {**env, "PYTHONUNBUFFERED": "1"}
    proc = start(launch_args(rundir, f"--config.max_steps={STEPS // 4}"), unbuffered)
    for line in proc.stdout:
        if line.startswith("run directory"):
            break
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                          f"interrupted ({signal.Signals(signum).name})")
    assert not [n for n in ("config.json", "run.json", "dataset.json") if (rundir / n).exists()]
    assert run(launch_args(rundir, f"--config.max_steps={STEPS // 4}"), env).returncode == 0


def test_a_signal_as_the_run_directory_is_written_is_undone_too(shakespeare, tmp_path, env):
    """The window the test above can hit by chance, made certain: SIGINT arrives the moment
    open_rundir returns, before launch.py has registered its undo (it printed "run directory"
    already). The signal waits for the undo, and the new run's files are removed. It is sent to
    the process, as Ctrl-C is, and given time to land while JAX's threads run (one of them takes
    it when the main thread blocks it: a hold by signal mask alone failed here)."""
    rundir = tmp_path / "run"
    script = ("import os, signal, sys, time, launch\n"
              "real = launch.open_rundir\n"
              "def sent(*a, **k):\n"
              "    out = real(*a, **k)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(0.5)\n"
              "    return out\n"
              "launch.open_rundir = sent\n"
              "launch.main(sys.argv[1:])\n")
    r = run(["-c", script, *launch_args(rundir)[1:]], env)
    assert_one_line_error(r, "interrupted (SIGINT)")
    assert not rundir.exists(), sorted(p.name for p in rundir.iterdir())


def test_the_run_keeps_its_dataset_record(shakespeare, tmp_path, env):
    """launch.py copies the dataset's meta.json into the run directory (dataset.json); a resume on
    the dataset prepared again with another vocabulary (here every letter's case swapped: the same
    size, other text) is refused and writes nothing."""
    data_root = tmp_path / "data"
    shutil.copytree(shakespeare, data_root / "shakespeare_char",
                    ignore=shutil.ignore_patterns("input.txt"))
    rundir, meta_path = tmp_path / "run", data_root / "shakespeare_char" / "meta.json"
    args = launch_args(rundir, "--config.max_steps=4", f"--config.data_root={data_root}")
    assert run(args, env).returncode == 0
    meta = json.loads(meta_path.read_text())
    assert json.loads((rundir / "dataset.json").read_text()) == meta
    meta["tokenizer"]["chars"] = meta["tokenizer"]["chars"].swapcase()
    meta_path.write_text(json.dumps(meta))
    names = ("config.json", "run.json", "dataset.json")
    before = {name: (rundir / name).read_text() for name in names}
    r = run(launch_args(rundir, "--config.max_steps=8", f"--config.data_root={data_root}"), env)
    where = data_root / "shakespeare_char"
    assert_one_line_error(r, f"{where} is not the dataset {rundir} trained on (tokenizer ")
    assert {name: (rundir / name).read_text() for name in before} == before
    # with more ids than the run's model has too: named as another dataset, not as a vocab_size
    # to set (a resume cannot change it)
    meta_path.write_text(json.dumps({**meta, "vocab_size": 200}))
    r = run(launch_args(rundir, "--config.max_steps=8", f"--config.data_root={data_root}"), env)
    assert_one_line_error(r, f"{where} is not the dataset {rundir} trained on (tokenizer ")
    meta_path.write_text(json.dumps(meta))
    assert committed_steps(rundir) == [4]
    # before its first checkpoint a run directory takes the dataset as it is now (a launch that
    # failed early: no checkpoint, and none recorded as saved)
    shutil.rmtree(rundir / "checkpoints")
    (rundir / "checkpoints.json").unlink()
    args = launch_args(rundir, "--config.max_steps=4", f"--config.data_root={data_root}")
    assert run(args, env).returncode == 0
    assert json.loads((rundir / "dataset.json").read_text()) == meta


def test_resume_with_another_model_shape_is_one_line_and_writes_nothing(shakespeare, tmp_path,
                                                                       env):
    rundir = tmp_path / "run"
    rundir.mkdir()
    saved = json.dumps(dataclasses.asdict(tiny_config()), indent=1)
    (rundir / "config.json").write_text(saved)
    r = run(launch_args(rundir, "--config.n_layer=3"), env)
    assert_one_line_error(r, f"{rundir} holds a run with n_layer=2 there, 3 here: resuming may "
                             f"change only max_steps")
    assert len(r.stderr.strip().splitlines()) == 1
    assert (rundir / "config.json").read_text() == saved
    assert sorted(p.name for p in rundir.iterdir()) == ["config.json"]


def test_a_checkpoint_of_another_model_is_one_line_naming_the_arrays(tmp_path):
    """As after an edit to model.py: a checkpoint restored into a model with other arrays (here
    RMSNorm gains added, the MLP twice as wide) is refused before anything is freed, naming what
    differs."""
    cfg, edited = tiny(), tiny(norm_gain=True, mlp_ratio=8)
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(tmp_path), cfg)
    save_checkpoint(mngr, 3, s.model, s.opt_state, {})
    mngr.wait_until_finished()
    s2 = train.setup(edited, train.make_mesh(edited))
    with pytest.raises(UsageError) as e:
        restore_checkpoint(mngr, s2.model, s2.opt_state)
    mlp, mlp2 = s.model.blocks.mlp, s2.model.blocks.mlp  # in whatever layout model.py stores them
    assert str(e.value).startswith(
        "the checkpoint of step 3 does not fit the model that model.py and the config build: "
        f"model.blocks.attn_norm absent there, (2, 32) here; model.blocks.mlp.down "
        f"{mlp.down.shape} there, {mlp2.down.shape} here; model.blocks.mlp.up {mlp.up.shape} "
        f"there, {mlp2.up.shape} here; ...")
    state = eqx.filter((s2.model, s2.opt_state), eqx.is_array)
    assert all(not x.is_deleted() for x in jax.tree.leaves(state))


@pytest.mark.parametrize("trained,read,said", [
    ({}, {"position": "alibi"}, "position='rope' there, 'alibi' here"),
    ({"n_head": 4, "n_kv_head": 1}, {"n_head": 4, "attention": "sharedkv", "n_kv_head": 2},
     "attention='mha' there, 'sharedkv' here; n_kv_head=1 there, 2 here")],
    ids=["rope-read-as-alibi", "mha-read-as-sharedkv"])
def test_a_checkpoint_of_another_runs_config_is_one_line(tmp_path, trained, read, said):
    """A checkpoint whose arrays fit this run's model but were trained as another's (copied from
    another run's directory, or config.json edited): RoPE's arrays read as ALiBi's, or MHA's with
    one key/value head as SharedKV's with two (the same qkv, split otherwise). Refused by
    resume's restore and by sample.py's, naming the fields, before any array is freed; under the
    config it was trained with, it restores."""
    cfg, other = tiny(**trained), tiny(**read)
    s = train.setup(cfg, train.make_mesh(cfg))
    saving = checkpoint_manager(epath.Path(tmp_path), cfg)
    save_checkpoint(saving, 3, s.model, s.opt_state, {})
    saving.wait_until_finished()
    s2 = train.setup(other, train.make_mesh(other))
    layout = lambda m: [(x.shape, x.dtype) for x in jax.tree.leaves(eqx.filter(m, eqx.is_array))]
    assert layout((s.model, s.opt_state)) == layout((s2.model, s2.opt_state))  # the arrays fit
    mngr = checkpoint_manager(epath.Path(tmp_path), other, read_only=True)
    for restore in (lambda: restore_checkpoint(mngr, s2.model, s2.opt_state),
                    lambda: restore_model(mngr, s2.model)):
        with pytest.raises(UsageError) as e:
            restore()
        assert str(e.value) == (
            f"the checkpoint of step 3 is another run's: it was trained with {said}: move it out "
            f"of {mngr.directory}, or read it with the config it was trained with")
        assert all(not x.is_deleted() for x in jax.tree.leaves(eqx.filter(s2.model, eqx.is_array)))
    s3 = train.setup(cfg, train.make_mesh(cfg))
    restore_checkpoint(checkpoint_manager(epath.Path(tmp_path), cfg, read_only=True), s3.model,
                       s3.opt_state)


def test_restore_model_reads_the_model_alone(tmp_path):
    """sample.py's restore: a checkpoint's model, onto a model built without an optimizer state
    (init_gpt, other initial values): exactly the arrays that were saved, and that
    restore_checkpoint reads, on the given model's shardings. A model of other shapes is refused,
    naming its arrays only (not the optimizer state it lacks)."""
    cfg = tiny(tie_embeddings=True, norm_gain=True)  # every kind of parameter, eqx.nn.Shared too
    arrays = lambda m: [x for x in jax.tree.leaves(m) if eqx.is_array(x)]
    s = train.setup(cfg, train.make_mesh(cfg))
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8, cfg.block_size), np.int32)
    model, opt_state, _ = s.step(s.model, s.opt_state, x, np.roll(x, -1, axis=2))  # trained
    saved = [np.asarray(a) for a in arrays(model)]
    mngr = checkpoint_manager(epath.Path(tmp_path), cfg)
    save_checkpoint(mngr, 1, model, opt_state, {})
    mngr.wait_until_finished()

    fresh = init_gpt(cfg, jax.random.key(1))
    layout = [(a.shape, a.dtype, a.weak_type, a.sharding) for a in arrays(fresh)]
    assert any((np.asarray(a) != b).any() for a, b in zip(arrays(fresh), saved))
    got = restore_model(mngr, fresh, step=1)
    assert [(a.shape, a.dtype, a.weak_type, a.sharding) for a in arrays(got)] == layout
    s2 = train.setup(cfg, train.make_mesh(cfg))
    full = restore_checkpoint(mngr, s2.model, s2.opt_state)[0]
    for a, b, c in zip(arrays(got), saved, arrays(full), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert jax.tree.structure(got) == jax.tree.structure(full)  # tied weights still tied
    # onto shapes alone (run.reading's read: nothing drawn): the same arrays, on the default device
    got = restore_model(mngr, eqx.filter_eval_shape(init_gpt, cfg, jax.random.key(1)), step=1)
    assert [(a.shape, a.dtype, a.weak_type, a.sharding) for a in arrays(got)] == layout
    for a, b in zip(arrays(got), saved, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert jax.tree.structure(got) == jax.tree.structure(full)

    with pytest.raises(UsageError) as e:
        restore_model(mngr, init_gpt(tiny(tie_embeddings=True), jax.random.key(1)))
    message = str(e.value)
    assert message.startswith("the checkpoint of step 1 does not fit the model that model.py")
    assert "norm (2, 32) there, absent here" in message and "opt_state" not in message


def test_unwritable_run_directory_is_one_line_before_training(shakespeare, tmp_path, env):
    (tmp_path / "file").write_text("")
    r = run(launch_args(tmp_path / "file" / "run"), env)
    where = tmp_path / "file" / "run"
    assert_one_line_error(r, f"cannot write the run directory {where}: Not a directory")
    assert len(r.stderr.strip().splitlines()) == 1


def test_full_disk_at_a_save_is_one_line(shakespeare, tmp_path, env):
    """A file size limit (ulimit -f: 128 blocks, 64 or 128 KiB) stands in for a full disk, which
    would need a small filesystem and root to mount it: config.json and metrics.jsonl fit, the
    checkpoint's ~400 KB do not, and Python ignores SIGXFSZ, so the write fails with EFBIG as with
    ENOSPC."""
    rundir = tmp_path / "run"
    limited = ("sh", "-c", 'ulimit -f 128 && exec "$0" "$@"')
    args = launch_args(rundir, "--config.max_steps=6", "--config.ckpt_interval=3")
    r = run(args, env, prefix=limited)
    assert_one_line_error(r, f"saving a checkpoint to {rundir / 'checkpoints'} failed:")
    assert "File too large" in r.stderr and committed_steps(rundir) == []


def test_a_write_left_unstarted_at_exit_does_not_follow_the_error(env):
    """What made the test above fail once in CI: a write coroutine orbax had made but not started
    when the save failed is collected at the interpreter's exit, and its RuntimeWarning ('coroutine
    ... was never awaited') printed after the error line. Made here on purpose (a coroutine made
    and dropped at exit), first without the quieting as the control."""
    code = ("import atexit, sys\n"
            "from run import checkpoint\n"
            "if sys.argv[1] == 'quiet': checkpoint.quiet_failed_saves()\n"
            "async def write_fragment(): pass\n"
            "atexit.register(lambda: [write_fragment()])\n"
            "sys.exit('error: saving a checkpoint failed')\n")
    loud = run(["-c", code, "loud"], env)
    assert "was never awaited" in loud.stderr and not loud.stderr.rstrip().endswith("failed")
    quiet = run(["-c", code, "quiet"], env)
    assert quiet.stderr.strip().splitlines() == ["error: saving a checkpoint failed"], quiet.stderr


def test_a_read_ending_after_the_loop_closed_does_not_follow_the_error(env):
    """What made test_damage's zstd test fail once under load: a tensorstore read that ended after
    orbax had closed its event loop handed the loop its result from tensorstore's thread, and the
    RuntimeError ('Event loop is closed') printed as a traceback after the error line. Made here
    on purpose (a thread posting to a closed loop), first without the quieting as the control;
    a loop still open still gets what is posted to it, and quieting twice wraps asyncio once."""
    code = ("import asyncio, sys, threading\n"
            "from run import checkpoint\n"
            "for _ in range(2 if sys.argv[1] == 'quiet' else 0): checkpoint.quiet_failed_saves()\n"
            "print('error: the checkpoint of step 8 is damaged', file=sys.stderr, flush=True)\n"
            "open_loop, closed = asyncio.new_event_loop(), asyncio.new_event_loop()\n"
            "closed.close()\n"
            "got = []\n"
            "def post():\n"
            "    open_loop.call_soon_threadsafe(got.append, 1)\n"
            "    closed.call_soon_threadsafe(print)\n"
            "t = threading.Thread(target=post); t.start(); t.join()\n"
            "open_loop.run_until_complete(asyncio.sleep(0))\n"
            "assert got == [1], got\n")
    loud = run(["-c", code, "loud"], env)
    assert "Event loop is closed" in loud.stderr, loud.stderr
    quiet = run(["-c", code, "quiet"], env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip().splitlines() == ["error: the checkpoint of step 8 is damaged"], \
        quiet.stderr


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_gs_run_directory_without_gcsfs_is_one_line(shakespeare, env):
    r = run(["launch.py", *TINY, "--rundir=gs://no-such-bucket/run"], env)
    assert_one_line_error(r, "gs://no-such-bucket/run: Please install gcsfs")
    assert len(r.stderr.strip().splitlines()) == 1


def test_fingerprints_are_the_sums_of_the_bit_patterns():
    """Against numpy's sums of the same bits (uint64, then mod 2**32) and of murmur3's finaliser
    of them (written out from its reference, uint64 arithmetic mod 2**32), for float32, bfloat16,
    int32 and bool arrays: the same numbers; a change of one element or a swap of two changes
    them, and changes the linear sums cannot see (the array negated, two sign flips, 2**30 added
    to four neighbours' bits) change the hashed one. (The same on N devices:
    test_checkpoint_restores_onto_another_mesh restores, and so checks, on 2 devices what 8 saved
    and on 8 what 2 saved.)"""
    from run.checkpoint import fingerprints

    def fmix32(h):  # MurmurHash3.cpp's fmix32
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) % 2**32
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) % 2**32
        return h ^ (h >> 16)

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(6, 8)).astype(np.float32),
              jnp.asarray(rng.normal(size=(4, 2)), jnp.bfloat16),
              rng.integers(-2**31, 2**31, (10,), dtype=np.int32), np.array([True, False, True]),
              np.array([1.0, np.inf], np.float32)]

    def numpy_sums(x):
        x = np.asarray(x)
        kind = np.uint32 if x.dtype == np.bool_ else np.dtype(f"uint{8 * x.dtype.itemsize}")
        bits = x.astype(kind) if x.dtype == np.bool_ else x.view(kind)
        bits = bits.ravel().astype(np.uint64)
        weights = 2 * np.arange(bits.size, dtype=np.uint64) + 1
        finite = np.isfinite(x).all() if np.issubdtype(x.dtype, np.inexact) or \
            x.dtype == jnp.bfloat16 else True
        keyed = bits ^ ((np.arange(bits.size, dtype=np.uint64) * 0x9E3779B9) % 2**32)
        return [int(finite), int(bits.sum() % 2**32), int((bits * weights).sum() % 2**32),
                int(fmix32(keyed).sum() % 2**32)]

    expected = [numpy_sums(x) for x in arrays]
    assert [v.tolist() for v in fingerprints(arrays)] == expected
    changed, swapped = arrays[0].copy(), arrays[0].copy()
    changed[3, 4] = np.nextafter(changed[3, 4], np.float32(np.inf))
    swapped[[0, 1]] = swapped[[1, 0]]
    for other in (changed, swapped):
        s = fingerprints([other])[0].tolist()
        assert s[1:3] != expected[0][1:3] and s[3] != expected[0][3]
    flipped, raised = arrays[0].copy(), arrays[0].view(np.uint32).copy()
    flipped[0, :2] *= -1
    raised[1, :4] += np.uint32(2**30)
    for other in (-arrays[0], flipped, raised.view(np.float32)):
        s = fingerprints([other])[0].tolist()
        assert s[1:3] == expected[0][1:3] and s[3] != expected[0][3]  # linear sums blind
    assert expected[-1][0] == 0  # inf: not finite


def test_a_checkpoint_of_three_numbers_an_array_is_verified_on_them(capsys):
    """A checkpoint saved before the hashed sum records [finite, sum, weighted sum] an array: it
    restores when those agree (upgrading never sets a run's checkpoints aside) and is damaged
    when one differs."""
    from run.checkpoint import Damaged, checksums, verify

    state = {"w": jnp.arange(6.0)}
    old = {k: v[:3] for k, v in checksums(state).items()}
    verify(7, state, old)
    old["w"][2] += 1
    with pytest.raises(Damaged, match="step 7 is damaged: its array w differs"):
        verify(7, {"w": jnp.arange(6.0)}, old)


def test_launch_without_space_for_the_first_checkpoint_is_refused_before_writing(
        shakespeare, tmp_path, monkeypatch):
    """Its size is the model's parameters and Adam's two moments, float32; a disk with less free
    (the reported free space made smaller) refuses the launch and nothing is created."""
    import shutil as shutil_module

    from run import rundir as rundir_module
    from run.checkpoint import first_checkpoint_bytes

    cfg = tiny_config()
    s = train.setup(cfg, train.make_mesh(cfg))
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(s.model, eqx.is_array)))
    assert first_checkpoint_bytes(cfg) == 3 * 4 * n_params
    real = shutil_module.disk_usage
    usage = lambda path: real(path)._replace(free=3 * 4 * n_params - 1)
    monkeypatch.setattr(rundir_module.shutil, "disk_usage", usage)
    with pytest.raises(UsageError, match=f"no space for a checkpoint in {tmp_path / 'run'}: one "
                                         f"needs {3 * 4 * n_params:,} bytes, "
                                         f"{3 * 4 * n_params - 1:,} are free"):
        rundir_module.open_rundir(str(tmp_path / "run"), "tiny", cfg)
    assert not (tmp_path / "run").exists()


def test_no_space_at_the_first_save_says_none_is_saved_yet(tmp_path, monkeypatch):
    """Not "the checkpoints up to step None are intact"."""
    import run.checkpoint as ckpt

    cfg = tiny()
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(tmp_path), cfg)
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    real = shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: real(p)._replace(free=1))
    with pytest.raises(ckpt.RunError, match=r"no space for the checkpoint of step 4 in .*: it "
                                            r"needs [\d,]+ bytes, 1 bytes are free \(none saved "
                                            r"yet\): free some"):
        save_checkpoint(mngr, 4, s.model, s.opt_state, {})


def test_a_checkpoint_saved_before_checksums_restores_with_a_note(tmp_path, capsys):
    """An older mugpt saved no checksums item: upgrading must not set a run's checkpoints aside.
    Such a checkpoint restores bit for bit, checked for finite values only, and says so."""
    import orbax.checkpoint as ocp

    cfg = tiny()
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(tmp_path), cfg)
    state = {"model": eqx.filter(s.model, eqx.is_array), "opt_state": s.opt_state}
    old_save = ocp.args.Composite(state=ocp.args.StandardSave(state), tally=ocp.args.JsonSave({}))
    mngr.save(1, args=old_save, force=True)  # as save_checkpoint wrote it before checksums
    mngr.wait_until_finished()
    assert (mngr.directory / "1").exists() and not (mngr.directory / "1" / "checksums").exists()
    s2 = train.setup(dataclasses.replace(cfg, seed=1), train.make_mesh(cfg))
    model = restore_checkpoint(mngr, s2.model, s2.opt_state)[0]
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(s.model, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    err = capsys.readouterr().err
    assert "has no checksums (saved by an older mugpt)" in err
    assert "records no config (saved by an older mugpt)" in err
    alone = restore_model(mngr, init_gpt(cfg, jax.random.key(2)), step=1)  # sample.py's read
    for a, b in zip(jax.tree.leaves(eqx.filter(alone, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(s.model, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reading_a_checkpoint_draws_no_random_model(tmp_path, monkeypatch):
    """sample.py, eval.py and export.py read a checkpoint (run.reading.restore_model) into the
    model's shapes alone: a random model drawn first as placeholders took several times the
    model's memory before the checkpoint was read (BENCHMARKS.md). init_gpt may be traced (for
    its shapes) but not run."""
    from run import reading

    cfg = tiny()
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(tmp_path), cfg)
    save_checkpoint(mngr, 1, s.model, s.opt_state, {})
    mngr.wait_until_finished()
    def traced_only(cfg, key, *args):
        assert isinstance(key, jax.core.Tracer), "a random model drawn to read a checkpoint into"
        return init_gpt(cfg, key, *args)

    monkeypatch.setattr(reading, "init_gpt", traced_only)
    model, step = reading.restore_model(epath.Path(tmp_path), cfg, None)
    assert step == 1
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(s.model, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_docs_name_every_field_a_resume_may_change():
    """docs/checkpoints.md lists configs.RESUMABLE field by field: a field made resumable is said
    there too (the list fell behind once: eval_tasks, wandb_project and WSD's decay were missing)."""
    text = (ROOT / "docs/checkpoints.md").read_text()
    assert not [f for f in configs.RESUMABLE if f"`{f}`" not in text]


def test_a_file_where_the_checkpoints_folder_goes_is_one_line(shakespeare, tmp_path, env):
    """A file named checkpoints in the run directory: one line naming it (a NotADirectoryError's
    traceback from orbax's listing), and the file is left as it was."""
    rundir = tmp_path / "run"
    rundir.mkdir()
    (rundir / "checkpoints").write_text("x")
    r = run(launch_args(rundir), env)
    assert_one_line_error(r, f"{rundir / 'checkpoints'} is a file, where a run keeps its "
                             "checkpoints' folder: move it, or pass another --rundir")
    assert (rundir / "checkpoints").read_text() == "x"
