"""The GPT: token embedding -> L pre-norm blocks -> RMSNorm -> readout.

Shapes: B batch, T time, S key positions, D model width, H heads, G key/value heads, R = H / G
query heads per key/value head, N = H + 2G heads of the stacked q, k, v projection (H + G under
SharedKV), K head dim, K2 = K / 2 RoPE's rotated pairs, F mlp width, V vocab, L layers. Modules
see one sequence (T tokens); train.py adds the batch with jax.vmap. Where tokens sit (RoPE's tables,
ALiBi's biases) and MUDD's connections between blocks are built from the config in layers/.

The functions here are the definition of the math. fused/ may hold a faster version of some
(attend, qk_norm_rope, gelu, cross_entropy); a run uses one only after checking it against the
function here where the model calls it, so an edit to this file always runs (fast_paths.select).
"""
from typing import Callable, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from configs import Config
from layers.mudd import Connections, run_blocks
from layers.positions import Positions, positions

# mup.py's coordinate check: tap(name, x) hands x to TAPS' functions at trace time, returns x
TAPS: list[Callable[[str, Array], None]] = []


def tap(name: str, x: Array) -> Array:
    for record in TAPS:
        record(name, x)
    return x


def batch_split(x: Array) -> Array:
    """x split as train.py splits the batch: under FSDP, XLA would carry the embedding table's D
    split into every activation and all-reduce them in each layer (tests/test_sharding.py)."""
    mesh = jax.sharding.get_abstract_mesh()
    return x if mesh.empty else jax.lax.with_sharding_constraint(x, jax.P())


def rms_norm(x_TD: Array, gain_D: Array | None) -> Array:
    """RMSNorm in float32 whatever the compute dtype (bf16 sums of squares lose precision)."""
    x = x_TD.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return (y if gain_D is None else y * gain_D).astype(x_TD.dtype)


def layer_norm(x_THK: Array, gain_K: Array) -> Array:
    """LayerNorm over the head dim, no bias: the QK-norm of Dehghani et al. 2023 (ViT-22B), which
    keeps attention logits bounded so larger learning rates stay stable (Wortsman et al. 2023)."""
    x = x_THK.astype(jnp.float32)
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain_K


def rope(x_THK: Array, cos_TK2: Array, sin_TK2: Array) -> Array:
    """Rotary position embedding (Su et al. 2021), rotate-half form: dims i and i + K/2 form a pair
    rotated by the position's angle, so q.k depends on the positions' difference only."""
    x1, x2 = jnp.split(x_THK, 2, axis=-1)
    cos, sin = cos_TK2[:, None], sin_TK2[:, None]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qk_norm_rope(q_THK: Array, k_SGK: Array, q_gain_K: Array, k_gain_K: Array,
                 q_rope: tuple[Array, Array] | None, k_rope: tuple[Array, Array] | None
                 ) -> tuple[Array, Array]:
    """Queries and keys QK-LayerNormed, then rotated by RoPE's tables at their own positions
    (None: no rotation, the positions come from ALiBi's biases), in the values' dtype."""
    q_THK, k_SGK = tap("q", q_THK), tap("k", k_SGK)
    dtype = q_THK.dtype
    q_THK, k_SGK = layer_norm(q_THK, q_gain_K), layer_norm(k_SGK, k_gain_K)
    if q_rope is not None:
        q_THK, k_SGK = rope(q_THK, *q_rope), rope(k_SGK, *k_rope)
    return q_THK.astype(dtype), k_SGK.astype(dtype)


def dropout(x: Array, rate: float, key: Array | None) -> Array:
    """Elements zeroed with probability rate, the rest scaled by 1 / (1 - rate) (Srivastava et al.
    2014); without a key (evaluation, sampling, export: all but train.py's step) x itself."""
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)


def gelu(x: Array) -> Array:  # GPT-2's tanh form
    return jax.nn.gelu(x)


def readout(h_TD: Array, unembed_VD: Array, mult: float) -> Float[Array, "T V"]:
    """Logits in float32, the matmul in the compute dtype (so its gradient's matmuls are too)."""
    return mult * jnp.einsum("TD,VD->TV", h_TD, unembed_VD).astype(jnp.float32)


