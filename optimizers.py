"""The optimizers (--config.optimizer) and LR schedules (--config.schedule), as optax chains:
clip by global norm, the optimizer's update, then scale_by_policy's -lr_t * lr_mult and decay.

adamw: Adam for every parameter. lion: Lion (Chen et al. 2023, arXiv 2302.06675) for every
parameter. muon: Muon (Jordan 2024) for the hidden matrices, the rows of params.policy_rows with a
muon_view, and Adam for the rest (embeddings, readout, gains, MUDD's small matrices). The muP rules
of each (their LR multipliers) are the policy table's; docs/optimizers.md has the reasons.
"""
import math

import jax
import jax.numpy as jnp
import optax

from configs import Config
from params import Policy
from run.errors import UsageError

is_policy = lambda x: isinstance(x, Policy)


# ------------------------------------------------------------------------------------------------
# The last link: the schedule, muP's LR multipliers and independent weight decay

def scale_by_policy(cfg: Config, table) -> optax.GradientTransformation:
    """The last link of the optimizer: -lr_t * lr_mult * update, and for decayed parameters the
    independent decay -weight_decay * (lr_t / learning_rate) * p, whatever lr and lr_mult (muP's
    1/m included). optax.adamw would multiply the decay by each parameter's LR multiplier too
    (Wortsman et al. 2023 on independent decay)."""
    schedule = lr_schedule(cfg)

    def update(updates, state, params):
        lr = schedule(state.count)
        decay = cfg.weight_decay * lr / cfg.learning_rate

        def one(u, p, policy: Policy):
            return -lr * policy.lr_mult * u - (decay * p if policy.decay else 0.0)

        updates = jax.tree.map(one, updates, params, table)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    init = lambda _: optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))
    return optax.GradientTransformation(init, update)


# ------------------------------------------------------------------------------------------------
# The optimizers' updates, before the LR

def scale_by_adam(cfg: Config, table) -> optax.GradientTransformation:
    """optax.scale_by_adam (its state too) with eps = adam_eps * eps_mult per parameter
    (CompleteP): Adam's m / (sqrt(v) + eps) of gradients divided by c is that of the gradients
    with eps * c in place of eps."""
    adam = optax.scale_by_adam(cfg.beta1, cfg.beta2, cfg.adam_eps)

    def update(grads, state, params=None):
        scaled = jax.tree.map(lambda g, policy: g / policy.eps_mult, grads, table)
        return adam.update(scaled, state, params)

    return optax.GradientTransformation(adam.init, update)


def scale_by_lion(cfg: Config, table) -> optax.GradientTransformation:
    """Lion's sign(lion_beta1 * m + (1 - lion_beta1) * g), m an EMA of the gradients at
    lion_beta2: optax's. Each entry is +-1, so no eps, and muP's per-parameter LRs are Adam's."""
    del table  # every parameter alike
    return optax.scale_by_lion(cfg.lion_beta1, cfg.lion_beta2)


# Keller Jordan's quintic Newton-Schulz coefficients (modded-nanogpt; "Muon: An optimizer for
# hidden layers in neural networks", kellerjordan.github.io/posts/muon, 2024): the largest slope
# at 0 for which 5 steps bring every singular value of a normalised matrix into about [0.7, 1.2]
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g_RC: jax.Array, steps: int) -> jax.Array:
    """About U V^T for g = U S V^T: X <- a X + (b A + c A^2) X with A = X X^T, from X = g / |g|_F
    (every singular value <= 1). On the short side's Gram matrix (X^T when R > C): the
    iteration commutes with the transpose, and the smaller A costs less. float32 arrays (Jordan's
    run bfloat16: XLA:CPU's bfloat16 matmuls are slow), at JAX's default matmul precision, which
    on a GPU or TPU may be TF32 or bfloat16 passes: the iteration is approximate anyway."""
    a, b, c = NS_COEFFS
    tall = g_RC.shape[0] > g_RC.shape[1]
    x = (g_RC.T if tall else g_RC).astype(jnp.float32)
    x = x / (jnp.linalg.norm(x) + 1e-7)  # Jordan's 1e-7: a zero gradient gives a zero update
    for _ in range(steps):
        A = jnp.einsum("rc,sc->rs", x, x)
        x = a * x + jnp.einsum("rs,sc->rc", b * A + c * A @ A, x)
    return x.T if tall else x


def orthogonalise(u: jax.Array, view: tuple[int, int], cfg: Config) -> jax.Array:
    """Muon's update of one stacked array: its trailing axes viewed as a matrix, view = (row axes,
    column axes) (qkv's (D, N, K) as D x (N K), out's (H, K, D) as (H K) x D), each leading index
    (a layer) its own matrix, orthogonalised, times muon_rms * sqrt(max(R, C)): an orthogonal
    R x C matrix has RMS 1 / sqrt(max(R, C)), so the update's RMS is muon_rms, AdamW's typical
    (Liu et al. 2025, "Muon is scalable", arXiv 2502.16982), and AdamW's LR and decay carry."""
    rows, cols = view
    layers = u.shape[:u.ndim - rows - cols]
    R, C = math.prod(u.shape[len(layers):len(layers) + rows]), math.prod(u.shape[u.ndim - cols:])
    g_NRC = u.reshape(-1, R, C)  # row-major: the row axes come first, so no transpose
    o_NRC = jax.vmap(lambda g: newton_schulz(g, cfg.muon_ns_steps))(g_NRC)
    return (cfg.muon_rms * math.sqrt(max(R, C)) * o_NRC).reshape(u.shape)


