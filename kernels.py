"""Fused kernels: optional fast paths for named functions of model.py, used only where they match.

A fast path has the signature of the model.py function it stands in for. When a run starts,
select() runs each one that applies to the run's device and shapes beside model.py's own function
on one sequence of the run's shapes and dtype, forward and gradient; one that differs (model.py
was edited, say) is set aside with a printed line, and model.py's function runs. So an edit to
model.py always runs; the check catches differences larger than the dtype's rounding (TOLERANCE),
and --config.kernels=false turns every fast path off.

- attend: jax.nn.dot_product_attention's cuDNN flash attention (GPU, bfloat16).
- gelu: model.gelu whose backward recomputes it, where the layers are unrolled (GPU): XLA otherwise
  keeps GELU's tanh as a second (B, T, F) output of the forward, written and read back.
- qk_norm_rope: a Pallas kernel for the QK-LayerNorm and RoPE, from the qkv projection straight to
  the q, k and v that attention takes, in one pass each way where XLA made many over float32
  intermediates. Lowered through Triton on one GPU (a pallas_call has no sharding rule: under FSDP
  XLA would gather its operands onto every device); elsewhere it runs in Pallas's interpreter, which
  is how the tests run it on a CPU.
"""
import dataclasses
import functools
import sys
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import model
from configs import Config

# Largest relative error (norm of the difference over the norm of model.py's result) a fast path
# may show, forward or gradient: a few roundings of the compute dtype.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
ROWS = 64  # tokens a Pallas program: (64, K) blocks
EPS = 1e-6  # model.layer_norm's


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class FastPath:
    name: str  # the function of model.py it stands in for, with the same signature
    what: str  # what it is, for the printed line
    fn: Callable
    applies: Callable[[Config], bool]  # on this run's devices, dtype and shapes
    # (arrays, call): one sequence's differentiable inputs, and call(fn, *arrays) -> fn's outputs
    example: Callable[[Config, jax.Array], tuple]


def select(cfg: Config) -> dict[str, Callable]:
    """{model.py function name: its fast path} for the fast paths that apply and match."""
    chosen = {}
    for path in FAST_PATHS if cfg.kernels else ():
        if not path.applies(cfg):
            continue
        reference = getattr(model, path.name)
        problem = mismatch(path.fn, reference, *path.example(cfg, jax.random.key(0)),
                           TOLERANCE[cfg.compute_dtype])
        if problem:
            say(f"kernels: {path.what} set aside, model.{path.name} runs instead: {problem}")
        else:
            chosen[path.name] = path.fn
    if chosen:
        say(f"kernels: {', '.join(chosen)} fused, checked against model.py's functions")
    return chosen


def say(line: str) -> None:
    """To stderr, by process 0: bench.py's stdout stays its one JSON line."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def mismatch(fast: Callable, reference: Callable, arrays: tuple, call: Callable,
             tolerance: float) -> str | None:
    """Why fast is not reference on these inputs (outputs, or gradients of a random projection of
    them), or None when they agree within tolerance."""
    def outputs_and_grads(fn, arrays):
        out, pullback = jax.vjp(lambda *a: call(fn, *a), *arrays)
        leaves = jax.tree.leaves(out)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        cotangent = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
        return out, pullback(jax.tree.unflatten(jax.tree.structure(out), cotangent))

    try:
        want = jax.jit(functools.partial(outputs_and_grads, reference))(arrays)
    except Exception as e:  # an edited signature: nothing to compare the fast path with
        return f"model.py's function does not take the kernel's inputs ({first_line(e)})"
    try:
        got = jax.jit(functools.partial(outputs_and_grads, fast))(arrays)
    except Exception as e:
        return f"it failed: {first_line(e)}"
    for part, g, w in (("output", got[0], want[0]), ("gradient", got[1], want[1])):
        if jax.tree.structure(g) != jax.tree.structure(w):
            return f"its {part} has another structure"
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            if a.shape != b.shape:
                return f"its {part} has shape {a.shape}, model.py's {b.shape}"
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            error = float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))
            if not error <= tolerance:
                return f"its {part} differs by {error:.3g} relative (at most {tolerance:g} allowed)"
    return None


def first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def cudnn_attend(q_THK, k_SGK, v_SGK, scale: float, mask_TS=None, bias_HTS=None):
    """model.attend by jax.nn.dot_product_attention: cuDNN's flash attention on a GPU (its XLA
    version elsewhere, which is how the tests check this path), grouped-query heads and ALiBi's
    bias included. is_causal aligns queries and keys from position 0, true in training;
    sample.py's cache passes a mask: model.attend takes those."""
    if mask_TS is not None:
        return model.attend(q_THK, k_SGK, v_SGK, scale, mask_TS, bias_HTS)
    bias = None if bias_HTS is None else bias_HTS.astype(q_THK.dtype)
    return jax.nn.dot_product_attention(q_THK, k_SGK, v_SGK, bias, scale=scale, is_causal=True,
                                        implementation="cudnn" if on_gpu() else "xla")


