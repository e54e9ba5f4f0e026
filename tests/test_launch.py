"""The CLI: typed overrides, one-line errors for bad input, and a short run end to end."""
import json
import os

import pytest

import configs
import launch
from configs import UsageError
from conftest import ROOT, run


def test_overrides_parse_to_the_field_types():
    cfg = launch.apply_overrides(configs.load("shakespeare_char_cpu"), [
        "--config.learning_rate=3e-4", "--config.n_layer=2", "--config.tie_embeddings=true",
        "--config.remat=save_dots", "--config.dataset=mine"])
    assert (cfg.learning_rate, cfg.n_layer, cfg.tie_embeddings, cfg.remat, cfg.dataset) == (3e-4, 2, True, "save_dots", "mine")
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
        launch.apply_overrides(configs.load("shakespeare_char_cpu"), [arg])


@pytest.mark.parametrize("kind", [tuple[int, int], list[int], float | None])
def test_a_field_type_the_command_line_cannot_parse_is_one_line(kind):
    """A field a researcher adds with a type parse_value does not know: an error, not tuple("2,4") or a TypeError."""
    with pytest.raises(UsageError, match=r"^--config.sizes: a field of type .* is set in a config module"):
        launch.parse_value("sizes", kind, "2,4")


def test_every_config_module_loads_and_checks():
    assert {"shakespeare_char", "shakespeare_char_cpu", "openwebtext", "openwebtext_xl"} <= set(configs.available())
    for name in configs.available():
        configs.load(name).check(configs.load(name).cpu_devices)  # 1, or the devices a CPU is split into
    xl = configs.load("openwebtext_xl")
    assert (xl.n_layer, xl.n_head, xl.d_model, xl.head_dim, xl.model_vocab) == (48, 25, 1600, 64, 50304)


BAD_INPUTS = [  # (arguments after --config=shakespeare_char_cpu, what the one line must say)
    (["--config=nope"], "unknown config 'nope'; available: openwebtext"),
    (["--config.d_model=130"], "d_model=130 is not divisible by n_head=4"),
    (["--config.d_model=12", "--config.n_head=4"], "head_dim=3 (d_model/n_head) is odd"),
    (["--config.batch_size=10", "--config.grad_accum=4"], "batch_size=10 is not divisible by devices x grad_accum"),
    (["--config.block_size=200000"], "block_size=200000 is longer than the val split"),
    (["--config.dataset=nodata"], "prepare it with `python data.py nodata`"),
    (["--config.loss_chunks=5"], "loss_chunks=5 does not divide the 12 sequences of a microbatch"),
    (["--config.vocab_size=50"], "beyond the model's vocab_size=50; set --config.vocab_size=65"),
    (["--config.cpu_devices=3"], "mesh_replica=2 does not divide the 3 devices"),
    (["--config.learning_rate=1e39"], "learning_rate=1e+39 and min_lr=0.0002 must be finite in float32"),
    (["--config.adam_eps=0"], "adam_eps=0.0 must be > 0"),
    (["--config.max_steps=33"], "max_steps=33 is not a multiple of steps_per_call=5"),
    (["--config.steps_per_call=0"], "steps_per_call=0 must be at least 1"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_is_one_line_without_traceback(shakespeare, tmp_path, args, message):
    argv = (["--config=shakespeare_char_cpu"] if not args[0].startswith("--config=") else []) + args
    r = run(["launch.py", *argv, f"--rundir={tmp_path / 'run'}"])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # nothing was written


def test_out_of_memory_is_one_line_naming_the_fix(shakespeare, tmp_path):
    """A model that cannot fit stops with one line that says what to change, not JAX's traceback. Its MLP weights
    (157 PB) are past any x86-64 address space, so the allocator refuses them at once whatever the machine."""
    r = run(["launch.py", "--config=shakespeare_char_cpu", "--config.mlp_ratio=600000000000", f"--rundir={tmp_path}/run"])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: out of memory (RESOURCE_EXHAUSTED"), r.stderr
    assert "--config.grad_accum" in lines[0] and "--config.remat" in lines[0]


def test_existing_run_with_another_config_is_not_overwritten(shakespeare, tmp_path):
    rundir = tmp_path / "run"
    rundir.mkdir()
    (rundir / "config.json").write_text("{}")
    r = run(["launch.py", "--config=shakespeare_char_cpu", f"--rundir={rundir}"])
    assert r.returncode != 0 and "holds a run with no dataset" in r.stderr and "Traceback" not in r.stderr
    assert (rundir / "config.json").read_text() == "{}"


def test_short_run_writes_metrics_and_tensorboard(shakespeare, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rundir = tmp_path / "run"  # given relative, as README's runs/quickstart is: orbax needs it made absolute
    r = run(["launch.py", "--config=shakespeare_char_cpu", f"--rundir={os.path.relpath(rundir, ROOT)}",
             "--config.max_steps=30", "--config.eval_interval=15", "--config.eval_batches=2", "--config.log_interval=5"])
    assert r.returncode == 0, r.stderr
    assert (rundir / "checkpoints" / "30").is_dir()  # the final save
    cfg = json.loads((rundir / "config.json").read_text())
    assert cfg["max_steps"] == 30 and cfg["n_layer"] == 4
    run_info = json.loads((rundir / "run.json").read_text())
    assert len(run_info["git"]["commit"] or "x" * 40) == 40 and run_info["git"]["dirty"] in (True, False, None)
    records = [json.loads(line) for line in (rundir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert all({"step", "train_loss", "val_loss", "lr", "tokens_per_s"} <= r.keys() for r in evals)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5  # it learns
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [5, 10, 15, 20, 25, 30] and steps[-1]["tokens_per_s"] > 0
    acc = EventAccumulator(str(rundir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "loss/val", "loss/batch", "lr", "grad_norm", "tokens_per_s"} <= tags
    assert "mfu" not in tags  # a CPU has no datasheet peak: no made-up MFU
    assert [e.step for e in acc.Scalars("loss/val")] == [0, 15, 30]
    assert acc.Scalars("loss/val")[-1].value == pytest.approx(evals[-1]["val_loss"], rel=1e-6)
