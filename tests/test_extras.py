"""The optional extras (requirements-export.txt): wandb logging, offline, continued on resume;
and a training run that imports none of them."""
import json
import re

import pytest

from conftest import TINY_RUN, run

EXTRAS = ("torch", "transformers", "lm_eval", "wandb", "tokenizers", "safetensors")


def test_training_imports_none_of_the_extras(shakespeare, tmp_path):
    code = (f"import sys, runpy\nsys.argv = ['launch.py', *{TINY_RUN!r}, '--config.max_steps=2', "
            f"'--rundir={tmp_path / 'run'}']\n"
            "try:\n    runpy.run_path('launch.py', run_name='__main__')\nfinally:\n"
            f"    print(sorted(m for m in {EXTRAS!r} if m in sys.modules))")
    r = run(["-c", code])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_wandb_offline_and_a_resumed_run_continues_the_same_wandb_run(shakespeare, tmp_path):
    pytest.importorskip("wandb")
    rundir = tmp_path / "run"
    args = [*TINY_RUN, f"--rundir={rundir}", "--config.eval_interval=4", "--config.eval_batches=1",
            "--config.log_interval=2", "--config.ckpt_interval=4", "--config.wandb_project=mugpt"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for steps in (4, 8):  # the second launch resumes from the checkpoint of step 4
        r = run(["launch.py", *args, f"--config.max_steps={steps}"], env)
        assert r.returncode == 0, r.stderr[-2000:]
    run_id = (rundir / "wandb_id").read_text()
    runs = sorted((rundir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d+_\d+-{run_id}", p.name)
                                  for p in runs)
    for p in runs:  # wandb's own record files hold the logged tags
        records = (p / f"run-{run_id}.wandb").read_bytes()
        assert b"loss/batch" in records and b"loss/val" in records
        # the resolved config (fields the command line does not name) and the text sample
        assert b"rope_base" in records and b"vocab_multiple" in records
        assert b"sample" in records
    assert json.loads((rundir / "config.json").read_text())["wandb_project"] == "mugpt"


def test_wandb_without_a_login_is_one_line_and_writes_nothing(shakespeare, tmp_path):
    """--config.wandb_project online with no API key (a fresh machine): one line naming the ways
    out, before the run directory's logs are touched; the refused launch leaves no config.json
    that would fail every resume the same way."""
    pytest.importorskip("wandb")
    rundir = tmp_path / "run"
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(tmp_path), "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config")}
    r = run(["launch.py", *TINY_RUN, f"--rundir={rundir}", "--config.max_steps=2",
             "--config.wandb_project=mugpt"], env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --config.wandb_project=mugpt: wandb could not start a run") \
        and "wandb login" in line and "WANDB_MODE=offline" in line, line
    assert not (rundir / "config.json").exists() and not (rundir / "wandb_id").exists()
    assert not list(rundir.glob("events.out.tfevents.*"))
