"""bench.py prints one valid JSON line with every field, for a tiny config; bench_gpu.sh's every
part runs, rehearsed on the CPU."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, run

TINY = ["--config=shakespeare_char_cpu", "--config.n_layer=2", "--config.d_model=32", "--config.n_head=2",
        "--config.block_size=16", "--config.batch_size=4"]
FIELDS = {"name", "device_kind", "device_count", "jax_version", "tokens_per_s", "step_ms", "flops_per_token",
          "flops_formula", "mfu", "compile_s", "peak_memory_bytes", "compute_dtype", "remat", "scan_unroll",
          "kernels", "matmul_peak_flops", "fraction_of_matmul_peak", "flops_per_token_causal", "mfu_causal",
          "peak_flops", "xla_flags", "memory_fraction"}


def test_bench_prints_one_json_line_with_every_field():
    r = run(["bench.py", "--steps=3", *TINY])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert FIELDS <= out.keys()
    assert out["device_kind"] == "cpu" and out["mfu"] is None  # no datasheet peak: no made-up MFU
    assert out["mfu_causal"] is None and out["peak_flops"] is None
    assert out["memory_fraction"] is None  # a GPU's allocator alone reads it
    assert out["kernels"] == []  # fused kernels run on a GPU only
    assert out["tokens_per_s"] == pytest.approx(4 * 16 / (out["step_ms"] / 1e3), rel=0.01)
    L, D, T, V = 2, 32, 16, 128
    assert out["flops_per_token"] == 6 * (L * 12 * D * D + D * V) + 12 * L * D * T
    assert out["flops_per_token_causal"] == 6 * (L * 12 * D * D + D * V) + 6 * L * D * T  # H K = D
    assert 0 < out["fraction_of_matmul_peak"] < 1.5 and out["compile_s"] > 0


@pytest.mark.parametrize("arg, error", [("--config.n_head=3", "error: d_model=128 is not divisible by n_head=3"),
                                        ("--steps=0", "error: --steps=0 must be at least 1"),
                                        ("--trace=/proc/mugpt", "error: cannot write --trace=/proc/mugpt"),
                                        ("--config.mlp_ratio=600000000000", "error: out of memory (RESOURCE_EXHAUSTED")])
def test_bench_rejects_bad_input_in_one_line(arg, error):
    r = run(["bench.py", "--config=shakespeare_char_cpu", arg])
    assert r.returncode != 0 and r.stderr.strip().startswith(error)
    assert "Traceback" not in r.stderr


def test_bench_torch_reports_both_step_times_and_their_ratio():
    pytest.importorskip("torch")
    r = run(["bench.py", "--steps=20", "--torch", *TINY])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["torch_step_ms"] > 0 and out["step_ms"] > 0
    assert out["step_over_torch"] == pytest.approx(out["step_ms"] / out["torch_step_ms"], rel=0.01)


@pytest.mark.parametrize("devices", [2, 1])
def test_bench_trace_prints_the_costliest_ops(tmp_path, devices):
    """--trace writes a profile (tensorboard's xplane, perfetto's json) and prints to stderr the XLA ops that took
    the most time, largest first; stdout stays one JSON line. Two devices training data-parallel sum their
    gradients in an all-reduce, which must be among the ops; one device has none."""
    r = run(["bench.py", "--steps=5", *TINY, f"--config.mesh_replica={devices}", f"--trace={tmp_path}"],
            {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and json.loads(r.stdout)["device_count"] == devices
    assert json.loads(r.stdout)["xla_flags"] == f"--xla_force_host_platform_device_count={devices}"
    ops = [(float(ms), name) for ms, name in re.findall(r"^ +(\d+\.\d+)  (\S+)$", r.stderr, re.M)]
    assert ops and all(re.fullmatch(r"[a-z][\w-]*(\.\d+)?", name) for _, name in ops), r.stderr
    assert [ms for ms, _ in ops] == sorted((ms for ms, _ in ops), reverse=True) and ops[-1][0] >= 0
    assert any(name.startswith("all-reduce") for _, name in ops) == (devices == 2)
    assert list(tmp_path.rglob("*.xplane.pb")) and list(tmp_path.rglob("*.trace.json.gz"))


def test_bench_time_to_reports_the_first_evaluation_at_the_target(shakespeare, tmp_path):
    """--time-to trains and reads the run's val losses back (tensorboard's reader): a target above
    the initial loss ln 128 (the padded vocab) is reached at step 0's evaluation."""
    args = ["bench.py", *TINY, "--config.max_steps=2", "--config.eval_interval=1",
            "--config.eval_batches=1"]
    reached = json.loads(run([*args, "--time-to=10", f"--rundir={tmp_path / 'a'}"]).stdout)
    assert reached["reached"] and reached["step"] == 0 and 0 < reached["wall_s"]
    assert reached["val_loss"] == pytest.approx(math.log(128), abs=0.1)  # zero readout: uniform
    assert reached["command"].endswith("--time-to=10 --rundir=" + str(tmp_path / "a"))
    # again into that run: it would resume the run and time its old events
    again = run([*args, "--time-to=10", f"--rundir={tmp_path / 'a'}"])
    assert again.returncode == 1 and again.stderr.strip().startswith(
        f"error: --rundir={tmp_path / 'a'} is not empty: --time-to times a run from step 0")


