"""When a copy of model.py's math counts as the same: the tolerance, the input scales and the error
measure that every check of a copy uses (a fast path's, fast_paths.py; the KV cache's,
inference/decode.py), and the check of GPT's two paths to the readout (check_one_readout)."""
import math
import sys
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import model
from configs import Config
from run.errors import UsageError

# Largest relative error a copy may show, forward or gradient: a few roundings of the dtype.
# Outputs are compared row by row (relative_error), gradients over the whole array.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
# The scales the check draws the model's inputs at, outputs compared at each: an edit whose effect
# hides at one magnitude (a soft-cap on attention's logits, a norm's epsilon, a z-loss term) shows
# at another. Gradients at the first only: near a one-hot softmax (large logits) a correct flash
# attention's backward in bfloat16 differs from autodiff's by more than rounding.
SCALES = (1.0, 1 / 64, 64.0)


def relative_error(a: jax.Array, b: jax.Array) -> float:
    """The largest over rows (along the last axis: a position's, a head's values) of the norm of
    a - b over the norm of b (one axis: the whole array): a difference at a few positions (a
    window that cuts the last keys) is not averaged away by the others."""
    return float(row_error(a, b))


def row_error(a: jax.Array, b: jax.Array) -> jax.Array:
    """relative_error as an array, for use inside a jit."""
    a, b = (jnp.atleast_2d(x.astype(jnp.float32)) for x in (a, b))
    row = lambda x: jnp.linalg.norm(x.reshape(-1, x.shape[-1]), axis=-1)  # noqa: E731
    norm = row(b)
    return jnp.max(row(a - b) / jnp.maximum(norm, 1e-3 * jnp.max(norm) + 1e-30))


def position_error(a: jax.Array, b: jax.Array) -> float:
    """For outputs of one number per position (a loss): the largest |a - b| over the root mean
    square of b. Each position on its own: relative_error would take a sequence's losses as one
    row, where a change at one position (no loss on an end-of-text token) shrinks as one over the
    root of the sequence's length, below bfloat16's tolerance at GPT-2's 1024 tokens."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / (jnp.sqrt(jnp.mean(jnp.square(b))) + 1e-30))


def whole_relative_error(a: jax.Array, b: jax.Array) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def edge_ids(V: int) -> list[int]:
    """The ids a tokenizer keeps for its special tokens sit at the vocabulary's edges (GPT-2's
    end-of-text is V - 1; BERT's [PAD], [UNK], [CLS] the lowest): an edit may treat one apart (no
    loss on it, a document mask after it), so every check's tokens hold them."""
    return list(dict.fromkeys(i for i in (V - 1, 0, V - 2, 1, 2) if 0 <= i < V))


