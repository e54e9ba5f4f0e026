"""muP's evidence, remade by one command (muP: Tensor Programs V, Yang et al. 2022, arXiv
2203.03466; its depth rules: CompleteP, Dey et al. 2025, arXiv 2505.01618):

    python mup.py evidence --out=docs/mup [--config=shakespeare_char_cpu] [--config.F=V]

Each part (PARTS) trains the real model (train.setup's step), on one device, at widths d_model x
1/2 .. 4 (more heads, the head dim stays) or depths n_layer x 1/2 .. 4. Coordinate checks: mean
|x| of each activation model.tap names, over a few steps on one batch (flat in width under muP,
in depth under CompleteP). LR sweeps: the validation loss per LR (the best LR stays put under
muP, moves under SP and without the depth rules). Curves: the train loss at the base LR over
seeds (wider is better at every step). DIR/evidence.json holds the git commit, each part's
settings (its full resolved config too) and results, written after each size: the same command
resumes; an --out of other settings is refused. README.md and the figures come from the JSON."""
import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import configs
import data
import model as M
import params
from tools import plots
from run import rundir
import train
from configs import Config
from run.errors import RunError, UsageError

# name: (what it measures, the axis it varies, the model). "sp" is SP as people run it, "nodepth"
# muP with CompleteP's rules off (depth_base = n_layer at every depth).
PARTS = {"coord_width": ("coord", "width", "mup"), "coord_width_sp": ("coord", "width", "sp"),
         "coord_depth": ("coord", "depth", "mup"),
         "coord_depth_nodepth": ("coord", "depth", "nodepth"),
         "lr_width": ("sweep", "width", "mup"), "lr_depth": ("sweep", "depth", "mup"),
         "lr_depth_nodepth": ("sweep", "depth", "nodepth"), "lr_width_sp": ("sweep", "width", "sp"),
         "curves": ("curves", "width", "mup")}
# Sizes as multiples of the base; steps, seeds: the whole fits a 2-core CPU's ~45 minutes for
# shakespeare_char_cpu (docs/mup.md), so LR sweeps over width stop at 2x, curves at 4x.
SCALES = {("coord", "width"): [0.5, 1, 2, 4], ("coord", "depth"): [0.5, 1, 2, 4],
          ("sweep", "width"): [0.5, 1, 2], ("sweep", "depth"): [0.5, 1, 2, 4],
          ("curves", "width"): [0.5, 1, 2, 4]}
STEPS, SEEDS = {"coord": 5, "sweep": 100, "curves": 200}, {"coord": 3, "sweep": 1, "curves": 3}
LR_FACTORS = [2.0**k for k in range(-4, 4)]  # the sweeps' grid: the base LR x 1/16 .. 8
EVERY = 10  # curves: the train loss is averaged over windows of this many steps