@pytest.mark.parametrize("command", ["launch", "bench"])
@pytest.mark.parametrize("given", [None, "0.5"])
def test_the_gpu_memory_fraction_defaults_to_0_9_unless_given(monkeypatch, command, given):
    """launch.py and bench.py set XLA_PYTHON_CLIENT_MEM_FRACTION before JAX's GPU backend starts
    (checked here by a run that stops at its config check), and leave a value the user set."""
    import signal

    import bench
    import launch

    if given is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", given)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # launch.main's handlers: not here
    bad = ["--config=shakespeare_char_cpu", "--config.batch_size=7", "--config.grad_accum=2"]
    monkeypatch.setattr("sys.argv", [f"{command}.py", *bad])
    with pytest.raises(SystemExit, match="batch_size=7 is not divisible"):
        (launch if command == "launch" else bench).main()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == (given or "0.9")


def test_bench_torch_refuses_a_model_that_is_not_its_baseline():
    """tools/bench_torch.py is a fixed GPT: it takes the model bench.py times only when their
    parameters match (the plain config), and refuses one model.py's edits made another (here tied
    embeddings: one matrix fewer), or a variant with as many parameters (ALiBi, dropout), rather
    than time two different models side by side."""
    pytest.importorskip("torch")
    from conftest import tiny
    from test_model import random_gpt
    from run.errors import UsageError
    from tools.bench_torch import torch_step

    cfg = tiny(n_layer=1)
    torch_step(cfg, random_gpt(cfg))
    tied = tiny(n_layer=1, tie_embeddings=True)
    with pytest.raises(UsageError, match=r"^--torch times tools/bench_torch.py's fixed GPT \(.* "
                                         r"parameters\), not this model"):
        torch_step(tied, random_gpt(tied))
    for variant in ({"position": "alibi"}, {"dropout": 0.1}):  # as many parameters, another model
        other = tiny(n_layer=1, **variant)
        with pytest.raises(UsageError, match=r"^--torch times tools/bench_torch.py's fixed GPT, "
                                             r"which has (position=rope|dropout=0.0), not "):
            torch_step(other, random_gpt(other))


