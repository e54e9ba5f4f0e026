"""muP's evidence, remade by one command (muP: Tensor Programs V, Yang et al. 2022, arXiv
2203.03466; its depth rules: CompleteP, Dey et al. 2025, arXiv 2505.01618):

    python mup.py evidence --out=docs/mup [--preset=cpu|gpu|tiny] [--seeds=3]
        [--config=shakespeare_char_cpu] [--config.F=V]

Each part (PARTS) trains the real model (train.setup's step), on one device, at widths d_model x
the preset's scales (more heads, the head dim stays) or depths n_layer x its scales. Every part
runs --seeds seeds, each its own initial model and its own batch order. Coordinate checks (as
microsoft/mup's): mean |x_t| and mean |x_t - x_0| of each activation model.tap names, over a few
steps on one batch at COORD_LR x the config's LR, from a nonzero readout (flat in width under muP,
in depth under CompleteP). LR sweeps: the validation loss per LR and seed (the best LR stays put
under muP, moves under SP and without the depth rules). Curves: the train loss at the base LR.
DIR/evidence.json holds the git commit (and whether the tree was dirty), the rules' fingerprint
(rules()), each part's settings (its full resolved config too) and results, written after each
size: the same command resumes; an --out of other settings is refused. README.md and the figures
come from the JSON (tools/plots.py), every claim there computed with its threshold."""
import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
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

# name: (what it measures, the axis it varies, the model). "sp" is SP as people run it, "spmodel"
# model.py's own param="sp" (muP at the base shape, every multiplier 1 elsewhere: what a user who
# turns muP off gets), "nodepth" muP with CompleteP's rules off (depth_base = n_layer at every depth).
PARTS = {"coord_width": ("coord", "width", "mup"), "coord_width_sp": ("coord", "width", "sp"),
         "coord_depth": ("coord", "depth", "mup"),
         "coord_depth_nodepth": ("coord", "depth", "nodepth"),
         "lr_width": ("sweep", "width", "mup"), "lr_depth": ("sweep", "depth", "mup"),
         "lr_depth_nodepth": ("sweep", "depth", "nodepth"), "lr_width_sp": ("sweep", "width", "sp"),
         "lr_width_spmodel": ("sweep", "width", "spmodel"), "curves": ("curves", "width", "mup")}
SEEDS = 3  # each optimum a mean +- sd, each drift a difference with its 95% interval
COORD_LR = 4.0  # coordinate checks at 4x the base LR: a larger LR shows a wrong rule sooner (mup)
COORD_READOUT = 1.0  # their readout N(0, 1 / d_base): model.py's zero would leave step 1 inert
READOUT = {"sp": 1.0}  # the training runs' readout at init (init): GPT-2's SP draws it, muP's is 0
COORD_SEQS = 4  # the batch's first sequences they read x_t on: x_0 is kept on the host until t


@dataclasses.dataclass(frozen=True)
class Preset:
    """Sizes as multiples of the base, steps per kind, the LR grid (multiples of the base LR), the
    config's overrides, and how many LRs one program trains at once (memory, not results)."""
    scales: dict
    steps: dict
    lr_factors: list
    overrides: list
    lrs_per_program: int = 8


