"""The GPT: token embedding -> L pre-norm blocks -> RMSNorm -> readout.

Shapes: B batch, T time, D model width, H heads, K head dim, F mlp width, V vocab, L layers.
Modules see one sequence (T tokens); train.py adds the batch with jax.vmap.
"""
import dataclasses
import functools
import itertools
import math
from typing import Callable, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

import kernels
from configs import Config


# Activation taps for mup.py's coordinate check: tap(name, x) returns x and hands it, at trace time, to the
# functions in TAPS (mup.py's sends mean |x| to the host by jax.debug.callback). Empty: nothing changes.
TAPS: list[Callable[[str, Array], None]] = []


def tap(name: str, x: Array) -> Array:
    for record in TAPS:
        record(name, x)
    return x


@jax.custom_batching.custom_vmap
def linear(x_TD: Array, w_DF: Array) -> Array:
    """x @ w. Under jax.vmap (train.py's batch) the batch is merged into the rows first, so the weight
    gradient is one 2-D matmul: XLA:CPU transposed the (B, T, F) cotangent first (a third of a CPU step).
    custom_vmap has no reverse-mode rule: differentiate under jax.vmap (a batch of one), as train.py does."""
    return x_TD @ w_DF


@linear.def_vmap
def _linear_vmap(axis_size: int, in_batched: tuple[bool, bool], x: Array, w: Array):
    if in_batched[1]:  # a batch of weights (e.g. several models at once): nothing to merge
        return jax.vmap(jnp.matmul, in_axes=(0 if in_batched[0] else None, 0))(x, w), True
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1]), True


def rms_norm(x_TD: Array, gain_D: Array | None) -> Array:
    """RMSNorm in float32 whatever the compute dtype (bf16 sums of squares lose precision)."""
    x = x_TD.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return (y if gain_D is None else y * gain_D).astype(x_TD.dtype)


def layer_norm(x_THK: Array, gain_K: Array) -> Array:
    """LayerNorm over the head dim, no bias: the QK-norm of Dehghani et al. 2023 (ViT-22B), which keeps
    attention logits bounded so larger learning rates stay stable (Wortsman et al. 2023)."""
    x = x_THK.astype(jnp.float32)
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain_K


