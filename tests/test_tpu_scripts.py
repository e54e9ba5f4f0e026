"""tpu_scripts/tpu.sh against a stub gcloud that records its argv and plays two TPU workers.

The stub runs each `ssh --command=...` with `bash -c` in one home directory per worker, all at once as gcloud
does, with a `python3` that records its argv, so the tests check what the worker's shell makes of the command,
not only the local argv. `scp` copies the file into each worker's home. Nothing is installed: `setup` is checked
by the python3 calls it makes, and a worker's virtual environment is a python3 that records it was the one run.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tpu_scripts"
SETTINGS = dict(TPU_NAME="my-tpu", ZONE="us-central2-b", PROJECT="my-proj", ACCELERATOR_TYPE="v4-32",
                RUNTIME_VERSION="tpu-ubuntu2204-base")
COMMON = ["--zone=us-central2-b", "--project=my-proj"]
SSH = ["compute", "tpus", "tpu-vm", "ssh", "my-tpu", *COMMON]
# What every verb's command line but setup's starts with: `setup`'s virtual environment first on PATH.
IN_VENV = 'if [ -d "$HOME/mugpt-venv/bin" ]; then PATH="$HOME/mugpt-venv/bin:$PATH"; fi; '
# An argument that a shell would split, unquote, expand or run if it were not quoted.
TRICKY = """--config.note=a b 'c' "d" $HOME `echo hi`; *"""

STUB_GCLOUD = f"""#!{sys.executable}
import json, os, shutil, subprocess, sys
from pathlib import Path
base = Path(os.environ["STUB_DIR"])
with open(base / "record.jsonl", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
argv = sys.argv[1:]
flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
homes = sorted((base / "workers").iterdir())
if flags.get("worker", "all") != "all":
    homes = [homes[int(flags["worker"])]]
if argv[3:4] == ["ssh"]:
    procs = [subprocess.Popen(["bash", "-c", flags["command"]], cwd=home, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=dict(PATH=f"{{base / 'bin'}}:{{os.environ['PATH']}}",
                                                               HOME=str(home), HOSTNAME=home.name))
             for home in homes]
    rc = 0
    for proc in procs:  # each worker's output in one piece, in worker order, so that tests can match lines
        out, err = proc.communicate()
        sys.stdout.buffer.write(out)
        sys.stdout.flush()
        sys.stderr.buffer.write(err)
        sys.stderr.flush()
        rc |= proc.returncode
    sys.exit(rc)
if argv[3:4] == ["scp"]:
    src, dest = argv[4], argv[5].split(":", 1)[1]
    for home in homes:
        shutil.copy(src, home / dest)
"""

# python3 on the workers: records its argv and directory; as launch.py it waits for SIGTERM and records it, or
# fails at once where ~/launch-fails exists.
STUB_PYTHON = f"""#!{sys.executable}
import json, os, signal, sys, time
with open(os.path.expanduser("~/python3-calls.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
if sys.argv[1:2] == ["launch.py"] and os.path.exists(os.path.expanduser("~/launch-fails")):
    print("42 parameters", flush=True)
    sys.exit("error: --rundir=gs://...: No module named 'gcsfs' (pip install gcsfs)")
if sys.argv[1:2] == ["launch.py"]:
    def on_term(*_):
        open(os.path.expanduser("~/got-signal"), "w").write("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("42 parameters", flush=True)
    print("\\rtrain: 0%\\rtrain: 1% step 0 loss 10.9", end="", flush=True)  # a tqdm bar, redrawn with \\r
    time.sleep(60)
"""


@pytest.fixture
def stub(tmp_path):
    """A copy of tpu_scripts/ in a fake repo, the stub gcloud and python3, and two worker homes."""
    repo = tmp_path / "repo"
    shutil.copytree(SCRIPTS, repo / "tpu_scripts", ignore=shutil.ignore_patterns("tpu.env"))
    for rel in ["model.py", "requirements.txt", "configs/__init__.py", "data/owt/meta.json",
                "data/owt/train.bin", "runs/old/metrics.jsonl", ".git/HEAD", "__pycache__/model.pyc",
                "configs/__pycache__/x.pyc"]:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(rel)
    (tmp_path / "bin").mkdir()
    for name, text in [("gcloud", STUB_GCLOUD), ("python3", STUB_PYTHON)]:
        (tmp_path / "bin" / name).write_text(text)
        (tmp_path / "bin" / name).chmod(0o755)
    for i in range(2):
        (tmp_path / "workers" / f"worker{i}").mkdir(parents=True)
    (tmp_path / "tmp").mkdir()
    yield tmp_path
    for pidfile in tmp_path.glob("workers/*/mugpt-logs/train.pid"):  # a stub trainer left by a failed test
        pid = pidfile.read_text().strip()
        try:
            if str(tmp_path / "bin/python3") in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def tpu(stub: Path, *args: str, path: str | None = None, **settings: str) -> subprocess.CompletedProcess:
    """tpu_scripts/tpu.sh ARGS with the stub gcloud first on PATH (or PATH=path) and SETTINGS (or settings) in the
    environment."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update(PATH=path or f"{stub / 'bin'}:{os.environ['PATH']}", STUB_DIR=str(stub), TMPDIR=str(stub / "tmp"),
               **(SETTINGS if not settings else settings))
    return subprocess.run(["bash", str(stub / "repo/tpu_scripts/tpu.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=20)


def bash_quoted(word: str) -> str:
    """word as bash's printf %q writes it (its style differs between bash versions)."""
    return subprocess.run(["bash", "-c", 'printf %q "$1"', "-", word], capture_output=True, text=True).stdout


def calls(stub: Path) -> list[list[str]]:
    path = stub / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def workers(stub: Path) -> list[Path]:
    return sorted((stub / "workers").iterdir())


def python3_calls(home: Path) -> list[dict]:
    return [json.loads(line) for line in (home / "python3-calls.jsonl").read_text().splitlines()]


def make_venv(stub: Path, home: Path) -> Path:
    """A stand-in for setup's ~/mugpt-venv in home: its python3 (and python) notes each call in
    ~/venv-python3-calls, then runs as the stub python3 (exec: the same pid, as launch.py needs)."""
    bin_dir = home / "mugpt-venv/bin"
    bin_dir.mkdir(parents=True)
    for name in ["python3", "python"]:
        (bin_dir / name).write_text(f'#!/bin/sh\necho "$*" >> "$HOME/venv-python3-calls"\n'
                                    f'exec {stub / "bin/python3"} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return home / "venv-python3-calls"


def wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_create_on_demand_spot_and_queued(stub):
    assert tpu(stub, "create").returncode == 0
    assert tpu(stub, "create", "--spot").returncode == 0
    assert tpu(stub, "create", "--queued", "--spot", "--", "--network=my net").returncode == 0
    base = ["compute", "tpus", "tpu-vm", "create", "my-tpu", *COMMON, "--accelerator-type=v4-32",
            "--version=tpu-ubuntu2204-base"]
    queued = ["compute", "tpus", "queued-resources", "create", "my-tpu", "--node-id=my-tpu", *COMMON,
              "--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base", "--spot", "--network=my net"]
    assert calls(stub) == [base, base + ["--spot"], queued]
    bad = tpu(stub, "create", "--preemptible")
    assert bad.returncode != 0 and "--preemptible" in bad.stderr and len(calls(stub)) == 3


def test_delete(stub):
    assert tpu(stub, "delete").returncode == 0
    assert tpu(stub, "delete", "--queued").returncode == 0
    assert calls(stub) == [["compute", "tpus", "tpu-vm", "delete", "my-tpu", *COMMON],
                           ["compute", "tpus", "queued-resources", "delete", "my-tpu", *COMMON, "--force"]]


def test_copy_sends_the_repo_without_runs_data_git_and_bytecode(stub):
    """data/ stays behind, meta.json too (sent alone, data.py on the workers would not prepare the dataset and
    then miss its bins), and the data fetched onto a worker is left as it is."""
    (workers(stub)[0] / "mugpt/data/owt").mkdir(parents=True)
    (workers(stub)[0] / "mugpt/data/owt/meta.json").write_text("the worker's own")
    r = tpu(stub, "copy")
    assert r.returncode == 0, r.stderr
    scp, ssh = calls(stub)
    assert scp[:4] == ["compute", "tpus", "tpu-vm", "scp"]
    assert Path(scp[4]).parent.parent == stub / "tmp" and Path(scp[4]).name == "mugpt.tar.gz"
    assert scp[5:] == ["my-tpu:mugpt.tar.gz", *COMMON, "--worker=all"]
    assert ssh == [*SSH, "--worker=all",
                   f"--command={IN_VENV}mkdir -p ~/mugpt && tar -xzf ~/mugpt.tar.gz -C ~/mugpt && rm ~/mugpt.tar.gz"]
    for home in workers(stub):
        got = sorted(str(p.relative_to(home / "mugpt")) for p in (home / "mugpt").rglob("*") if p.is_file())
        assert got == [".mugpt_git", "configs/__init__.py", *(["data/owt/meta.json"] if home.name == "worker0" else []),
                       "model.py", "requirements.txt", "tpu_scripts/tpu.env.example", "tpu_scripts/tpu.sh"]
        assert json.loads((home / "mugpt/.mugpt_git").read_text()) == {"commit": None, "dirty": None}  # not a checkout
        assert not (home / "mugpt.tar.gz").exists()
    assert list((stub / "tmp").iterdir()) == []  # the local tarball is cleaned up
    assert (workers(stub)[0] / "mugpt/data/owt/meta.json").read_text() == "the worker's own"


def test_copy_records_the_commit_for_run_json(stub, monkeypatch):
    """The copy has no .git: .mugpt_git says which commit it is and whether the tree was dirty, and
    run/rundir.py's git_state reads it there (git finds no repository in the copy)."""
    repo = stub / "repo"
    shutil.rmtree(repo / ".git")
    git = lambda *args: subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                                       capture_output=True, text=True, check=True).stdout.strip()
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "x")
    head = git("rev-parse", "HEAD")
    from run import rundir

    for dirty in (False, True):
        if dirty:
            (repo / "model.py").write_text("edited")
        assert tpu(stub, "copy").returncode == 0
        for home in workers(stub):
            assert json.loads((home / "mugpt/.mugpt_git").read_text()) == {"commit": head, "dirty": dirty}
        # rundir.py as it sits in the copy: run/ under the copy's top, where .mugpt_git is
        monkeypatch.setattr(rundir, "__file__", str(workers(stub)[0] / "mugpt/run/rundir.py"))
        assert rundir.git_state() == {"commit": head, "dirty": dirty}


def test_setup_makes_a_python_3_11_venv_with_jax_tpu_requirements_and_gcsfs(stub):
    """The images' python3 (3.10) installs uv, which makes ~/mugpt-venv with a Python >= 3.11 where there is none
    yet (worker1), and installs into it; a worker with one (worker0) keeps it, and setup does not run it."""
    for home in workers(stub):
        (home / "mugpt").mkdir()
    venv_calls = make_venv(stub, workers(stub)[0])
    r = tpu(stub, "setup")
    assert r.returncode == 0, r.stderr
    assert calls(stub) == [[*SSH, "--worker=all", (
        "--command=cd ~/mugpt && python3 -m pip install --user uv && "
        "{ [ -x ~/mugpt-venv/bin/python ] || python3 -m uv venv --python '>=3.11' ~/mugpt-venv; } && "
        "python3 -m uv pip install --python ~/mugpt-venv/bin/python 'jax[tpu]' -r requirements.txt gcsfs")]]
    for i, home in enumerate(workers(stub)):
        venv = str(home / "mugpt-venv")
        install_uv = ["-m", "pip", "install", "--user", "uv"]
        make = ["-m", "uv", "venv", "--python", ">=3.11", venv]
        install = ["-m", "uv", "pip", "install", "--python", f"{venv}/bin/python", "jax[tpu]", "-r", "requirements.txt",
                   "gcsfs"]
        assert python3_calls(home) == [{"argv": argv, "cwd": str(home / "mugpt")}
                                       for argv in ([install_uv, install] if i == 0 else [install_uv, make, install])]
    assert not venv_calls.exists()


RUNNING = 'pid=$(cat ~/mugpt-logs/train.pid 2>/dev/null) && grep -q launch.py "/proc/$pid/cmdline" 2>/dev/null'
TAIL = ('tail -c 1000000 ~/mugpt-logs/train.log 2>/dev/null | tail -n {} | '
        """awk -F "\\r" "{{ print \\"$HOSTNAME: \\" \\$NF }}\"""")


def launch_command(*args: str) -> str:
    return (f"--command={IN_VENV}if {RUNNING}; then echo \"$HOSTNAME: launch.py is already running (pid $pid)\" >&2; "
            "exit 1; fi; mkdir -p ~/mugpt-logs && cd ~/mugpt && echo \"== $(date)\" >> ~/mugpt-logs/train.log && "
            "{ setsid nohup bash -c 'echo $$ > ~/mugpt-logs/train.pid && exec \"$@\"' mugpt python3 launch.py "
            f"{' '.join(map(bash_quoted, args))} --multihost >> ~/mugpt-logs/train.log 2>&1 < /dev/null & }} && "
            f"sleep 5 && if {RUNNING}; then echo \"$HOSTNAME: launch.py is running (pid $pid)\"; "
            "else echo \"$HOSTNAME: launch.py exited within 5 s; the end of ~/mugpt-logs/train.log:\"; "
            f"{TAIL.format(10)}; exit 1; fi")


def test_launch_status_logs_stop(stub):
    """launch detaches launch.py with the arguments intact, in worker0's virtual environment; status sees it;
    stop delivers SIGTERM to it."""
    for home in workers(stub):
        (home / "mugpt").mkdir()
    venv_calls = make_venv(stub, workers(stub)[0])
    args = ["--config=openwebtext", "--rundir=gs://my-bucket/runs/owt", TRICKY]
    t0 = time.time()
    r = tpu(stub, "launch", "--", *args)
    assert r.returncode == 0, r.stderr
    assert time.time() - t0 < 20  # returned after its 5 s check: the trainer (sleeping 60 s) is detached
    assert calls(stub) == [[*SSH, "--worker=all", launch_command(*args)]]
    pids = []
    for home in workers(stub):
        assert wait_for(lambda: "step 0" in (home / "mugpt-logs/train.log").read_text())
        assert python3_calls(home) == [{"argv": ["launch.py", *args, "--multihost"], "cwd": str(home / "mugpt")}]
        pid = int((home / "mugpt-logs/train.pid").read_text())
        assert os.getsid(pid) == pid != os.getsid(0)  # its own session: ssh's hangup does not reach it
        assert f"{home.name}: launch.py is running (pid {pid})\n" in r.stdout
        pids.append(pid)
    assert venv_calls.read_text().startswith("launch.py --config=openwebtext ")  # worker0's python3 was the venv's

    again = tpu(stub, "launch", "--", "--config=openwebtext")
    assert again.returncode != 0 and "already running" in again.stderr
    assert all(len(python3_calls(home)) == 1 for home in workers(stub))

    status = tpu(stub, "status")
    assert status.returncode == 0
    assert calls(stub)[-1] == [*SSH, "--worker=all", (
        f"--command={IN_VENV}if {RUNNING}; then echo \"$HOSTNAME: running, pid $pid\"; "
        "else echo \"$HOSTNAME: not running\"; fi; " + TAIL.format(1))]
    for home, pid in zip(workers(stub), pids):
        assert f"{home.name}: running, pid {pid}\n{home.name}: train: 1% step 0 loss 10.9\n" in status.stdout

    logs = tpu(stub, "logs")
    assert calls(stub)[-1] == [*SSH, "--worker=all", f"--command={IN_VENV}" + TAIL.format(50)]
    for home in workers(stub):  # the whole log; of the bar, only its last redraw
        assert f"{home.name}: == " in logs.stdout and f"{home.name}: 42 parameters" in logs.stdout
        assert f"{home.name}: train: 1% step 0 loss 10.9\n" in logs.stdout and "train: 0%" not in logs.stdout
    logs1 = tpu(stub, "logs", "1")
    assert calls(stub)[-1] == [*SSH, "--worker=1", f"--command={IN_VENV}" + TAIL.format(50)]
    assert "worker1: train: 1%" in logs1.stdout and "worker0" not in logs1.stdout

    stop = tpu(stub, "stop")
    assert stop.returncode == 0
    assert calls(stub)[-1] == [*SSH, "--worker=all", (
        f"--command={IN_VENV}if {RUNNING}; then kill -TERM \"$pid\" && echo \"$HOSTNAME: sent SIGTERM to launch.py, "
        "pid $pid\"; else echo \"$HOSTNAME: launch.py is not running\"; fi")]
    for home in workers(stub):
        assert wait_for(lambda: (home / "got-signal").exists()) and (home / "got-signal").read_text() == "SIGTERM"
    assert wait_for(lambda: "not running" in tpu(stub, "status").stdout)
    assert tpu(stub, "status").stdout.count("not running") == 2


def test_launch_fails_where_launch_py_has_already_exited(stub):
    """launch waits 5 s, then shows the log's end of a worker whose launch.py exited, and exits non-zero."""
    for home in workers(stub):
        (home / "mugpt").mkdir()
    w0, w1 = workers(stub)
    (w0 / "launch-fails").touch()
    r = tpu(stub, "launch", "--", "--config=openwebtext", "--rundir=gs://my-bucket/runs/owt")
    assert r.returncode != 0
    assert ("worker0: launch.py exited within 5 s; the end of ~/mugpt-logs/train.log:\n"
            "worker0: == ") in r.stdout  # the log's last lines: this launch's, from its date line on
    assert ("worker0: 42 parameters\n"
            "worker0: error: --rundir=gs://...: No module named 'gcsfs' (pip install gcsfs)\n") in r.stdout
    assert wait_for(lambda: (w1 / "mugpt-logs/train.pid").exists())
    pid = int((w1 / "mugpt-logs/train.pid").read_text())
    assert f"worker1: launch.py is running (pid {pid})\n" in r.stdout


def test_stop_leaves_an_unrelated_process_with_a_stale_pid_alone(stub):
    other = subprocess.Popen(["sleep", "30"])
    try:
        home = workers(stub)[0]
        (home / "mugpt-logs").mkdir()
        (home / "mugpt-logs/train.pid").write_text(str(other.pid))
        r = tpu(stub, "stop")
        assert r.returncode == 0 and "worker0: launch.py is not running" in r.stdout
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_ssh_runs_one_argv_on_every_worker(stub):
    """In ~/mugpt where it exists, else in the home directory; with the venv's python3 where there is one."""
    w0, w1 = workers(stub)
    (w0 / "mugpt").mkdir()
    venv_calls = make_venv(stub, w1)
    r = tpu(stub, "ssh", "--", "python3", "data.py", TRICKY)
    assert r.returncode == 0, r.stderr
    assert calls(stub) == [[*SSH, "--worker=all",
                            f"--command={IN_VENV}cd ~/mugpt 2>/dev/null; python3 data.py {bash_quoted(TRICKY)}"]]
    assert python3_calls(w0) == [{"argv": ["data.py", TRICKY], "cwd": str(w0 / "mugpt")}]
    assert python3_calls(w1) == [{"argv": ["data.py", TRICKY], "cwd": str(w1)}]
    assert venv_calls.read_text() == f"data.py {TRICKY}\n" and not (w0 / "venv-python3-calls").exists()


def test_the_environment_overrides_tpu_env(stub):
    (stub / "repo/tpu_scripts/tpu.env").write_text(textwrap.dedent("""\
        TPU_NAME=file-tpu
        ZONE=file-zone
        PROJECT=file-proj
        """))
    assert tpu(stub, "delete", TPU_NAME="env-tpu", ZONE="").returncode == 0  # empty counts as unset
    assert calls(stub) == [["compute", "tpus", "tpu-vm", "delete", "env-tpu", "--zone=file-zone",
                            "--project=file-proj"]]


@pytest.mark.parametrize("verb, missing", [("status", "ZONE"), ("create", "RUNTIME_VERSION")])
def test_a_missing_setting_is_a_one_line_error_naming_it(stub, verb, missing):
    r = tpu(stub, verb, **{k: v for k, v in SETTINGS.items() if k != missing})
    assert r.returncode != 0 and calls(stub) == []
    assert r.stderr.count("\n") == 1 and missing in r.stderr


@pytest.mark.parametrize("args", [("launch",), ("launch", "--"), ("ssh",), ("frobnicate",), ("delete", "--spot"),
                                  ("delete", "--queued", "now"), ("copy", "--dry-run"), ("setup", "--upgrade"),
                                  ("status", "0"), ("stop", "--force"), ("logs", "abc"), ("logs", "-1"), ("logs", ""),
                                  ("logs", "0", "1")], ids=" ".join)
def test_usage_errors(stub, args):
    """A verb given what it does not take says so in one line and runs nothing (copy --dry-run copies nothing)."""
    r = tpu(stub, *args)
    assert r.returncode == 1 and r.stderr.startswith("tpu.sh: ") and r.stderr.count("\n") == 1, r.stderr
    assert calls(stub) == []  # no gcloud command ran
    assert calls(stub) == []


def test_help_lists_the_verbs(stub):
    assert "launch -- ARGS" in tpu(stub, "--help").stdout


def test_without_gcloud_a_one_line_error_says_to_install_it(stub):
    bin_dir = stub / "bin-without-gcloud"
    bin_dir.mkdir()
    for tool in ["bash", "dirname"]:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    r = tpu(stub, "status", path=str(bin_dir))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "install the Google Cloud CLI" in r.stderr, r.stderr


def test_shellcheck_passes_on_every_script():
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is not installed (CI installs it in .ci/run)")
        pytest.skip("shellcheck is not installed")
    scripts = sorted(p for p in SCRIPTS.iterdir() if p.suffix == ".sh" or p.name.endswith(".example"))
    assert scripts
    scripts.append(ROOT / "bench_gpu.sh")  # a GPU's scarce minutes are not spent on a shell slip
    r = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
