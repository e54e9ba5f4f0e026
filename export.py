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

Before it writes, export runs the PyTorch model it is about to write beside model.py's forward
(float32, on the same tokens; with the run's weights and with a model drawn as training starts)
and refuses in one line when they differ, naming every array of model.py's GPT that no exported
tensor carries: an edit of model.py that hf/modeling_mugpt.py does not follow is never exported
as a model that silently computes something else. DIR is written
beside itself and renamed into place at the end (--force replaces an earlier export whole, no
other folder): an interrupted export leaves no half-written DIR. Needs requirements-export.txt
(torch, transformers, safetensors)."""
import argparse
import os
import shutil
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from etils import epath

from inference.decode import in_float32
from fused.agreement import tokens
from params import init_gpt
from run import reading
from text.tokenization import hf_tokenizer
from configs import Config
from run.errors import ArgumentParser, UsageError

ROOT = Path(__file__).resolve().parent
# The Config fields of the architecture variants (docs/variants.md) and the values
# hf/modeling_mugpt.py implements: a fork that adds a value gets a one-line refusal, not a model
# that silently computes something else
SUPPORTED = {"attention": ("mha", "sharedkv"), "position": ("rope", "alibi"),
             "connections": ("residual", "mudd")}
DTYPES = ("float32", "bfloat16", "float16")
# The self-check's bound on |PyTorch - JAX| logits, relative to the largest logit alone: float32
# rounding through the blocks stays far below it, the edits export did not follow far above it
# (BENCHMARKS.md); an absolute floor let an edit through in a model early in training.
RTOL = 1e-4
# The same check on a model drawn as training starts (another seed; its zero arrays, muP's readout
# and MUDD's dynamic weights, drawn small), with a tighter bound: early in training the readout is
# still near zero and hides what the blocks compute, so an edit moved a checkpoint's logits less
# than RTOL allows; on a drawn model float32 rounding stays an order of magnitude below this
# bound and the edits that slipped through sit well above it (figures: BENCHMARKS.md)
DRAWN_RTOL = 2e-5


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
    if rundir is not None and "://" not in str(rundir):  # --force replaces out whole
        run, whole = Path(str(rundir)).resolve(), out.resolve()
        if whole == run or whole in run.parents or run in whole.parents:
            raise UsageError(f"--out={out} is, holds or lies in the run directory {rundir}: "
                             "replacing it could delete the run; name a folder outside it")
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


def drawn(cfg: Config):
    """A GPT drawn as training starts (params.init_gpt, seed + 1), in float32, its all-zero arrays
    drawn at 0.02: every function of model.py away from where an early checkpoint's weights
    leave it (a zero readout gives zero logits whatever the blocks compute)."""
    model = in_float32(init_gpt(cfg, jax.random.key(cfg.seed + 1)), cfg)
    params, static = eqx.partition(model, eqx.is_array)  # (a tied readout's placeholder: static)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(cfg.seed + 2), len(leaves))  # one each: no two alike
    leaves = [x if x.any() else 0.02 * jax.random.normal(k, x.shape, x.dtype)
              for x, k in zip(leaves, keys)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), static)


def logit_gap(torch_model, model, V: int, block_size: int) -> tuple[float, float]:
    """max |PyTorch - JAX| logit and max |JAX logit|, in float32, on a full block and a short
    sequence (in one pass, and the last token by its KV cache as generate decodes)."""
    import torch
    from hf.modeling_mugpt import CACHE

    # a new function: jit's cache, keyed by it, must not give back the trace of model.py
    # before an edit made in this process (the tests')
    worst, scale, forward = 0.0, 0.0, eqx.filter_jit(lambda gpt, ids_T: gpt(ids_T))
    for T in (block_size, max(1, block_size // 4)):
        ids_T = tokens(T, V, seed=T)  # special ids (the vocabulary's edges) among them
        # "highest": float32 matmuls on an accelerator too (TF32 would exceed RTOL)
        with jax.default_matmul_precision("highest"):
            want_TV = np.asarray(forward(model, ids_T))[:, :V]
        with torch.no_grad():
            ids = torch.from_numpy(ids_T)[None]
            got_TV = torch_model(ids).logits[0].numpy()
            if T > 1:  # and its KV-cache decoding (generate's): a prefill, then one step
                prefill = torch_model(ids[:, :-1], use_cache=True)
                step = torch_model(ids[:, -1:], past_key_values=getattr(prefill, CACHE),
                                   use_cache=True)
                got_TV = np.concatenate([got_TV, step.logits[0].numpy()])
                want_TV = np.concatenate([want_TV, want_TV[-1:]])
        worst = max(worst, float(np.abs(got_TV - want_TV).max()))
        scale = max(scale, float(np.abs(want_TV).max()))
    return worst, scale


def self_check(model, weights: dict[str, np.ndarray], read: set[int], config: dict,
               cfg: Config) -> None:
    """Refuses (UsageError, one line) unless hf/modeling_mugpt.py's model computes model.py's
    logits (logit_gap) with these weights and with those of a model drawn as training starts
    (drawn), every array of the model is carried by an exported tensor, and, in a
    half-precision export's dtype, its logits are finite."""
    import torch
    from hf.configuration_mugpt import MuGPTConfig
    from hf.modeling_mugpt import MuGPTForCausalLM

    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    missing = [jax.tree_util.keystr(path)[1:] for path, x in leaves if id(x) not in read]
    V, block_size = config["vocab_size"], config["max_position_embeddings"]
    fresh = drawn(cfg)
    try:
        torch_model = MuGPTForCausalLM(MuGPTConfig(**{**config, "dtype": "float32"})).eval()
        for what, gpt, arrays, rtol in (("a drawn model", fresh, state_dict(fresh, V)[0],
                                         DRAWN_RTOL), ("the run's weights", model, weights, RTOL)):
            torch_model.load_state_dict({k: torch.tensor(v) for k, v in arrays.items()})
            worst, scale = logit_gap(torch_model, gpt, V, block_size)
            differs = f"on {what}, max |PyTorch - JAX| logit {worst:.3g} (bound {rtol * scale:.2g})"
            if not (ok := worst <= rtol * scale):
                break
    except Exception as e:  # the modeling file cannot even take these weights or run
        differs, ok = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}", False
    if not ok or missing:
        carried = f"; model.py arrays no exported tensor carries: {', '.join(missing)}"
        raise UsageError("hf/modeling_mugpt.py with the converted weights does not follow "
                         f"model.py: {differs}{carried if missing else ''}; edit "
                         "hf/modeling_mugpt.py (and export.py's state_dict) to follow model.py; "
                         "nothing was written")
    if config["dtype"] != "float32":  # as saved: float16 overflows past 65504
        with torch.no_grad():
            ids = torch.from_numpy(tokens(block_size, V, seed=block_size))[None]
            half = torch_model.to(getattr(torch, config["dtype"]))(ids).logits
        if not torch.isfinite(half).all():
            raise UsageError(f"in {config['dtype']} the exported model's logits are not finite "
                             "(in float32 they are): export with --dtype=bfloat16 or float32; "
                             "nothing was written")


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
    self_check(in_float32(model, cfg), weights, read, config, cfg)
    # written beside out and renamed into place: a killed export leaves no half of one at out
    tmp, old = (out.parent / f".{out.name}.{what}-{os.getpid()}" for what in ("export", "old"))
    for stale in (tmp, old):  # a killed export's, of the same process id
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tensors = {k: torch.tensor(v).to(getattr(torch, dtype)) for k, v in weights.items()}
        safetensors.torch.save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        MuGPTConfig(**config).save_pretrained(tmp)
        for name in ("configuration_mugpt.py", "modeling_mugpt.py"):
            shutil.copy(ROOT / "hf" / name, tmp / name)
        tokenizer.model_max_length = cfg.block_size
        tokenizer.save_pretrained(tmp)
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
