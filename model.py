"""The GPT: token embedding -> L pre-norm blocks -> RMSNorm -> readout.

Shapes: B batch, T time, S key positions, D model width, H heads, G key/value heads, R = H / G
query heads per key/value head, N = H + 2G heads of the stacked q, k, v projection (H + G under
SharedKV), K head dim, K2 = K / 2 RoPE's rotated pairs, F mlp width, V vocab, L layers; MUDD:
C streams, J states, M = C * J its mixing width. Modules see one sequence (T tokens); train.py adds
the batch with jax.vmap.

The functions here are the definition of the math. kernels/ may hold a fused version of some
(attend, qk_norm_rope, gelu, cross_entropy); a run uses one only after checking it against the
function here where the model calls it, so an edit to this file always runs (fast_paths.select).
"""
import math
from typing import Callable, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from configs import Config

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


def rope_table(pos_T: Array, K: int, base: float) -> tuple[Array, Array]:
    """cos and sin (T, K/2) of RoPE's angles pos * base^(-2i/K), built once for all blocks."""
    inv_freq_K2 = base ** (-jnp.arange(K // 2, dtype=jnp.float32) / (K // 2))
    angle_TK2 = pos_T.astype(jnp.float32)[:, None] * inv_freq_K2
    return jnp.cos(angle_TK2), jnp.sin(angle_TK2)


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


def alibi_bias(q_T: Array, k_S: Array, H: int) -> Array:
    """ALiBi's (Press et al. 2022, arXiv 2108.12409) logit bias -m_h (i - j), query position i, key
    position j. Slopes m: 2^(-8/H), 2^(-16/H), ... for H a power of two; else those of the power of
    two below H, then every other one of twice that power (the paper's code, ZeRO-transformer's)."""
    powers = lambda n: [2 ** (-8 * (i + 1) / n) for i in range(n)]  # noqa: E731
    below = 2 ** math.floor(math.log2(H))
    slopes_H = jnp.array(powers(below) + powers(2 * below)[0::2][:H - below], jnp.float32)
    return -slopes_H[:, None, None] * (q_T[:, None] - k_S[None, :])


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


class Positions(NamedTuple):
    """Where the T queries and S keys of a forward sit, built once for all blocks (GPT.positions):
    RoPE's tables (None with ALiBi), and a mask only where a KV cache makes S differ from T."""
    q_T: Array
    k_S: Array
    q_rope: tuple[Array, Array] | None
    k_rope: tuple[Array, Array] | None
    mask_TS: Array | None  # None: causal, the queries and keys are the same T tokens


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
    alibi: bool = eqx.field(static=True)
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
        self.scale, self.kv_heads, self.alibi = cfg.attn_scale, G, cfg.position == "alibi"
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
        bias_HTS = alibi_bias(at.q_T, at.k_S, q_THK.shape[1]) if self.alibi else None
        attend_fn = self.fast_attend or attend
        o_THK = attend_fn(q_THK, k_SGK, v_TGK, self.scale, at.mask_TS, bias_HTS)
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


class Connections(eqx.Module):
    """MUDD's dynamic dense connections after block i (Xiao et al. 2025, arXiv 2502.12170): per
    token, weights A (C, J) = GELU(RMSNorm(X_i+1) W1) W2 + b of the J = i + 2 states so far (the
    embedding, each block's output), one weighted sum per stream (C: Attention's inputs and the
    residual; 1 after the last block). W2 = 0 and b one-hot on X_i+1 at init: the baseline."""
    w1: Float[Array, "D CJ"]
    w2: Float[Array, "CJ CJ"]
    b: Float[Array, "C J"]  # stored as b minus the one-hot, so every parameter starts at 0 mean

    def __init__(self, cfg: Config, i: int):
        C = (3 if cfg.attention == "sharedkv" else 4) if i < cfg.n_layer - 1 else 1
        J = i + 2
        self.w1, self.w2 = jnp.zeros((cfg.d_model, C * J)), jnp.zeros((C * J, C * J))
        self.b = jnp.zeros((C, J))

    @jax.named_scope("mudd")
    def __call__(self, states_JTD: list[Array]) -> tuple[Array, ...]:
        (C, J), x_TD = self.b.shape, states_JTD[-1]
        h_TM = gelu(jnp.einsum("TD,DM->TM", rms_norm(x_TD, None), self.w1.astype(x_TD.dtype)))
        a_TCJ = (h_TM @ self.w2.astype(x_TD.dtype)).reshape(-1, C, J)  # w2: (M, M)
        a_TCJ = (a_TCJ + self.b + jnp.eye(J)[-1]).astype(x_TD.dtype)  # b is float32: keep bf16
        # sums of products rather than an einsum over the stacked states: the backward then keeps
        # the states (alive anyway), not a stacked copy per layer (L^2 T D memory)
        return tuple(sum(a_TCJ[:, c, j, None] * x for j, x in enumerate(states_JTD))
                     for c in range(C))


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
        cache with them written. A lax.scan over the stacked blocks (compile time flat in depth);
        MUDD's blocks read every earlier state, so a Python loop (a scan would save the history
        per layer). key: this sequence's dropout key (train.py's); None: no dropout."""
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
        if self.mudd is None:
            step = lambda x_TD, inputs: layer((x_TD,), inputs)
            return jax.lax.scan(step, x_TD, (params, cache, block_keys), unroll=self.unroll)
        states, xs_TD, caches = [x_TD], (x_TD,), []
        for i, connect in enumerate(self.mudd):
            inputs = jax.tree.map(lambda a: a[i], (params, cache, block_keys))
            x_TD, layer_cache = layer(xs_TD, inputs)
            states.append(x_TD)
            caches.append(layer_cache)
            xs_TD = connect(states)
        return xs_TD[0], None if cache is None else jax.tree.map(lambda *c: jnp.stack(c), *caches)

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
        """Each position's cross-entropy of its next token y_T from the stream: train.py's loss."""
        cross_entropy_fn = self.fast_cross_entropy or cross_entropy
        return cross_entropy_fn(*self.readout_inputs(x_TD), self.readout_mult, y_T)

    def readout_inputs(self, x_TD: Array) -> tuple[Array, Array]:
        return rms_norm(x_TD, self.final_norm), self.embeddings().unembed.astype(self.dtype)

    def positions(self, q_T: Array, S: int | None = None) -> Positions:
        """Positions of queries at q_T; keys at the same ones, or with a KV cache of S positions
        at 0..S-1, a mask hiding those after each query."""
        k_S = q_T if S is None else jnp.arange(S)
        mask_TS = None if S is None else k_S[None, :] <= q_T[:, None]
        if self.rope_base is None:
            return Positions(q_T, k_S, None, None, mask_TS)
        K = self.blocks.attn.out.shape[2]
        q_rope = rope_table(q_T, K, self.rope_base)
        k_rope = q_rope if S is None else rope_table(k_S, K, self.rope_base)
        return Positions(q_T, k_S, q_rope, k_rope, mask_TS)

