"""Export a run to a Hugging Face model directory:
    python export.py --rundir=RUN --out=DIR [--step=N] [--force] [--dtype=float32|bfloat16|float16]

DIR gets model.safetensors (in --dtype), config.json (with an auto_map to our own PyTorch modeling
file, hf/modeling_mugpt.py, copied beside it), and the tokenizer's files, so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads it and .generate() runs with a KV cache. The muP/CompleteP multipliers are carried in
config.json (not folded into the weights: that would untie tied embeddings), and so are the
architecture variants (docs/variants.md, any combination). The model's padded vocabulary rows
are not exported: the logits are the tokenizer's vocabulary, so generate never emits a padding
id. Any checkpoint (sharded over N devices or not) is read on one CPU device.

Before DIR is in place, export loads what it wrote as a user would (from_pretrained) and runs it
beside model.py's forward (hf/check.py: float32, on the same tokens, generate's inputs too; with
the run's weights and with models drawn as training starts) and refuses in one line when they
differ, naming every array of model.py's GPT that no exported tensor carries: an edit of
model.py that hf/modeling_mugpt.py does not follow is never exported as a model that silently
computes something else. DIR is written beside itself and renamed into place at the end
(--force replaces an earlier export whole, no other folder): an interrupted export leaves no
half-written DIR. Needs requirements-export.txt (torch, transformers, safetensors)."""
import argparse
import itertools
import os
import shutil
import sys
from pathlib import Path

import equinox as eqx
import numpy as np
from etils import epath

from inference.decode import plain_gpt
from hf.check import self_check
from run import reading
from text.tokenization import hf_tokenizer
from configs import Config
from run.errors import ArgumentParser, UsageError

ROOT = Path(__file__).resolve().parent
HF = ROOT / "hf"  # the modeling files an export carries (and its self-check loads from there)
# The Config fields of the architecture variants (docs/variants.md) and the values
# hf/modeling_mugpt.py implements: a fork that adds a value gets a one-line refusal, not a model
# that silently computes something else
SUPPORTED = {"attention": ("mha", "sharedkv"), "position": ("rope", "alibi"),
             "connections": ("residual", "mudd")}
DTYPES = ("float32", "bfloat16", "float16")
EXPORTS = itertools.count()  # this process's exports: each writes its own folder beside out


def check_exportable(cfg: Config) -> None:
    for field, values in SUPPORTED.items():
        if getattr(cfg, field) not in values:
            raise UsageError(f"export does not support {field}={getattr(cfg, field)}: "
                             f"hf/modeling_mugpt.py implements {field} in {values} only")


def hf_config(cfg: Config, n_vocab: int, tokenizer, dtype: str = "float32") -> dict:
    """hf/configuration_mugpt.py's fields, from the run's config."""
    return dict(
        vocab_size=n_vocab, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.mlp_width, max_position_embeddings=cfg.block_size,
        rope_base=cfg.rope_base, norm_gain=cfg.norm_gain, tie_embeddings=cfg.tie_embeddings,
        attn_scale=cfg.attn_scale, branch_mult=1 / cfg.depth_mult, alpha_in=cfg.alpha_in,
        readout_mult=cfg.alpha_out / cfg.width_mult, attention=cfg.attention,
        position=cfg.position, connections=cfg.connections, dtype=dtype,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        # generate() without an attention mask masks every id equal to a pad id that is not eos:
        # a character vocabulary's pad is its newline, a character of the text
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id == tokenizer.eos_token_id
        else None,
        architectures=["MuGPTForCausalLM"],
        auto_map={"AutoConfig": "configuration_mugpt.MuGPTConfig",
                  "AutoModelForCausalLM": "modeling_mugpt.MuGPTForCausalLM"})


def state_dict(model, n_vocab: int) -> tuple[dict[str, np.ndarray], set[int]]:
    """model.py's arrays under hf/modeling_mugpt.py's names, (out, in) as torch's Linear stores
    them, and the ids of the arrays it read (self_check names the others). qkv (L, D, N, K)
    flattens to (L, D, NK): q heads, then key heads (none with SharedKV), then value heads, the
    order modeling_mugpt.py splits them in."""
    read = set()

    def a(x):  # every array of the model is read through here, whole
        read.add(id(x))
        return np.asarray(x, np.float32)

    emb, b = model.embeddings(), model.blocks
    L, D = b.attn.qkv.shape[0], emb.embed.shape[1]
    out = {"embed.weight": a(emb.embed)[:n_vocab]}
    if not isinstance(model.emb, eqx.nn.Shared):  # tied: the embedding is the readout
        out["unembed"] = a(emb.unembed)[:n_vocab]
    if model.final_norm is not None:
        out["final_norm"] = a(model.final_norm)
    T = lambda x: x.transpose(0, 2, 1)  # noqa: E731  (L, in, out) -> (L, out, in)
    layers = {"attn.qkv.weight": T(a(b.attn.qkv).reshape(L, D, -1)),
              "attn.out.weight": T(a(b.attn.out).reshape(L, -1, D)),
              "attn.q_norm": a(b.attn.q_norm), "attn.k_norm": a(b.attn.k_norm),
              "up.weight": T(a(b.mlp.up)), "down.weight": T(a(b.mlp.down))}
    if b.attn_norm is not None:
        layers |= {"attn_norm": a(b.attn_norm), "mlp_norm": a(b.mlp_norm)}
    out |= {f"blocks.{i}.{name}": w[i] for name, w in layers.items() for i in range(L)}
    for i, c in enumerate(model.mudd or ()):  # MUDD's Connections, one per block
        out |= {f"mudd.{i}.w1.weight": a(c.w1).T, f"mudd.{i}.w2.weight": a(c.w2).T,
                f"mudd.{i}.b": a(c.b)}
    return {k: np.ascontiguousarray(v) for k, v in out.items()}, read


