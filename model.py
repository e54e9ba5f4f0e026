"""The GPT: token embedding -> L pre-norm blocks -> RMSNorm -> readout.

Shapes: B batch, T time, S key positions, D model width, H heads, K head dim, F mlp width,
V vocab, L layers. Modules see one sequence (T tokens); train.py adds the batch with jax.vmap.

The functions here are the definition of the math. kernels.py may hold a fused version of some
(attend, qk_norm_rope, gelu); a run uses one only after checking it against the function here, so
an edit to this file always runs (kernels.select).
"""
import dataclasses
import functools
import itertools
import math
from typing import Callable, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from configs import Config, UsageError

# mup.py's coordinate check: tap(name, x) hands x to TAPS' functions at trace time, returns x
TAPS: list[Callable[[str, Array], None]] = []


def tap(name: str, x: Array) -> Array:
    for record in TAPS:
        record(name, x)
    return x


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


def qk_norm_rope(qkv_T3HK: Array, q_gain_K: Array, k_gain_K: Array, cos_TK2: Array,
                 sin_TK2: Array) -> tuple[Array, Array, Array]:
    """Queries and keys QK-LayerNormed and rotated, values as they are, from the qkv projection."""
    q_THK, k_THK, v_THK = qkv_T3HK[:, 0], qkv_T3HK[:, 1], qkv_T3HK[:, 2]
    q_THK, k_THK = tap("q", q_THK), tap("k", k_THK)
    q_THK = rope(layer_norm(q_THK, q_gain_K), cos_TK2, sin_TK2).astype(v_THK.dtype)
    k_THK = rope(layer_norm(k_THK, k_gain_K), cos_TK2, sin_TK2).astype(v_THK.dtype)
    return q_THK, k_THK, v_THK


def gelu(x: Array) -> Array:  # GPT-2's tanh form
    return jax.nn.gelu(x)


def attend(q_THK: Array, k_SHK: Array, v_SHK: Array, scale: float,
           mask_TS: Array | None = None) -> Array:
    """softmax(q.k * scale) v over the keys mask_TS allows (None: causal), softmax in float32."""
    if mask_TS is None:
        mask_TS = jnp.tril(jnp.ones((q_THK.shape[0], k_SHK.shape[0]), bool))
    logits_HTS = jnp.einsum("THK,SHK->HTS", q_THK, k_SHK, preferred_element_type=jnp.float32)
    logits_HTS = jnp.where(mask_TS, scale * logits_HTS, jnp.finfo(jnp.float32).min)
    probs_HTS = jax.nn.softmax(logits_HTS, axis=-1).astype(v_SHK.dtype)
    return jnp.einsum("HTS,SHK->THK", probs_HTS, v_SHK)


class Attention(eqx.Module):
    qkv: Float[Array, "D 3 H K"]
    out: Float[Array, "H K D"]
    q_norm: Float[Array, "K"]
    k_norm: Float[Array, "K"]
    scale: float = eqx.field(static=True)  # attention logit multiplier: cfg.attn_scale
    rope_base: float = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    # fused versions of attend and qk_norm_rope that kernels.select checked against them, or None
    fast_attend: Callable | None = eqx.field(static=True)
    fast_qk_norm_rope: Callable | None = eqx.field(static=True)

    def __init__(self, cfg: Config, fast: dict[str, Callable]):
        D, H, K = cfg.d_model, cfg.n_head, cfg.head_dim
        self.qkv, self.out = jnp.zeros((D, 3, H, K)), jnp.zeros((H, K, D))
        self.q_norm, self.k_norm = jnp.ones(K), jnp.ones(K)
        self.scale, self.rope_base, self.dtype = cfg.attn_scale, cfg.rope_base, cfg.compute_dtype
        self.fast_attend, self.fast_qk_norm_rope = fast.get("attend"), fast.get("qk_norm_rope")

    def __call__(self, x_TD: Array, rope_TK2: tuple[Array, Array],
                 cache: Callable | None = None) -> Array:
        """rope_TK2: GPT.rope's tables. cache: sample.py's KV cache, a function that stores these
        keys and values, returning the cache's (S, H, K) ones and the (T, S) mask of those seen."""
        qkv_T3HK = jnp.einsum("TD,DCHK->TCHK", x_TD, self.qkv.astype(self.dtype))
        cos_TK2, sin_TK2 = rope_TK2
        norm_rope = self.fast_qk_norm_rope or qk_norm_rope
        q_THK, k_THK, v_THK = norm_rope(qkv_T3HK, self.q_norm, self.k_norm, cos_TK2, sin_TK2)
        if TAPS:  # the causal logits, for mup.py
            logits_HTT = self.scale * jnp.einsum("THK,SHK->HTS", q_THK, k_THK)
            tap("attn_logits", logits_HTT[:, *jnp.tril_indices(len(x_TD))])
        k_SHK, v_SHK, mask_TS = (k_THK, v_THK, None) if cache is None else cache(k_THK, v_THK)
        o_THK = (self.fast_attend or attend)(q_THK, k_SHK, v_SHK, self.scale, mask_TS)
        return tap("attn_out", jnp.einsum("THK,HKD->TD", o_THK, self.out.astype(self.dtype)))


