"""Many small models trained at once, for the evidence commands (mup.py, tools/optimizer_sweep.py):
LR sweeps vmapped over learning rates and seeds in one program (train_runs), and microsoft/mup's
coordinate check (coord_check: the activations model.tap names, read after each step). Each runs
train.setup's real step on one device."""
from collections import defaultdict

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import data
import model as M
import params
import train
from configs import Config


def init(cfg: Config, key: jax.Array, readout: float = 0.0) -> M.GPT:
    """model.init_gpt, but with the readout drawn N(0, readout^2 / (D / m)) (std 1 / sqrt(d_base)
    under muP, 1 / sqrt(D) under SP, at readout 1) where readout is not 0, model.py's zero init
    (at the base shape muP is model.py's SP exactly). SP as GPT-2 (std 0.02 at D = 768,
    openai/gpt-2 model.py) and PyTorch's nn.Linear draw it: mup.READOUT["sp"] = 1."""
    gpt = params.init_gpt(cfg, key)
    if not readout or cfg.tie_embeddings:
        return gpt
    z = jax.random.normal(jax.random.fold_in(key, 1), gpt.emb.unembed.shape)
    std = readout / (cfg.d_model / cfg.width_mult) ** 0.5
    return eqx.tree_at(lambda g: g.emb.unembed, gpt, std * z)


def one_device_mesh() -> jax.sharding.Mesh:
    """The first device alone: the sweeps compare sizes and LRs, not speed, and JAX refuses
    activation_sizes' ordered callback on more than one."""
    return train.make_mesh(Config(mesh_replica=1), jax.devices()[:1])


# (name, activation) of each tap of the forwards run by activations
_SEEN: list[tuple[str, np.ndarray]] = []


def _record(name: str, x: jax.Array) -> None:
    """model.TAPS entry while activations runs: x to the host by an ordered callback from inside
    the jitted forward, so values arrive in the order the taps ran (inside lax.scan, the l-th
    "resid" is layer l's)."""
    jax.debug.callback(lambda v: _SEEN.append((name, np.asarray(v, np.float32))), x, ordered=True)


@eqx.filter_jit
def _tapped_forward(gpt: M.GPT, tokens_T: jax.Array) -> jax.Array:
    return gpt(tokens_T)  # traced (once per shape) only with _record in model.TAPS