# cpu: the whole fits a 2-core CPU in about an hour with 3 seeds (docs/mup.md), so LR sweeps over
# width stop at 2x, curves at 4x. gpu: widths 64 -> 2048 and depths 2 -> 64 around a base of width
# 256, 4 layers, 128 steps x 32 x 256 tokens (1M tokens a run), in bfloat16; 2 LRs x 3 seeds per
# program keep width 2048's parameters, Adam's moments and activations within an H100.
# tiny: the same code at toy sizes, for the CPU test of the whole command.
_GRID = [2.0**k for k in range(-4, 4)]  # the base LR x 1/16 .. 8
PRESETS = {
    "cpu": Preset(scales={("coord", "width"): [0.5, 1, 2, 4], ("coord", "depth"): [0.5, 1, 2, 4],
                          ("sweep", "width"): [0.5, 1, 2], ("sweep", "depth"): [0.5, 1, 2, 4],
                          ("curves", "width"): [0.5, 1, 2, 4]},
                  steps={"coord": 5, "sweep": 100, "curves": 200}, lr_factors=_GRID, overrides=[]),
    "gpu": Preset(scales={("coord", "width"): [0.25, 0.5, 1, 2, 4, 8],
                          ("coord", "depth"): [0.5, 1, 2, 4, 8, 16],
                          ("sweep", "width"): [0.25, 0.5, 1, 2, 4, 8],
                          ("sweep", "depth"): [0.5, 1, 2, 4, 8, 16],
                          ("curves", "width"): [0.25, 1, 4, 8]},
                  steps={"coord": 5, "sweep": 128, "curves": 128}, lr_factors=_GRID,
                  overrides=["--config.d_model=256", "--config.n_head=4", "--config.d_base=256",
                             "--config.attn_tau=8.0", "--config.block_size=256",
                             "--config.batch_size=32", "--config.compute_dtype=bfloat16"],
                  lrs_per_program=2),
    "tiny": Preset(scales={("coord", "width"): [0.5, 1], ("coord", "depth"): [0.5, 1],
                           ("sweep", "width"): [1, 2], ("sweep", "depth"): [0.5, 1],
                           ("curves", "width"): [0.5, 1]},
                   steps={"coord": 2, "sweep": 4, "curves": 20}, lr_factors=[0.5, 1.0, 2.0],
                   overrides=["--config.d_model=32", "--config.n_head=2", "--config.d_base=32",
                              "--config.n_layer=2", "--config.depth_base=2",
                              "--config.attn_tau=4.0", "--config.block_size=16",
                              "--config.batch_size=4", "--config.eval_batches=2"],
                   lrs_per_program=2),
}
EVERY = 10  # curves: the train loss is averaged over windows of this many steps


def evidence_config(name: str, preset: str, overrides: list[str]) -> Config:
    """The base config of an evidence run: the named config, the preset's overrides, the user's;
    one device and model.py's own functions (the taps are in them; a fused kernel skips them)."""
    cfg = configs.apply_overrides(configs.load(name), PRESETS[preset].overrides + overrides)
    return dataclasses.replace(cfg, mesh_replica=1, kernels=False)


def rules() -> dict:
    """The rules' fingerprint: every policy row's multipliers and init std, the forward
    multipliers and the LR schedule at a reference shape where no factor is 1 (m = 4, d = 2), as
    the code computes them now. evidence.json records it: a rule changed in params.py, model.py
    or train.py's schedule makes the evidence stale (tests/test_mup.py)."""
    ref = Config(param="mup", d_model=128, n_head=4, d_base=32, n_layer=4, depth_base=2,
                 vocab_size=65, attn_tau=8.0, alpha_in=2.0, alpha_out=0.5, learning_rate=1e-2,
                 min_lr=1e-3, warmup_steps=4, max_steps=16, connections="mudd")
    rows = {name: [p.init_std, p.init_mean, p.lr_mult, p.eps_mult, p.decay]
            for name, p in params.policy_rows(ref).items()}
    gpt = eqx.filter_eval_shape(M.GPT, ref)
    forward = {"alpha_in": gpt.alpha_in, "readout_mult": gpt.readout_mult,
               "branch_mult": float(gpt.blocks.branch_mult), "attn_scale": gpt.blocks.attn.scale}
    schedule = train.lr_schedule(ref)
    return {"rows": rows, "forward": forward,
            "lr": [round(float(schedule(t)), 9) for t in range(0, 17, 2)]}


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
    if name in ("sp", "spmodel"):  # spmodel: model.py's param="sp", alpha_out and readout kept
        return dataclasses.replace(cfg, param="sp", alpha_out=1.0 if name == "sp" else cfg.alpha_out)
    return dataclasses.replace(cfg, depth_base=cfg.n_layer) if name == "nodepth" else cfg


