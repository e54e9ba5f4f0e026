"""Fused kernels: optional fast paths for named functions of model.py, used only where they match.

A fast path has the signature of the model.py function it stands in for. When a run starts,
select() checks each one that applies to the run's device and shapes where the model calls it:
the model's forward is traced once at the run's shapes with a recorder in each fast path's place,
which notes how the model calls the function (the arguments, their shapes and dtypes, which are
None, which vary with the parameters and tokens); then each fast path runs beside model.py's own
function on those calls, values drawn at those shapes and at several scales (SCALES), forward and
gradient, on a batch split over the run's devices as train.py splits its batch. One that differs
(model.py was edited, say), fails (an argument it does not take), or would hand the call to
model.py's function (a mask it has no kernel for) is set aside with a printed line, and model.py's
function runs. So an edit to model.py always runs, a fast path never fails a step, and the line
naming what runs fused is true; the check catches differences larger than the dtype's rounding at
any position (TOLERANCE; the fused loss in float32 too), and --config.kernels=false turns every
fast path off.

- attend: jax.nn.dot_product_attention's cuDNN flash attention (GPU, bfloat16); on a TPU, JAX's
  Pallas splash attention (causal; not ALiBi, whose bias it has no input for).
- gelu: model.gelu whose backward recomputes it, where the layers are unrolled (GPU): XLA otherwise
  keeps GELU's tanh as a second (B, T, F) output of the forward, written and read back.
- qk_norm_rope: fused/pallas_qk_norm_rope.py's kernel for the QK-LayerNorm and RoPE (GPU).
- cross_entropy: fused/cross_entropy.py, the log-softmax of the readout with no float32 logits
  (GPU, bfloat16).

Several devices: a kernel (a pallas_call, cuDNN's call) runs inside jax.shard_map on each
device's own sequences (per_device), so 1, 2 or 8 devices run the same kernel on their share.
"""
import contextlib
import dataclasses
import functools
import sys
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import model
from fused import cross_entropy as fused_cross_entropy, pallas_qk_norm_rope as pallas
from fused.agreement import (SCALES, TOLERANCE, check_one_readout, edge_ids, position_error,
                             relative_error, whole_relative_error)
from configs import Config

SPLASH_BLOCK = 128  # splash attention's default blocks of queries and keys


# --------------------------------------------------------------------------------------------------
# Where a run is: the backend, and the batch axes a kernel runs per device over

