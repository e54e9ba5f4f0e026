"""Reading a run that launch.py wrote: its config, its tokenizer, the model of a checkpoint. One
module that sample.py, eval.py, export.py and bench.py use, so each reads a run the same way."""
import json
import logging

import jax
from etils import epath

import data
from configs import Config
from model import GPT
from params import init_gpt
from run.errors import UsageError
from text import tokenization


def tokenizer(meta: dict):
    """(encode, decode) between text and token ids, as a dataset's meta.json says."""
    return tokenization.load(meta["tokenizer"])


def read_dataset_record(rundir: epath.Path, cfg: Config) -> dict:
    """launch.py's copy of the dataset's meta.json, else (an older run, or unreadable) its own."""
    try:
        return json.loads((rundir / "dataset.json").read_text())
    except (OSError, ValueError):
        return data.read_meta(cfg)


def read_config(rundir: epath.Path) -> Config:
    """The run's resolved config (launch.py's config.json); missing fields get today's defaults."""
    if not rundir.is_dir():
        raise UsageError(f"no run directory {rundir}")
    if not (rundir / "config.json").exists():
        raise UsageError(f"{rundir} holds no run: it has no config.json")
    saved = json.loads((rundir / "config.json").read_text())
    if unknown := sorted(set(saved) - set(Config.__dataclass_fields__)):
        fields = ", ".join(unknown)
        raise UsageError(f"{rundir}/config.json has fields this code does not know ({fields}): "
                         "a run of another version of mugpt")
    return Config(**saved)


def restore_model(rundir: epath.Path, cfg: Config, step: int | None) -> tuple[GPT, int]:
    """The model of the run's checkpoint of `step` (default: the latest), on one device: sampling
    needs no mesh and no optimizer state. It runs model.py's functions, no fused kernels."""
    from run import checkpoint  # with orbax, slow to load: bad arguments are reported before it

    # orbax warns of each option a read-only manager overrides
    logging.getLogger("absl").setLevel(logging.ERROR)
    mngr = checkpoint.checkpoint_manager(rundir, cfg, read_only=True)
    steps = sorted(mngr.all_steps())
    if not steps:
        raise UsageError(f"{rundir} has no checkpoint yet (training writes one every "
                         f"ckpt_interval={cfg.ckpt_interval} steps and at the end)")
    if step is not None and step not in steps:
        have = ", ".join(map(str, steps))
        raise UsageError(f"--step={step}: {rundir} has checkpoints of steps {have} only")
    step = steps[-1] if step is None else step
    placeholders = init_gpt(cfg, jax.random.key(0))  # on the default device; replaced
    try:
        return checkpoint.restore_model(mngr, placeholders, step), step
    except checkpoint.Damaged as e:  # left as it is: someone else's run, perhaps still training
        others = ", ".join(str(s) for s in steps if s != step)
        raise UsageError(f"{e}" + (f" (pass --step=: there are also {others})" if others else ""))