def init(cfg: Config, key: jax.Array, readout: float = 0.0) -> M.GPT:
    """model.init_gpt, but with the readout drawn N(0, readout^2 / (D / m)) (std 1 / sqrt(d_base)
    under muP, 1 / sqrt(D) under SP, at readout 1) where readout is not 0, model.py's zero init
    (at the base shape muP is model.py's SP exactly). SP as GPT-2 (std 0.02 at D = 768,
    openai/gpt-2 model.py) and PyTorch's nn.Linear draw it: READOUT["sp"] = 1."""
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
    cfg = dataclasses.replace(cfg, max_steps=steps, warmup_steps=warmup)
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
        loss = lambda x_BT, y_BT: train.objective(gpt, x_BT, y_BT, cfg)
        return losses, jax.vmap(loss)(x_EBT, y_EBT).mean()

    over_seeds = jax.vmap(run, in_axes=(None, 0, 0, 0))
    sweep = eqx.filter_jit(jax.vmap(over_seeds, in_axes=(0, None, None, None)))
    n, k = len(lrs), min(lrs_per_program or len(lrs), len(lrs))
    padded = list(lrs) + [lrs[-1]] * (-n % k)  # equal programs: one compilation; cut below
    out = [sweep(jnp.asarray(padded[i:i + k], jnp.float32), arrays_0, x_NSGBT, y_NSGBT)
           for i in range(0, n, k)]
    return tuple(np.concatenate([np.asarray(o[j]) for o in out])[:n] for j in (0, 1))


def settings(cfg: Config, preset: str = "cpu", seeds: int = SEEDS) -> dict:
    """Each part's settings: what it trains, at which sizes, from how many seeds (each its own
    initial model and batches), and its model's full config. Coordinate checks: at COORD_LR x the
    LR, from a readout COORD_READOUT, read on COORD_SEQS sequences."""
    pre, out = PRESETS[preset], {}
    for part, (kind, axis, model) in PARTS.items():
        base = cfg.d_model if axis == "width" else cfg.n_layer
        sizes = [round(base * k) for k in pre.scales[kind, axis]]
        factors = {"sweep": pre.lr_factors, "coord": [COORD_LR], "curves": [1]}[kind]
        config = json.loads(json.dumps(dataclasses.asdict(variant(cfg, model))))  # JSON's types
        out[part] = dict(kind=kind, axis=axis, model=model, sizes=sizes, steps=pre.steps[kind],
                         seeds=seeds, lrs=[cfg.learning_rate * k for k in factors],
                         batches="per seed", config=config)
        if kind == "coord":
            out[part].update(readout=COORD_READOUT, sequences=COORD_SEQS)
    return out


def measure(s: dict, size: int, lrs_per_program: int | None = None):
    """One size of a part: what evidence.json records for it."""
    cfg = variant(resize(Config(**s["config"]), s["axis"], size), s["model"])  # nodepth: L again
    if s["kind"] == "coord":
        cfg = dataclasses.replace(cfg, learning_rate=s["lrs"][0])
        return coord_check(cfg, s["steps"], s["seeds"], s["readout"], s["sequences"])
    loss, val = train_runs(cfg, s["lrs"], s["seeds"], s["steps"], lrs_per_program,
                           READOUT.get(s["model"], 0.0))
    if s["kind"] == "sweep":  # (seeds, LRs)
        return [[float(v) if np.isfinite(v) else None for v in row] for row in val.T]
    windows = loss[0].reshape(s["seeds"], -1, EVERY).mean(axis=-1)  # (seeds, steps / EVERY)
    return {"train": windows.tolist(), "val": val[0].tolist()}