def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def batch_axes() -> tuple[str, ...] | None:
    """The mesh axes a batch of sequences is split over where this is traced: those of the mesh in
    context (train.py's step sets it: jax.sharding.use_abstract_mesh, which works inside a jit too)
    longer than 1 that no enclosing shard_map has made manual (train.py's data
    parallelism takes "replica"). None without a mesh: one device, or a caller without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    axes = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                 if kind != AxisType.Manual and mesh.shape[name] > 1)
    return axes or None


def per_device(kernel: Callable, *arrays):
    """kernel(*arrays) on each device's own sequences. The model sees one sequence and train.py's
    jax.vmap adds the batch with spmd_axis_name=batch_axes(): a shard_map inside that vmap gets
    the batch axis split over those mesh axes, so each device runs the kernel (vmapped) on its
    own share. This rather than a sharding rule (custom_partitioning) per kernel: one wrapper
    for every kernel, and XLA's partitioner never sees a kernel it would gather operands for (a
    pallas_call has no rule: under FSDP every device would compute the whole batch). Unbatched
    arrays (the gains, the rope tables) are whole on every device, and shard_map's transpose sums
    their gradients over the devices. check_vma=False: pallas_call's outputs and jax's attention
    carry no varying-axes types."""
    axes = batch_axes()
    if axes is None:
        return kernel(*arrays)
    return jax.shard_map(kernel, in_specs=P(), out_specs=P(), axis_names=set(axes),
                         check_vma=False)(*arrays)


# --------------------------------------------------------------------------------------------------
# The self-check: each fast path against model.py's function, where the model calls it

@dataclasses.dataclass(frozen=True)
class FastPath:
    name: str  # the function of model.py it stands in for, with the same signature
    what: str  # what it is, for the printed line
    fn: Callable
    applies: Callable[[Config], bool]  # on this run's devices, dtype and shapes
    # Outputs of one number per position (a loss): compared position by position (position_error)
    per_position: bool = False
    # Math that runs in float32 as well: checked there too, at float32's tolerance, where an edit
    # below bfloat16's rounding (label smoothing of 0.02) shows; the edit still trains in bfloat16
    float32_too: bool = False


def select(cfg: Config, mesh: jax.sharding.Mesh | None = None, loss: Callable | None = None,
           special_ids: tuple[int, ...] = ()) -> dict[str, Callable]:
    """{model.py function name: its fast path} for the fast paths that apply and match wherever
    the model calls them, checked on the run's mesh (None: one device). loss(model, x_BT, y_BT):
    the loss training runs (train.py's loss_fn; None: model.GPT.loss, as train.py calls it).
    special_ids: the tokenizer's (its end-of-text), among the targets wherever they sit: a loss
    edit keyed on one (no loss on it) must show where it is not at the vocabulary's edge."""
    paths = [path for path in FAST_PATHS if cfg.kernels and path.applies(cfg)]
    calls = calls_in_model(cfg, {path.name for path in paths}, loss or model_loss) if paths else {}
    chosen = {}
    for path in paths:
        if not calls[path.name]:  # an edit took the call out (SwiGLU has no GELU): nothing to run
            say(f"kernels: {path.what} unused: the model never calls model.{path.name} through it")
            continue
        problem = None
        for call in calls[path.name]:
            problem = problem or check_at(path, call, cfg, mesh, special_ids)
        if problem:
            say(f"kernels: {path.what} set aside, model.{path.name} runs instead: {problem}")
        else:
            chosen[path.name] = path
    if chosen:
        say("kernels: fused, each checked where the model calls it: "
            + ", ".join(f"model.{name} as {path.what}" for name, path in chosen.items()))
    fast = {name: path.fn for name, path in chosen.items()}
    check_one_readout(cfg, fast)
    return fast


class Drawn:
    """An array argument of a recorded call: its shape and dtype, and whether it varies with the
    parameters or the tokens (q, k, the QK-norm gains: an input with a gradient, each device's
    own) or not (RoPE's tables, ALiBi's bias, a mask: constants of the step)."""

    def __init__(self, x: jax.Array):
        self.shape, self.dtype, self.varies = x.shape, x.dtype, False

    def __repr__(self) -> str:
        return f"{self.dtype.name}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass
class Call:
    """How the model calls model.py's function `name`: spec is (args, kwargs), arrays as Drawn."""
    name: str
    spec: tuple

    def __repr__(self) -> str:
        args, kwargs = self.spec
        shown = [*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]
        return f"{self.name}({', '.join(shown)})"


def remap(x, leaf: Callable, is_leaf: Callable, memo: dict):
    """x with leaf(a) for each a that is_leaf, in tuples, lists and dicts; an object met twice
    gives the same result (model.py hands qk_norm_rope one RoPE table for q and k, and
    fused_qk_norm_rope asks `is`)."""
    if id(x) not in memo:
        again = lambda y: remap(y, leaf, is_leaf, memo)  # noqa: E731
        if is_leaf(x):
            memo[id(x)] = leaf(x)
        elif isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
            memo[id(x)] = type(x)(*map(again, x))
        elif isinstance(x, (tuple, list)):
            memo[id(x)] = type(x)(map(again, x))
        elif isinstance(x, dict):
            memo[id(x)] = {k: again(v) for k, v in x.items()}
        else:  # None, a Python number (attend's scale): as it is
            memo[id(x)] = x
    return memo[id(x)]


def is_drawn(x) -> bool:
    return isinstance(x, Drawn)


def model_loss(gpt: model.GPT, x_BT: jax.Array, y_BT: jax.Array) -> jax.Array:
    return jax.vmap(gpt.loss)(jax.vmap(lambda t: gpt.hidden(t)[0])(x_BT), y_BT)


def calls_in_model(cfg: Config, names: set[str], loss: Callable = model_loss
                   ) -> dict[str, list[Call]]:
    """{name: the distinct calls of model.<name>} where the model calls a fast path, at the run's
    shapes: the logits and the loss (of loss_chunks sequences, their tokens as targets) traced
    abstractly (jax.eval_shape), the model built with a recorder as its fast path, under a
    jax.vmap over the parameters and the tokens, whose batching rule (custom_vmap's) tells which
    arguments vary with them."""
    calls = {name: [] for name in names}

    def recorder(name: str) -> Callable:
        def record(*args, **kwargs):
            found = []
            spec = remap((args, kwargs), lambda x: found.append((Drawn(x), x)) or found[-1][0],
                         lambda x: isinstance(x, jax.Array), {})
            drawn = [d for d, _ in found]
            calls[name].append(Call(name, spec))

            def reference(*arrays):
                by_id = dict(zip(map(id, drawn), arrays))
                args, kwargs = remap(spec, lambda d: by_id[id(d)], is_drawn, {})
                return getattr(model, name)(*args, **kwargs)

            watched = jax.custom_batching.custom_vmap(reference)

            @watched.def_vmap
            def batched(axis_size, in_batched, *arrays):
                for d, varies in zip(drawn, in_batched):
                    d.varies |= varies
                axes = [0 if varies else None for varies in in_batched]
                out = jax.vmap(reference, in_axes=axes)(*arrays)
                return out, jax.tree.map(lambda _: True, out)

            return watched(*(x for _, x in found))
        return record

    gpt = eqx.filter_eval_shape(model.GPT, cfg, {name: recorder(name) for name in names})
    params, static = eqx.partition(gpt, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    two = lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype)  # noqa: E731
    tokens = jax.ShapeDtypeStruct((2, cfg.block_size), jnp.int32)

    def forward(params, tokens_T):  # the logits, and the loss training runs (on loss_chunks
        gpt = eqx.combine(params, static)  # sequences: it splits its batch into that many)
        tokens_BT = jnp.broadcast_to(tokens_T, (cfg.loss_chunks, *tokens_T.shape))
        return gpt(tokens_T), loss(gpt, tokens_BT, tokens_BT)

    jax.eval_shape(jax.vmap(forward), jax.tree.map(two, params), tokens)
    distinct = lambda c: repr(c) + str([d.varies for d in drawn_in(c)])  # noqa: E731
    return {name: list({distinct(c): c for c in found}.values()) for name, found in calls.items()}


def drawn_in(call: Call) -> list[Drawn]:
    found = []
    remap(call.spec, lambda d: found.append(d) or d, is_drawn, {})
    return found


def check_at(path: FastPath, call: Call, cfg: Config, mesh: jax.sharding.Mesh | None,
             special_ids: tuple[int, ...] = ()) -> str | None:
    """Why path is not model.py's function at this call of the model, or None."""
    try:
        arrays, run = batch_on(mesh, cfg, functools.partial(call_example, call, special_ids))
    except Exception as e:  # an argument of a kind draw() does not know
        return f"the model's arguments could not be drawn ({first_line(e)}); it calls {call}"
    HANDED_BACK.clear()
    in_mesh = jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh else None
    error = position_error if path.per_position else relative_error
    with in_mesh or contextlib.nullcontext():
        problem = mismatch(path.fn, getattr(model, path.name), arrays, run,
                           TOLERANCE[cfg.compute_dtype], error)
        if not problem and path.float32_too and cfg.compute_dtype != "float32":
            in_float32 = tuple(x.astype(jnp.float32) for x in arrays)
            problem = mismatch(path.fn, getattr(model, path.name), in_float32, run,
                               TOLERANCE["float32"], error)
            problem = problem and f"{problem}, in float32"
    if HANDED_BACK:
        problem = f"it hands {HANDED_BACK[0]} to model.py's function"
    return problem and f"{problem}; the model calls {call}"


def call_example(call: Call, special_ids: tuple[int, ...], cfg: Config, key: jax.Array) -> tuple:
    """(arrays, run) for the check: the call's varying float arrays drawn at random (the inputs
    differentiated), the others drawn once and held constant; run(fn, scale, *arrays) calls fn
    as the model calls it, the inputs times scale."""
    drawn = drawn_in(call)
    keys = jax.random.split(key, max(len(drawn), 1))
    ids = special_target_ids(cfg, special_ids)
    values = {id(d): draw(d, k, cfg.vocab_size, ids) for d, k in zip(drawn, keys)}
    if call.name == "cross_entropy":
        confident_targets(call, values, len(ids), cfg.vocab_size)
    inputs = [d for d in drawn if d.varies and jnp.issubdtype(d.dtype, jnp.floating)]

    def run(fn, scale, *arrays):
        scaled = [x * scale.astype(x.dtype) for x in arrays]
        by_id = values | dict(zip(map(id, inputs), scaled))
        args, kwargs = remap(call.spec, lambda d: by_id[id(d)], is_drawn, {})
        return fn(*args, **kwargs)

    return tuple(values[id(d)] for d in inputs), run


def special_target_ids(cfg: Config, special_ids: tuple[int, ...]) -> list[int]:
    """The targets every row of the check starts with: the ignore indices -1 and PyTorch's -100
    (an edit that masks the loss there must show; take_along_axis reads them as V - 1 and
    V - 100, which the fused loss does too), the vocabulary's edges (agreement.edge_ids), the
    tokenizer's special ids, and the first padded id (no tokenizer id: a pad target, say)."""
    padded = [cfg.vocab_size] if cfg.model_vocab > cfg.vocab_size else []
    torch_ignore = [-100] if cfg.model_vocab >= 100 else []  # else no row it could read
    return list(dict.fromkeys([-1, *torch_ignore, *edge_ids(cfg.vocab_size), *special_ids,
                               *padded]))


def draw(d: Drawn, key: jax.Array, V: int, first: list[int]) -> jax.Array:
    """Values for an argument. Integers are token ids (the loss's targets), drawn over the whole
    vocabulary V, each row starting with `first` (special_target_ids)."""
    if jnp.issubdtype(d.dtype, jnp.floating):
        return jax.random.normal(key, d.shape, d.dtype)
    if jnp.issubdtype(d.dtype, jax.dtypes.prng_key):  # a dropout key, say
        return jax.random.split(key, d.shape)
    if d.dtype == jnp.bool_:
        return jax.random.bernoulli(key, 0.5, d.shape)
    ids = jax.random.randint(key, d.shape, 0, V, d.dtype)
    edges = jnp.array(first[:d.shape[-1] if d.shape else 0], d.dtype)
    return ids.at[..., :len(edges)].set(edges) if d.shape else ids


def confident_targets(call: Call, values: dict, n_first: int, V: int) -> None:
    """Every other target after the first ids set to the drawn readout's likeliest token: drawn
    apart, a target is almost never the one the logits favour, so a loss that weighs a position
    by its confidence (a focal loss's (1 - p)^gamma, dropping learned tokens) would equal the
    plain one, where a trained model's targets often have p > 0.5. Scaling the readout's inputs
    keeps the argmax: p runs from near uniform to near one over SCALES."""
    args = call.spec[0]
    if len(args) != 4 or not all(map(is_drawn, (args[0], args[1], args[3]))):
        return  # another signature: the check runs on the random targets alone
    h, w, y = (values[id(args[i])] for i in (0, 1, 3))
    if h.ndim != 2 or w.ndim != 2 or y.shape != h.shape[:1]:
        return
    best = jnp.argmax(jnp.einsum("td,vd->tv", h.astype(jnp.float32),
                                 w[:V].astype(jnp.float32)), -1).astype(y.dtype)
    at = jnp.arange(y.shape[0])
    values[id(args[3])] = jnp.where((at >= n_first) & (at % 2 == 0), best, y)


# Why the fast path being checked handed calls to model.py's function (select clears it)
HANDED_BACK: list[str] = []


def hand_back(name: str, why: str, *args):
    """model.<name>(*args), for inputs a fast path has no kernel for (sample.py's decoding, say);
    select() sets aside a fast path that does so where the model calls it in training."""
    HANDED_BACK.append(why)
    return getattr(model, name)(*args)


def batch_on(mesh: jax.sharding.Mesh | None, cfg: Config, example: Callable) -> tuple:
    """example's inputs and call as train.py runs them on mesh (None: one device): a batch of two
    sequences per device, split over them, under jax.vmap with batch_axes(). Two, not one: a
    kernel's batching under vmap (a pallas_call's grid, cuDNN's batch) must keep each device's
    sequences apart, as training's many per device."""
    devices = mesh.size if mesh is not None else 1
    examples = [example(cfg, key) for key in jax.random.split(jax.random.key(0), 2 * devices)]
    arrays = jax.tree.map(lambda *a: jnp.stack(a), *(arrays for arrays, _ in examples))
    if devices > 1:
        arrays = jax.device_put(arrays, NamedSharding(mesh, P(mesh.axis_names)))
    call = examples[0][1]

    def batched_call(fn, scale, *arrays):
        return jax.vmap(lambda *a: call(fn, scale, *a), spmd_axis_name=batch_axes())(*arrays)

    return arrays, batched_call


def say(line: str) -> None:
    """To stderr, by process 0: bench.py's stdout stays its one JSON line."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def mismatch(fast: Callable, reference: Callable, arrays: tuple, call: Callable,
             tolerance: float, output_error: Callable = relative_error) -> str | None:
    """Why fast is not reference on these inputs at each of SCALES (outputs, by output_error, or
    gradients of a random projection of them), or None when they agree within tolerance."""
    def outputs_and_grads(fn, scale, arrays):
        out, pullback = jax.vjp(lambda *a: call(fn, scale, *a), *arrays)
        leaves = jax.tree.leaves(out)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        cotangent = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
        return out, pullback(jax.tree.unflatten(jax.tree.structure(out), cotangent))

    want_fn = jax.jit(functools.partial(outputs_and_grads, reference))  # one compilation each,
    got_fn = jax.jit(functools.partial(outputs_and_grads, fast))  # the scale an input
    for scale in SCALES:
        try:
            want = want_fn(jnp.float32(scale), arrays)
        except Exception as e:  # nothing to compare the fast path with
            return f"model.py's function fails on values drawn at these shapes ({first_line(e)})"
        try:
            got = got_fn(jnp.float32(scale), arrays)
        except Exception as e:
            return f"it failed: {first_line(e)}"
        parts = [("output", got[0], want[0], output_error)]
        if scale == SCALES[0]:
            parts.append(("gradient", got[1], want[1], whole_relative_error))
        for part, g, w, error_of in parts:
            if jax.tree.structure(g) != jax.tree.structure(w):
                return f"its {part} has another structure"
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
                if a.shape != b.shape:
                    return f"its {part} has shape {a.shape}, model.py's {b.shape}"
                if a.dtype != b.dtype:
                    return f"its {part} has dtype {a.dtype}, model.py's {b.dtype}"
                error = error_of(a, b)
                if not error <= tolerance:
                    at = "" if scale == 1 else f", inputs drawn at {scale:g} times the normal"
                    return (f"its {part} differs by {error:.3g} relative (at most {tolerance:g} "
                            f"allowed{at})")
    return None


def first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# --------------------------------------------------------------------------------------------------
# The fast paths: attention (cuDNN on a GPU, splash on a TPU), QK-norm + RoPE, GELU

def cudnn_attend(q_THK, k_SGK, v_SGK, scale: float, mask_TS=None, bias_HTS=None):
    """model.attend by jax.nn.dot_product_attention: cuDNN's flash attention on a GPU (its XLA
    version elsewhere, which is how the tests check this path), grouped-query heads and ALiBi's
    bias included. is_causal aligns queries and keys from position 0, true in training;
    sample.py's cache passes a mask, and an edit of model.py may pass float32 (cuDNN takes
    half precision only): model.attend takes those."""
    args = (q_THK, k_SGK, v_SGK, scale, mask_TS, bias_HTS)
    if mask_TS is not None:
        return hand_back("attend", "calls with a mask", *args)
    if on_gpu() and q_THK.dtype not in (jnp.bfloat16, jnp.float16):
        return hand_back("attend", f"calls in {q_THK.dtype} (cuDNN takes half precision)", *args)
    bias = None if bias_HTS is None else bias_HTS.astype(q_THK.dtype)
    kernel = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=True,
                               implementation="cudnn" if on_gpu() else "xla")
    return per_device(kernel, q_THK, k_SGK, v_SGK, bias)


def cudnn_applies(cfg: Config) -> bool:
    """cuDNN's flash attention takes bfloat16 and head dims that are multiples of 8 up to 128."""
    K = cfg.head_dim
    return on_gpu() and cfg.compute_dtype == "bfloat16" and K % 8 == 0 and K <= 128