def activations(gpt: M.GPT, x_BT: np.ndarray) -> dict[str, list[np.ndarray]]:
    """Each tapped activation over the sequences x_BT: name -> one array per call of its tap
    (per layer), the sequences stacked in front."""
    _SEEN.clear()
    M.TAPS.append(_record)
    try:
        for tokens_T in x_BT:
            _tapped_forward(gpt, jnp.asarray(tokens_T))
        jax.effects_barrier()
    finally:
        M.TAPS.remove(_record)
    seen = defaultdict(list)
    for name, value in _SEEN:
        seen[name].append(value)
    calls = {k: len(v) // len(x_BT) for k, v in seen.items()}  # sequence after sequence
    return {k: [np.stack(v[c::calls[k]]) for c in range(calls[k])] for k, v in seen.items()}


def mean_sizes(acts: dict[str, list[np.ndarray]]) -> dict[str, float]:
    """Mean |x| of each activation: the last layer's residual stream ("resid"), the others
    averaged over layers."""
    means = {k: [float(np.abs(a).mean()) for a in v] for k, v in acts.items()}
    return {k: v[-1] if k == "resid" else float(np.mean(v)) for k, v in means.items()}


def activation_sizes(gpt: M.GPT, x_BT: np.ndarray) -> dict[str, float]:
    """Mean |x| of each tapped activation over the sequences x_BT (mean_sizes)."""
    return mean_sizes(activations(gpt, x_BT))


def coord_check(cfg: Config, steps: int, seeds: int, readout: float = 0.0,
                seqs: int | None = None) -> dict[str, dict[str, list[float]]]:
    """{"x": mean |x_t|, "dx": mean |x_t - x_0|}, each activation name -> its value after t = 0 ..
    steps steps, averaged over seeds (each its own initial model and batch), every step on that
    seed's one batch at the config's learning rate, constant (no warmup: step 1 moves at full
    LR). readout: init's; seqs: the first sequences of the batch the activations are read on."""
    tokens = data.load_split(cfg, "train")
    cfg = dataclasses.replace(cfg, warmup_steps=0, min_lr=cfg.learning_rate, max_steps=steps)
    s = train.setup(cfg, one_device_mesh())  # its step is compiled once, used for every seed
    table = {k: defaultdict(lambda: np.zeros(steps + 1)) for k in ("x", "dx")}
    for seed in range(seeds):
        x_BT, y_BT = data.get_batch(tokens, cfg.seed + seed, data.TRAIN, 0, cfg.batch_size,
                                    cfg.block_size)
        batch = [a.reshape(cfg.grad_accum, cfg.microbatch_size, cfg.block_size)
                 for a in (x_BT, y_BT)]
        gpt = init(cfg, jax.random.key(cfg.seed + seed), readout)
        gpt = eqx.filter_shard(gpt, s.model_sharding)
        opt_state = train.make_optimizer(cfg, params.policy_table(gpt, cfg)).init(
            eqx.filter(gpt, eqx.is_array))
        opt_state = eqx.filter_shard(opt_state, s.opt_sharding)
        for t in range(steps + 1):
            acts = activations(gpt, x_BT[:seqs])
            first = acts if t == 0 else first
            moved = {k: [a - a0 for a, a0 in zip(v, first[k])] for k, v in acts.items()}
            for kind, values in (("x", acts), ("dx", moved)):
                for name, v in mean_sizes(values).items():
                    table[kind][name][t] += v / seeds
            if t < steps:
                gpt, opt_state, _ = s.step(gpt, opt_state, *batch)
    return {kind: {n: v.tolist() for n, v in t.items()} for kind, t in table.items()}


def train_runs(cfg: Config, lrs: list[float], seeds: int, steps: int,
               lrs_per_program: int | None = None, readout: float = 0.0) -> tuple[np.ndarray, ...]:
    """The train loss of every step, shape (LRs, seeds, steps), and the validation loss after the
    last, (LRs, seeds): seed i starts from its own initial model and reads its own batches (seed
    cfg.seed + i for both), the same at every LR; the config's schedule compressed to `steps` steps
    (min_lr / learning_rate kept). One program vmapped over seeds and lrs_per_program LRs (all by
    default): the LR reaches train.setup through the config as a tracer."""
    train_tokens, val_tokens = data.load_split(cfg, "train"), data.load_split(cfg, "val")
    G, B, T = cfg.grad_accum, cfg.microbatch_size, cfg.block_size
    xy = [[data.get_batch(train_tokens, cfg.seed + i, data.TRAIN, s, cfg.batch_size, T)
           for s in range(steps)] for i in range(seeds)]
    val = [data.get_batch(val_tokens, cfg.seed, data.EVAL_VAL, i, B, T)
           for i in range(cfg.eval_batches)]
    mesh = one_device_mesh()
    # (seeds, steps, G, B, T), int32 as get_batch makes them: no int64 into the loss's VJP
    x_NSGBT, y_NSGBT = (jnp.asarray(np.stack([np.stack([b[k].reshape(G, B, T) for b in seed])
                                              for seed in xy])) for k in (0, 1))
    x_EBT, y_EBT = (jnp.asarray(np.stack([b[i] for b in val])) for i in (0, 1))
    warmup = round(cfg.warmup_steps * steps / cfg.max_steps)
    # kernels off: setup is traced here, and the fast paths' check needs values (fused/)
    cfg = dataclasses.replace(cfg, max_steps=steps, warmup_steps=warmup, kernels=False)
    # The initial models, drawn outside the compiled program, stacked over seeds.
    models = [init(cfg, jax.random.key(cfg.seed + i), readout) for i in range(seeds)]
    arrays_0 = jax.tree.map(lambda *a: jnp.stack(a), *[eqx.filter(g, eqx.is_array) for g in models])
    static = eqx.filter(models[0], eqx.is_array, inverse=True)

    def run(lr, arrays, x_SGBT, y_SGBT):
        min_lr = lr * cfg.min_lr / cfg.learning_rate
        s = train.setup(dataclasses.replace(cfg, learning_rate=lr, min_lr=min_lr), mesh)

        def one_step(carry, batch):
            gpt, opt_state, metrics = s.step(*carry, *batch)
            return (gpt, opt_state), metrics["loss"]

        start = (eqx.combine(arrays, static), s.opt_state)
        (gpt, _), losses = jax.lax.scan(one_step, start, (x_SGBT, y_SGBT))
        loss = lambda x_BT, y_BT: train.loss_fn(gpt, x_BT, y_BT, cfg)[1]  # the cross-entropy
        return losses, jax.vmap(loss)(x_EBT, y_EBT).mean()

    over_seeds = jax.vmap(run, in_axes=(None, 0, 0, 0))
    sweep = eqx.filter_jit(jax.vmap(over_seeds, in_axes=(0, None, None, None)))
    n, k = len(lrs), min(lrs_per_program or len(lrs), len(lrs))
    padded = list(lrs) + [lrs[-1]] * (-n % k)  # equal programs: one compilation; cut below
    out = [sweep(jnp.asarray(padded[i:i + k], jnp.float32), arrays_0, x_NSGBT, y_NSGBT)
           for i in range(0, n, k)]
    return tuple(np.concatenate([np.asarray(o[j]) for o in out])[:n] for j in (0, 1))
