"""Reading a run that launch.py wrote: its config, its tokenizer, the model of a checkpoint. One
module that sample.py, eval.py, export.py and bench.py use, so each reads a run the same way."""
import logging
import sys

import equinox as eqx
import jax
from etils import epath

import data
from configs import Config
from model import GPT
from params import init_gpt
from run.errors import UsageError
from run.rundir import FORWARD, code_changes, read_json, saved_config
from text import tokenization


def tokenizer(meta: dict):
    """(encode, decode) between text and token ids, as a dataset's meta.json says."""
    return tokenization.load(meta["tokenizer"])


def read_dataset_record(rundir: epath.Path, cfg: Config) -> dict:
    """launch.py's copy of the dataset's meta.json, else (an older run) the dataset's own, checked:
    a record that is not JSON, lacks what the tokenizer needs or whose tokenizer does not load is
    one line naming the file."""
    path = rundir / "dataset.json"
    if not path.exists():
        return data.read_meta(cfg)
    meta = read_json(path)
    try:
        vocab, ids = int(meta["vocab_size"]), tokenization.size(meta["tokenizer"])
        tokenizer(meta)
    except UsageError:  # tiktoken offline, say: not the file's fault
        raise
    except Exception as e:  # a key missing, the tokenizer's JSON cut short: whatever it raises
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        raise UsageError(f"{path} is not a dataset record whose tokenizer loads ({why}): copy "
                         f"the dataset's meta.json over it") from None
    if not ids <= vocab <= cfg.vocab_size:  # the model's rows, the export's: every id has one
        raise UsageError(f"{path}: vocab_size={vocab} does not lie between its tokenizer's "
                         f"{ids} ids and the config's vocab_size={cfg.vocab_size}: copy the "
                         f"dataset's meta.json over it")
    return meta


def read_config(rundir: epath.Path) -> Config:
    """The run's resolved config (launch.py's config.json, checked); missing fields get today's
    defaults."""
    if not rundir.is_dir():
        raise UsageError(f"no run directory {rundir}")
    if not (rundir / "config.json").exists():
        raise UsageError(f"{rundir} holds no run: it has no config.json")
    return Config(**saved_config(rundir))


def restore_model(rundir: epath.Path, cfg: Config, step: int | None) -> tuple[GPT, int]:
    """The model of the run's checkpoint of `step` (default: the latest), on one device: sampling
    needs no mesh and no optimizer state. It runs model.py's functions, no fused kernels."""
    from run import checkpoint  # with orbax, slow to load: bad arguments are reported before it
    from run.written import all_gone

    # orbax warns of each option a read-only manager overrides
    logging.getLogger("absl").setLevel(logging.ERROR)
    mngr = checkpoint.checkpoint_manager(rundir, cfg, read_only=True)
    steps = sorted(mngr.all_steps())
    if not steps and (gone := all_gone(rundir, mngr.directory)):  # lost, not yet to come
        raise UsageError(gone)
    if not steps:
        raise UsageError(f"{rundir} has no checkpoint yet (training writes one every "
                         f"ckpt_interval={cfg.ckpt_interval} steps and at the end)")
    if step is not None and step not in steps:
        have = ", ".join(map(str, steps))
        raise UsageError(f"--step={step}: {rundir} has checkpoints of steps {have} only")
    step = steps[-1] if step is None else step
    try:
        record = read_json(rundir / "run.json")
    except UsageError:  # the note's source only: a corrupt record does not stop the reading
        record = {}
    if changes := code_changes(record, FORWARD):  # the same shapes, perhaps other math
        print(f"note: {changes}: its checkpoint runs in the model as it is now", file=sys.stderr)
    # shapes alone, nothing drawn: a random model drawn first took several times the model's
    # memory before a byte of the checkpoint was read (more than a laptop has at GPT-2 XL's size)
    placeholders = eqx.filter_eval_shape(init_gpt, cfg, jax.random.key(0))
    try:
        return checkpoint.restore_model(mngr, placeholders, step), step
    except checkpoint.Damaged as e:  # left as it is: someone else's run, perhaps still training
        checkpoint.quiet_failed_saves()  # orbax's reads of the other arrays, abandoned, say it too
        others = ", ".join(str(s) for s in steps if s != step)
        raise UsageError(f"{e}" + (f" (pass --step=: there are also {others})" if others else ""))