def cudnn_applies(cfg: Config) -> bool:
    """cuDNN's flash attention takes bfloat16 and head dims that are multiples of 8 up to 128."""
    K = cfg.head_dim
    return on_gpu() and cfg.compute_dtype == "bfloat16" and K % 8 == 0 and K <= 128


def attend_example(cfg: Config, key: jax.Array) -> tuple:
    T, H, G, K = cfg.block_size, cfg.n_head, cfg.kv_heads, cfg.head_dim
    keys = jax.random.split(key, 3)
    q = jax.random.normal(keys[0], (T, H, K), cfg.compute_dtype)
    k, v = (jax.random.normal(k, (T, G, K), cfg.compute_dtype) for k in keys[1:])
    bias = None
    if cfg.position == "alibi":
        bias = model.alibi_bias(jnp.arange(T), jnp.arange(T), H)
    return (q, k, v), lambda fn, q, k, v: fn(q, k, v, cfg.attn_scale, None, bias)


def fused_qk_norm_rope(q_THK, k_TGK, q_gain_K, k_gain_K, q_rope, k_rope):
    """model.qk_norm_rope by the Pallas kernel below, where queries and keys share positions and
    head counts and the shapes fit its blocks (sample.py's decoding steps do not: model.py's
    function takes those)."""
    (T, H, K), (S, G, _) = q_THK.shape, k_TGK.shape
    if q_rope is not k_rope or (S, G) != (T, H) or not pallas_fits(T, K):
        return model.qk_norm_rope(q_THK, k_TGK, q_gain_K, k_gain_K, q_rope, k_rope)
    # the kernel's layout is the (T, 3, H, K) projection: q, k and a third group it copies
    qkv_TC = jnp.concatenate([q_THK, k_TGK, k_TGK], axis=1).reshape(T, 3 * H * K)
    return pallas_qk_norm_rope(qkv_TC, q_gain_K, k_gain_K, *q_rope, H)[:2]


def pallas_fits(T: int, K: int) -> bool:
    """Triton's power-of-two blocks: the head dim, and whole blocks of ROWS tokens."""
    return K >= 16 and K & (K - 1) == 0 and T % ROWS == 0


def qk_norm_rope_applies(cfg: Config) -> bool:
    same_heads, rope = cfg.kv_heads == cfg.n_head, cfg.position == "rope"
    fits = pallas_fits(cfg.block_size, cfg.head_dim)
    return on_gpu() and jax.device_count() == 1 and same_heads and rope and fits


def qk_norm_rope_example(cfg: Config, key: jax.Array) -> tuple:
    T, H, G, K = cfg.block_size, cfg.n_head, cfg.kv_heads, cfg.head_dim
    keys = jax.random.split(key, 4)
    q = jax.random.normal(keys[0], (T, H, K), cfg.compute_dtype)
    k = jax.random.normal(keys[1], (T, G, K), cfg.compute_dtype)
    q_gain, k_gain = (1 + 0.1 * jax.random.normal(k, (K,)) for k in keys[2:])
    table = model.rope_table(jnp.arange(T), K, cfg.rope_base)
    return (q, k, q_gain, k_gain), lambda fn, *arrays: fn(*arrays, table, table)


@jax.custom_vjp
def recomputing_gelu(x):
    """model.gelu, whatever it says; its backward is jax.vjp of model.gelu from x alone."""
    return model.gelu(x)


def _gelu_bwd(x, dy):  # the barrier keeps XLA from sharing the tanh with the forward's again
    return jax.vjp(model.gelu, jax.lax.optimization_barrier(x))[1](dy)


