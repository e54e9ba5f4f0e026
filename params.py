"""How each parameter of model.py's GPT is initialised, optimised and sharded: one table,
policy_rows, for SP and muP (with CompleteP's depth rules), and init_gpt, which draws a GPT by it.
A parameter added to model.py needs a row here: policy_table stops with one line naming it."""
import dataclasses
import math
from typing import Callable

import equinox as eqx
import jax
from jax import Array
from jax.sharding import PartitionSpec as P

from configs import Config
from run.errors import UsageError
from model import GPT


def init_gpt(cfg: Config, key: Array, fast: dict[str, Callable] | None = None,
             table=None, shardings=None) -> GPT:
    """A GPT whose parameters are drawn as the policy table says: init_mean + init_std * N(0, 1),
    and whose forward multipliers (muP's and CompleteP's) are static fields set from the config.
    table: policy_table's, when the caller has built it already. shardings: the parameters'
    (train.setup's), drawn straight onto them, each device computing its share only: drawn on one
    device first, the whole model and its temporaries (several times it) were on that device,
    which FSDP is there to avoid (BENCHMARKS.md). JAX's threefry is partitionable: the values
    are those drawn on one device."""
    skeleton = eqx.filter_eval_shape(GPT, cfg, fast)  # shapes only: eager zeros would each compile
    params, static = eqx.partition(skeleton, is_param)
    leaves, treedef = jax.tree.flatten(params)
    is_policy = lambda x: isinstance(x, Policy)
    table = policy_table(skeleton, cfg) if table is None else table
    rows = jax.tree.leaves(table, is_leaf=is_policy)
    specs = tuple((x.shape, row.init_mean, row.init_std) for x, row in zip(leaves, rows))
    onto = None if shardings is None else jax.tree.leaves(shardings)
    values = jax.jit(draw, static_argnums=1, out_shardings=onto)(key, specs)
    return eqx.combine(jax.tree.unflatten(treedef, values), static)


def draw(key: Array, specs: tuple) -> list[Array]:
    """mean + std * N(0, 1) for each (shape, mean, std), each array from its own key, in one
    jitted function (not one compilation per shape). Each drawn alone in its shape, so that a
    sharded draw computes only each device's share: one normal cut into the arrays was computed
    whole on every device."""
    keys = jax.random.split(key, len(specs))
    return [mean + std * jax.random.normal(k, shape) for k, (shape, mean, std) in zip(keys, specs)]


@dataclasses.dataclass(frozen=True)
class Policy:
    """How one parameter is initialised, optimised and sharded."""
    init_std: float  # parameter = init_mean + init_std * N(0, 1)
    lr_mult: float  # multiplies the schedule's learning rate
    decay: bool  # independent weight decay applies
    spec: tuple  # PartitionSpec of one layer's array; stacked block arrays get None for L in front
    init_mean: float = 0.0
    eps_mult: float = 1.0  # multiplies Adam's epsilon
    # Under optimizer=muon, Muon's view of one layer's array as a matrix: (row axes, column axes),
    # the trailing ones (fan-in, fan-out); None: Adam (optimizers.py)
    muon_view: tuple[int, int] | None = None


def policy_rows(cfg: Config) -> dict[str, Policy]:
    """The per-parameter table. m = d_model / d_base and d = n_layer / depth_base under muP, 1 under
    SP, where every multiplier is 1: at the base shape muP is SP. [TP5] Tensor Programs V Table 3;
    [mup] microsoft/mup; [nGm] EleutherAI nanoGPT-mup and its completep branch; [muT]
    mu_transformer (Lingle 2024); [CP] CompleteP (Dey et al. 2025), alpha = 1: no depth factor on
    any LR. Weight decay is independent of lr and m (optimizers.scale_by_policy). Adam's eps must
    stay below the gradients (Everett et al. 2024), which carry the readout's 1/m and, inside
    blocks, the branch scale 1/d: eps is scaled by the same [CP, nGm]. FSDP shards every matrix's
    D axis. Lion's update is a sign, entrywise +-1: muP's rules for entrywise updates, Adam's and
    SignSGD's alike (Tensor Programs IVb, Yang & Littwin 2023, arXiv 2308.01814), carry over; Lion
    has no eps. Muon's update of a hidden R x C matrix, muon_rms * sqrt(max(R, C)) times an
    orthogonal matrix, has spectral norm lr * lr_mult * muon_rms * sqrt(max(R, C)): lr_mult =
    1/sqrt(m) keeps it constant in width, as the spectral condition asks (||dW|| ~ sqrt(fan_out /
    fan_in), width-free for hidden matrices; Yang, Simon & Bernstein 2023, arXiv 2310.17813); at
    m = 1 it is Moonshot's RMS matching (arXiv 2502.16982). Muon's update, like Adam's, ignores
    the gradient's scale: no depth factor either [CP]."""
    D, F, m, d = cfg.d_model, cfg.mlp_width, cfg.width_mult, cfg.depth_mult
    hidden = dict(lr_mult=1 / m, decay=True, eps_mult=1 / (m * d))  # [TP5 hidden, mup, nGm, muT]
    if cfg.optimizer == "muon":  # its hidden matrices take Muon: the spectral condition's rule
        hidden["lr_mult"] = 1 / math.sqrt(m)
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
        # hidden matrices: init std 1/sqrt(fan_in), LR lr / m (Muon's: lr / sqrt(m)); Muon's
        # matrices are qkv's D x (N K), out's (H K) x D, up's D x F and down's F x D
        "blocks.attn.qkv": Policy(1 / math.sqrt(D), spec=("fsdp", None, None), muon_view=(1, 2),
                                  **hidden),
        "blocks.attn.out": Policy(1 / math.sqrt(D), spec=(None, None, "fsdp"), muon_view=(2, 1),
                                  **hidden),
        "blocks.mlp.up": Policy(1 / math.sqrt(D), spec=("fsdp", None), muon_view=(1, 1), **hidden),
        "blocks.mlp.down": Policy(1 / math.sqrt(F), spec=(None, "fsdp"), muon_view=(1, 1),
                                  **hidden),
        # QK-LayerNorm gains: K entries at every width, LR lr, no decay [muT; Wortsman et al. 2023]
        "blocks.attn.q_norm": Policy(0.0, spec=(None,), **gain),
        "blocks.attn.k_norm": Policy(0.0, spec=(None,), **gain),
        # RMSNorm gains, only with cfg.norm_gain: off by default, they break transfer [muT]
        "blocks.attn_norm": Policy(0.0, spec=(None,), **gain),
        "blocks.mlp_norm": Policy(0.0, spec=(None,), **gain),
        # the final RMSNorm's gain: outside the blocks, so no branch scale in its gradient
        "final_norm": Policy(0.0, spec=(None,), **{**gain, "eps_mult": 1 / m}),
        # MUDD's connections, outside the blocks' branches. W1: fan-in D grows with width, fan-out
        # fixed, like a readout: LR lr / m keeps its output's update O(1); its init output may be
        # O(1), as W2 = 0 makes A independent of it at init. W2 and b: finite in both dimensions
        # (vector-like [TP5]); b, the connections' static part, is not decayed. Their gradients
        # are sums over the D coordinates of the streams': O(1), so eps is not scaled.
        "mudd.w1": Policy(1 / math.sqrt(D), 1 / m, decay=True, spec=("fsdp", None)),
        "mudd.w2": Policy(0.0, 1.0, decay=True, spec=(None, None)),
        "mudd.b": Policy(0.0, 1.0, decay=False, spec=(None, None)),
    }