def cross_entropy(h_TD: Array, unembed_VD: Array, mult: float, y_T: Array) -> Float[Array, "T"]:
    """Each position's cross-entropy of its next token y_T: -log softmax(readout)[y], float32."""
    logits_TV = readout(h_TD, unembed_VD, mult)
    label_T = jnp.take_along_axis(logits_TV, y_T[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(logits_TV, axis=-1) - label_T


def attend(q_THK: Array, k_SGK: Array, v_SGK: Array, scale: float, mask_TS: Array | None = None,
           bias_HTS: Array | None = None) -> Array:
    """softmax(q.k * scale + bias) v over the keys mask_TS allows (None: causal), in float32.
    Grouped-query attention (Ainslie et al. 2023) when G < H: query head h reads key and value
    head h // (H / G)."""
    (T, H, K), (S, G, _) = q_THK.shape, k_SGK.shape
    q_TGRK = q_THK.reshape(T, G, H // G, K)
    logits_GRTS = jnp.einsum("TGRK,SGK->GRTS", q_TGRK, k_SGK, preferred_element_type=jnp.float32)
    logits_HTS = scale * logits_GRTS.reshape(H, T, S)
    if TAPS and mask_TS is None:  # mup.py's coordinate check: the causal logits
        tap("attn_logits", logits_HTS[:, *jnp.tril_indices(T)])
    if bias_HTS is not None:
        logits_HTS = logits_HTS + bias_HTS
    if mask_TS is None:
        mask_TS = jnp.tril(jnp.ones((T, S), bool))
    logits_HTS = jnp.where(mask_TS, logits_HTS, jnp.finfo(jnp.float32).min)
    probs_GRTS = jax.nn.softmax(logits_HTS, axis=-1).astype(v_SGK.dtype).reshape(G, -1, T, S)
    return jnp.einsum("GRTS,SGK->TGRK", probs_GRTS, v_SGK).reshape(T, H, K)


class KVCache(NamedTuple):
    """One layer's keys and values (L in front: every layer's) at positions 0..S-1 before the
    QK-norm and RoPE, which are applied again at every step. SharedKV keeps only the values."""
    k: Array | None
    v: Array


class Attention(eqx.Module):
    # the projections, heads along one axis: H query heads, then G key heads and G value heads
    # (SharedKV: G value heads only; its keys are the values)
    qkv: Float[Array, "D N K"]
    out: Float[Array, "H K D"]
    q_norm: Float[Array, "K"]
    k_norm: Float[Array, "K"]
    scale: float = eqx.field(static=True)  # attention logit multiplier: cfg.attn_scale
    kv_heads: int = eqx.field(static=True)  # G
    shared_kv: bool = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    # fused versions of attend and qk_norm_rope that fast_paths.select checked, or None
    fast_attend: Callable | None = eqx.field(static=True)
    fast_qk_norm_rope: Callable | None = eqx.field(static=True)

    def __init__(self, cfg: Config, fast: dict[str, Callable]):
        D, H, G, K = cfg.d_model, cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.shared_kv = cfg.attention == "sharedkv"
        self.qkv = jnp.zeros((D, H + (1 if self.shared_kv else 2) * G, K))
        self.out = jnp.zeros((H, K, D))
        self.q_norm, self.k_norm = jnp.ones(K), jnp.ones(K)
        self.scale, self.kv_heads = cfg.attn_scale, G
        self.dtype = cfg.compute_dtype
        self.fast_attend, self.fast_qk_norm_rope = fast.get("attend"), fast.get("qk_norm_rope")

    def project(self, xs_TD: tuple[Array, ...]) -> list[Array]:
        """[q_THK, k_TGK, v_TGK] (SharedKV: [q, v, v]) from one input, or from MUDD's one input
        per projection (queries', keys', values' streams)."""
        H, G = self.out.shape[0], self.kv_heads
        splits = [H] if self.shared_kv else [H, H + G]
        w_DNK = self.qkv.astype(self.dtype)
        if len(xs_TD) == 1:  # one matmul for all heads
            parts = jnp.split(jnp.einsum("TD,DNK->TNK", xs_TD[0], w_DNK), splits, axis=1)
        else:
            w_parts = jnp.split(w_DNK, splits, axis=1)
            parts = [jnp.einsum("TD,DNK->TNK", x, w) for x, w in zip(xs_TD, w_parts)]
        return [parts[0], parts[1], parts[1]] if self.shared_kv else parts

    @jax.named_scope("attn")  # a profile groups its ops under this name
    def __call__(self, xs_TD: tuple[Array, ...], at: Positions,
                 cache: KVCache | None = None) -> tuple[Array, KVCache | None]:
        """The attention output (T, D), and the cache with these tokens' keys and values written
        at their positions (sample.py's decoding; None in training)."""
        q_THK, k_TGK, v_TGK = self.project(xs_TD)
        if cache is not None:
            write = lambda c, new: jax.lax.dynamic_update_slice_in_dim(c, new, at.q_T[0], 0)
            v_SGK = write(cache.v, v_TGK)
            k_SGK = v_SGK if self.shared_kv else write(cache.k, k_TGK)
            cache = KVCache(None if self.shared_kv else k_SGK, v_SGK)
            k_TGK, v_TGK = k_SGK, v_SGK
        norm_rope = self.fast_qk_norm_rope or qk_norm_rope
        q_THK, k_SGK = norm_rope(q_THK, k_TGK, self.q_norm, self.k_norm, at.q_rope, at.k_rope)
        attend_fn = self.fast_attend or attend
        o_THK = attend_fn(q_THK, k_SGK, v_TGK, self.scale, at.mask_TS, at.bias_HTS)
        return tap("attn_out", jnp.einsum("THK,HKD->TD", o_THK, self.out.astype(self.dtype))), cache


class MLP(eqx.Module):
    up: Float[Array, "D F"]
    down: Float[Array, "F D"]
    dtype: str = eqx.field(static=True)
    fast_gelu: Callable | None = eqx.field(static=True)  # fast_paths.select's, or None

    def __init__(self, cfg: Config, fast: dict[str, Callable]):
        self.up = jnp.zeros((cfg.d_model, cfg.mlp_width))
        self.down = jnp.zeros((cfg.mlp_width, cfg.d_model))
        self.dtype, self.fast_gelu = cfg.compute_dtype, fast.get("gelu")

    @jax.named_scope("mlp")
    def __call__(self, x_TD: Array) -> Array:
        h_TF = jnp.einsum("TD,DF->TF", x_TD, self.up.astype(self.dtype))
        h_TF = tap("mlp_hidden", (self.fast_gelu or gelu)(h_TF))
        return tap("mlp_out", jnp.einsum("TF,FD->TD", h_TF, self.down.astype(self.dtype)))


class Block(eqx.Module):
    attn_norm: Float[Array, "D"] | None  # RMSNorm gains, only with cfg.norm_gain
    attn: Attention
    mlp_norm: Float[Array, "D"] | None
    mlp: MLP
    # CompleteP: residual branches scaled by depth_base / L (Dey et al. 2025, alpha = 1)
    branch_mult: float = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)  # cfg.dropout, on each branch's output

    def __init__(self, cfg: Config, fast: dict[str, Callable]):
        self.attn_norm = self.mlp_norm = jnp.ones(cfg.d_model) if cfg.norm_gain else None
        self.attn, self.mlp = Attention(cfg, fast), MLP(cfg, fast)
        self.branch_mult, self.dropout_rate = 1 / cfg.depth_mult, cfg.dropout

    @jax.named_scope("block")
    def __call__(self, xs_TD: tuple[Array, ...], at: Positions, cache: KVCache | None = None,
                 key: Array | None = None) -> tuple[Array, KVCache | None]:
        """xs_TD: the residual stream (x,), or MUDD's streams for the queries, (keys,) values and
        the residual; the new residual stream and Attention's cache. key: dropout's, on each
        branch's output as nanoGPT's (not on the attention probabilities: fused attention)."""
        *streams, x_TD = xs_TD
        attn_key, mlp_key = (None, None) if key is None else jax.random.split(key)
        normed = tuple(rms_norm(s, self.attn_norm) for s in streams or [x_TD])
        attn_TD, cache = self.attn(normed, at, cache)
        x_TD = x_TD + self.branch_mult * dropout(attn_TD, self.dropout_rate, attn_key)
        mlp_TD = self.mlp(rms_norm(x_TD, self.mlp_norm))
        x_TD = x_TD + self.branch_mult * dropout(mlp_TD, self.dropout_rate, mlp_key)
        return tap("resid", x_TD), cache


class Embeddings(eqx.Module):  # the readout stored like embed, so that eqx.nn.Shared can tie them
    embed: Float[Array, "V D"]
    unembed: Float[Array, "V D"]


# what the backward pass may keep instead of recomputing, per block ("none": no jax.checkpoint)
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # weight matmuls' out
}


class GPT(eqx.Module):
    emb: Embeddings | eqx.nn.Shared  # Shared when cfg.tie_embeddings: one array, two uses
    blocks: Block  # stacked by eqx.filter_vmap: every array has a leading L axis
    mudd: tuple[Connections, ...] | None  # one per block with cfg.connections="mudd"
    final_norm: Float[Array, "D"] | None
    alpha_in: float = eqx.field(static=True)  # embedding output multiplier
    readout_mult: float = eqx.field(static=True)  # alpha_out / m under muP (TP5 Table 3)
    rope_base: float | None = eqx.field(static=True)  # None: ALiBi, no rotation
    dtype: str = eqx.field(static=True)
    remat: Literal["none", "full", "save_dots"] = eqx.field(static=True)
    unroll: int = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)  # cfg.dropout, on the embedding's output
    fast_cross_entropy: Callable | None = eqx.field(static=True)  # fast_paths.select's, or None

    def __init__(self, cfg: Config, fast: dict[str, Callable] | None = None):
        """The structure and static fields; the arrays are placeholders that init_gpt draws anew.
        fast: fast_paths.select's checked kernels (none: model.py's functions alone)."""
        V, D = cfg.model_vocab, cfg.d_model
        self.emb = Embeddings(embed=jnp.zeros((V, D)), unembed=jnp.zeros((V, D)))
        if cfg.tie_embeddings:
            self.emb = eqx.nn.Shared(self.emb, where=lambda e: e.unembed, get=lambda e: e.embed)
        self.blocks = eqx.filter_vmap(lambda _: Block(cfg, fast or {}))(jnp.arange(cfg.n_layer))
        self.mudd = None
        if cfg.connections == "mudd":
            self.mudd = tuple(Connections(cfg, i) for i in range(cfg.n_layer))
        self.final_norm = jnp.ones(D) if cfg.norm_gain else None
        self.alpha_in, self.readout_mult = cfg.alpha_in, cfg.alpha_out / cfg.width_mult
        self.rope_base = cfg.rope_base if cfg.position == "rope" else None
        self.dtype, self.remat, self.unroll = cfg.compute_dtype, cfg.remat, cfg.scan_unroll
        self.dropout_rate, self.fast_cross_entropy = cfg.dropout, (fast or {}).get("cross_entropy")

    def embeddings(self) -> Embeddings:
        return self.emb() if isinstance(self.emb, eqx.nn.Shared) else self.emb

    def __call__(self, tokens_T: Int[Array, "T"]) -> Float[Array, "T V"]:
        """Logits in float32 for one sequence."""
        return self.logits(self.hidden(tokens_T)[0])

    def hidden(self, tokens_T: Int[Array, "T"], start=0, cache: KVCache | None = None,
               key: Array | None = None) -> tuple[Array, KVCache | None]:
        """The stream after the last block for tokens at positions start.., and sample.py's KV
        cache with them written. A lax.scan over the stacked blocks (compile time flat in depth).
        key: this sequence's dropout key (train.py's); None: no dropout."""
        S = None if cache is None else cache.v.shape[1]
        at = self.positions(start + jnp.arange(tokens_T.shape[0]), S)
        params, static = eqx.partition(self.blocks, eqx.is_array)
        keys = None if key is None else jax.random.split(key, 1 + self.blocks.attn.out.shape[0])
        embed_key, block_keys = (None, None) if key is None else (keys[0], keys[1:])  # 1 + L

        def layer(xs_TD, inputs):
            block_params, layer_cache, layer_key = inputs
            return eqx.combine(block_params, static)(xs_TD, at, layer_cache, layer_key)

        if self.remat != "none":  # prevent_cse=False is safe inside scan (jax.checkpoint's docs)
            policy = REMAT_POLICIES[self.remat]
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=self.mudd is not None)
        x_TD = dropout(self.embed(tokens_T), self.dropout_rate, embed_key)
        if self.mudd is not None:  # layers/mudd.py: each block reads every earlier state
            return run_blocks(self.mudd, layer, x_TD, (params, cache, block_keys), rms_norm, gelu)
        step = lambda x_TD, inputs: layer((x_TD,), inputs)
        return jax.lax.scan(step, x_TD, (params, cache, block_keys), unroll=self.unroll)

    @jax.named_scope("embed")
    def embed(self, tokens_T: Int[Array, "T"]) -> Array:
        x_TD = self.alpha_in * self.embeddings().embed[tokens_T].astype(self.dtype)
        return tap("embed", batch_split(x_TD))

    @jax.named_scope("readout")
    def logits(self, x_TD: Array) -> Float[Array, "T V"]:
        """The final norm and the readout, in float32."""
        return tap("logits", readout(*self.readout_inputs(x_TD), self.readout_mult))

    @jax.named_scope("readout")
    def loss(self, x_TD: Array, y_T: Int[Array, "T"]) -> Float[Array, "T"]:
        """Each position's cross-entropy of its next token y_T from the stream: train.py's loss.
        A second path to the readout (the fused one never makes the float32 logits): a change
        to the logits goes in readout, which both read (fused/agreement.check_one_readout)."""
        cross_entropy_fn = self.fast_cross_entropy or cross_entropy
        return cross_entropy_fn(*self.readout_inputs(x_TD), self.readout_mult, y_T)

    def readout_inputs(self, x_TD: Array) -> tuple[Array, Array]:
        return rms_norm(x_TD, self.final_norm), self.embeddings().unembed.astype(self.dtype)

    def positions(self, q_T: Array, S: int | None = None) -> Positions:
        """Queries at q_T; keys at the same positions or a KV cache's S (layers/positions.py)."""
        H, K = self.blocks.attn.out.shape[1:3]  # the stacked blocks' (L, H, K, D)
        return positions(q_T, S, H, K, self.rope_base)