class MLP(eqx.Module):
    up: Float[Array, "D F"]
    down: Float[Array, "F D"]
    dtype: str = eqx.field(static=True)
    fast_gelu: Callable | None = eqx.field(static=True)  # kernels.select's, or None

    def __init__(self, cfg: Config, fast: dict[str, Callable]):
        self.up = jnp.zeros((cfg.d_model, cfg.mlp_width))
        self.down = jnp.zeros((cfg.mlp_width, cfg.d_model))
        self.dtype, self.fast_gelu = cfg.compute_dtype, fast.get("gelu")

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

    def __init__(self, cfg: Config, fast: dict[str, Callable]):
        self.attn_norm = self.mlp_norm = jnp.ones(cfg.d_model) if cfg.norm_gain else None
        self.attn, self.mlp = Attention(cfg, fast), MLP(cfg, fast)
        self.branch_mult = 1 / cfg.depth_mult

    def __call__(self, x_TD: Array, rope_TK2: tuple[Array, Array],
                 cache: Callable | None = None) -> Array:
        x_TD = x_TD + self.branch_mult * self.attn(rms_norm(x_TD, self.attn_norm), rope_TK2, cache)
        return tap("resid", x_TD + self.branch_mult * self.mlp(rms_norm(x_TD, self.mlp_norm)))


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
    final_norm: Float[Array, "D"] | None
    alpha_in: float = eqx.field(static=True)  # embedding output multiplier
    readout_mult: float = eqx.field(static=True)  # alpha_out / m under muP (TP5 Table 3)
    dtype: str = eqx.field(static=True)
    remat: Literal["none", "full", "save_dots"] = eqx.field(static=True)
    unroll: int = eqx.field(static=True)

    def __init__(self, cfg: Config, fast: dict[str, Callable] | None = None):
        """The structure and static fields; the arrays are placeholders that init_gpt draws anew.
        fast: kernels.select's checked kernels (none: model.py's functions alone)."""
        V, D = cfg.model_vocab, cfg.d_model
        self.emb = Embeddings(embed=jnp.zeros((V, D)), unembed=jnp.zeros((V, D)))
        if cfg.tie_embeddings:
            self.emb = eqx.nn.Shared(self.emb, where=lambda e: e.unembed, get=lambda e: e.embed)
        self.blocks = eqx.filter_vmap(lambda _: Block(cfg, fast or {}))(jnp.arange(cfg.n_layer))
        self.final_norm = jnp.ones(D) if cfg.norm_gain else None
        self.alpha_in, self.readout_mult = cfg.alpha_in, cfg.alpha_out / cfg.width_mult
        self.dtype, self.remat, self.unroll = cfg.compute_dtype, cfg.remat, cfg.scan_unroll

    def embeddings(self) -> Embeddings:
        return self.emb() if isinstance(self.emb, eqx.nn.Shared) else self.emb

    def __call__(self, tokens_T: Int[Array, "T"]) -> Float[Array, "T V"]:
        """Logits in float32 for one sequence."""
        return self.logits(self.hidden(tokens_T))

    def hidden(self, tokens_T: Int[Array, "T"]) -> Array:
        """The residual stream after the last block. The L blocks run by lax.scan over the stacked
        parameters: compile time does not grow with depth. sample.py runs them with a KV cache."""
        params, static = eqx.partition(self.blocks, eqx.is_array)
        rope_TK2 = self.rope(jnp.arange(tokens_T.shape[0]))

        def layer(x_TD, block_params):
            return eqx.combine(block_params, static)(x_TD, rope_TK2), None

        if self.remat != "none":  # prevent_cse=False is safe inside scan (jax.checkpoint's docs)
            policy = REMAT_POLICIES[self.remat]
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        return jax.lax.scan(layer, self.embed(tokens_T), params, unroll=self.unroll)[0]

    def embed(self, tokens_T: Int[Array, "T"]) -> Array:
        return tap("embed", self.alpha_in * self.embeddings().embed[tokens_T].astype(self.dtype))

    def logits(self, x_TD: Array) -> Float[Array, "T V"]:
        """The final norm and the readout, in float32."""
        h_TD = rms_norm(x_TD, self.final_norm)
        unembed_VD = self.embeddings().unembed.astype(self.dtype)
        # cast after the matmul: its gradient's matmuls then run in the compute dtype too
        logits_TV = jnp.einsum("TD,VD->TV", h_TD, unembed_VD).astype(jnp.float32)
        return tap("logits", self.readout_mult * logits_TV)

    def rope(self, pos_T: Array) -> tuple[Array, Array]:
        """RoPE's tables at these positions, for every block."""
        attn = self.blocks.attn
        return rope_table(pos_T, attn.qkv.shape[-1], attn.rope_base)


