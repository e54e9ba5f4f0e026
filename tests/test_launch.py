"""The CLI: typed overrides, one-line errors for bad input, and a short run end to end."""
import dataclasses
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import configs
from run.errors import UsageError
from conftest import ROOT, run

# The CPU split into 2 devices, as a user splits it to train data-parallel on 2 cores
SPLIT_CPU = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def test_overrides_parse_to_the_field_types():
    cfg = configs.apply_overrides(configs.load("shakespeare_char_cpu"), [
        "--config.learning_rate=3e-4", "--config.n_layer=2", "--config.tie_embeddings=true",
        "--config.remat=save_dots", "--config.dataset=mine"])
    got = (cfg.learning_rate, cfg.n_layer, cfg.tie_embeddings, cfg.remat, cfg.dataset)
    assert got == (3e-4, 2, True, "save_dots", "mine")
    assert isinstance(cfg.learning_rate, float) and isinstance(cfg.n_layer, int)


@pytest.mark.parametrize("arg,message", [
    ("--config.n_layers=2", "unknown config field 'n_layers'; did you mean n_layer"),
    ("--config.n_layer=two", "n_layer='two': expected int"),
    ("--config.n_layer=2.5", "n_layer='2.5': expected int"),
    ("--config.learning_rate=fast", "learning_rate='fast': expected float"),
    ("--config.tie_embeddings=maybe", "expected true or false"),
    ("--config.remat=some", "allowed values are none, full, save_dots"),
    ("--n_layer=2", "overrides look like --config.FIELD=VALUE"),
])
def test_bad_overrides_name_the_field(arg, message):
    with pytest.raises(UsageError, match=message):
        configs.apply_overrides(configs.load("shakespeare_char_cpu"), [arg])


@pytest.mark.parametrize("kind", [tuple[int, int], list[int], dict[str, int] | None])
def test_a_field_type_the_command_line_cannot_parse_is_one_line(kind):
    """A field a researcher adds with a type parse_value does not know: an error, not tuple("2,4")
    or a TypeError."""
    message = r"^--config.sizes: a field of type .* is set in a config module"
    with pytest.raises(UsageError, match=message):
        configs.parse_value("sizes", kind, "2,4")


def test_an_optional_field_parses_its_type_or_none():
    assert configs.parse_value("n_kv_head", int | None, "2") == 2
    assert configs.parse_value("n_kv_head", int | None, "None") is None
    with pytest.raises(UsageError, match=r"^--config.n_kv_head='two': expected int$"):
        configs.parse_value("n_kv_head", int | None, "two")


@pytest.mark.parametrize("field,value,message", [
    # a negative one would flip the gradient
    ("grad_clip", -1.0, "grad_clip=-1.0 must be finite and >= 0 (0: no clipping)"),
    ("min_lr", 1.0, "min_lr=1.0 is above learning_rate=0.004"),  # the "decay" would raise the LR
    ("warmup_steps", -5, "warmup_steps=-5 must be >= 0"),
    ("rope_base", 0.0, "rope_base=0.0 must be > 0 and finite"),
    ("alpha_out", 0.0, "alpha_out=0.0 must be > 0 and finite"),
    # numpy's generator would fail after the run directory is written
    ("seed", -1, "seed=-1 must be in [0, 2**31)"),
    ("seed", 2**64, "seed=18446744073709551616 must be in [0, 2**31)"),  # jax.random.key's overflow
    ("adam_eps", 1e300, "adam_eps=1e+300 must be > 0 and finite in float32"),  # inf: no update
    ("mlp_ratio", 0, "mlp_ratio=0 must be > 0 and finite"),  # an MLP of no width
    # a ZeroDivisionError in check itself
    ("mesh_replica", 0, "mesh_replica=0 must be at least 1"),
    ("dataset", "", "dataset is empty: name a folder of data/"),
    # an OverflowError from the schedule's jit, a traceback after the run directory was made
    ("max_steps", 3_000_000_000, "max_steps=3000000000 must be below 2**31"),
    ("warmup_steps", 2**31, "warmup_steps=2147483648 must be below 2**31"),
    # an out-of-memory line that advised a smaller microbatch
    ("vocab_multiple", 10**8, "vocab_multiple=100000000 must be at most 4096"),
])
def test_bad_values_name_the_field(field, value, message):
    cfg = configs.load("shakespeare_char_cpu")
    cfg.check(2)  # control: the config itself passes
    with pytest.raises(UsageError) as e:
        dataclasses.replace(cfg, **{field: value}).check(2)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("field,value,message", [
    # trained SP while config.json said muP
    ("param", "muP", "param='muP': allowed values are 'sp', 'mup'"),
    # a non-empty string is truthy
    ("tie_embeddings", "false", "tie_embeddings='false' must be true or false"),
    ("compute_dtype", "fp16", "compute_dtype='fp16': allowed values are 'float32', 'bfloat16'"),
    ("batch_size", 12.0, "batch_size=12.0 must be an integer"),
    ("n_layer", "2", "n_layer='2' must be an integer"),
    ("learning_rate", "1e-3", "learning_rate='1e-3' must be a number"),
    ("min_lr", None, "min_lr=None must be a number"),
    ("dataset", 3, "dataset=3 must be a string"),
    ("learning_rate", [1e-3], "learning_rate=[0.001] must be a number"),  # a TypeError in check
])
def test_a_config_module_value_of_the_wrong_type_is_refused(field, value, message):
    """A config module sets fields in Python, past the command line's parsing: Config checks each
    type itself. Numbers pass where they belong (an int for a float field, numpy's integers)."""
    with pytest.raises(UsageError) as e:
        configs.Config(**{field: value})
    assert str(e.value) == message
    configs.Config(learning_rate=1, n_layer=np.int64(3), param="mup", tie_embeddings=True)