def scale_by_muon(cfg: Config, table) -> optax.GradientTransformation:
    """Muon: an EMA of the gradients at muon_momentum, its Nesterov look-ahead (1 - beta) g +
    beta m (Jordan's default), orthogonalised per matrix. table: the Muon parameters' rows."""
    beta = cfg.muon_momentum

    def init(params):
        return optax.TraceState(trace=jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        ema = lambda m, g: beta * m + (1 - beta) * g
        momentum = jax.tree.map(ema, state.trace, grads)
        nesterov = jax.tree.map(ema, momentum, grads)
        updates = jax.tree.map(lambda u, p: orthogonalise(u, p.muon_view, cfg), nesterov, table)
        return updates, optax.TraceState(trace=momentum)

    return optax.GradientTransformation(init, update)


def muon_and_adam(cfg: Config, table) -> optax.GradientTransformation:
    """Muon for the parameters whose policy has a muon_view, Adam for the others: optax.partition
    gives each its own parameters (the others are optax.MaskedNode), and its own table rows."""
    def rows(label):  # the table, masked as optax.partition masks the gradients
        mask = lambda p: p if (p.muon_view is not None) == (label == "muon") else optax.MaskedNode()
        return jax.tree.map(mask, table, is_leaf=is_policy)

    labels = jax.tree.map(lambda p: "adam" if p.muon_view is None else "muon", table,
                          is_leaf=is_policy)
    return optax.partition({"muon": scale_by_muon(cfg, rows("muon")),
                            "adam": scale_by_adam(cfg, rows("adam"))},
                           lambda _: labels)  # a function: the GPT-shaped tree is callable


OPTIMIZERS = {"adamw": scale_by_adam, "lion": scale_by_lion, "muon": muon_and_adam}


def make_optimizer(cfg: Config, table) -> optax.GradientTransformation:
    """Clip by global norm (grad_clip=0: no clipping), cfg.optimizer's update, LR and decay."""
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip else optax.identity()
    return optax.chain(clip, OPTIMIZERS[cfg.optimizer](cfg, table), scale_by_policy(cfg, table))


# ------------------------------------------------------------------------------------------------
# Schedules: linear warmup, then cfg.schedule's

def cosine(cfg: Config, step: jax.Array) -> jax.Array:
    """Cosine decay from learning_rate at warmup_steps to min_lr at max_steps."""
    frac = jnp.clip((step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1), 0, 1)
    return cfg.min_lr + 0.5 * (cfg.learning_rate - cfg.min_lr) * (1 + jnp.cos(math.pi * frac))


def wsd(cfg: Config, step: jax.Array) -> jax.Array:
    """Warmup-stable-decay (MiniCPM, Hu et al. 2024, arXiv 2404.06395): learning_rate until
    cfg.decay_start, then down to min_lr at max_steps, linearly or as 1 - sqrt (the cooldown of
    Hägele et al. 2024, arXiv 2405.18392). The stable phase does not depend on max_steps, so a run
    there may be extended (check_extension)."""
    start = cfg.decay_start
    frac = jnp.clip((step - start) / max(cfg.max_steps - start, 1), 0, 1)
    shape = frac if cfg.decay_shape == "linear" else jnp.sqrt(frac)
    return cfg.learning_rate - (cfg.learning_rate - cfg.min_lr) * shape


def constant(cfg: Config, step: jax.Array) -> jax.Array:
    """learning_rate after warmup (min_lr unused)."""
    return jnp.full_like(step, 1.0) * cfg.learning_rate


SCHEDULES = {"cosine": cosine, "wsd": wsd, "constant": constant}


def lr_schedule(cfg: Config):
    """Linear warmup to learning_rate in warmup_steps, then cfg.schedule's LR."""
    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = cfg.learning_rate * (step + 1) / max(cfg.warmup_steps, 1)
        return jnp.where(step < cfg.warmup_steps, warm, SCHEDULES[cfg.schedule](cfg, step))

    return lr


def applied_lr(cfg: Config, opt_state) -> jax.Array:
    """The LR of the last update applied (0 before any), the one train.py logs as "lr": the
    schedule at the count of scale_by_policy's state (make_optimizer's last link). A skipped
    (non-finite) step leaves that count as it was, so after one the LR lags schedule(step).
    Computed in the step, so it reaches the host with the step's other metrics."""
    return lr_schedule(cfg)(opt_state[-1].count - 1)


def check_extension(old: Config, new: Config, step: int) -> None:
    """A WSD run resumed at `step` with another max_steps or decay: allowed while every step taken
    (0 to step - 1) had the stable phase's LR under both schedules, where the two agree, so the run resumes
    bitwise as if launched with the new config. Past that, the steps taken had the old decay's
    LRs, the new schedule others: refused."""
    fields = ("max_steps", "decay_fraction", "decay_shape")
    changed = [f"{f}={getattr(new, f)!r} (was {getattr(old, f)!r})" for f in fields
               if getattr(old, f) != getattr(new, f)]
    start = min(old.decay_start, new.decay_start)  # the step `start` still has learning_rate
    if new.schedule == "wsd" and changed and step > start + 1:
        raise UsageError(f"the checkpoint is at step {step}, past the start of the WSD decay "
                         f"(step {start}): {', '.join(changed)} would change the LR of steps "
                         f"already taken; a WSD run is extended only in its stable phase")
