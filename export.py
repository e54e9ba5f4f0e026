"""Export a run to a Hugging Face model directory:
    python export.py --rundir=RUN --out=DIR [--step=N] [--force]

DIR gets model.safetensors (float32), config.json (with an auto_map to our own PyTorch modeling
file, hf/modeling_mugpt.py, copied beside it), and the tokenizer's files, so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads it and .generate() runs with a KV cache. The muP/CompleteP multipliers are carried in
config.json (not folded into the weights: that would untie tied embeddings), and so are the
architecture variants (docs/variants.md, any combination). The model's padded vocabulary rows
are not exported: the logits are the tokenizer's vocabulary, so generate never emits a padding
id. Any checkpoint (sharded over N devices or not) is read on one CPU device.
Needs requirements-export.txt (torch, transformers, safetensors)."""
import argparse
import shutil
import sys
from pathlib import Path

import equinox as eqx
import numpy as np
from etils import epath

from run import reading
from text import tokenization
from configs import Config
from run.errors import UsageError

ROOT = Path(__file__).resolve().parent
# The Config fields of the architecture variants (docs/variants.md) and the values
# hf/modeling_mugpt.py implements: a fork that adds a value gets a one-line refusal, not a model
# that silently computes something else
SUPPORTED = {"attention": ("mha", "sharedkv"), "position": ("rope", "alibi"),
             "connections": ("residual", "mudd")}


def check_exportable(cfg: Config) -> None:
    for field, values in SUPPORTED.items():
        if getattr(cfg, field) not in values:
            raise UsageError(f"export does not support {field}={getattr(cfg, field)}: "
                             f"hf/modeling_mugpt.py implements {field} in {values} only")


def hf_config(cfg: Config, n_vocab: int, tokenizer) -> dict:
    """hf/configuration_mugpt.py's fields, from the run's config."""
    return dict(
        vocab_size=n_vocab, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.mlp_width, max_position_embeddings=cfg.block_size,
        rope_base=cfg.rope_base, norm_gain=cfg.norm_gain, tie_embeddings=cfg.tie_embeddings,
        attn_scale=cfg.attn_scale, branch_mult=1 / cfg.depth_mult, alpha_in=cfg.alpha_in,
        readout_mult=cfg.alpha_out / cfg.width_mult, attention=cfg.attention,
        position=cfg.position, connections=cfg.connections, torch_dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["MuGPTForCausalLM"],
        auto_map={"AutoConfig": "configuration_mugpt.MuGPTConfig",
                  "AutoModelForCausalLM": "modeling_mugpt.MuGPTForCausalLM"})


def state_dict(model, n_vocab: int) -> dict[str, np.ndarray]:
    """model.py's arrays under hf/modeling_mugpt.py's names, (out, in) as torch's Linear stores
    them. qkv (L, D, N, K) flattens to (L, D, NK): q heads, then key heads (none with SharedKV),
    then value heads, the order modeling_mugpt.py splits them in."""
    emb, b = model.embeddings(), model.blocks
    L, D = b.attn.qkv.shape[0], emb.embed.shape[1]
    a = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out = {"embed.weight": a(emb.embed[:n_vocab])}
    if not isinstance(model.emb, eqx.nn.Shared):  # tied: the embedding is the readout
        out["unembed"] = a(emb.unembed[:n_vocab])
    if model.final_norm is not None:
        out["final_norm"] = a(model.final_norm)
    for i in range(L):  # .T: (in, out) -> (out, in)
        out |= {f"blocks.{i}.attn.qkv.weight": a(b.attn.qkv[i].reshape(D, -1)).T,
                f"blocks.{i}.attn.out.weight": a(b.attn.out[i].reshape(-1, D)).T,
                f"blocks.{i}.attn.q_norm": a(b.attn.q_norm[i]),
                f"blocks.{i}.attn.k_norm": a(b.attn.k_norm[i]),
                f"blocks.{i}.up.weight": a(b.mlp.up[i]).T,
                f"blocks.{i}.down.weight": a(b.mlp.down[i]).T}
        if b.attn_norm is not None:
            out[f"blocks.{i}.attn_norm"] = a(b.attn_norm[i])
            out[f"blocks.{i}.mlp_norm"] = a(b.mlp_norm[i])
    for i, c in enumerate(model.mudd or ()):  # MUDD's Connections, one per block
        out |= {f"mudd.{i}.w1.weight": a(c.w1).T, f"mudd.{i}.w2.weight": a(c.w2).T,
                f"mudd.{i}.b": a(c.b)}
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_tokenizer(meta: dict):
    """The dataset's tokenizer (meta.json's record) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = meta["tokenizer"]
    if tok["kind"] == "char":  # one id per character, no merges; decoded by joining
        vocab = {c: i for i, c in enumerate(tok["chars"])}
        core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        core.decoder = decoders.Fuse()
        # No end-of-text character: lm-eval needs a prefix for an empty context (bos) and pads
        # batches (never read: any id does); the first character (a newline) serves for both.
        first = tok["chars"][0]
        return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=first, pad_token=first)
    if tok["kind"] == "hf":
        core = Tokenizer.from_str(tok["json"])
        eos = core.id_to_token(tok["eos"])
        return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=eos)
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = tokenization.encoding(tok["encoding"])
    converter = TikTokenConverter(pattern=enc._pat_str)
    converter.load_tiktoken_bpe = lambda _: enc._mergeable_ranks  # tiktoken's own ranks
    core = converter.converted()
    eos = enc.decode([enc.eot_token])
    core.add_special_tokens([eos])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, bos_token=eos,
                                   pad_token=eos)


def export(rundir: epath.Path, out: Path, step: int | None = None, force: bool = False) -> int:
    """Write the HF directory; returns the checkpoint's step. Bad input: UsageError."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UsageError(f"--out={out} exists and is not empty: pass --force to overwrite it")
    cfg = reading.read_config(rundir)
    check_exportable(cfg)
    meta = reading.read_dataset_record(rundir, cfg)
    model, step = reading.restore_model(rundir, cfg, step)
    write(model, cfg, meta, out)
    return step


def write(model, cfg: Config, meta: dict, out: Path) -> None:
    """The HF directory of a model.py GPT with its config and dataset record (meta.json's)."""
    import safetensors.numpy
    from hf.configuration_mugpt import MuGPTConfig

    tokenizer = hf_tokenizer(meta)
    if out.exists() and not out.is_dir():
        out.unlink()
    out.mkdir(parents=True, exist_ok=True)
    weights = state_dict(model, meta["vocab_size"])
    safetensors.numpy.save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    MuGPTConfig(**hf_config(cfg, meta["vocab_size"], tokenizer)).save_pretrained(out)
    for name in ("configuration_mugpt.py", "modeling_mugpt.py"):
        shutil.copy(ROOT / "hf" / name, out / name)
    tokenizer.model_max_length = cfg.block_size
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rundir", required=True, help="a run directory written by launch.py")
    ap.add_argument("--out", required=True, help="the Hugging Face model directory to write")
    ap.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    args = ap.parse_args(argv)
    try:
        step = export(epath.Path(args.rundir), Path(args.out), args.step, args.force)
    except UsageError as e:
        sys.exit(f"error: {e}")
    print(f"{args.out}: step {step} of {args.rundir}; load it with "
          f"AutoModelForCausalLM.from_pretrained({args.out!r}, trust_remote_code=True)")


if __name__ == "__main__":
    main()