def init_gpt(cfg: Config, key: Array, fast: dict[str, Callable] | None = None) -> GPT:
    """A GPT whose parameters are drawn as the policy table says: init_mean + init_std * N(0, 1),
    and whose forward multipliers (muP's and CompleteP's) are static fields set from the config."""
    skeleton = eqx.filter_eval_shape(GPT, cfg, fast)  # shapes only: eager zeros would each compile
    params, static = eqx.partition(skeleton, is_param)
    leaves, treedef = jax.tree.flatten(params)
    is_policy = lambda x: isinstance(x, Policy)
    rows = jax.tree.leaves(policy_table(skeleton, cfg), is_leaf=is_policy)
    specs = tuple((x.shape, row.init_mean, row.init_std) for x, row in zip(leaves, rows))
    return eqx.combine(jax.tree.unflatten(treedef, draw(key, specs)), static)


@functools.partial(jax.jit, static_argnums=1)
def draw(key: Array, specs: tuple) -> list[Array]:
    """mean + std * N(0, 1) for each (shape, mean, std), cut from one draw: one jitted function
    for all of them, not one compilation per shape."""
    sizes = [math.prod(shape) for shape, _, _ in specs]
    z = jax.random.normal(key, (sum(sizes),))
    pieces = jnp.split(z, list(itertools.accumulate(sizes))[:-1])
    return [mean + std * p.reshape(shape) for p, (shape, mean, std) in zip(pieces, specs)]


@dataclasses.dataclass(frozen=True)
class Policy:
    """How one parameter is initialised, optimised and sharded."""
    init_std: float  # parameter = init_mean + init_std * N(0, 1)
    lr_mult: float  # multiplies the schedule's learning rate
    decay: bool  # independent weight decay applies
    spec: tuple  # PartitionSpec of one layer's array; stacked block arrays get None for L in front
    init_mean: float = 0.0
    eps_mult: float = 1.0  # multiplies Adam's epsilon