# (configs/NAME.py's text, what the one line must say after "error: configs/NAME.py: ")
MODULES = [
    ("from configs import Config\nconfig = Config(n_layer=2\n",
     "SyntaxError: '(' was never closed ({name}.py, line 2)"),
    ("from configs import Config\nconfg = Config()\n",
     "AttributeError: module 'configs.{name}' has no attribute 'config'"),
    ("from configs import Config\nconfig = Config(n_layers=2)\n",
     "TypeError: Config.__init__() got an unexpected keyword argument 'n_layers'"),
    ("config = dict(n_layer=2)\n", "`config` is a dict, not a Config: write config = Config(...)"),
    ("from dataclasses import replace\nfrom configs.shakespeare_char_cpu import config as base\n"
     "config = replace(base, param='muP')\n", "param='muP': allowed values are 'sp', 'mup'"),
]


@pytest.mark.parametrize("text,message", MODULES)
def test_a_broken_config_module_is_one_line(shakespeare, tmp_path, text, message):
    """Run in a copy of the repo: a broken module in the repo's own configs/ would be read by the
    tests that list every config while it is there (pytest -n runs them at the same time)."""
    name, repo = f"broken_{MODULES.index((text, message))}", tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", "data", "runs", "docs", "__pycache__"))
    (repo / "data").symlink_to(ROOT / "data")
    (repo / "configs" / f"{name}.py").write_text(text)
    r = run(["launch.py", f"--config={name}", f"--rundir={tmp_path / 'run'}"], cwd=repo)
    expected = f"error: configs/{name}.py: {message.format(name=name)}"
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [expected], r.stderr
    assert not (tmp_path / "run").exists()


def test_every_config_module_loads_and_checks():
    shipped = {"shakespeare_char", "shakespeare_char_cpu", "openwebtext", "openwebtext_xl"}
    assert shipped <= set(configs.available())
    for name in configs.available():
        cfg = configs.load(name)
        cfg.check(cfg.mesh_replica)  # the fewest devices its mesh takes
    xl = configs.load("openwebtext_xl")
    shape = (xl.n_layer, xl.n_head, xl.d_model, xl.head_dim, xl.model_vocab)
    assert shape == (48, 25, 1600, 64, 50304)


