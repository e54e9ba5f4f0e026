"""model.cross_entropy with the log-softmax fused: the readout's logits stay in the compute dtype
(bfloat16 on a GPU) and no float32 (T, V) array is written, forward or backward.

model.py's function, differentiated by autodiff, writes the logits in float32 (the cast after the
matmul), then a float32 log-softmax, and in the backward pass float32 softmax and gradient arrays:
at GPT-2's vocabulary those are the largest arrays of the step and several passes over memory.
Here the matmul is the same plain einsum (its gradient's matmuls are autodiff's), and a custom VJP
takes the logits from there: the forward reads them once for the float32 log-sum-exp (the cast
fused into the reduction) and keeps them, in the compute dtype, with the log-sum-exp; the backward
makes the logits' gradient, mult * (softmax - onehot(y)) * g, in one elementwise pass into the
compute dtype, which the two matmuls of the readout's gradient read. The custom VJP is only the
log-softmax part: jax.vmap of it (train.py's batch) stays elementwise, and the weight gradient's
matmul contracts the batch and the tokens at once, as autodiff's does.

fast_paths.select checks it against model.cross_entropy where the model calls it (model.GPT.loss),
forward and gradient, like every fast path: an edit to the loss in model.py sets it aside.
"""
import functools

import jax
import jax.numpy as jnp


def cross_entropy(h_TD: jax.Array, unembed_VD: jax.Array, mult: float, y_T: jax.Array
                  ) -> jax.Array:
    """model.cross_entropy's signature and value: each position's -log softmax(logits)[y]."""
    z_TV = jnp.einsum("TD,VD->TV", h_TD, unembed_VD)  # the compute dtype: never float32 whole
    return logits_cross_entropy(z_TV, mult, y_T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def logits_cross_entropy(z_TV: jax.Array, mult: float, y_T: jax.Array) -> jax.Array:
    return _forward(z_TV, mult, y_T)[0]


def _forward(z_TV, mult, y_T):
    x_TV = mult * z_TV.astype(jnp.float32)  # fused into its readers: not written
    lse_T = jax.nn.logsumexp(x_TV, axis=-1)
    label_T = jnp.take_along_axis(x_TV, y_T[:, None], axis=-1)[:, 0]
    return lse_T - label_T, (z_TV, lse_T, y_T)


def _backward(mult, residuals, g_T):
    z_TV, lse_T, y_T = residuals
    p_TV = jnp.exp(mult * z_TV.astype(jnp.float32) - lse_T[:, None])  # the softmax
    V = z_TV.shape[-1]  # a negative target counts from the end, as take_along_axis reads it
    onehot_TV = jnp.arange(V) == jnp.where(y_T < 0, y_T + V, y_T)[:, None]
    dz_TV = (mult * g_T[:, None] * (p_TV - onehot_TV)).astype(z_TV.dtype)
    return dz_TV, None  # y: integers, no gradient


logits_cross_entropy.defvjp(_forward, _backward)