def is_param(x) -> bool:
    """An array of the model, or its shape alone (init_gpt's skeleton)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def param_name(path) -> str:
    """'blocks.attn.qkv' for a key path; eqx.nn.Shared's wrapper (.pytree) is not in the name."""
    keys = (k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey))
    return ".".join(name for name in keys if name != "pytree")


def policy_table(model: GPT, cfg: Config, mesh_shape: dict[str, int] | None = None):
    """A pytree like the model's arrays with each parameter's Policy; each needs a row, and each
    axis its spec shards must divide by the mesh axes' sizes (mesh_shape: train.make_mesh's)."""
    rows, params = policy_rows(cfg), eqx.filter(model, is_param)
    names = [param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if missing := [name for name in names if name not in rows]:
        raise UsageError(f"params.py: parameters without a row in policy_rows: "
                         f"{', '.join(missing)} "
                         "(add each one's init std, LR multiplier, decay and sharding)")

    def row(path, x):
        name, policy = param_name(path), rows[param_name(path)]
        if name.startswith("blocks."):  # stacked over layers: one more axis in front
            policy = dataclasses.replace(policy, spec=(None, *policy.spec))
        if len(policy.spec) != x.ndim:
            raise UsageError(f"params.py: policy_rows gives {name} the sharding {rows[name].spec}, "
                             f"which does not fit its shape {x.shape} (blocks: L in front)")
        view = rows[name].muon_view  # one layer's axes, as its spec's
        if cfg.optimizer == "muon" and view and (min(view) < 1 or sum(view) != len(rows[name].spec)):
            raise UsageError(f"params.py: policy_rows gives {name} the muon_view {view}, which "
                             f"does not split one layer's {len(rows[name].spec)} axes into rows "
                             "and columns (Muon would orthogonalise another matrix)")
        for size, axes in zip(x.shape, policy.spec):  # an axis name, a tuple of them, or None
            parts = math.prod((mesh_shape or {}).get(a, 1) for a in jax.tree.leaves(axes))
            if size % parts:
                raise UsageError(f"params.py: policy_rows shards {name} {x.shape} over {axes}'s "
                                 f"{parts} devices along an axis of {size}, which {parts} does "
                                 "not divide: give that axis None in its spec, or set "
                                 "mesh_replica")
        return policy

    return jax.tree_util.tree_map_with_path(row, params)


def check(cfg: Config, n_devices: int = 1) -> None:
    """The policy table of the model's shapes alone, its shardings on the mesh train.make_mesh
    makes of n_devices: launch.py's check before the run directory."""
    policy_table(eqx.filter_eval_shape(GPT, cfg), cfg, cfg.mesh_shape(n_devices))


def partition_specs(table):
    """The PartitionSpec of each parameter, from policy_table's table."""
    is_policy = lambda x: isinstance(x, Policy)
    return jax.tree.map(lambda p: P(*p.spec), table, is_leaf=is_policy)


def flops_per_token(model: GPT, T: int) -> float:
    """Model FLOPs per token, forward + backward, from the model's own arrays: 6N + 12·L·H·K·T
    (PaLM app. B). N: every matrix a token is multiplied by (the blocks' and the readout, not the
    embedding lookup nor the gains); 12·L·H·K·T: attention's scores and their use, full T x T
    (bench.py also reports the causal half, as MaxText and llm.c count)."""
    arrays = jax.tree.leaves(eqx.filter(model.blocks, is_param))
    N = sum(math.prod(x.shape) for x in arrays if len(x.shape) >= 3)  # (L, ...) matrices
    N += math.prod(model.embeddings().unembed.shape)
    D = model.embeddings().unembed.shape[1]
    for c in model.mudd or ():  # MUDD: W1, W2, and C x J weights of a D-vector per token
        N += c.w1.size + c.w2.size + c.b.size * D
    L, H, K, _ = model.blocks.attn.out.shape
    return 6 * N + 12 * L * H * K * T
