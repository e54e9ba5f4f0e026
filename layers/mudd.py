"""MUDD's dynamic dense connections (Xiao et al. 2025, arXiv 2502.12170; Caiyun-AI/MUDDFormer),
model.py's cfg.connections="mudd": after block i, per token, weights A (C, J) = GELU(RMSNorm(X_i+1)
W1) W2 + b of the J = i + 2 states so far (the embedding, each block's output), one weighted sum
per stream (C: the queries', keys' and values' inputs and the residual; 1 after the last block).
W2 = 0 and b one-hot on X_i+1 at init: the plain residual stream. Its RMSNorm (no gain) and GELU
are model.py's, handed in by GPT.hidden (this file imports no model.py: no import cycle).
Shapes as in model.py: C streams, J states, M = C * J the mixing width."""
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from configs import Config


class Connections(eqx.Module):
    w1: Float[Array, "D CJ"]
    w2: Float[Array, "CJ CJ"]
    b: Float[Array, "C J"]  # stored as b minus the one-hot, so every parameter starts at 0 mean

    def __init__(self, cfg: Config, i: int):
        C = (3 if cfg.attention == "sharedkv" else 4) if i < cfg.n_layer - 1 else 1
        J = i + 2
        self.w1, self.w2 = jnp.zeros((cfg.d_model, C * J)), jnp.zeros((C * J, C * J))
        self.b = jnp.zeros((C, J))

    @jax.named_scope("mudd")
    def __call__(self, states_JTD: list[Array], norm: Callable, act: Callable) -> tuple[Array, ...]:
        (C, J), x_TD = self.b.shape, states_JTD[-1]
        h_TM = act(jnp.einsum("TD,DM->TM", norm(x_TD, None), self.w1.astype(x_TD.dtype)))
        a_TCJ = (h_TM @ self.w2.astype(x_TD.dtype)).reshape(-1, C, J)  # w2: (M, M)
        a_TCJ = (a_TCJ + self.b + jnp.eye(J)[-1]).astype(x_TD.dtype)  # b is float32: keep bf16
        # sums of products rather than an einsum over the stacked states: the backward then keeps
        # the states (alive anyway), not a stacked copy per layer (L^2 T D memory)
        return tuple(sum(a_TCJ[:, c, j, None] * x for j, x in enumerate(states_JTD))
                     for c in range(C))


def run_blocks(connections: tuple[Connections, ...], layer: Callable, x_TD: Array, inputs: Any,
               norm: Callable, act: Callable) -> tuple[Array, Any]:
    """The blocks one after another, each reading the streams the Connections before it made of
    every earlier state: a Python loop, as a scan would save the whole history per layer.
    layer(xs_TD, inputs of block i) -> (x_TD, block i's cache); inputs: the stacked blocks'
    parameters, caches and dropout keys; norm(x, gain), act(x): model.py's rms_norm and gelu.
    Returns the last stream and the caches stacked."""
    states, xs_TD, caches = [x_TD], (x_TD,), []
    for i, connect in enumerate(connections):
        x_TD, layer_cache = layer(xs_TD, jax.tree.map(lambda a: a[i], inputs))
        states.append(x_TD)
        caches.append(layer_cache)
        xs_TD = connect(states, norm, act)
    return xs_TD[0], jax.tree.map(lambda *c: jnp.stack(c), *caches)