def rope_tables(pos_T: Array, K: int, base: float) -> tuple[Array, Array]:
    """cos, sin (T, K/2) of RoPE's angles. Training's positions are numpy (GPT.hidden), so these are constants:
    traced, XLA:CPU recomputed them in every fusion (~6% of a CPU step). sample.py's are traced: jnp then."""
    xp = np if isinstance(pos_T, np.ndarray) else jnp
    angle_TK2 = pos_T.astype(np.float32)[:, None] * base ** (-xp.arange(K // 2, dtype=np.float32) / (K // 2))
    return xp.cos(angle_TK2), xp.sin(angle_TK2)


def rope(x_THK: Array, pos_T: Array, base: float) -> Array:
    """Rotary position embedding (Su et al. 2021), rotate-half form: dims i and i + K/2 form a pair
    rotated by angle pos * base^(-2i/K), so q.k depends on the positions' difference only."""
    half = x_THK.shape[-1] // 2
    cos_T1K, sin_T1K = (table[:, None] for table in rope_tables(pos_T, x_THK.shape[-1], base))
    x1, x2 = x_THK[..., :half], x_THK[..., half:]
    return jnp.concatenate([x1 * cos_T1K - x2 * sin_T1K, x2 * cos_T1K + x1 * sin_T1K], axis=-1)


def attend(q_THK: Array, k_SHK: Array, v_SHK: Array, scale: float, impl: str | None = None,
           mask_TS: Array | None = None) -> Array:
    """softmax(q.k * scale) v over the keys mask_TS allows (None: causal). jax.nn.dot_product_attention where
    impl names a fused kernel (cuDNN flash attention on GPU); else written out, softmax in float32: jax's XLA
    version vmaps over a query-group axis of size 1 whose softmax backward XLA:CPU ran ~10x slower."""
    if impl is not None:
        return jax.nn.dot_product_attention(q_THK, k_SHK, v_SHK, scale=scale, mask=mask_TS,
                                            is_causal=mask_TS is None, implementation=impl)
    if mask_TS is None:  # a constant; an iota-built mask was rebuilt inside each fusion on the CPU
        mask_TS = np.tril(np.ones((q_THK.shape[0], k_SHK.shape[0]), bool))
    logits_HTS = scale * jnp.einsum("THK,SHK->HTS", q_THK, k_SHK, preferred_element_type=jnp.float32)
    logits_HTS = jnp.where(mask_TS, logits_HTS, jnp.finfo(jnp.float32).min)
    return jnp.einsum("HTS,SHK->THK", jax.nn.softmax(logits_HTS, axis=-1).astype(v_SHK.dtype), v_SHK)


class Attention(eqx.Module):
    qkv: Float[Array, "D 3 H K"]
    out: Float[Array, "H K D"]
    q_norm: Float[Array, "K"]
    k_norm: Float[Array, "K"]
    scale: float = eqx.field(static=True)  # attention logit multiplier: cfg.attn_scale
    rope_base: float = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    impl: str | None = eqx.field(static=True)  # a fused attention kernel (attend), or None
    fused: bool = eqx.field(static=True)  # cfg.kernels: may the QK-norm and RoPE run as kernels.py's kernel

    def project(self, x_TD: Array, pos_T: Array) -> tuple[Array, Array, Array]:
        """Queries and keys (QK-LayerNormed, rotated) and values of one sequence."""
        D, _, H, K = self.qkv.shape
        qkv_TC = linear(x_TD, self.qkv.astype(self.dtype).reshape(D, 3 * H * K))
        if self.fused and isinstance(pos_T, np.ndarray) and not TAPS and kernels.applies(len(pos_T), K):
            # on one GPU: the same math as below in one Triton kernel each way (kernels.py: -8% of a 124M step)
            return kernels.qk_norm_rope(qkv_TC, self.q_norm, self.k_norm, *rope_tables(pos_T, K, self.rope_base), H)
        qkv_T3HK = qkv_TC.reshape(-1, 3, H, K)
        # split: its gradient is one concatenate, not three indexings' padded copies summed (CPU step -0.5 ms)
        q_THK, k_THK, v_THK = (a[:, 0] for a in jnp.split(qkv_T3HK, 3, axis=1))
        q_THK, k_THK = tap("q", q_THK), tap("k", k_THK)
        q_THK = rope(layer_norm(q_THK, self.q_norm), pos_T, self.rope_base).astype(self.dtype)
        k_THK = rope(layer_norm(k_THK, self.k_norm), pos_T, self.rope_base).astype(self.dtype)
        return q_THK, k_THK, v_THK

    def __call__(self, x_TD: Array, pos_T: Array, cache: Callable | None = None) -> Array:
        """cache: sample.py's KV cache, a function that stores these keys and values and returns the cache's
        (S, H, K) ones with the (T, S) mask of those each query may see: decoding runs this same code."""
        q_THK, k_THK, v_THK = self.project(x_TD, pos_T)
        if TAPS:  # the logits themselves stay inside attend; the causal ones, for mup.py
            tap("attn_logits", self.scale * jnp.einsum("THK,SHK->HTS", q_THK, k_THK)[:, *jnp.tril_indices(len(pos_T))])
        k_SHK, v_SHK, mask_TS = (k_THK, v_THK, None) if cache is None else cache(k_THK, v_THK)
        o_THK = attend(q_THK, k_SHK, v_SHK, self.scale, self.impl if cache is None else None, mask_TS)
        T, H, K = o_THK.shape
        return tap("attn_out", linear(o_THK.reshape(T, H * K), self.out.astype(self.dtype).reshape(H * K, -1)))


class MLP(eqx.Module):
    up: Float[Array, "D F"]
    # (D, F), used transposed: XLA:CPU forms its gradient g^T h ~1.7x faster than an (F, D) one (BENCHMARKS.md)
    down: Float[Array, "D F"]
    dtype: str = eqx.field(static=True)
    act: Callable[[Array], Array] = eqx.field(static=True)  # GELU: jax.nn.gelu, or kernels.gelu (gpt_skeleton)

    def __call__(self, x_TD: Array) -> Array:
        h_TF = tap("mlp_hidden", self.act(linear(x_TD, self.up.astype(self.dtype))))
        return tap("mlp_out", linear(h_TF, self.down.astype(self.dtype).T))


class Block(eqx.Module):
    attn_norm: Float[Array, "D"] | None  # RMSNorm gains, only with cfg.norm_gain
    attn: Attention
    mlp_norm: Float[Array, "D"] | None
    mlp: MLP
    branch_mult: float = eqx.field(static=True)  # CompleteP: depth_base / L (Dey et al. 2025, alpha = 1)

    def __call__(self, x_TD: Array, pos_T: Array, cache: Callable | None = None) -> Array:
        x_TD = x_TD + self.branch_mult * self.attn(rms_norm(x_TD, self.attn_norm), pos_T, cache)
        return tap("resid", x_TD + self.branch_mult * self.mlp(rms_norm(x_TD, self.mlp_norm)))


class Embeddings(eqx.Module):
    embed: Float[Array, "V D"]
    unembed: Float[Array, "V D"]  # the readout, stored like embed so eqx.nn.Shared can tie the two


REMAT_POLICIES = {  # what the backward pass may keep instead of recomputing, per block
    # "none": no jax.checkpoint at all, keep everything: fastest, most memory
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # weight matmuls' outputs only
}


class GPT(eqx.Module):
    emb: Embeddings | eqx.nn.Shared  # Shared when cfg.tie_embeddings: one array, two uses
    blocks: Block  # stacked by eqx.filter_vmap: every array has a leading L axis
    final_norm: Float[Array, "D"] | None
    alpha_in: float = eqx.field(static=True)  # embedding output multiplier
    readout_mult: float = eqx.field(static=True)  # logit multiplier: alpha_out / m under muP (TP5 Table 3)
    dtype: str = eqx.field(static=True)
    remat: Literal["none", "full", "save_dots"] = eqx.field(static=True)
    unroll: int = eqx.field(static=True)

    def embeddings(self) -> Embeddings:
        return self.emb() if isinstance(self.emb, eqx.nn.Shared) else self.emb

    def __call__(self, tokens_T: Int[Array, "T"]) -> Float[Array, "T V"]:
        """Logits in float32 for one sequence."""
        return self.logits(self.hidden(tokens_T))

    def hidden(self, tokens_T: Int[Array, "T"]) -> Array:
        """The residual stream after the last block; train.loss_fn applies self.logits in chunks."""
        return self.run_blocks(self.embed(tokens_T), np.arange(tokens_T.shape[0]))  # concrete: see rope

    def embed(self, tokens_T: Int[Array, "T"]) -> Array:
        return tap("embed", self.alpha_in * self.embeddings().embed[tokens_T].astype(self.dtype))

    def logits(self, x_TD: Array) -> Float[Array, "T V"]:
        """The final norm and the readout, in float32; sample.py calls embed, the blocks and this apart."""
        h_TD = rms_norm(x_TD, self.final_norm)
        logits_TV = linear(h_TD, self.embeddings().unembed.astype(self.dtype).T).astype(jnp.float32)
        return tap("logits", self.readout_mult * logits_TV)

    def run_blocks(self, x_TD: Array, pos_T: Array) -> Array:
        """All L blocks by lax.scan over the stacked parameters: compile time does not grow with depth."""
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x_TD, block_params):
            return eqx.combine(block_params, static)(x_TD, pos_T), None

        if self.remat != "none":  # prevent_cse=False is safe and faster inside scan (jax.checkpoint docs)
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        return jax.lax.scan(layer, x_TD, params, unroll=self.unroll)[0]


def init_gpt(cfg: Config, key: Array) -> GPT:
    """A GPT whose parameters are drawn as the policy table says: init_mean + init_std * N(0, 1), and
    whose forward multipliers (muP's and CompleteP's) are static fields set from the config."""
    skeleton = eqx.filter_eval_shape(gpt_skeleton, cfg)  # shapes only: eager zeros would each compile
    params, static = eqx.partition(skeleton, is_param)
    leaves, treedef = jax.tree.flatten(params)
    rows = jax.tree.leaves(policy_table(skeleton, cfg), is_leaf=lambda x: isinstance(x, Policy))
    leaves = draw(key, tuple((x.shape, row.init_mean, row.init_std) for x, row in zip(leaves, rows)))
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


def gpt_skeleton(cfg: Config) -> GPT:
    """The GPT's structure and static fields; its arrays are placeholders that init_gpt replaces."""
    D, H, K, F, V = cfg.d_model, cfg.n_head, cfg.head_dim, cfg.mlp_width, cfg.model_vocab
    gain = lambda n: jnp.ones(n) if cfg.norm_gain else None
    dt, impl = cfg.compute_dtype, attention_impl(cfg)

    def block(_):
        attn = Attention(jnp.zeros((D, 3, H, K)), jnp.zeros((H, K, D)), jnp.ones(K), jnp.ones(K),
                         scale=cfg.attn_scale, rope_base=cfg.rope_base, dtype=dt, impl=impl, fused=cfg.kernels)
        act = kernels.gelu if impl == "cudnn" and cfg.scan_unroll >= cfg.n_layer else jax.nn.gelu
        mlp = MLP(jnp.zeros((D, F)), jnp.zeros((D, F)), dtype=dt, act=act)
        return Block(gain(D), attn, gain(D), mlp, branch_mult=1 / cfg.depth_mult)

    emb = Embeddings(jnp.zeros((V, D)), jnp.zeros((V, D)))
    if cfg.tie_embeddings:
        emb = eqx.nn.Shared(emb, where=lambda e: e.unembed, get=lambda e: e.embed)
    return GPT(emb, eqx.filter_vmap(block)(jnp.arange(cfg.n_layer)), gain(D), alpha_in=cfg.alpha_in,
               readout_mult=cfg.alpha_out / cfg.width_mult, dtype=dt, remat=cfg.remat, unroll=cfg.scan_unroll)


@functools.partial(jax.jit, static_argnums=1)
def draw(key: Array, specs: tuple) -> list[Array]:
    """mean + std * N(0, 1) for each (shape, mean, std), cut from one draw: one per shape would each compile."""
    sizes = [math.prod(shape) for shape, _, _ in specs]
    z = jax.random.normal(key, (sum(sizes),))
    pieces = jnp.split(z, list(itertools.accumulate(sizes))[:-1])
    return [mean + std * p.reshape(shape) for p, (shape, mean, std) in zip(pieces, specs)]


def attention_impl(cfg: Config) -> str | None:
    """cuDNN flash attention on NVIDIA GPUs where it applies (bf16, head dim a multiple of 8 up to 128);
    XLA's everywhere else. On TPU a Pallas splash-attention kernel would be selected here."""
    cudnn_ok = cfg.compute_dtype == "bfloat16" and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128
    return "cudnn" if cfg.kernels and jax.default_backend() == "gpu" and cudnn_ok else None


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
    """The per-parameter table. m = cfg.width_mult = d_model / d_base and d = cfg.depth_mult =
    n_layer / depth_base under muP, both 1 under SP: every multiplier is then 1, so at the base shape
    muP is SP. Sources: [TP5] Tensor Programs V (Yang et al. 2022) Table 3, muP for Adam; [mup]
    microsoft/mup (MuAdam divides matrix-like LRs by width_mult, MuReadout the logits); [nGm]
    EleutherAI nanoGPT-mup, the same rules in a GPT, and its completep branch; [muT] mu_transformer
    (Lingle 2024); [CP] CompleteP (Dey et al. 2025) Table 1 with alpha = 1: no depth factor on any LR.
    Weight decay is independent of lr and of m (train.scale_by_policy), so muP needs no decay rule.
    Adam's epsilon must stay below the gradients it is added to (Everett et al. 2024): all gradients
    carry the readout's 1/m and those inside blocks also the branch scale 1/d, so eps is scaled down
    by the same ([CP], [nGm] completep: adam_eps / (m_N * m_L)). Forward multipliers are static fields
    of the model (init_gpt). Sharding: FSDP on the D axis of every matrix (1-D gains stay replicated)."""
    D, F, m, d = cfg.d_model, cfg.mlp_width, cfg.width_mult, cfg.depth_mult
    gain = dict(init_mean=1.0, eps_mult=1 / (m * d))  # vector-like inside blocks: LR lr, no decay [TP5, CP]
    return {
        # name: Policy(init std, LR multiplier, decayed, spec of one layer, Adam eps multiplier)
        # embedding: constant init std and LR at every width; forward x alpha_in [TP5 input weights, mup, nGm].
        # Tied, std 1/sqrt(D/m) (1/sqrt(d_base) under muP: constant too) starts the logits at O(alpha_out), not
        # O(alpha_out sqrt(d_base)): step-0 loss 129 -> 6.9 and val at 600 steps 1.99 -> 1.86 (BENCHMARKS.md)
        "emb.embed": Policy(1 / math.sqrt(D / m) if cfg.tie_embeddings else 1.0, 1.0, True, (None, "fsdp"), eps_mult=1 / m),
        # readout: zero init (loss starts at ln V) [TP5], forward x alpha_out / m [mup MuReadout, nGm], LR lr
        # (vector-like: one dim grows). Tied, the shared array keeps emb.embed's row: the readout's other form,
        # constant init, with the same alpha_out / m.
        "emb.unembed": Policy(0.0, 1.0, True, (None, "fsdp"), eps_mult=1 / m),
        # hidden matrices: init std 1/sqrt(fan_in), LR lr / m [TP5 hidden weights, mup MuAdam, nGm, muT]
        "blocks.attn.qkv": Policy(1 / math.sqrt(D), 1 / m, True, ("fsdp", None, None, None), eps_mult=1 / (m * d)),
        "blocks.attn.out": Policy(1 / math.sqrt(D), 1 / m, True, (None, None, "fsdp"), eps_mult=1 / (m * d)),
        "blocks.mlp.up": Policy(1 / math.sqrt(D), 1 / m, True, ("fsdp", None), eps_mult=1 / (m * d)),
        "blocks.mlp.down": Policy(1 / math.sqrt(F), 1 / m, True, ("fsdp", None), eps_mult=1 / (m * d)),
        # QK-LayerNorm gains: K entries at every width, LR lr, no decay [muT; Wortsman et al. 2023]
        "blocks.attn.q_norm": Policy(0.0, 1.0, False, (None,), **gain),
        "blocks.attn.k_norm": Policy(0.0, 1.0, False, (None,), **gain),
        # RMSNorm gains, only with cfg.norm_gain: vector-like, LR lr [TP5]; off by default: they break transfer [muT]
        "blocks.attn_norm": Policy(0.0, 1.0, False, (None,), **gain),
        "blocks.mlp_norm": Policy(0.0, 1.0, False, (None,), **gain),
        # the final RMSNorm's gain: outside the blocks, so no branch scale in its gradient
        "final_norm": Policy(0.0, 1.0, False, (None,), init_mean=1.0, eps_mult=1 / m),
    }


def is_param(x) -> bool:
    """An array of the model, or its shape alone (init_gpt's skeleton)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def param_name(path) -> str:
    """'blocks.attn.qkv' for a key path; eqx.nn.Shared's wrapper (.pytree) is not part of the name."""
    return ".".join(k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey) and k.name != "pytree")