def policy_rows(cfg: Config) -> dict[str, Policy]:
    """The per-parameter table. m = d_model / d_base and d = n_layer / depth_base under muP, 1 under
    SP, where every multiplier is 1: at the base shape muP is SP. [TP5] Tensor Programs V Table 3;
    [mup] microsoft/mup; [nGm] EleutherAI nanoGPT-mup and its completep branch; [muT]
    mu_transformer (Lingle 2024); [CP] CompleteP (Dey et al. 2025), alpha = 1: no depth factor on
    any LR. Weight decay is independent of lr and m (train.scale_by_policy). Adam's eps must stay
    below the gradients (Everett et al. 2024), which carry the readout's 1/m and, inside blocks,
    the branch scale 1/d: eps is scaled by the same [CP, nGm]. FSDP shards every matrix's D axis."""
    D, F, m, d = cfg.d_model, cfg.mlp_width, cfg.width_mult, cfg.depth_mult
    hidden = dict(lr_mult=1 / m, decay=True, eps_mult=1 / (m * d))  # [TP5 hidden, mup, nGm, muT]
    gain = dict(lr_mult=1.0, decay=False, init_mean=1.0, eps_mult=1 / (m * d))  # vector-like [TP5]
    # Tied embeddings: std 1/sqrt(D/m) (1/sqrt(d_base) under muP: constant in width) starts the
    # logits at O(alpha_out) rather than O(alpha_out sqrt(d_base)) (BENCHMARKS.md)
    embed_std = 1 / math.sqrt(D / m) if cfg.tie_embeddings else 1.0
    return {
        # embedding: constant init std and LR at every width; output x alpha_in [TP5, mup, nGm]
        "emb.embed": Policy(embed_std, 1.0, decay=True, spec=(None, "fsdp"), eps_mult=1 / m),
        # readout: zero init (loss starts at ln V) [TP5], forward x alpha_out / m [mup, nGm], LR lr
        # (vector-like: one dim grows). Tied, the shared array keeps emb.embed's row.
        "emb.unembed": Policy(0.0, 1.0, decay=True, spec=(None, "fsdp"), eps_mult=1 / m),
        # hidden matrices: init std 1/sqrt(fan_in), LR lr / m
        "blocks.attn.qkv": Policy(1 / math.sqrt(D), spec=("fsdp", None, None, None), **hidden),
        "blocks.attn.out": Policy(1 / math.sqrt(D), spec=(None, None, "fsdp"), **hidden),
        "blocks.mlp.up": Policy(1 / math.sqrt(D), spec=("fsdp", None), **hidden),
        "blocks.mlp.down": Policy(1 / math.sqrt(F), spec=(None, "fsdp"), **hidden),
        # QK-LayerNorm gains: K entries at every width, LR lr, no decay [muT; Wortsman et al. 2023]
        "blocks.attn.q_norm": Policy(0.0, spec=(None,), **gain),
        "blocks.attn.k_norm": Policy(0.0, spec=(None,), **gain),
        # RMSNorm gains, only with cfg.norm_gain: off by default, they break transfer [muT]
        "blocks.attn_norm": Policy(0.0, spec=(None,), **gain),
        "blocks.mlp_norm": Policy(0.0, spec=(None,), **gain),
        # the final RMSNorm's gain: outside the blocks, so no branch scale in its gradient
        "final_norm": Policy(0.0, spec=(None,), **{**gain, "eps_mult": 1 / m}),
    }


def is_param(x) -> bool:
    """An array of the model, or its shape alone (init_gpt's skeleton)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def param_name(path) -> str:
    """'blocks.attn.qkv' for a key path; eqx.nn.Shared's wrapper (.pytree) is not in the name."""
    keys = (k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey))
    return ".".join(name for name in keys if name != "pytree")


def policy_table(model: GPT, cfg: Config):
    """A pytree like the model's arrays with each parameter's Policy; each needs a row."""
    rows, params = policy_rows(cfg), eqx.filter(model, is_param)
    names = [param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if missing := [name for name in names if name not in rows]:
        raise UsageError(f"model.py: parameters without a row in policy_rows: {', '.join(missing)} "
                         "(add each one's init std, LR multiplier, decay and sharding)")

    def row(path, x):
        name, policy = param_name(path), rows[param_name(path)]
        if name.startswith("blocks."):  # stacked over layers: one more axis in front
            policy = dataclasses.replace(policy, spec=(None, *policy.spec))
        if len(policy.spec) != x.ndim:
            raise UsageError(f"model.py: policy_rows gives {name} the sharding {rows[name].spec}, "
                             f"which does not fit its shape {x.shape} (blocks: L in front)")
        return policy

    return jax.tree_util.tree_map_with_path(row, params)


def check(cfg: Config) -> None:
    """The policy table of the model's shapes alone: launch.py's check before the run directory."""
    policy_table(eqx.filter_eval_shape(GPT, cfg), cfg)


def partition_specs(model: GPT, cfg: Config):
    is_policy = lambda x: isinstance(x, Policy)
    return jax.tree.map(lambda p: P(*p.spec), policy_table(model, cfg), is_leaf=is_policy)


def flops_per_token(model: GPT, T: int) -> float:
    """Model FLOPs per token, forward + backward, from the model's own arrays: 6N + 12·L·H·K·T
    (PaLM app. B). N: every matrix a token is multiplied by (the blocks' and the readout, not the
    embedding lookup nor the gains); 12·L·H·K·T: attention's scores and their use, full T x T."""
    arrays = jax.tree.leaves(eqx.filter(model.blocks, is_param))
    N = sum(math.prod(x.shape) for x in arrays if len(x.shape) >= 3)  # (L, ...) matrices
    N += math.prod(model.embeddings().unembed.shape)
    L, H, K, _ = model.blocks.attn.out.shape
    return 6 * N + 12 * L * H * K * T