def check_out(out: Path, force: bool, rundir: epath.Path | None = None) -> None:
    """Before the checkpoint is read: an --out that can be written and replaced, never the run."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out={out} is a file: export writes a folder, name another --out")
    # --force replaces out whole: never the run, nor this repository's hf/ (it holds a
    # modeling_mugpt.py, as an export does)
    kept = {"the run directory": rundir, "the modeling files' source": HF}
    for what, folder in kept.items():
        if folder is None or "://" in str(folder):
            continue
        whole, keep = out.resolve(), Path(str(folder)).resolve()
        if whole == keep or whole in keep.parents or keep in whole.parents:
            raise UsageError(f"--out={out} is, holds or lies in {what} {folder}: replacing it "
                             "could delete it; name a folder outside it")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UsageError(f"--out={out} exists and is not empty: pass --force to replace it")
        if not (out / "modeling_mugpt.py").is_file():  # --force deletes out: only an export's
            raise UsageError(f"--out={out} is not a folder export.py wrote (no modeling_mugpt.py): "
                             "--force replaces only an earlier export; name a new or empty folder")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out={out}: {parent} is not a folder this user can write in; name "
                         "another --out")


def export(rundir: epath.Path, out: Path, step: int | None = None, force: bool = False,
           dtype: str = "float32") -> int:
    """Write the HF directory; returns the checkpoint's step. Bad input: UsageError."""
    check_out(out, force, rundir)
    cfg = reading.read_config(rundir)
    check_exportable(cfg)
    meta = reading.read_dataset_record(rundir, cfg)
    model, step = reading.restore_model(rundir, cfg, step)
    write(model, cfg, meta, out, dtype)
    return step


def write(model, cfg: Config, meta: dict, out: Path, dtype: str = "float32") -> None:
    """The HF directory of a model.py GPT with its config and dataset record (meta.json's), after
    self_check; out, if there, is replaced whole."""
    import safetensors.torch
    import torch
    from hf.configuration_mugpt import MuGPTConfig

    tokenizer = hf_tokenizer(meta)
    config = hf_config(cfg, meta["vocab_size"], tokenizer, dtype)
    try:
        weights, read = state_dict(model, meta["vocab_size"])
    except (AttributeError, TypeError, ValueError) as e:  # a renamed or reshaped array
        raise UsageError(f"export.py's state_dict cannot read model.py's GPT ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}): edit it and hf/modeling_mugpt.py to "
                         "follow model.py; nothing was written") from None
    # Written beside out, checked there and renamed into place: a killed export leaves no half of
    # one at out. A folder name of its own per export: transformers keeps the modeling module it
    # loaded for the self-check under the folder's name, and gave a second export of this process
    # the first's module (an edit of the modeling file unchecked)
    for stale in out.parent.glob(f".{out.name}.*-{os.getpid()}-*"):  # a killed export's
        shutil.rmtree(stale, ignore_errors=True)
    n = next(EXPORTS)
    tmp, old = (out.parent / f".{out.name}.{what}-{os.getpid()}-{n}" for what in ("export", "old"))
    try:
        tmp.mkdir(parents=True)
        tensors = {k: torch.tensor(v).to(getattr(torch, dtype)) for k, v in weights.items()}
        safetensors.torch.save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        MuGPTConfig(**config).save_pretrained(tmp)
        for name in ("configuration_mugpt.py", "modeling_mugpt.py"):
            shutil.copy(HF / name, tmp / name)
        tokenizer.model_max_length = cfg.block_size
        tokenizer.save_pretrained(tmp)
        self_check(plain_gpt(model, cfg), weights, read, config, cfg, tmp, state_dict)
        if out.exists():  # moved aside, not merged into: no file of the old export survives
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # a full disk, a folder made read-only meanwhile
        if old.exists() and not out.exists():
            old.rename(out)
        kept = "the old export is as it was" if out.exists() else "nothing was written"
        raise UsageError(f"writing {out} failed ({e.strerror or e}); {kept}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted write's, if any


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rundir", required=True, help="a run directory written by launch.py")
    ap.add_argument("--out", required=True, help="the Hugging Face model directory to write")
    ap.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out whole")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="the saved weights' dtype (the self-check runs in float32 before)")
    args = ap.parse_args(argv)
    try:
        step = export(epath.Path(args.rundir), Path(args.out), args.step, args.force, args.dtype)
    except UsageError as e:
        sys.exit(f"error: {e}")
    print(f"{args.out}: step {step} of {args.rundir} in {args.dtype}; load it with "
          f"AutoModelForCausalLM.from_pretrained({args.out!r}, trust_remote_code=True)")


if __name__ == "__main__":
    main()