def policy_table(model: GPT, cfg: Config):
    """A pytree like the model's arrays with each parameter's Policy; every parameter needs a row."""
    rows, params = policy_rows(cfg), eqx.filter(model, is_param)
    missing = [param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
               if param_name(path) not in rows]
    assert not missing, f"parameters without a row in policy_rows: {missing}"

    def row(path, x):
        policy = rows[param_name(path)]
        if param_name(path).startswith("blocks."):
            policy = dataclasses.replace(policy, spec=(None, *policy.spec))
        assert len(policy.spec) == x.ndim, f"{param_name(path)}: spec {policy.spec} for shape {x.shape}"
        return policy

    return jax.tree_util.tree_map_with_path(row, params)


def partition_specs(model: GPT, cfg: Config):
    return jax.tree.map(lambda p: P(*p.spec), policy_table(model, cfg), is_leaf=lambda x: isinstance(x, Policy))


def count_params(model: GPT) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def flops_per_token(cfg: Config) -> float:
    """Model FLOPs per token, forward + backward: 6N + 12·L·D·T (PaLM, Chowdhery et al. 2022, app. B).
    N counts the weights that take part in matmuls: blocks and readout, not the embedding lookup;
    12·L·D·T is the attention scores and their use, over the full T x T (causal masking not deducted)."""
    N = cfg.n_layer * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.mlp_width) + cfg.d_model * cfg.model_vocab
    return 6 * N + 12 * cfg.n_layer * cfg.d_model * cfg.block_size