def splash_attend(q_THK, k_SGK, v_SGK, scale: float, mask_TS=None, bias_HTS=None):
    """model.attend by JAX's Pallas splash attention for TPUs (in its interpreter elsewhere, which
    is how the tests check it), causal, grouped-query heads included (its MHA kernel reads key
    head h // (H / G)). It has no input for a bias (ALiBi) nor sample.py's mask: model.attend
    takes those. The scale multiplies q: splash computes q.k unscaled."""
    (T, H, _), S = q_THK.shape, k_SGK.shape[0]
    if mask_TS is not None or bias_HTS is not None or S != T:
        why = "a mask" if mask_TS is not None else "a bias" if bias_HTS is not None else "S != T"
        why = f"calls with {why}"
        return hand_back("attend", why, q_THK, k_SGK, v_SGK, scale, mask_TS, bias_HTS)
    splash = splash_kernel(T, H, interpret=not on_tpu())
    heads_first = lambda x: jnp.swapaxes(x, 0, 1)
    kernel = lambda q, k, v: heads_first(splash(*map(heads_first, (q * scale, k, v))))
    return per_device(kernel, q_THK, k_SGK, v_SGK)


@functools.cache
def splash_kernel(T: int, H: int, interpret: bool):
    """Splash attention's kernel for H heads of T causal tokens, on one device (a shard_map
    around it splits the batch)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel, splash_attention_mask as mask)
    causal = mask.MultiHeadMask([mask.CausalMask((T, T))] * H)
    b = min(SPLASH_BLOCK, T)
    blocks = kernel.BlockSizes(b, b, b, b, b, b, b, b)
    return kernel.make_splash_mha(causal, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash_applies(cfg: Config) -> bool:
    """On a TPU, without ALiBi (no bias input), and whole blocks of tokens."""
    T = cfg.block_size
    return on_tpu() and cfg.position == "rope" and T % min(SPLASH_BLOCK, T) == 0


def fused_qk_norm_rope(q_THK, k_TGK, q_gain_K, k_gain_K, q_rope, k_rope):
    """model.qk_norm_rope by fused/pallas_qk_norm_rope.py's kernel, where queries and keys share
    positions and rotation tables and the shapes fit its blocks (ALiBi has no tables; sample.py's
    decoding steps differ: model.py's function takes those)."""
    (T, _, K), S = q_THK.shape, k_TGK.shape[0]
    if q_rope is None or q_rope is not k_rope or S != T or not pallas.fits(T, K):
        why = ("no rotation tables" if q_rope is None else "other tables for q than for k"
               if q_rope is not k_rope or S != T else "shapes outside its blocks")
        why = f"calls with {why}"
        return hand_back("qk_norm_rope", why, q_THK, k_TGK, q_gain_K, k_gain_K, q_rope, k_rope)
    return per_device(pallas.qk_norm_rope, q_THK, k_TGK, q_gain_K, k_gain_K, *q_rope)


def qk_norm_rope_applies(cfg: Config) -> bool:
    fits = pallas.fits(cfg.block_size, cfg.head_dim)
    return on_gpu() and cfg.position == "rope" and fits


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


def cross_entropy_applies(cfg: Config) -> bool:
    """Where the logits are bfloat16: in float32 it would write the same arrays as model.py's."""
    return on_gpu() and cfg.compute_dtype == "bfloat16"


FAST_PATHS = [
    FastPath("attend", "cuDNN flash attention", cudnn_attend, cudnn_applies),
    FastPath("attend", "splash attention", splash_attend, splash_applies),
    FastPath("qk_norm_rope", "the Pallas QK-norm + RoPE kernel", fused_qk_norm_rope,
             qk_norm_rope_applies, float32_too=True),
    FastPath("gelu", "the recomputing GELU", recomputing_gelu, gelu_applies),
    FastPath("cross_entropy", "the fused readout cross-entropy", fused_cross_entropy.cross_entropy,
             cross_entropy_applies, per_position=True, float32_too=True),
]