# (arguments after --config=shakespeare_char_cpu, what the one line must say), on SPLIT_CPU
BAD_INPUTS = [
    (["--config=nope"], "unknown config 'nope'; available: openwebtext"),
    (["--config.d_model=130"], "d_model=130 is not divisible by n_head=4"),
    (["--config.d_model=12", "--config.n_head=4"], "head_dim=3 (d_model/n_head) is odd"),
    (["--config.batch_size=10", "--config.grad_accum=4"],
     "batch_size=10 is not divisible by devices x grad_accum"),
    (["--config.block_size=200000"], "block_size=200000 (+1 for the targets) is longer"),
    (["--config.dataset=nodata"], "prepare it with `python data.py nodata`"),
    (["--config.loss_chunks=5"], "loss_chunks=5 does not divide the 12 sequences of a microbatch"),
    # each replica's loss takes its 6: a traceback from the chunks' reshape at the first step
    (["--config.loss_chunks=4", "--config.mesh_replica=2"],
     "loss_chunks=4 does not divide the 6 sequences of a microbatch on each replica "
     "(12 / mesh_replica=2)"),
    (["--config.vocab_size=50"], "beyond the model's vocab_size=50; set --config.vocab_size=65"),
    (["--config.mesh_replica=3"], "mesh_replica=3 does not divide the 2 devices (on a CPU, "
                                  "JAX_NUM_CPU_DEVICES=N splits it"),
    (["--config.learning_rate=1e39"],
     "learning_rate=1e+39 and min_lr=0.0002 must be finite in float32"),
    (["--config.adam_eps=0"], "adam_eps=0.0 must be > 0"),
    (["--config=shakespeare_char_cpu.py"],
     "unknown config 'shakespeare_char_cpu.py'; did you mean --config=shakespeare_char_cpu?"),
    (["--config=configs/shakespeare_char_cpu.py"],
     "unknown config 'configs/shakespeare_char_cpu.py'; did you mean --config=shakespeare_char_cpu?"),
    (["--config=shakespere_char_cpu"], "did you mean --config=shakespeare_char_cpu or"),
    # multi-host flags: without --multihost each host would train alone into the shared run
    # directory
    (["--process_id=1", "--num_processes=2", "--coordinator_address=127.0.0.1:1234"],
     "--coordinator_address is for multi-host runs: add --multihost"),
    (["--multihost", "--coordinator_address=127.0.0.1:1234", "--num_processes=2"],
     "--multihost: The process id of the current process must be defined"),
    (["--multihost", "--coordinator_address=127.0.0.1:1234", "--num_processes=2",
      "--process_id=5"], "process_id < num_processes"),
    (["--multihost", "--coordinator_address=nohost", "--num_processes=1", "--process_id=0"],
     "--coordinator_address=nohost: expected HOST:PORT"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_is_one_line_without_traceback(shakespeare, tmp_path, args, message):
    if not args[0].startswith("--config="):
        args = ["--config=shakespeare_char_cpu", *args]
    r = run(["launch.py", *args, f"--rundir={tmp_path / 'run'}"], SPLIT_CPU)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # nothing was written


def test_out_of_memory_is_one_line_naming_the_fix(shakespeare, tmp_path):
    """A model that cannot fit stops with one line that says what to change, not JAX's traceback.
    Its MLP weights (157 PB) are past any x86-64 address space, so the allocator refuses them at
    once whatever the machine. --debug saves no checkpoint, so the launch's check of the disk for
    one (which would refuse this model first) does not apply."""
    r = run(["launch.py", "--config=shakespeare_char_cpu", "--config.mlp_ratio=600000000000",
             f"--rundir={tmp_path}/run", "--debug"])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: out of memory (RESOURCE_EXHAUSTED"), r.stderr
    assert "--config.grad_accum" in lines[0] and "--config.remat" in lines[0]


def test_existing_run_with_another_config_is_not_overwritten(shakespeare, tmp_path):
    rundir = tmp_path / "run"
    rundir.mkdir()
    (rundir / "config.json").write_text("{}")
    r = run(["launch.py", "--config=shakespeare_char_cpu", f"--rundir={rundir}"])
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "config.json is not a run's config" in r.stderr
    assert (rundir / "config.json").read_text() == "{}"


def test_a_run_saved_before_a_config_field_existed_resumes(shakespeare, tmp_path):
    """A field added to Config later (a new option, default off) is its default in an older run's
    config.json: the run resumes, and a launch that sets the field otherwise is refused."""
    from conftest import TINY_RUN
    rundir = tmp_path / "run"
    r = run(["launch.py", *TINY_RUN, "--config.max_steps=2", f"--rundir={rundir}"])
    assert r.returncode == 0, r.stderr
    assert "warning: max_steps=2 ends before warmup_steps=4 does: the learning rate never " \
           "reaches learning_rate=0.002" in r.stderr.splitlines()
    saved = json.loads((rundir / "config.json").read_text())
    del saved["norm_gain"]  # as if norm_gain had been added to Config after this run
    (rundir / "config.json").write_text(json.dumps(saved))
    r = run(["launch.py", *TINY_RUN, "--config.max_steps=3", f"--rundir={rundir}"])
    assert r.returncode == 0, r.stderr
    r = run(["launch.py", *TINY_RUN, "--config.norm_gain=true", f"--rundir={rundir}"])
    assert r.returncode == 1 and "holds a run with norm_gain=False there" in r.stderr, r.stderr


def test_a_resume_with_another_config_names_every_field_that_differs(shakespeare, tmp_path):
    """Each field, not only the first; with --rundir alone, an override of a field a resume may
    not change is refused, each named. Nothing is written."""
    from conftest import TINY_RUN
    rundir = tmp_path / "run"
    r = run(["launch.py", *TINY_RUN, "--config.max_steps=1", f"--rundir={rundir}"])
    assert r.returncode == 0, r.stderr
    files = {p.name: p.read_bytes() for p in rundir.iterdir() if p.is_file()}
    r = run(["launch.py", "--config=shakespeare_char_cpu", f"--rundir={rundir}"])
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for field in ("n_layer=2 there, 4 here", "d_model=32 there, 128 here", "n_head=2 there, 4",
                  "block_size=16 there, 64 here", "batch_size=8 there, 12 here",
                  "warmup_steps=4 there, ", "learning_rate=0.002 there, "):
        assert field in r.stderr, r.stderr
    r = run(["launch.py", f"--rundir={rundir}", "--config.n_layer=3", "--config.max_steps=2",
             "--config.seed=1"])
    assert r.returncode == 1 and r.stderr.startswith(
        f"error: {rundir} resumes as its config.json says: n_layer, seed cannot change"), r.stderr
    # a misspelled flag is named as a new run names it (it was "cannot change")
    for arg, message in [("--max_steps=2", "unrecognised argument '--max_steps=2' (see --help); "
                                           "overrides look like --config.FIELD=VALUE"),
                         ("--config.max_step=2", "unknown config field 'max_step'; did you mean "
                                                 "max_steps")]:
        r = run(["launch.py", f"--rundir={rundir}", arg])
        assert r.returncode == 1 and r.stderr.startswith(f"error: {message}"), r.stderr
    assert {p.name: p.read_bytes() for p in rundir.iterdir() if p.is_file()} == files


def test_short_run_writes_metrics_and_tensorboard(shakespeare, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rundir = tmp_path / "run"
    # relative, as README's runs/quickstart is: orbax needs it made absolute
    relative = os.path.relpath(rundir, ROOT)
    r = run(["launch.py", "--config=shakespeare_char_cpu", f"--rundir={relative}",
             "--config.max_steps=30", "--config.eval_interval=15", "--config.eval_batches=2",
             "--config.log_interval=5"])
    assert r.returncode == 0, r.stderr
    assert (rundir / "checkpoints" / "30").is_dir()  # the final save
    cfg = json.loads((rundir / "config.json").read_text())
    assert cfg["max_steps"] == 30 and cfg["n_layer"] == 4
    run_info = json.loads((rundir / "run.json").read_text())
    assert len(run_info["git"]["commit"] or "x" * 40) == 40
    assert run_info["git"]["dirty"] in (True, False, None)
    records = [json.loads(line) for line in (rundir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert all({"step", "train_loss", "val_loss", "lr", "tokens_per_s"} <= r.keys() for r in evals)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5  # it learns
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [5, 10, 15, 20, 25, 30] and steps[-1]["tokens_per_s"] > 0
    # "lr": the LR of the last update applied, in a step's evaluation record as in its step record
    # (the evaluation's was the next step's): in warmup, update s - 1's learning_rate * s / warmup
    for r in records:
        want = cfg["learning_rate"] * r["step"] / cfg["warmup_steps"]
        assert r["lr"] == pytest.approx(want, rel=1e-6), r
    acc = EventAccumulator(str(rundir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "loss/val", "loss/batch", "lr", "grad_norm", "tokens_per_s"} <= tags
    assert "mfu" not in tags  # a CPU has no datasheet peak: no made-up MFU
    assert [e.step for e in acc.Scalars("loss/val")] == [0, 15, 30]
    assert acc.Scalars("loss/val")[-1].value == pytest.approx(evals[-1]["val_loss"], rel=1e-6)


def test_a_run_resumed_or_read_with_other_code_says_which_files_changed(shakespeare, tmp_path):
    """run.json records a hash of each file that defines the run's math at every launch. A resume
    after model.py, train.py or data.py (the batches) changed says which, and so do sample.py,
    eval.py and export.py of the files of the forward (train.py and data.py are not): the same
    shapes may hold other math."""
    from conftest import TINY_RUN
    from run.rundir import TRAINING
    rundir = tmp_path / "run"
    r = run(["launch.py", *TINY_RUN, "--config.max_steps=1", f"--rundir={rundir}"])
    assert r.returncode == 0, r.stderr
    record = json.loads((rundir / "run.json").read_text())
    assert "model.py" in TRAINING and record["code"] == {
        f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:12] for f in TRAINING}
    assert "data.py" in TRAINING  # as if trained before an edit of each:
    record["code"] |= {"model.py": "0" * 12, "train.py": "0" * 12, "data.py": "0" * 12}
    (rundir / "run.json").write_text(json.dumps(record))
    commit = str(record["git"]["commit"])[:7] if record["git"]["commit"] else "unknown"
    r = run(["sample.py", f"--rundir={rundir}", "--max_new_tokens=2"])
    assert r.returncode == 0 and (f"note: model.py changed since this run's last launch (at commit "
                                  f"{commit}): its checkpoint runs in the model as it is now"
                                  ) in r.stderr.splitlines(), r.stderr
    r = run(["launch.py", f"--rundir={rundir}", "--config.max_steps=2"])
    assert r.returncode == 0 and (f"note: model.py, train.py, data.py changed since this run's "
                                  f"last launch (at commit {commit}): the run goes on with the "
                                  f"code as it is now") in r.stdout.splitlines(), r.stdout
    r = run(["sample.py", f"--rundir={rundir}", "--max_new_tokens=2"])  # the resume's own record
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr


FIRST_STEP_FAILURES = {  # code run before launch.main, and whether the folder was there before
    # a bug of any kind where train.train would start, in a new folder
    "a bug": ("def bug(*args, **kwargs):\n    raise OverflowError('a bug')\n"
              "train.train = bug\n", "OverflowError: a bug", False),
    # model.py edited with a shape mistake: the step-0 evaluation's forward fails, after the
    # metrics, tensorboard events, lock and checkpoints/ were made; in a folder made beforehand
    "model.py's edit": ("import model\nmodel.gelu = lambda x: x[..., :-1]\n",
                        "does not match previous terms", True),
}


@pytest.mark.parametrize("failure", FIRST_STEP_FAILURES)
def test_any_error_before_the_first_step_undoes_the_launch(shakespeare, tmp_path, failure):
    """Not only a refusal (UsageError, RunError): an error of any kind before the first step leaves
    the folder as it was (a new one: none), not a config.json that says what never ran nor logs
    that would make the next launch there refuse; its traceback still shows."""
    from conftest import TINY_RUN
    code, error, existed = FIRST_STEP_FAILURES[failure]
    rundir = tmp_path / "run"
    if existed:
        rundir.mkdir()
    code = f"import launch, train\n{code}launch.main({[*TINY_RUN, f'--rundir={rundir}']!r})\n"
    r = run(["-c", code])
    assert r.returncode != 0 and error in r.stderr, r.stderr
    assert (sorted(p.name for p in rundir.iterdir()) == [] if existed
            else not rundir.exists()), list(rundir.iterdir())


@pytest.mark.parametrize("name", ["run.json", "dataset.json", "metrics.jsonl"])
def test_a_folder_with_a_runs_files_but_no_config_json_is_not_overwritten(shakespeare, tmp_path,
                                                                         name):
    """A run that lost its config.json, or someone's files of those names: a new run there
    replaced them and exited 0."""
    rundir = tmp_path / "run"
    rundir.mkdir()
    (rundir / name).write_text("not mugpt's\n")
    from conftest import TINY_RUN
    r = run(["launch.py", *TINY_RUN, "--config.max_steps=1", f"--rundir={rundir}"])
    assert r.returncode == 1 and r.stderr == (
        f"error: {rundir} holds {name} but no config.json: a new run would replace them; restore "
        f"its config.json (the run's settings), or pass another --rundir\n"), r.stderr
    assert sorted(p.name for p in rundir.iterdir()) == [name]
    assert (rundir / name).read_text() == "not mugpt's\n"


@pytest.mark.parametrize("args", [["launch.py", "--num_processes=x"], ["bench.py", "--steps=x"],
                                  ["sample.py", "--rundir=r", "--bogus"], ["data.py"],
                                  ["eval.py", "--rundir=r"],
                                  ["export.py", "--rundir=r", "--out=o", "--step=x"],
                                  ["variants.py", "--size=huge"], ["mup.py", "evidence", "--bogus"],
                                  ["-m", "tools.plots"]])
def test_argparse_errors_are_one_line_in_each_command(args):
    """A flag unknown, a value of the wrong type, an argument missing: argparse's own errors were
    a usage block above the line; one line now (run.errors.ArgumentParser), argparse's exit 2."""
    r = run(args)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(
        " (see --help)"), r.stderr
