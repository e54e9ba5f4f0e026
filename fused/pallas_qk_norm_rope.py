"""The Pallas kernel behind fast_paths.py's fused model.qk_norm_rope: QK-LayerNorm then RoPE, from
the projection's q (T, H, K) and k (T, G, K) straight to what attention takes, in one pass each way
where XLA made many over float32 intermediates. Triton on a GPU; elsewhere Pallas's interpreter,
which is how the tests run it on a CPU. G <= H: grouped-query and SharedKV keys included.

Both passes run a grid of (T / ROWS, H + G) programs: program (i, j) takes ROWS tokens of query
head j (j < H) or of key head j - H, so q and k are read and written in their own layouts, with no
concatenate of the two (a copy of its own).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS = 64  # tokens a Pallas program: (64, K) blocks
EPS = 1e-6  # model.layer_norm's


def fits(T: int, K: int) -> bool:
    """Triton's power-of-two blocks: the head dim, and whole blocks of ROWS tokens."""
    return K >= 16 and K & (K - 1) == 0 and T % ROWS == 0


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


def _on_q_or_k(H: int, step):
    """step(0) in the programs of query heads, step(1) in those of key heads. A ref is read
    only where a branch does, so each program loads one head's block."""
    is_key = pl.program_id(1) >= H
    pl.when(jnp.logical_not(is_key))(lambda: step(0))
    pl.when(is_key)(lambda: step(1))


def _fwd_kernel(H, q_ref, k_ref, g_ref, cos_ref, sin_ref, qo_ref, ko_ref):
    def step(which):
        x_ref, o_ref = ((q_ref, qo_ref), (k_ref, ko_ref))[which]
        n1, n2, _ = _normalized(x_ref)
        g1, g2 = _halves(g_ref)
        a1, a2 = n1 * g1, n2 * g2  # LayerNorm's output, then RoPE's rotation of the pair (a1, a2)
        cos, sin = cos_ref[...], sin_ref[...]
        _store(o_ref, a1 * cos - a2 * sin, a2 * cos + a1 * sin)

    _on_q_or_k(H, step)


def _bwd_kernel(H, q_ref, k_ref, g_ref, cos_ref, sin_ref, dqo_ref, dko_ref, dq_ref, dk_ref,
                dg_ref):
    def step(which):
        x_ref, dy_ref, dx_ref = ((q_ref, dqo_ref, dq_ref), (k_ref, dko_ref, dk_ref))[which]
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

    _on_q_or_k(H, step)


def _specs(H: int, K: int):
    """BlockSpecs of program (i, j)'s (ROWS, K) block of q's head j and of k's head j - H (each
    clamped into range where the program takes the other), of the rotation tables' rows, and of
    the gain the program uses (all of it; row 0 of the stacked pair q's, row 1 k's)."""
    q = pl.BlockSpec((ROWS, K), lambda i, j: (i, jnp.minimum(j, H - 1)))
    k = pl.BlockSpec((ROWS, K), lambda i, j: (i, jnp.maximum(j - H, 0)))
    table = pl.BlockSpec((ROWS, K // 2), lambda i, j: (i, 0))
    gain = pl.BlockSpec((1, K), lambda i, j: (jnp.minimum(j // H, 1), 0))
    return q, k, table, gain


@jax.custom_vjp
def qk_norm_rope(q_THK, k_TGK, q_gain_K, k_gain_K, cos_TK2, sin_TK2):
    """q = rope(layer_norm(q, q_gain)) and k = rope(layer_norm(k, k_gain)) in their dtype.
    cos, sin: (T, K / 2) float32 rotation tables, the same positions for q and k."""
    return _forward(q_THK, k_TGK, q_gain_K, k_gain_K, cos_TK2, sin_TK2)


def _forward(q_THK, k_TGK, q_gain_K, k_gain_K, cos_TK2, sin_TK2):
    (T, H, K), G = q_THK.shape, k_TGK.shape[1]
    q, k, table, gain = _specs(H, K)
    q_TC, k_TC = q_THK.reshape(T, H * K), k_TGK.reshape(T, G * K)
    qo, ko = pl.pallas_call(
        functools.partial(_fwd_kernel, H), grid=(T // ROWS, H + G),
        out_shape=(jax.ShapeDtypeStruct(q_TC.shape, q_TC.dtype),
                   jax.ShapeDtypeStruct(k_TC.shape, k_TC.dtype)),
        in_specs=[q, k, gain, table, table], out_specs=[q, k],
        interpret=jax.default_backend() != "gpu",
    )(q_TC, k_TC, jnp.stack([q_gain_K, k_gain_K]), cos_TK2, sin_TK2)
    return qo.reshape(T, H, K), ko.reshape(T, G, K)


def _fwd(*inputs):
    return _forward(*inputs), inputs


def _bwd(residuals, cotangents):
    q_THK, k_TGK, q_gain_K, k_gain_K, cos_TK2, sin_TK2 = residuals
    (T, H, K), G = q_THK.shape, k_TGK.shape[1]
    q, k, table, gain = _specs(H, K)
    q_TC, k_TC = q_THK.reshape(T, H * K), k_TGK.reshape(T, G * K)
    dqo_TC, dko_TC = (d.reshape(x.shape).astype(x.dtype) for d, x in zip(cotangents, (q_TC, k_TC)))
    dq_TC, dk_TC, dg = pl.pallas_call(
        functools.partial(_bwd_kernel, H), grid=(T // ROWS, H + G),
        out_shape=(jax.ShapeDtypeStruct(q_TC.shape, q_TC.dtype),
                   jax.ShapeDtypeStruct(k_TC.shape, k_TC.dtype),
                   jax.ShapeDtypeStruct((T // ROWS, (H + G) * K), jnp.float32)),
        in_specs=[q, k, gain, table, table, q, k],
        out_specs=[q, k, pl.BlockSpec((1, K), lambda i, j: (i, j))],
        interpret=jax.default_backend() != "gpu",
    )(q_TC, k_TC, jnp.stack([q_gain_K, k_gain_K]), cos_TK2, sin_TK2, dqo_TC, dko_TC)
    dg_NK = dg.reshape(-1, H + G, K)  # each program's part of its gain's gradient
    dq_gain, dk_gain = dg_NK[:, :H].sum((0, 1)), dg_NK[:, H:].sum((0, 1))
    # the rotation tables are functions of the positions: constants, no gradient to give
    return (dq_TC.reshape(T, H, K), dk_TC.reshape(T, G, K), dq_gain.astype(q_gain_K.dtype),
            dk_gain.astype(k_gain_K.dtype), 0 * cos_TK2, 0 * sin_TK2)


qk_norm_rope.defvjp(_fwd, _bwd)
