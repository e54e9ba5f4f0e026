"""Fused kernels (Pallas): work that XLA's own fusions do in many passes, done in one; and gelu, which
keeps XLA from saving an intermediate.

qk_norm_rope: the QK-LayerNorm and rotary embedding of model.Attention.project, from the qkv projection
straight to the q, k and v that attention takes. Left to XLA:GPU, the split, the norm (float32 out), RoPE's
halves and concatenate, and their gradients came to ~16 kernels a layer over float32 intermediates: 12 of
69 ms in a GPT-2 124M step on an H100, 90 of 451 ms at 1.5B. Here it is one kernel forward (run again where
the remat recomputes the block) and one backward, reading and writing the compute dtype: the 124M step
134.7 -> 124.3 ms, the 1.5B one 447 -> 392 ms (BENCHMARKS.md).
Lowered through Triton on GPU; elsewhere it runs in Pallas's interpreter, for tests only (model.py
selects it on GPU alone). jax 0.11 warns that Pallas's Triton backend is deprecated in favour of Mosaic GPU:
a port is due when it goes. A TPU kernel (splash attention through Pallas's Mosaic backend) would go here too.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS = 64  # tokens a program: 64 x 64 bf16 blocks; XL's 16 x 1024 tokens x 25 heads = 6400 programs
EPS = 1e-6  # model.layer_norm's


def applies(T: int, K: int) -> bool:
    """On one GPU (a pallas_call has no sharding rule: under FSDP XLA would gather its operands onto every
    device), with Triton's power-of-two blocks: the head dim, and whole blocks of ROWS tokens."""
    on_one_gpu = jax.default_backend() == "gpu" and jax.device_count() == 1
    return on_one_gpu and K >= 16 and K & (K - 1) == 0 and T % ROWS == 0


def _halves(ref):
    """A (rows, K) block read as its two halves in float32: RoPE pairs dim i with dim i + K/2, and Triton
    has no slicing of loaded values, so the halves are loaded apart."""
    half = ref.shape[1] // 2
    return ref[:, :half].astype(jnp.float32), ref[:, half:].astype(jnp.float32)


def _row_mean(a1, a2):
    """The mean over each row of a block held as its two halves."""
    return (jnp.sum(a1, 1, keepdims=True) + jnp.sum(a2, 1, keepdims=True)) / (a1.shape[1] + a2.shape[1])


def _normalized(x_ref):
    """(x - mean) / sqrt(var + eps) over each row (one token's head), as two halves, and 1 / sqrt(var + eps)."""
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
    vo_ref[...] = v_ref[...]  # v is copied out here rather than by a separate slice of the qkv output


def _bwd_kernel(x_ref, g_ref, cos_ref, sin_ref, dq_ref, dk_ref, dv_ref, dx_ref, dg_ref):
    """One (ROWS, K) block of the qkv gradient: the grid's second axis runs over q's, k's and v's heads,
    so the gradient is written in qkv's own layout and needs no concatenate (which cost a pass over it,
    and made XLA fuse the concatenate into slower Triton matmuls)."""
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

    pl.when(group == 0)(lambda: norm_rope_grad(dq_ref))  # a ref is read only where a branch reads it
    pl.when(group == 1)(lambda: norm_rope_grad(dk_ref))

    @pl.when(group == 2)
    def _():
        dx_ref[...] = dv_ref[...]
        dg_ref[...] = jnp.zeros(dg_ref.shape, dg_ref.dtype)


def _blocks(K: int, *columns: int):
    """BlockSpecs of (ROWS, K) blocks of a (T, C) array, at head h of column group c (C = groups x H x K)."""
    return [pl.BlockSpec((ROWS, K), lambda i, h, c=c: (i, c + h)) for c in columns]


