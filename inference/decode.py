"""Text from a model by KV-cache decoding: one jitted lax.scan, one token per step for all samples.

Decoding keeps a key/value cache of S positions (sample.py's --context, default block_size: the
model was trained on those). A longer prompt keeps its last S tokens, and when the cache is full the
window slides by half: the last S // 2 tokens are run again from position 0 (a fresh cache) and
generation goes on, so every new token sees S // 2 to S tokens. Each layer runs its own
Block.__call__ (model.hidden with a cache), no fused kernels, so an edit of model.py reaches
decoding; one that reaches the forward but not the cached path (a mask made where attend's mask_TS
is None) is caught by check_cache, which sample.py and training's preview run first.

Shapes as in model.py, plus S cache positions and N new tokens per sample."""
import dataclasses
from functools import partial
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from configs import Config
from fused.agreement import TOLERANCE, row_error, spread, tokens
from model import GPT, KVCache
from run.errors import UsageError


def empty_cache(model: GPT, S: int) -> KVCache:
    """A KV cache of S positions: zeros, L in front (SharedKV keeps the values only)."""
    attn = model.blocks.attn
    (L, _, K, _), G = attn.out.shape, attn.kv_heads
    zeros = jnp.zeros((L, S, G, K), model.dtype)
    return KVCache(None if attn.shared_kv else zeros, zeros)


def extend(model: GPT, cache: KVCache, tokens_T: jax.Array, start) -> tuple[jax.Array, KVCache]:
    """Run tokens_T at positions start..start+T-1 through the blocks, writing their keys and values
    into the cache there; each attends to the cache's positions up to its own. Serves the prefill
    (T = S, start 0) and each decode step (T = 1) by model.hidden itself, so training and decoding
    cannot drift apart. Returns the last block's output and the cache."""
    return model.hidden(tokens_T, start, cache)


def plain_gpt(model: GPT, cfg: Config, dtype: str = "float32") -> GPT:
    """The same arrays in a GPT that computes in dtype with model.py's functions alone (no fast
    path): the reference of check_cache and of export.py's self-check."""
    skeleton = eqx.filter_eval_shape(GPT, dataclasses.replace(cfg, compute_dtype=dtype))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(model))


@eqx.filter_jit
def cached_against_full(model: GPT, tokens_S: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Whether the full forward's logits over S tokens are finite, and how far decoding's are from
    them (row_error), as generate runs them: a prefill of S - 1 tokens into a cache of S, then one
    step at the last position; and a prefill of p = S // 2 tokens, the later positions padded
    with 0, then one step at p: a step must read the cache up to its own position only, which at
    the last position every mask does (one aligned to the last key, as is_causal may be, lets an
    inner step read the padding). In one program: the start of every run calls it."""
    S, p = tokens_S.shape[0], tokens_S.shape[0] // 2
    want_SV = model(tokens_S)
    x_SD, cache = extend(model, empty_cache(model, S), tokens_S.at[-1].set(0), 0)
    x_1D, _ = extend(model, cache, tokens_S[-1:], S - 1)
    _, inner = extend(model, empty_cache(model, S), tokens_S.at[p:].set(0), 0)
    x_pD, _ = extend(model, inner, tokens_S[p:p + 1], p)
    got_SV = jnp.concatenate([model.logits(x_SD[:-1]), model.logits(x_1D)])
    return jnp.isfinite(want_SV).all(), jnp.maximum(  # position by position
        row_error(got_SV, want_SV), row_error(model.logits(x_pD), want_SV[p:p + 1]))


def check_cache(model: GPT, cfg: Config, S: int, special_ids: tuple[int, ...] = ()) -> None:
    """A UsageError unless decoding with a cache of S gives the model's own logits: an edit of
    model.py that the cached path does not follow (a mask made where attend's mask_TS is None:
    decoding passes its own; learned positions that ignore hidden's start) would sample another
    model than the one trained. One sequence of S tokens (special ids among them: a document mask
    after an end-of-text must reach decoding too), the model's arrays computed in float32,
    matmuls at full precision: bfloat16's and a fused kernel's rounding, compounded over the
    layers, would hide a small difference or make one up. Then in the run's compute dtype, at its
    tolerance, as sampling runs: an edit that branches on the dtype shows there only. That
    tolerance grows to twice the dtype's own rounding of the logits (against float32's) where that
    is larger: decoding's honest error compounds with depth (1.79e-2 at 1.5B parameters, 48
    layers; at 24 layers x 256 wide half the rounding: BENCHMARKS.md), an edit's is not rounding's
    size. special_ids: the tokenizer's (text/tokenization.special_ids), among the tokens."""
    tokens_S = jnp.asarray(tokens(S, cfg.vocab_size, special=special_ids))  # the edges' too
    model = with_a_readout(model)
    for dtype in dict.fromkeys(["float32", cfg.compute_dtype]):
        with jax.default_matmul_precision("float32" if dtype == "float32" else None):
            finite, error = map(float, cached_against_full(plain_gpt(model, cfg, dtype), tokens_S))
        tolerance = TOLERANCE[dtype]
        if not finite or error <= tolerance:  # not finite: overflow, nothing to compare
            continue
        if dtype != "float32":  # past the tolerance only: the two forwards of its own rounding
            full = eqx.filter_jit(lambda gpt, ids_S: gpt(ids_S))  # traced anew: model.py as now
            with jax.default_matmul_precision("float32"):
                want_SV = full(plain_gpt(model, cfg), tokens_S)
            own = float(row_error(full(plain_gpt(model, cfg, dtype), tokens_S), want_SV))
            tolerance = max(tolerance, 2 * own)
        if not error <= tolerance:
            in_dtype = "" if dtype == "float32" else f" in {dtype}"
            raise UsageError(f"decoding with a KV cache does not give the model's own logits (they "
                             f"differ by {error:.3g} relative over {S} tokens{in_dtype}, "
                             f"{tolerance:.2g} allowed): an edit "
                             "of model.py reaches its forward but not GPT.hidden with a cache (a "
                             "mask made where attend's mask_TS is None, positions that ignore "
                             "start, SharedKV's keys changed in Attention.project: the cache "
                             "branch of Attention.__call__ uses the values as keys); make both "
                             "follow it")