def open_out(text: str, new: dict, rules_now: dict) -> tuple[Path, dict]:
    """--out, checked before any training: a writable directory and its evidence.json ({} if
    none), which must be of these settings and rules: others are refused, never overwritten."""
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
        differ = plots.differences(old["settings"], new) + ["rules"] * (old["rules"] != rules_now)
        why = f"other settings ({', '.join(differ[:4])}{' ...' * (len(differ) > 4)} differ)"
        old["results"] = {p: {int(k): v for k, v in r.items()} for p, r in old["results"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not evidence's
        differ, why = True, "unrecorded settings"
    if differ:
        raise UsageError(f"--out={out} holds {path.name} of {why}: "
                         "pick another --out or delete the file")
    return out, old


def evidence(name: str, overrides: list[str], preset: str, seeds: int, out_text: str) -> None:
    """Every part, every size not yet in DIR/evidence.json; the files after each."""
    parts, rules_now = settings(evidence_config(name, preset, overrides), preset, seeds), rules()
    out, old = open_out(out_text, parts, rules_now)
    results = old.get("results", {})
    todo = [(p, size) for p, s in parts.items() for size in s["sizes"]
            if size not in results.get(p, {})]
    print(f"{out}/evidence.json has these settings' results: {len(todo)} sizes left" * bool(old))
    # the code that measured: this process's, before any training (the file's if nothing is left);
    # a dirty tree is labelled in the JSON and the README
    commit = rundir.git_state() if todo else {k: old[k] for k in ("commit", "dirty")}
    start = time.monotonic()
    for done, (part, size) in enumerate(todo + [(None, None)]):  # the last writes every figure
        if part:
            print(f"[{done + 1}/{len(todo)}] {part}, {parts[part]['axis']} {size}: training "
                  f"{len(parts[part].get('lrs', [0]))} LR(s) x {seeds} seed(s)", flush=True)
            results.setdefault(part, {})[size] = measure(parts[part], size,
                                                         PRESETS[preset].lrs_per_program)
        doc = {"config_name": name, "overrides": overrides, "preset": preset, "seeds": seeds,
               **commit, "rules": rules_now, "settings": parts,
               "results": {p: dict(sorted(r.items())) for p, r in results.items()}}
        doc = json.loads(json.dumps(doc))  # sizes as strings, as a reread file has them
        for p in [part] if part else doc["results"]:
            plots.write(out, doc, p)
        plots.write_atomic(out / "evidence.json", lambda p: p.write_text(json.dumps(doc, indent=1)))
        if part:  # sizes differ in cost: the estimate is the mean so far times those left
            spent = time.monotonic() - start
            left = spent / (done + 1) * (len(todo) - done - 1)
            print(f"[{done + 1}/{len(todo)}] {part}, {parts[part]['axis']} {size}: done; "
                  f"{spent / 60:.1f} min so far, about {left / 60:.0f} min left", flush=True)
    print(f"all parts done: {out}/README.md")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["evidence"])
    ap.add_argument("--config", default="shakespeare_char_cpu",
                    help=f"one of: {', '.join(configs.available())}")
    ap.add_argument("--preset", default="cpu", choices=list(PRESETS),
                    help="sizes, steps and LR grid (PRESETS)")
    ap.add_argument("--seeds", type=int, default=SEEDS, help="seeds per size and LR (>= 1)")
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
        if args.seeds < 1:
            raise UsageError(f"--seeds={args.seeds}: at least 1 (3 or more for a spread)")
        cfg = evidence_config(args.config, args.preset, overrides)
        for s in settings(cfg, args.preset, args.seeds).values():  # all before any training
            for size in s["sizes"]:
                resize(Config(**s["config"]), s["axis"], size).check(1)
        evidence(args.config, overrides, args.preset, args.seeds, args.out)
    except (UsageError, RunError) as e:
        raise SystemExit(f"error: {e}")
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    main()