def _shared(K: int):
    """BlockSpecs of the rotation tables (the block's rows) and of a gain (all of it), alike for every head."""
    return pl.BlockSpec((ROWS, K // 2), lambda i, h: (i, 0)), pl.BlockSpec((1, K), lambda i, h: (0, 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def qk_norm_rope(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H: int):
    """q_THK, k_THK, v_THK from one sequence's qkv projection (T, 3 * H * K, as model.Attention lays it out):
    q and k = rope(layer_norm(., gain)), v as is. cos, sin: (T, K / 2) float32 rotation tables."""
    return _forward(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H)


def _forward(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H):
    T, K = qkv_TC.shape[0], qkv_TC.shape[1] // (3 * H)
    table, gain = _shared(K)
    out = jax.ShapeDtypeStruct((T, H * K), qkv_TC.dtype)
    q, k, v = pl.pallas_call(
        _fwd_kernel, grid=(T // ROWS, H), out_shape=(out, out, out), interpret=jax.default_backend() != "gpu",
        in_specs=[*_blocks(K, 0, H, 2 * H), gain, gain, table, table], out_specs=_blocks(K, 0, 0, 0),
    )(qkv_TC, qkv_TC, qkv_TC, q_gain_K[None], k_gain_K[None], cos_TK2, sin_TK2)
    return tuple(a.reshape(T, H, K) for a in (q, k, v))


def _fwd(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H):
    return _forward(qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2, H), (qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2)


def _bwd(H, residuals, cotangents):
    qkv_TC, q_gain_K, k_gain_K, cos_TK2, sin_TK2 = residuals
    (T, C), K = qkv_TC.shape, qkv_TC.shape[1] // (3 * H)
    table, _ = _shared(K)
    block = pl.BlockSpec((ROWS, K), lambda i, j: (i, j))  # j: the column block, of 3 * H
    head = pl.BlockSpec((ROWS, K), lambda i, j: (i, j % H))  # the same head's block of dq, dk or dv
    gain = pl.BlockSpec((1, K), lambda i, j: (jnp.minimum(j // H, 1), 0))  # q's gain, or k's
    dqkv_TC, dg = pl.pallas_call(
        _bwd_kernel, grid=(T // ROWS, 3 * H), interpret=jax.default_backend() != "gpu",
        out_shape=(jax.ShapeDtypeStruct((T, C), qkv_TC.dtype), jax.ShapeDtypeStruct((T // ROWS, C), jnp.float32)),
        in_specs=[block, gain, table, table, head, head, head],
        out_specs=[block, pl.BlockSpec((1, K), lambda i, j: (i, j))],
    )(qkv_TC, jnp.stack([q_gain_K, k_gain_K]), cos_TK2, sin_TK2,
      *(d.reshape(T, H * K).astype(qkv_TC.dtype) for d in cotangents))
    dg_2K = dg.reshape(-1, 3, H, K)[:, :2].sum((0, 2))  # the gain gradients, summed over blocks and heads
    return dqkv_TC, dg_2K[0].astype(q_gain_K.dtype), dg_2K[1].astype(k_gain_K.dtype), 0 * cos_TK2, 0 * sin_TK2


qk_norm_rope.defvjp(_fwd, _bwd)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """jax.nn.gelu (tanh form) whose backward recomputes it from x. With the layers unrolled, XLA merges
    the remat's recomputation into the forward (prevent_cse=False) and keeps GELU's tanh as a second
    (B, T, F) output, written in the forward and read in the backward: 1.3% of a 124M step on an H100.
    In a scan the recomputation stays in the backward, fused with the hidden activations the down
    projection's gradient needs, and this separate pass was slower (1.9% at 1.5B): model.py uses it unrolled."""
    return jax.nn.gelu(x)


# the barrier keeps XLA from sharing the backward's tanh with the forward's again
gelu.defvjp(lambda x: (jax.nn.gelu(x), x), lambda x, dy: jax.vjp(jax.nn.gelu, jax.lax.optimization_barrier(x))[1](dy))