def test_bench_refuses_a_folder_it_cannot_write_before_timing(tmp_path):
    """--checkpoint and --time-to's --rundir are written at the end: a file in the way was a
    NotADirectoryError traceback after the timing. --rundir without --time-to was ignored."""
    (tmp_path / "file").write_text("")
    where = f"{tmp_path / 'file'} is not a folder this user can write in"
    for args, error in [([f"--checkpoint={tmp_path / 'file' / 'ck'}"],
                         f"--checkpoint={tmp_path / 'file' / 'ck'}: {where}; name another"),
                        (["--time-to=3", f"--rundir={tmp_path / 'file'}"],
                         f"--rundir={tmp_path / 'file'}: {where}; name another --rundir"),
                        ([f"--rundir={tmp_path / 'run'}"],
                         "--rundir is --time-to's run directory: add --time-to=LOSS or drop it"),
                        # nan is never reached (all max_steps trained), inf at step 0
                        *[([f"--time-to={v}", f"--rundir={tmp_path / 'run'}"],
                           f"--time-to={float(v)} must be a loss above 0 and finite")
                          for v in ("nan", "inf", "-1", "0")]]:
        r = run(["bench.py", *TINY, "--steps=1", "--config.max_steps=1", *args])
        assert r.returncode == 1 and r.stderr.startswith(f"error: {error}"), r.stderr
        assert len(r.stderr.splitlines()) == 1 and not (tmp_path / "run").exists()


# bench_gpu.sh's calls made tiny for a CPU: appended last, these overrides win over the script's
# (4 heads: the script's grouped-query line has 4 key/value heads; 32 sequences: openwebtext_xl's
# 32 microbatches)
REHEARSAL = ["--config.n_layer=2", "--config.d_model=32", "--config.n_head=4",
             "--config.block_size=32", "--config.batch_size=32", "--config.max_steps=2",
             "--config.eval_interval=1", "--config.eval_batches=1",
             "--config.compute_dtype=float32"]


def test_bench_gpu_sh_runs_every_part_on_the_cpu(shakespeare, tmp_path, env):
    """A device is lent for minutes, rarely: bench_gpu.sh's every part is rehearsed here with tiny
    models (a `python` on PATH appends REHEARSAL and one step to each measurement, an
    `nvidia-smi` says one GPU), so that a renamed field, module or flag fails here and not on the
    GPU. Every measurement gives its JSON line; each fast path is set aside once; the checks
    pass."""
    from fused import fast_paths

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tiny = " ".join(REHEARSAL)
    (bin_dir / "python").write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = bench.py ] || { [ "$1" = - ] && [ $# -gt 1 ]; }; then\n'
        f'  exec {sys.executable} "$@" {tiny} --steps=1\n'
        'elif [ "$1 $2" = "-m tools.optimizer_sweep" ]; then\n'
        f'  exec {sys.executable} "$@" {tiny} --steps=10 --seeds=2\n'
        f'fi\nexec {sys.executable} "$@"\n')
    (bin_dir / "nvidia-smi").write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -L ]; then echo "GPU 0: rehearsal"; else echo "name"; echo "rehearsal"; fi\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    out = tmp_path / "out"
    env = {**env, "BUDGET": "1200", "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}
    r = subprocess.run(["bash", "bench_gpu.sh", str(out), "mfu", "time", "fast", "trace", "check",
                        "more", "optim"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    broken = [line for line in lines if "failed" in line or "skipped" in line]
    assert not broken, (broken, (out / "stderr.log").read_text()[-3000:])
    names = {p.name for p in fast_paths.FAST_PATHS}  # attend's two: cuDNN's and the TPU's
    assert {line.get("without") for line in lines} - {None} == names
    assert {line.get("qk_norm_rope_rows") for line in lines} - {None} == {128, 256}
    assert any("--xla_gpu_enable_cublaslt=true" in line.get("xla_flags", "") for line in lines)
    assert [line["reached"] for line in lines if "target_val_loss" in line] == [False, False]
    assert len(lines) == 3 + 1 + 6 + len(names) + 1 + 5  # mfu, time, fast, trace, more
    check = (out / "check.log").read_text()
    assert "edit caught" in check and " passed" in check and "failed" not in check, check
    assert (out / "optimizers_gpu" / "README.md").is_file()
