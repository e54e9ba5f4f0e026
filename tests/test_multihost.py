"""Multi-host training, for real on the CPU: launch.py --multihost as two processes of 2 devices
each (jax.distributed on 127.0.0.1, gloo collectives) against one process of 4 devices."""
import dataclasses
import json
import socket

import jax
import numpy as np
import pytest
from etils import epath

import configs
import train
from run.checkpoint import checkpoint_manager, restore_checkpoint
from conftest import ROOT, TINY_RUN, run_each

STEPS = 10
# A tiny model on shakespeare_char; every step logged, evaluations at 0 and STEPS, checkpoints at
# STEPS / 2 and STEPS.
TINY = [*TINY_RUN, "--config.eval_batches=1", "--config.log_interval=1",
        f"--config.eval_interval={STEPS}", f"--config.ckpt_interval={STEPS // 2}",
        f"--config.max_steps={STEPS}"]


# The processes run in conftest.run's environment, not with test_checkpoint's persistent
# compilation cache: a multi-device CPU step loaded from it can run its collectives in different
# orders on different devices and hang (test_checkpoint_restores_onto_another_mesh).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multihost(rundir, *args: str) -> list[list[str]]:
    """The commands of a run as two processes (of 2 devices each: run_each's devices), joined by
    jax.distributed on a free port."""
    port = free_port()
    join = ["--multihost", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
    return [["launch.py", *TINY, f"--rundir={rundir}", *join, f"--process_id={i}", *args]
            for i in range(2)]


def records(rundir) -> dict[int, dict]:
    """metrics.jsonl: step -> the losses and task scores logged at that step (train steps and
    evaluations)."""
    out = {}
    for line in (rundir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["step"], {}).update(
            {k: v for k, v in r.items() if k.endswith("loss") or k.startswith("mc3/")})
    return out


def restored(rundir, cfg: configs.Config) -> list[np.ndarray]:
    """The parameters and optimizer state of the latest checkpoint, restored onto this process's
    devices."""
    cfg = dataclasses.replace(cfg, mesh_replica=1)
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(rundir), cfg, read_only=True)
    model, opt_state, _ = restore_checkpoint(mngr, s.model, s.opt_state)
    return [np.asarray(x) for x in jax.tree.leaves((model, opt_state))]


def test_mesh_and_batch_rows_per_process():
    """make_mesh puts replicas across processes, fsdp within; each process reads only its rows (the
    probe asserts)."""
    port = free_port()
    probe = str(ROOT / "tests/mesh_probe.py")
    results = run_each([[probe, f"127.0.0.1:{port}", str(i)] for i in range(2)], None, 240, [2, 2])
    for i, r in enumerate(results):
        assert r.returncode == 0 and f"process {i}: ok" in r.stdout, r.stderr


@pytest.mark.parametrize("replica", [1, 2])
def test_two_processes_train_as_one(shakespeare, tmp_path, replica):
    """Two processes x 2 devices and one process x 4 devices, on a 1 x 4 (all FSDP) or a 2 x 2
    (replica x fsdp) mesh: the same loss at every step and evaluation, the same downstream
    task's scores (each process's rows gathered), and checkpoints that restore
    to the same state. Process 0 alone prints progress and writes the run directory."""
    # a downstream task scored at each evaluation too (its choices need 32 tokens)
    mesh = [f"--config.mesh_replica={replica}", "--config.eval_tasks=tests/tasks/mc3.jsonl",
            "--config.block_size=32"]
    one, two = tmp_path / "one", tmp_path / "two"
    alone = ["launch.py", *TINY, f"--rundir={one}", *mesh]
    r_one, *r_two = run_each([alone, *multihost(two, *mesh)], None, 240, [4, 2, 2])
    for r in (r_one, *r_two):
        assert r.returncode == 0, r.stderr
    assert f"mesh {{'replica': {replica}, 'fsdp': {4 // replica}}}" in r_two[0].stdout
    assert "step 10: train" in r_two[0].stdout
    # process 1 prints none of it (gloo prints its connections in both, from several threads at
    # once)
    assert not any(text in r_two[1].stdout for text in ("run directory", "parameters", "step"))
    assert "train:" not in r_two[1].stderr  # no progress bar either
    assert len(list(two.glob("events.out.tfevents.*"))) == 1
    assert "--process_id=0" in (two / "run.json").read_text()

    a, b = records(one), records(two)
    assert sorted(a) == sorted(b) == list(range(STEPS + 1))
    assert all(a[s].keys() == b[s].keys() for s in a)
    assert {"mc3/acc", "mc3/acc_norm"} <= a[0].keys() & a[STEPS].keys()
    diffs = [abs(a[s][k] - b[s][k]) for s in a for k in a[s]]
    print(f"mesh {replica} x {4 // replica}: {len(diffs)} losses, "
          f"max |1x4 - 2x2| = {max(diffs):.2e}; "
          f"step {STEPS} loss {a[STEPS]['loss']:.6f} vs {b[STEPS]['loss']:.6f}")
    assert max(diffs) <= 1e-6

    cfg = configs.apply_overrides(configs.load("shakespeare_char_cpu"), [*TINY[1:], *mesh])
    state_one, state_two = restored(one, cfg), restored(two, cfg)
    assert len(state_one) == len(state_two)
    worst = max(float(np.abs(x - y).max()) for x, y in zip(state_one, state_two))
    print(f"mesh {replica} x {4 // replica}: {len(state_one)} restored arrays, "
          f"max |1x4 - 2x2| = {worst:.2e}")
    # gloo's all-reduce sums in another order than one process does, and Adam's
    # g / (sqrt(v) + eps) scales that rounding up where |g| is tiny: 1e-5 is ~0.1% of one step's
    # update here
    for x, y in zip(state_one, state_two):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["data", "loop"])
def test_a_failure_in_one_process_stops_both_with_its_reason(shakespeare, tmp_path, where):
    """data: process 1's data directory lacks train.bin (its fetch failed) and it stops before
    training. loop: process 0 cannot write metrics.jsonl at its first log, after the first
    collectives. Either way the other process, which would wait in its next collective, stops
    within seconds with the reason."""
    rundir = tmp_path / "run"
    if where == "data":
        bad = tmp_path / "bad" / "shakespeare_char"
        bad.mkdir(parents=True)
        for name in ("meta.json", "val.bin"):
            (bad / name).write_bytes((shakespeare / name).read_bytes())
        commands = multihost(rundir)
        commands[1].append(f"--config.data_root={bad.parent}")
        failing, reason = 1, f"{bad / 'train.bin'} is missing"
    else:
        (rundir / "metrics.jsonl.tmp").mkdir(parents=True)
        commands, failing = multihost(rundir), 0
        reason = "IsADirectoryError: [Errno 21] Is a directory"
    results = run_each(commands, None, 120, [2, 2])
    for i, r in enumerate(results):
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1, r.stderr
        prefix = "error: " if i == failing else f"error: process {failing} failed: "
        assert last.startswith(prefix) and reason in last, r.stderr
    # a bad input is one line; a bug shows where it is
    assert ("Traceback" in results[failing].stderr) == (where == "loop")
    assert "Traceback" not in results[1 - failing].stderr