recomputing_gelu.defvjp(lambda x: (model.gelu(x), x), _gelu_bwd)


def gelu_applies(cfg: Config) -> bool:
    """In a scan XLA keeps the recomputation in the backward already, and this pass was slower."""
    return on_gpu() and cfg.scan_unroll >= cfg.n_layer


def gelu_example(cfg: Config, key: jax.Array) -> tuple:
    x = jax.random.normal(key, (cfg.block_size, cfg.mlp_width), cfg.compute_dtype)
    return (x,), lambda fn, x: fn(x)


FAST_PATHS = [
    FastPath("attend", "cuDNN flash attention", cudnn_attend, cudnn_applies, attend_example),
    FastPath("qk_norm_rope", "the Pallas QK-norm + RoPE kernel", fused_qk_norm_rope,
             qk_norm_rope_applies, qk_norm_rope_example),
    FastPath("gelu", "the recomputing GELU", recomputing_gelu, gelu_applies, gelu_example),
]


# The Pallas kernel: forward and backward, each one pass over (ROWS, K) blocks.

def _halves(ref):
    """A (rows, K) block read as its two halves in float32: RoPE pairs dim i with dim i + K/2,
    and Triton has no slicing of loaded values, so the halves are loaded apart."""
    half = ref.shape[1] // 2
    return ref[:, :half].astype(jnp.float32), ref[:, half:].astype(jnp.float32)


def _row_mean(a1, a2):
    """The mean over each row of a block held as its two halves."""
    total = jnp.sum(a1, 1, keepdims=True) + jnp.sum(a2, 1, keepdims=True)
    return total / (a1.shape[1] + a2.shape[1])


def _normalized(x_ref):
    """(x - mean) / sqrt(var + eps) over each row (one token's head), as two halves, and
    1 / sqrt(var + eps)."""
    x1, x2 = _halves(x_ref)
    mean = _row_mean(x1, x2)
    x1, x2 = x1 - mean, x2 - mean
    r = jax.lax.rsqrt(_row_mean(x1 * x1, x2 * x2) + EPS)
    return x1 * r, x2 * r, r


def _store(ref, y1, y2):
    half = ref.shape[1] // 2
    ref[:, :half], ref[:, half:] = y1.astype(ref.dtype), y2.astype(ref.dtype)


def _fwd_kernel(q_ref, k_ref, v_ref, gq_ref, gk_ref, cos_ref, sin_ref, qo_ref, ko_ref, vo_ref):
    cos, sin = cos_ref[...], sin_ref[...]
    for x_ref, g_ref, o_ref in ((q_ref, gq_ref, qo_ref), (k_ref, gk_ref, ko_ref)):
        n1, n2, _ = _normalized(x_ref)
        g1, g2 = _halves(g_ref)
        a1, a2 = n1 * g1, n2 * g2  # LayerNorm's output, then RoPE's rotation of the pair (a1, a2)
        _store(o_ref, a1 * cos - a2 * sin, a2 * cos + a1 * sin)
    vo_ref[...] = v_ref[...]  # v copied here rather than by a separate slice of the qkv output


def _bwd_kernel(x_ref, g_ref, cos_ref, sin_ref, dq_ref, dk_ref, dv_ref, dx_ref, dg_ref):
    """One (ROWS, K) block of the qkv gradient: the grid's second axis runs over q's, k's and v's
    heads, so the gradient is written in qkv's own layout and needs no concatenate (a pass of its
    own, which XLA also fused into slower Triton matmuls)."""
    group = pl.program_id(1) // (pl.num_programs(1) // 3)  # 0: q, 1: k, 2: v

    def norm_rope_grad(dy_ref):
        n1, n2, r = _normalized(x_ref)
        g1, g2 = _halves(g_ref)
        dy1, dy2 = _halves(dy_ref)
        cos, sin = cos_ref[...], sin_ref[...]
        da1, da2 = dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin  # RoPE's transpose: rotate back
        _store(dg_ref, jnp.sum(da1 * n1, 0, keepdims=True), jnp.sum(da2 * n2, 0, keepdims=True))
        dn1, dn2 = da1 * g1, da2 * g2
        # LayerNorm's backward: dx = r * (dn - mean(dn) - n * mean(dn * n)) over the row
        mean_dn, mean_dnn = _row_mean(dn1, dn2), _row_mean(dn1 * n1, dn2 * n2)
        _store(dx_ref, r * (dn1 - mean_dn - n1 * mean_dnn), r * (dn2 - mean_dn - n2 * mean_dnn))

    pl.when(group == 0)(lambda: norm_rope_grad(dq_ref))  # a ref is read only where a branch does
    pl.when(group == 1)(lambda: norm_rope_grad(dk_ref))

    @pl.when(group == 2)
    def _():
        dx_ref[...] = dv_ref[...]
        dg_ref[...] = jnp.zeros(dg_ref.shape, dg_ref.dtype)


