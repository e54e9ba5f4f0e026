"""Where the T queries and S keys of a forward sit, built once for all blocks (model.GPT.positions):
RoPE's cos/sin tables, or ALiBi's logit biases; with sample.py's KV cache, keys at the cache's S
positions and a mask hiding those after each query. Shapes as in model.py."""
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array


class Positions(NamedTuple):
    q_T: Array
    k_S: Array
    q_rope: tuple[Array, Array] | None  # cos and sin (T, K2) of the queries; None with ALiBi
    k_rope: tuple[Array, Array] | None
    mask_TS: Array | None  # None: causal, the queries and keys are the same T tokens
    bias_HTS: Array | None  # ALiBi's, None with RoPE


def rope_table(pos_T: Array, K: int, base: float) -> tuple[Array, Array]:
    """cos and sin (T, K/2) of RoPE's (Su et al. 2021) angles pos * base^(-2i/K)."""
    inv_freq_K2 = base ** (-jnp.arange(K // 2, dtype=jnp.float32) / (K // 2))
    angle_TK2 = pos_T.astype(jnp.float32)[:, None] * inv_freq_K2
    return jnp.cos(angle_TK2), jnp.sin(angle_TK2)


def alibi_bias(q_T: Array, k_S: Array, H: int) -> Array:
    """ALiBi's (Press et al. 2022, arXiv 2108.12409) logit bias -m_h (i - j), query position i, key
    position j. Slopes m: 2^(-8/H), 2^(-16/H), ... for H a power of two; else those of the power of
    two below H, then every other one of twice that power (the paper's code, ZeRO-transformer's)."""
    powers = lambda n: [2 ** (-8 * (i + 1) / n) for i in range(n)]  # noqa: E731
    below = 2 ** math.floor(math.log2(H))
    slopes_H = jnp.array(powers(below) + powers(2 * below)[0::2][:H - below], jnp.float32)
    return -slopes_H[:, None, None] * (q_T[:, None] - k_S[None, :])


def positions(q_T: Array, S: int | None, H: int, K: int, rope_base: float | None) -> Positions:
    """Queries at q_T; keys at the same positions, or with a KV cache of S positions at 0..S-1 and
    a mask hiding those after each query. rope_base None: ALiBi's biases for H heads, no tables."""
    k_S = q_T if S is None else jnp.arange(S)
    mask_TS = None if S is None else k_S[None, :] <= q_T[:, None]
    if rope_base is None:
        return Positions(q_T, k_S, None, None, mask_TS, alibi_bias(q_T, k_S, H))
    q_rope = rope_table(q_T, K, rope_base)
    k_rope = q_rope if S is None else rope_table(k_S, K, rope_base)
    return Positions(q_T, k_S, q_rope, k_rope, mask_TS, None)