def with_a_readout(model: GPT) -> GPT:
    """The readout starts at zero (params.py: the loss starts at ln V), so at step 0 every logit
    is 0, the full forward's and decoding's alike, and check_cache would compare zeros. What it
    checks is the code, not the weights: a drawn readout stands in for a zero one."""
    emb = model.emb
    if isinstance(emb, eqx.nn.Shared) or bool(jnp.any(emb.unembed != 0)):  # tied: embed's, drawn
        return model
    return eqx.tree_at(lambda gpt: gpt.emb.unembed, model,
                       spread(emb.unembed.shape, emb.unembed.dtype, seed=1))


def pick(logits_V: jax.Array, key: jax.Array, temperature, n_vocab: int, top_k: int,
         top_p: float) -> jax.Array:
    """One token: argmax at temperature 0, else a draw from softmax(logits / temperature) among the
    top_k likeliest tokens (0: all), then the smallest set holding top_p of the mass. The
    temperature is traced (no recompilation per value); top_k and top_p shape the program."""
    # The model pads its vocabulary (cfg.vocab_multiple); the padding rows are untrained ids the
    # tokenizer cannot decode.
    valid_V = jnp.arange(logits_V.shape[0]) < n_vocab
    greedy = jnp.argmax(jnp.where(valid_V, logits_V, -jnp.inf))
    # shifted to max 0, then masked: a tiny temperature gives -inf, a huge one 0, never inf - inf
    scaled_V = (logits_V - logits_V[greedy]) / jnp.where(temperature > 0, temperature, 1.0)
    logits_V = jnp.where(valid_V, scaled_V, -jnp.inf)
    if top_k:
        kth = jax.lax.top_k(logits_V, min(top_k, n_vocab))[0][-1]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    # nucleus sampling (Holtzman et al. 2020): keep a token if the mass before it is < top_p
    if top_p < 1:
        sorted_V = jnp.sort(logits_V)[::-1]
        probs_V = jax.nn.softmax(sorted_V)
        n_keep = jnp.sum(jnp.cumsum(probs_V) - probs_V < top_p)
        logits_V = jnp.where(logits_V < sorted_V[n_keep - 1], -jnp.inf, logits_V)
    return jnp.where(temperature > 0, jax.random.categorical(key, logits_V), greedy)