def tokens(T: int, V: int, seed: int = 0, special: tuple[int, ...] = ()) -> np.ndarray:
    """T token ids for a check: random over the whole vocabulary, with edge_ids and the
    tokenizer's special ids (its end-of-text, wherever it sits) a third of the way in, so that
    the tokens after them show what an edit keyed on them changes."""
    ids = np.random.default_rng(seed).integers(0, V, T)
    edges = list(dict.fromkeys([*edge_ids(V), *(i for i in special if 0 <= i < V)]))[:T - T // 3]
    ids[T // 3:T // 3 + len(edges)] = edges
    return ids


def spread(shape: tuple, dtype, seed: int) -> jax.Array:
    """Values in [-2, 2] with no pattern a readout would notice: cheaper to compile than
    jax.random's (this runs at every start, on the CPU too)."""
    i = jnp.arange(math.prod(shape), dtype=jnp.float32)
    return (2 * jnp.cos(i * 2.399963 + seed)).reshape(shape).astype(dtype)


def check_one_readout(cfg: Config, fast: dict[str, Callable]) -> None:
    """GPT.logits (what sampling, eval.py and the export read) against model.readout of
    GPT.readout_inputs, which GPT.loss reads through model.cross_entropy (training's loss, and the
    fused one is checked against it): on a random readout of the run's shapes at each of SCALES.
    An edit in GPT.logits alone (a final soft-cap) would train one model and sample another: a
    UsageError. Edits of model.cross_entropy (or of GPT.loss) are the loss's own, and train; one
    line says so, and for model.cross_entropy which kind: a loss of the readout's softmax alone
    (label smoothing: the same logits shifted by a constant give the same loss) trains the model
    sampling reads, while one that reads more of the logits (a soft-cap, or a z-loss that
    belongs in train.loss_fn's objective) may not."""
    shapes = eqx.filter_eval_shape(model.GPT, cfg, fast)
    params, static = eqx.partition(shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    T, dtype = min(cfg.block_size, 8), jnp.dtype(cfg.compute_dtype)
    y_T = tokens(T, cfg.vocab_size)  # numpy: a jnp array made here would be traced (tools/sweeps)

    @jax.jit
    def both(scale):  # the unused arrays (the blocks') never made: XLA drops them
        leaves, tree = jax.tree.flatten(params)
        drawn = [scale * spread(x.shape, x.dtype, i) for i, x in enumerate(leaves)]
        gpt = eqx.combine(jax.tree.unflatten(tree, drawn), static)
        x_TD = spread((T, cfg.d_model), dtype, -1)
        h_TD, unembed_VD = gpt.readout_inputs(x_TD)
        inputs = h_TD, unembed_VD, gpt.readout_mult
        want = model.readout(*inputs)
        plain_T = optax.softmax_cross_entropy_with_integer_labels(want, y_T)
        # the same logits, each position's shifted by a constant that a softmax does not see: one
        # more feature, the constant, read with weight 1 / mult (in float32: no new rounding)
        h_TD, unembed_VD = h_TD.astype(jnp.float32), unembed_VD.astype(jnp.float32)
        shifted = (jnp.concatenate([h_TD, 3 * spread((T, 1), jnp.float32, -2)], 1),
                   jnp.pad(unembed_VD, ((0, 0), (0, 1)), constant_values=1 / gpt.readout_mult))
        cross_entropy_T = model.cross_entropy(*inputs, y_T)
        return (jnp.isfinite(want).all(), row_error(gpt.logits(x_TD), want),
                row_error(cross_entropy_T, plain_T), row_error(gpt.loss(x_TD, y_T), cross_entropy_T),
                row_error(model.cross_entropy(*shifted, gpt.readout_mult, y_T),
                          model.cross_entropy(h_TD, unembed_VD, gpt.readout_mult, y_T)))

    # Compiled once and called: its values are concrete even where setup is traced (tools/sweeps),
    # and it runs as one program, not op by op (jax.ensure_compile_time_eval) at every start.
    compiled = both.lower(np.float32(1)).compile()
    for scale in SCALES:  # the parameters' (the stream is normed before the readout)
        finite, error, loss_error, method_error, shift_error = map(np.asarray,
                                                                   compiled(np.float32(scale)))
        if not finite:  # a readout that overflows (alpha_out=1e39): the run's steps are
            continue  # non-finite, which train.py reports; nothing to compare
        if not error <= TOLERANCE[cfg.compute_dtype]:
            raise UsageError(f"model.GPT.logits is not model.readout, which training's loss reads "
                             f"(they differ by {error:.3g} relative): an edit in GPT.logits "
                             "reaches sampling, eval.py and the export but not training; make it "
                             "in model.readout")
        if scale == SCALES[0] and not loss_error <= TOLERANCE[cfg.compute_dtype]:
            say_the_loss_is_its_own(loss_error, shift_error <= TOLERANCE["float32"])
        if scale == SCALES[0] and not method_error <= TOLERANCE[cfg.compute_dtype]:
            note(f"note: model.GPT.loss is not model.cross_entropy of GPT.readout_inputs (they "
                 f"differ by {method_error:.3g} relative): training optimises and logs it as "
                 "loss/ (not a plain cross-entropy's); a term on the logits belongs in "
                 "train.loss_fn's objective, so loss/ stays the cross-entropy, and a change to "
                 "the cross-entropy in model.cross_entropy")


def say_the_loss_is_its_own(error: float, of_the_softmax: bool) -> None:
    """One line at the start, on process 0: which kind of loss model.cross_entropy now is."""
    head = (f"note: model.cross_entropy is not the cross-entropy of model.readout's logits (they "
            f"differ by {error:.3g} relative)")
    if of_the_softmax:
        tail = ("; it reads them only through their softmax (label smoothing, say): training "
                "optimises and logs that loss (loss/ is not a plain cross-entropy's), and "
                "sampling, eval.py and the export read the same model.readout")
    else:
        tail = (" and reads more of them than their softmax: a change to the logits themselves "
                "(a soft-cap) trains a model that sampling, eval.py and the export do not read: "
                "make it in model.readout; a term on the logits (a z-loss) belongs in "
                "train.loss_fn's objective, so loss/ stays the cross-entropy")
    note(head + tail)


def note(line: str) -> None:
    """To stderr, by process 0."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)