def resize(cfg: Config, axis: str, size: int) -> Config:
    """cfg at another width (heads grow, the head dim stays) or depth."""
    if axis == "depth":
        return dataclasses.replace(cfg, n_layer=size)
    if size % cfg.head_dim:
        raise UsageError(f"width {size} is not a multiple of the head dim {cfg.head_dim}")
    H = size // cfg.head_dim  # grouped-query attention keeps its ratio of query to kv heads
    G = None if cfg.n_kv_head is None else max(1, cfg.n_kv_head * H // cfg.n_head)
    return dataclasses.replace(cfg, d_model=size, n_head=H, n_kv_head=G)


def variant(cfg: Config, name: str) -> Config:
    """The config of a part's model. SP as GPT-2 and TP5 (Table 3, "SP") run it: every LR the
    same, logits unscaled (alpha_out 1), and the readout drawn like the other matrices (init)."""
    if name == "sp":
        return dataclasses.replace(cfg, param="sp", alpha_out=1.0)
    return dataclasses.replace(cfg, depth_base=cfg.n_layer) if name == "nodepth" else cfg


def init(cfg: Config, key: jax.Array) -> M.GPT:
    """model.init_gpt, but under SP the readout N(0, 1 / D) like every matrix, as GPT-2 (std 0.02
    at D = 768, openai/gpt-2 model.py) and PyTorch's default nn.Linear: model.py's SP keeps
    muP's zero readout, so that at the base shape muP is SP exactly."""
    gpt = params.init_gpt(cfg, key)
    if cfg.param != "sp" or cfg.tie_embeddings:
        return gpt
    z = jax.random.normal(jax.random.fold_in(key, 1), gpt.emb.unembed.shape)
    return eqx.tree_at(lambda g: g.emb.unembed, gpt, z / cfg.d_model**0.5)


def one_device_mesh() -> jax.sharding.Mesh:
    """The first device alone: the sweeps compare sizes and LRs, not speed, and JAX refuses
    activation_sizes' ordered callback on more than one."""
    return train.make_mesh(Config(mesh_replica=1), jax.devices()[:1])


# (name, mean |x|) of each tap of the forwards run by activation_sizes
_SEEN: list[tuple[str, float]] = []


def _record(name: str, x: jax.Array) -> None:
    """model.TAPS entry while activation_sizes runs: mean |x| to the host by an ordered callback
    from inside the jitted forward, so values arrive in the order the taps ran (inside lax.scan,
    the l-th "resid" is layer l's)."""
    mean = jnp.mean(jnp.abs(x))
    jax.debug.callback(lambda v: _SEEN.append((name, float(v))), mean, ordered=True)


@eqx.filter_jit
def _tapped_forward(gpt: M.GPT, tokens_T: jax.Array) -> jax.Array:
    return gpt(tokens_T)  # traced (once per shape) only with _record in model.TAPS


def activation_sizes(gpt: M.GPT, x_BT: np.ndarray) -> dict[str, float]:
    """Mean |x| of each tapped activation over the sequences x_BT: the last layer's residual
    stream ("resid"), the others averaged over layers."""
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
    # a value per call of the tap, averaged over the sequences
    per_call = {k: np.reshape(v, (len(x_BT), -1)).mean(axis=0) for k, v in seen.items()}
    return {k: float(v[-1] if k == "resid" else v.mean()) for k, v in per_call.items()}


def coord_check(cfg: Config, steps: int, seeds: int) -> dict[str, list[float]]:
    """Activation name -> mean |x| averaged over seeds after t = 0 .. steps steps on one fixed
    batch at the config's learning rate, constant (no warmup: step 1 moves at full LR)."""
    tokens = data.load_split(cfg, "train")
    x_BT, y_BT = data.get_batch(tokens, cfg.seed, data.TRAIN, 0, cfg.batch_size, cfg.block_size)
    batch = [a.reshape(cfg.grad_accum, cfg.microbatch_size, cfg.block_size) for a in (x_BT, y_BT)]
    cfg = dataclasses.replace(cfg, warmup_steps=0, min_lr=cfg.learning_rate, max_steps=steps)
    s = train.setup(cfg, one_device_mesh())  # its step is compiled once, used for every seed
    table = defaultdict(lambda: np.zeros(steps + 1))
    for seed in range(seeds):
        gpt = eqx.filter_shard(init(cfg, jax.random.key(seed)), s.model_sharding)
        opt_state = train.make_optimizer(cfg, params.policy_table(gpt, cfg)).init(
            eqx.filter(gpt, eqx.is_array))
        opt_state = eqx.filter_shard(opt_state, s.opt_sharding)
        for t in range(steps + 1):
            for name, v in activation_sizes(gpt, x_BT).items():
                table[name][t] += v / seeds
            if t < steps:
                gpt, opt_state, _ = s.step(gpt, opt_state, *batch)
    return {name: values.tolist() for name, values in table.items()}


def train_runs(cfg: Config, lrs: list[float], seeds: int, steps: int) -> tuple[np.ndarray, ...]:
    """The train loss of every step, shape (LRs, seeds, steps), and the validation loss after the
    last, (LRs, seeds): every run on the same batches, each seed its own initial model, the
    config's schedule compressed to `steps` steps (min_lr / learning_rate kept). One program
    vmapped over LRs and seeds: the LR reaches train.setup through the config as a tracer."""
    train_tokens, val_tokens = data.load_split(cfg, "train"), data.load_split(cfg, "val")
    G, B, T = cfg.grad_accum, cfg.microbatch_size, cfg.block_size
    xy = [data.get_batch(train_tokens, cfg.seed, data.TRAIN, s, cfg.batch_size, T)
          for s in range(steps)]
    val = [data.get_batch(val_tokens, cfg.seed, data.EVAL_VAL, i, B, T)
           for i in range(cfg.eval_batches)]
    mesh = one_device_mesh()
    x_SGBT, y_SGBT = (np.stack([b[i].reshape(G, B, T) for b in xy]) for i in (0, 1))
    # int32, as get_batch makes them: no int64 into the loss's VJP
    x_EBT, y_EBT = (jnp.asarray(np.stack([b[i] for b in val])) for i in (0, 1))
    warmup = round(cfg.warmup_steps * steps / cfg.max_steps)
    cfg = dataclasses.replace(cfg, max_steps=steps, warmup_steps=warmup)
    # The initial models, drawn outside the compiled program, stacked over seeds.
    models = [init(cfg, jax.random.key(cfg.seed + i)) for i in range(seeds)]
    arrays_0 = jax.tree.map(lambda *a: jnp.stack(a), *[eqx.filter(g, eqx.is_array) for g in models])
    static = eqx.filter(models[0], eqx.is_array, inverse=True)

    def run(lr, arrays):
        min_lr = lr * cfg.min_lr / cfg.learning_rate
        s = train.setup(dataclasses.replace(cfg, learning_rate=lr, min_lr=min_lr), mesh)

        def one_step(carry, batch):
            gpt, opt_state, metrics = s.step(*carry, *batch)
            return (gpt, opt_state), metrics["loss"]

        start = (eqx.combine(arrays, static), s.opt_state)
        (gpt, _), losses = jax.lax.scan(one_step, start, (x_SGBT, y_SGBT))
        loss = lambda x_BT, y_BT: train.objective(gpt, x_BT, y_BT, cfg)
        return losses, jax.vmap(loss)(x_EBT, y_EBT).mean()

    sweep = eqx.filter_jit(jax.vmap(jax.vmap(run, in_axes=(None, 0)), in_axes=(0, None)))
    return tuple(map(np.asarray, sweep(jnp.asarray(lrs, jnp.float32), arrays_0)))


def settings(cfg: Config) -> dict:
    """Each part's settings: what it trains, at which sizes, and its model's full config."""
    out = {}
    for part, (kind, axis, model) in PARTS.items():
        base = cfg.d_model if axis == "width" else cfg.n_layer
        sizes = [round(base * k) for k in SCALES[kind, axis]]
        lrs = [cfg.learning_rate * k for k in (LR_FACTORS if kind == "sweep" else [1])]
        config = json.loads(json.dumps(dataclasses.asdict(variant(cfg, model))))  # JSON's types
        out[part] = dict(kind=kind, axis=axis, model=model, sizes=sizes, steps=STEPS[kind],
                         seeds=SEEDS[kind], lrs=lrs, config=config)
    return out


def measure(s: dict, size: int):
    """One size of a part: what evidence.json records for it."""
    cfg = variant(resize(Config(**s["config"]), s["axis"], size), s["model"])  # nodepth: L again
    if s["kind"] == "coord":
        return coord_check(cfg, s["steps"], s["seeds"])
    loss, val = train_runs(cfg, s["lrs"], s["seeds"], s["steps"])
    if s["kind"] == "sweep":
        return [float(v) if np.isfinite(v) else None for v in val[:, 0]]
    windows = loss[0].reshape(s["seeds"], -1, EVERY).mean(axis=-1)  # (seeds, steps / EVERY)
    return {"train": windows.tolist(), "val": val[0].tolist()}


def open_out(text: str, new: dict) -> tuple[Path, dict]:
    """--out, checked before any training: a writable directory and its evidence.json ({} if
    none), which must be of these settings: others are refused, never overwritten."""
    out, path = Path(text), Path(text, "evidence.json")
    try:
        if not text or path.is_dir():
            raise IsADirectoryError(0, "empty" if not text else f"{path.name} is a directory")
        out.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out).close()  # a probe: made and removed
    except OSError as e:
        raise UsageError(f"--out={out if text else ''} cannot be written ({e.strerror or e}): "
                         "pick another directory") from None
    if not path.exists():
        return out, {}
    try:
        old = json.loads(path.read_text())
        differ = plots.differences(old["settings"], new)
        why = f"other settings ({', '.join(differ[:4])}{' ...' * (len(differ) > 4)} differ)"
        old["results"] = {p: {int(k): v for k, v in r.items()} for p, r in old["results"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not evidence's
        differ, why = True, "unrecorded settings"
    if differ:
        raise UsageError(f"--out={out} holds {path.name} of {why}: "
                         "pick another --out or delete the file")
    return out, old


def evidence(name: str, overrides: list[str], cfg: Config, out_text: str) -> None:
    """Every part, every size not yet in DIR/evidence.json; the files after each."""
    parts = settings(cfg)
    out, old = open_out(out_text, parts)
    results = old.get("results", {})
    todo = [(p, size) for p, s in parts.items() for size in s["sizes"]
            if size not in results.get(p, {})]
    print(f"{out}/evidence.json has these settings' results: {len(todo)} sizes left" * bool(old))
    # the code that measured: this process's, before any training (the file's if nothing is left)
    commit = rundir.git_state() if todo else {k: old[k] for k in ("commit", "dirty")}
    for part, size in todo + [(None, None)]:  # the last round writes every figure
        if part:
            results.setdefault(part, {})[size] = measure(parts[part], size)
        doc = {"config_name": name, "overrides": overrides, **commit, "settings": parts,
               "results": {p: dict(sorted(r.items())) for p, r in results.items()}}
        doc = json.loads(json.dumps(doc))  # sizes as strings, as a reread file has them
        for p in [part] if part else doc["results"]:
            plots.write(out, doc, p)
        plots.write_atomic(out / "evidence.json", lambda p: p.write_text(json.dumps(doc, indent=1)))
        if part:
            print(f"{part}, {parts[part]['axis']} {size}: done", flush=True)
    print(f"all parts done: {out}/README.md")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["evidence"])
    ap.add_argument("--config", default="shakespeare_char_cpu",
                    help=f"one of: {', '.join(configs.available())}")
    ap.add_argument("--out", required=True, help="output directory")
    args, overrides = ap.parse_known_args(argv)  # --config.FIELD=VALUE, as launch.py takes them

    def interrupted(*_):
        """Ctrl-C: one line and out at once (each file is written whole, plots.write_atomic);
        not a KeyboardInterrupt, for launch.interrupted's reasons."""
        sys.stdout.flush()
        print("error: interrupted; rerun the same command to continue", file=sys.stderr)
        os._exit(1)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        cfg = configs.apply_overrides(configs.load(args.config), overrides)
        # kernels=False: the taps are in model.py's functions, which a fused kernel would skip
        cfg = dataclasses.replace(cfg, mesh_replica=1, kernels=False)
        for s in settings(cfg).values():  # all before any training
            for size in s["sizes"]:
                resize(Config(**s["config"]), s["axis"], size).check(1)
        evidence(args.config, overrides, cfg, args.out)
    except (UsageError, RunError) as e:
        raise SystemExit(f"error: {e}")
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    main()