# not jax.jit: a model with tied embeddings holds a non-array leaf (eqx.nn.Shared)
@eqx.filter_jit
def generate(model: GPT, prompt_S: jax.Array, key: jax.Array, temperature: jax.Array, *,
             num_samples: int, max_new_tokens: int, n_vocab: int, top_k: int = 0,
             top_p: float = 1.0) -> jax.Array:
    """(num_samples, max_new_tokens) tokens following the prompt: prompt_S is its tokens padded
    with -1 to the cache length S (prompt_window), so one compilation serves every prompt length;
    key and temperature are traced arrays too (a Python float would be compiled in). The shared
    prompt is prefilled once and its cache copied to every sample; then a lax.scan, one token a
    step, the batch added by jax.vmap around extend. Sample b's step i draws with
    fold_in(fold_in(key, b), i), so a sample does not depend on how many others are drawn."""
    S, B = prompt_S.shape[0], num_samples
    n_prompt, prompt_S = jnp.sum(prompt_S >= 0), jnp.maximum(prompt_S, 0)
    keep = S // 2  # tokens kept when the window slides
    sample_keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    pick_B = jax.vmap(partial(pick, n_vocab=n_vocab, top_k=top_k, top_p=top_p), (0, 0, None))
    extend_B = jax.vmap(extend, in_axes=(None, 0, 0, None))

    def draw(logits_BV, i):
        keys_B = jax.vmap(jax.random.fold_in, (0, None))(sample_keys_B, i)
        return pick_B(logits_BV, keys_B, temperature)

    x_SD, cache = extend(model, empty_cache(model, S), prompt_S, 0)
    logits_V = model.logits(jax.lax.dynamic_slice_in_dim(x_SD, n_prompt - 1, 1))[0]
    first_B = draw(jnp.broadcast_to(logits_V, (B, *logits_V.shape)), 0)
    cache_B = jax.tree.map(lambda c: jnp.broadcast_to(c, (B, *c.shape)), cache)
    window_BS = jnp.broadcast_to(prompt_S, (B, S))  # the tokens whose keys the cache holds

    def slide(cache_B, window_BS):
        window_BS = jnp.roll(window_BS, keep - S, axis=1)  # the last `keep` tokens to the front
        # Rerun from position 0: positions >= keep get keys of the rolled-over tokens, which the
        # position mask hides until the new tokens overwrite them.
        return extend_B(model, cache_B, window_BS, 0)[1], window_BS, jnp.int32(keep)

    def step(carry, i):
        cache_B, window_BS, token_B, pos = carry  # token_B: the newest, not yet in the cache
        # pos is one number for all samples (they share the prompt), so this cond is a real branch,
        # not a select that would run the slide's prefill at every step.
        unchanged = lambda c, w: (c, w, pos)
        cache_B, window_BS, pos = jax.lax.cond(pos == S, slide, unchanged, cache_B, window_BS)
        window_BS = jax.lax.dynamic_update_slice_in_dim(window_BS, token_B[:, None], pos, axis=1)
        x_B1D, cache_B = extend_B(model, cache_B, token_B[:, None], pos)
        token_B = draw(jax.vmap(model.logits)(x_B1D)[:, 0], i)
        return (cache_B, window_BS, token_B, pos + 1), token_B

    carry = (cache_B, window_BS, first_B, n_prompt.astype(jnp.int32))
    _, rest_NB = jax.lax.scan(step, carry, jnp.arange(1, max_new_tokens))
    return jnp.concatenate([first_B[:, None], rest_NB.T], axis=1)


def prompt_window(prompt: list[int], S: int) -> jax.Array:
    """The prompt's last S tokens, padded with -1 to S tokens: generate's fixed shape."""
    window = np.full(S, -1, np.int32)  # numpy: each eager jnp op here compiled on its own
    window[:len(prompt[-S:])] = prompt[-S:]
    return jnp.asarray(window)


def preview(model: GPT, cfg: Config, prompt: list[int], decode: Callable, n_vocab: int,
            special_ids: tuple[int, ...] = (), n: int = 128) -> str:
    """One short sample for the training log (train.py writes one at each evaluation): the prompt
    and n tokens at temperature 1, drawn with the same key every time, so successive ones show what
    training changed. decode: the run's tokenizer, loaded once by train.py. A model whose cached
    decoding is not its forward (check_cache) gets the reason instead: training goes on."""
    try:
        check_cache(model, cfg, cfg.block_size, special_ids)
    except UsageError as e:
        return f"(no sample: {e})"
    prompt_S = prompt_window(prompt, cfg.block_size)
    tokens_1N = generate(model, prompt_S, jax.random.key(cfg.seed), jnp.float32(1.0),
                         num_samples=1, max_new_tokens=n, n_vocab=n_vocab)
    return decode(prompt + jax.device_get(tokens_1N)[0].tolist())
