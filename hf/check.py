"""export.py's self-check: the PyTorch model an export writes (hf/modeling_mugpt.py with the
converted weights, loaded from the folder as its user loads it) against model.py's forward, on
the run's weights and on models drawn as training starts; a refusal in one line when they
differ. Its own file, beside the modeling file it checks: export.py converts and writes."""
from pathlib import Path
from typing import Callable

import equinox as eqx
import jax
import numpy as np

from configs import Config
from fused.agreement import tokens
from inference.decode import plain_gpt
from params import init_gpt
from run.errors import UsageError

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
# A half-precision export's logits against its own float32 logits, relative to the largest: a
# coarse bound that honest rounding, growing with depth, stays below (a few 1e-3 at 2 layers), and
# a path that computes garbage only in float16 or bfloat16 (a norm that overflows to zeros, a
# dtype-dependent branch) does not; finer edits are the float32 check's
HALF_RTOL = 0.1


def drawn(cfg: Config):
    """A GPT drawn as training starts (params.init_gpt, seed + 1), in float32, its all-zero arrays
    drawn at 0.02: every function of model.py away from where an early checkpoint's weights
    leave it (a zero readout gives zero logits whatever the blocks compute)."""
    model = plain_gpt(init_gpt(cfg, jax.random.key(cfg.seed + 1)), cfg)
    params, static = eqx.partition(model, eqx.is_array)  # (a tied readout's placeholder: static)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(cfg.seed + 2), len(leaves))  # one each: no two alike
    leaves = [x if x.any() else 0.02 * jax.random.normal(k, x.shape, x.dtype)
              for x, k in zip(leaves, keys)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), static)


def logit_gap(torch_model, model, V: int, block_size: int, special: tuple[int, ...] = ()
              ) -> tuple[float, float]:
    """max |PyTorch - JAX| logit and max |JAX logit|, in float32, on a full block and a short
    sequence (in one pass, and the last token by its KV cache as generate decodes), and on the
    full block beside its prefix left-padded, through prepare_inputs_for_generation (generate's
    and lm-eval's way in: an attention mask and the positions it makes from it)."""
    import torch
    from hf.modeling_mugpt import CACHE

    # a new function: jit's cache, keyed by it, must not give back the trace of model.py
    # before an edit made in this process (the tests')
    worst, scale, forward = 0.0, 0.0, eqx.filter_jit(lambda gpt, ids_T: gpt(ids_T))
    for T in (block_size, max(1, block_size // 4)):
        ids_T = tokens(T, V, seed=T, special=special)  # special ids (the edges' too) among them
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
        if T == block_size and T > 1:  # the prefix of T - k tokens: the full block's first rows
            k = T // 2
            ids_BT = torch.stack([ids[0], torch.cat([ids[0, :k], ids[0, :T - k]])])
            mask_BT = torch.ones_like(ids_BT)
            mask_BT[1, :k] = 0  # its padding: any tokens, never attended to
            with torch.no_grad():
                inputs = torch_model.prepare_inputs_for_generation(ids_BT, attention_mask=mask_BT)
                got_BTV = torch_model(**inputs).logits.numpy()
            worst = max(worst, float(np.abs(got_BTV[0] - want_TV[:T]).max()),
                        float(np.abs(got_BTV[1, k:] - want_TV[:T - k]).max()))
    return worst, scale


def self_check(model, weights: dict[str, np.ndarray], read: set[int], config: dict,
               cfg: Config, folder: Path, state_dict: Callable) -> None:
    """Refuses (UsageError, one line) unless the model written in folder, loaded as its user loads
    it (from_pretrained, its own modeling file: a buffer made in __init__ but not saved is what
    that makes of it, not what the class makes), computes model.py's logits (logit_gap) with
    these weights and with those of a model drawn as training starts (drawn; and its arrays but
    the gains at 1/64), every array of the model is carried by an exported tensor, and, in a
    half-precision export's dtype, its logits are finite and within HALF_RTOL of float32's."""
    import torch
    from transformers import AutoModelForCausalLM

    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    missing = [jax.tree_util.keystr(path)[1:] for path, x in leaves if id(x) not in read]
    V, block_size = config["vocab_size"], config["max_position_embeddings"]
    special = () if config.get("eos_token_id") is None else (config["eos_token_id"],)
    fresh = drawn(cfg)
    # every array but the norms' gains at 1/64: the stream, queries and keys far below 1, where a
    # norm's epsilon (1e-5 for model.py's 1e-6) shows (at the drawn scale it is below the bound);
    # the gains keep attention's logits near 1 (all at 1/64 made its softmax uniform)
    small = jax.tree_util.tree_map_with_path(
        lambda path, x: x if not eqx.is_array(x) or "norm" in jax.tree_util.keystr(path) else x / 64,
        fresh)
    try:
        torch_model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                           dtype=torch.float32).eval()
        for what, gpt, arrays, rtol in (
                ("a drawn model", fresh, state_dict(fresh, V)[0], DRAWN_RTOL),
                ("a drawn model at 1/64 but its gains", small, state_dict(small, V)[0], DRAWN_RTOL),
                ("the run's weights", model, weights, RTOL)):
            torch_model.load_state_dict({k: torch.tensor(v) for k, v in arrays.items()})
            worst, scale = logit_gap(torch_model, gpt, V, block_size, special)
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
            full = torch_model(ids).logits  # the run's weights, checked above
            half = torch_model.to(getattr(torch, config["dtype"]))(ids).logits.float()
        if not torch.isfinite(half).all():
            raise UsageError(f"in {config['dtype']} the exported model's logits are not finite "
                             "(in float32 they are): export with --dtype=bfloat16 or float32; "
                             "nothing was written")
        gap, bound = float((half - full).abs().max()), HALF_RTOL * float(full.abs().max())
        if not gap <= bound:
            raise UsageError(f"in {config['dtype']} the exported model computes other logits than "
                             f"in float32 (max difference {gap:.3g}, rounding's bound "
                             f"{bound:.2g}): hf/modeling_mugpt.py runs another path in "
                             f"{config['dtype']}; export with --dtype=float32, or mend that "
                             "path; nothing was written")