def _blocks(K: int, *columns: int):
    """BlockSpecs of (ROWS, K) blocks of a (T, C) array, at head h of column group c
    (C = groups x H x K)."""
    return [pl.BlockSpec((ROWS, K), lambda i, h, c=c: (i, c + h)) for c in columns]


def _shared(K: int):
    """BlockSpecs of the rotation tables (the block's rows) and of a gain (all of it), alike for
    every head."""
    table = pl.BlockSpec((ROWS, K // 2), lambda i, h: (i, 0))
    return table, pl.BlockSpec((1, K), lambda i, h: (0, 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def pallas_qk_norm_rope(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H: int):
    """q_THK, k_THK, v_THK from one sequence's qkv projection (T, 3 * H * K: model.Attention's
    (T, 3, H, K) flattened):
    q and k = rope(layer_norm(., gain)), v as is. cos, sin: (T, K / 2) float32 rotation tables."""
    return _forward(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H)


def _forward(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H):
    T, K = qkv_TC.shape[0], qkv_TC.shape[1] // (3 * H)
    table, gain = _shared(K)
    out = jax.ShapeDtypeStruct((T, H * K), qkv_TC.dtype)
    q, k, v = pl.pallas_call(
        _fwd_kernel, grid=(T // ROWS, H), out_shape=(out, out, out), interpret=not on_gpu(),
        in_specs=[*_blocks(K, 0, H, 2 * H), gain, gain, table, table],
        out_specs=_blocks(K, 0, 0, 0),
    )(qkv_TC, qkv_TC, qkv_TC, q_gain_K[None], k_gain_K[None], cos_TK2, sin_TK2)
    return tuple(a.reshape(T, H, K) for a in (q, k, v))


def _fwd(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H):
    inputs = (qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2)
    return _forward(*inputs, H), inputs


def _bwd(H, residuals, cotangents):
    qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2 = residuals
    (T, C), K = qkv_TC.shape, qkv_TC.shape[1] // (3 * H)
    table, _ = _shared(K)
    block = pl.BlockSpec((ROWS, K), lambda i, j: (i, j))  # j: the column block, of 3 * H
    head = pl.BlockSpec((ROWS, K), lambda i, j: (i, j % H))  # the same head's block of dq, dk or dv
    gain = pl.BlockSpec((1, K), lambda i, j: (jnp.minimum(j // H, 1), 0))  # q's gain, or k's
    dqkv_TC, dg = pl.pallas_call(
        _bwd_kernel, grid=(T // ROWS, 3 * H), interpret=not on_gpu(),
        out_shape=(jax.ShapeDtypeStruct((T, C), qkv_TC.dtype),
                   jax.ShapeDtypeStruct((T // ROWS, C), jnp.float32)),
        in_specs=[block, gain, table, table, head, head, head],
        out_specs=[block, pl.BlockSpec((1, K), lambda i, j: (i, j))],
    )(qkv_TC, jnp.stack([q_gain_K, k_gain_K]), cos_TK2, sin_TK2,
      *(d.reshape(T, H * K).astype(qkv_TC.dtype) for d in cotangents))
    dg_2K = dg.reshape(-1, 3, H, K)[:, :2].sum((0, 2))  # gain gradients: summed over blocks, heads
    dq_gain, dk_gain = dg_2K[0].astype(q_gain_K.dtype), dg_2K[1].astype(k_gain_K.dtype)
    # the rotation tables are functions of the positions: constants, no gradient to give
    return dqkv_TC, dq_gain, dk_gain, 0 * cos_TK2, 0 * sin_TK2


pallas_qk_norm_rope.defvjp(_fwd, _bwd)


