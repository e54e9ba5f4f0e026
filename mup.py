"""Checks that muP (Tensor Programs V, Yang et al. 2022, arXiv 2203.03466) does what it promises,
as numbers and plots. Both train the real model with the real train step (train.setup) at the
config's hyperparameters, on one device; a width w is d_model = w with n_head = w / head_dim.

    python mup.py coord --config=NAME --widths=64,128,256,512 --steps=5 --out=DIR
                        [--param=sp] [--depths=2,4,8] [--config.F=V]

trains each width (or, with --depths, each depth at the config's width) --steps steps on one fixed
batch at a constant LR, from 3 seeds, and records the mean |x| of every activation model.tap names
before each step and after the last. Under muP each stays the same size as the width grows:
DIR/coord_check.json holds each activation's fitted slopes of log2 mean|x| against log2 width, one
per step (index 0 = at init), and DIR/coord_check.png shows them (the "coordinate check" of TP5
and microsoft/mup).

    python mup.py transfer --config=NAME --widths=64,128,256 --lrs=1e-3,2e-3,4e-3 --steps=200
                           --out=DIR [--param=sp] [--config.F=V]

trains every (width, LR) pair on the same batches with the config's schedule compressed to --steps
steps, and writes the final validation loss after each width: DIR/lr_transfer.json (the grid and
the best LR per width) and DIR/lr_transfer.png. Under muP the best LR stays put as the width grows;
under SP it moves. The JSON files record their settings: results of other settings in DIR are
refused, never overwritten; transfer again with the same ones trains only the widths missing."""
import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import configs
import data
import model as M
import params
import plots
import train
from configs import Config, RunError, UsageError


def resize(cfg: Config, axis: str, size: int) -> Config:
    """cfg at another width (heads grow, the head dim stays) or depth."""
    if axis == "depth":
        return dataclasses.replace(cfg, n_layer=size)
    if size % cfg.head_dim:
        raise UsageError(f"width {size} is not a multiple of the head dim {cfg.head_dim} "
                         f"of {cfg.d_model}/{cfg.n_head}")
    return dataclasses.replace(cfg, d_model=size, n_head=size // cfg.head_dim)


def one_device_mesh() -> jax.sharding.Mesh:
    """The first device alone (of a GPU node, a TPU VM, a split CPU): the sweeps compare widths
    and LRs, not speed, and JAX refuses activation_sizes' ordered callback on more than one."""
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
    """Mean |x| of each tapped activation over the sequences x_BT: the residual stream per layer
    ("resid.0", ...), the others averaged over layers."""
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
    out = {}
    for name, values in seen.items():
        per_layer = np.reshape(values, (len(x_BT), -1)).mean(axis=0)  # a value per call of the tap
        out |= ({f"resid.{i}": v for i, v in enumerate(per_layer)} if name == "resid"
                else {name: per_layer.mean()})
    return out


def coord_check(cfg: Config, axis: str, sizes: list[int], steps: int,
                seeds: int = 3) -> dict[str, np.ndarray]:
    """Activation name -> mean |x| averaged over seeds, shape (len(sizes), steps + 1): column t
    after t steps on one fixed batch at the config's learning rate, constant (no warmup: step 1
    moves at full LR)."""
    mesh = one_device_mesh()
    tokens = data.load_split(cfg, "train")
    x_BT, y_BT = data.get_batch(tokens, cfg.seed, data.TRAIN, 0, cfg.batch_size, cfg.block_size)
    batch = [a.reshape(cfg.grad_accum, cfg.microbatch_size, cfg.block_size) for a in (x_BT, y_BT)]
    table = defaultdict(lambda: np.zeros((len(sizes), steps + 1)))
    for i, size in enumerate(sizes):
        c = dataclasses.replace(resize(cfg, axis, size), warmup_steps=0,
                                min_lr=cfg.learning_rate, max_steps=steps)
        s = train.setup(c, mesh)  # its step is compiled once per shape, used for every seed
        for seed in range(seeds):
            gpt = eqx.filter_shard(params.init_gpt(c, jax.random.key(seed)), s.model_sharding)
            optimizer = train.make_optimizer(c, params.policy_table(gpt, c))
            opt_state = optimizer.init(eqx.filter(gpt, eqx.is_array))
            opt_state = eqx.filter_shard(opt_state, s.opt_sharding)
            for t in range(steps + 1):
                sizes_t = activation_sizes(gpt, x_BT)
                if axis == "depth":  # the layers differ between depths: compare the last stream
                    kept = {k: v for k, v in sizes_t.items() if not k.startswith("resid.")}
                    sizes_t = kept | {"resid.last": sizes_t[f"resid.{c.n_layer - 1}"]}
                for name, v in sizes_t.items():
                    table[name][i, t] += v / seeds
                if t < steps:
                    gpt, opt_state, _ = s.step(gpt, opt_state, *batch)
    return dict(table)


def slopes(sizes: list[int], table: dict[str, np.ndarray]) -> dict[str, list[float | None]]:
    """Per activation and step, the least-squares slope of log2 mean|x| against log2 size; None
    where an activation is exactly 0 at some size (the logits at init: the readout starts at 0)."""
    fit = lambda y: float(np.polyfit(np.log2(sizes), np.log2(y), 1)[0]) if np.all(y > 0) else None
    return {name: [fit(col) for col in values.T] for name, values in table.items()}


def lr_sweep(cfg: Config, lrs: list[float], steps: int) -> np.ndarray:
    """Validation loss after `steps` steps at each learning rate, on the same batches, with the
    config's schedule compressed to `steps` steps (min_lr / learning_rate kept). One compiled
    program vmapped over the LRs: the LR reaches train.setup through the config as a tracer."""
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
    # The same initial model for every LR, drawn outside the compiled sweep.
    gpt0 = train.setup(cfg, mesh).model

    def final_loss(lr, gpt):
        min_lr = lr * cfg.min_lr / cfg.learning_rate
        s = train.setup(dataclasses.replace(cfg, learning_rate=lr, min_lr=min_lr), mesh)

        def one_step(carry, batch):
            gpt, opt_state, _ = s.step(*carry, *batch)
            return (gpt, opt_state), None

        (gpt, _), _ = jax.lax.scan(one_step, (gpt, s.opt_state), (x_SGBT, y_SGBT))
        loss = lambda x_BT, y_BT: train.loss_fn(gpt, x_BT, y_BT, cfg)
        return jax.vmap(loss)(x_EBT, y_EBT).mean()

    sweep = eqx.filter_jit(jax.vmap(final_loss, in_axes=(0, None)))
    return np.asarray(sweep(jnp.asarray(lrs, jnp.float32), gpt0))


def positive_list(flag: str, text: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag}={text} is not a comma-separated list of "
                         f"{kind.__name__}s") from None
    if not all(0 < v < float("inf") for v in values):  # nan fails the test too
        raise UsageError(f"{flag}={text}: every value must be positive and finite")
    if len(set(values)) < len(values):
        raise UsageError(f"{flag}={text} repeats a value")
    return values


def open_out(text: str, name: str, settings: dict) -> tuple[Path, dict]:
    """--out, checked before any training: a writable directory and its NAME.json ({} if none),
    which must be of these settings: results of others are refused, never overwritten."""
    out, path = Path(text), Path(text, f"{name}.json")
    try:
        if not text or path.is_dir() or path.with_suffix(".png").is_dir():
            why = "empty" if not text else f"{path.name} or its .png is a directory"
            raise IsADirectoryError(0, why)
        out.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out).close()  # a probe: made and removed
    except OSError as e:
        raise UsageError(f"--out={out if text else ''} cannot be written ({e.strerror or e}): "
                         "pick another directory") from None
    if not path.exists():
        return out, {}
    try:
        old = json.loads(path.read_text())
        keys = settings | old["settings"]
        differ = [k for k in keys if old["settings"].get(k) != settings.get(k)]
        why = f"other settings ({', '.join(differ[:4])} differ)"
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or no settings
        differ, why = True, "unrecorded settings (an older mup.py's)"
    if differ:
        raise UsageError(f"--out={out} holds {path.name} of {why}: "
                         "pick another --out or delete the file")
    return out, old


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """write(a temporary file beside path), then rename it to path: a run killed midway leaves the
    old file or the new one, never half of one."""
    # The suffix stays last: savefig picks the format from it.
    tmp = path.with_name(f".{path.stem}.{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise RunError(f"writing {path} failed ({e.strerror or e}); "
                       "the file is as it was") from None
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["coord", "transfer"])
    ap.add_argument("--config", required=True, help=f"one of: {', '.join(configs.available())}")
    ap.add_argument("--widths", help="comma-separated model widths (default 64,128,256,512)")
    ap.add_argument("--depths",
                    help="coord: comma-separated depths at the config's width, instead of widths")
    ap.add_argument("--lrs", help="transfer: comma-separated learning rates")
    ap.add_argument("--steps", type=int, default=5,
                    help="train steps (coord: a few; transfer: a few hundred)")
    ap.add_argument("--param", choices=["mup", "sp"], help="override the config's parametrization")
    ap.add_argument("--seeds", type=int, default=3, help="coord: seeds to average over")
    ap.add_argument("--out", required=True, help="output directory")
    args, overrides = ap.parse_known_args(argv)  # --config.FIELD=VALUE, as launch.py takes them
    transfer = args.command == "transfer"

    def interrupted(*_):
        """Ctrl-C: one line and out at once (the files are whole at any moment: write_atomic);
        not a KeyboardInterrupt, for launch.interrupted's reasons."""
        sys.stdout.flush()
        then = "continue" if transfer else "start again"
        print(f"error: interrupted; rerun the same command to {then}", file=sys.stderr)
        os._exit(1)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        cfg = configs.apply_overrides(configs.load(args.config), overrides)
        # kernels=False: the taps are in model.py's functions, which a fused kernel would skip
        cfg = dataclasses.replace(cfg, param=args.param or cfg.param, mesh_replica=1,
                                  kernels=False)
        for flag, value in (("--steps", args.steps), ("--seeds", args.seeds)):
            if value < 1:
                raise UsageError(f"{flag}={value} must be at least 1")
        if transfer and args.depths is not None:
            raise UsageError("--depths is for coord: transfer sweeps widths (--widths)")
        if args.widths is not None and args.depths is not None:
            raise UsageError("--widths and --depths both given: "
                             "coord sweeps one (depths at the config's width)")
        # The default is set here, not by argparse, so that --depths sees --widths unset.
        width_text = "64,128,256,512" if args.widths is None else args.widths
        axis, text = ("width", width_text) if args.depths is None else ("depth", args.depths)
        sizes = positive_list(f"--{axis}s", text, int)
        if len(sizes) < 2:
            raise UsageError(f"--{axis}s={text} needs at least two values to fit a slope")
        for size in sizes:  # all before any training: a bad one fails before the others train
            resize(cfg, axis, size).check(1)
        lrs = sorted(positive_list("--lrs", args.lrs, float)) if args.lrs else None
        if transfer and lrs is None:
            raise UsageError("transfer needs --lrs")
        if not transfer and lrs is not None:
            raise UsageError("--lrs is for transfer: coord trains at the config's LR")
        if lrs and lrs[-1] >= 3e38:
            raise UsageError(f"--lrs={args.lrs}: every LR must be finite in float32")
        # The config in JSON's types, to compare with a file's.
        config = json.loads(json.dumps(dataclasses.asdict(cfg)))
        sweep = {"lrs": lrs} if transfer else {"axis": axis, "sizes": sizes, "seeds": args.seeds}
        settings = {"config": args.config, "steps": args.steps, **sweep,
                    **{f"config.{k}": v for k, v in config.items()}}
        out, old = open_out(args.out, "lr_transfer" if transfer else "coord_check", settings)
        name = f"{args.config}, {cfg.param}"
        if not transfer:  # coord is short: results of the same settings are made again
            table = coord_check(cfg, axis, sizes, args.steps, args.seeds)
            fitted = slopes(sizes, table)
            title = f"{name}: mean |x| against {axis}, lr {cfg.learning_rate:g}"
            write_atomic(out / "coord_check.png",
                         lambda p: plots.coord(p, axis, sizes, table, title))
            result = json.dumps({"settings": settings, "slopes": fitted}, indent=1)
            write_atomic(out / "coord_check.json", lambda p: p.write_text(result))
            worst = max(abs(v) for s in fitted.values() for v in s[1:] if v is not None)
            print(f"largest |slope| after step 0: {worst:.3f}; "
                  f"wrote {out}/coord_check.json and .png")
            return
        # The file's results of these settings; a null loss (a diverged run) reads back as nan.
        old_rows = zip(old.get("widths", []), old.get("loss", []))
        loss = {w: np.array(row, float) for w, row in old_rows}
        best = lambda w: lrs[int(np.nanargmin(loss[w]))] if np.isfinite(loss[w]).any() else None
        title = f"{name}, {args.steps} steps"
        if done := [w for w in sizes if w in loss]:
            print(f"{out}/lr_transfer.json has these settings' results at width "
                  f"{', '.join(map(str, done))}: not trained again")
        # The files are rewritten after each width: they show progress, and a rerun resumes.
        for w in [w for w in sizes if w not in loss]:
            loss[w] = lr_sweep(resize(cfg, "width", w), lrs, args.steps)
            widths = sorted(loss)
            rows = [[float(v) if np.isfinite(v) else None for v in loss[x]] for x in widths]
            result = json.dumps({"settings": settings, "widths": widths, "loss": rows,
                                 "best_lr": {str(x): best(x) for x in widths}}, indent=1)
            write_atomic(out / "lr_transfer.png", lambda p: plots.transfer(p, loss, lrs, title))
            write_atomic(out / "lr_transfer.json", lambda p: p.write_text(result))
            if best(w):
                print(f"width {w}: best LR {best(w):g}, loss {np.nanmin(loss[w]):.4f}", flush=True)
            else:
                print(f"width {w}: every LR diverged (loss nan)", flush=True)
        best_lrs = {w: best(w) for w in sorted(loss)}
        print(f"best LR per width: {best_lrs}; results in {out}/lr_transfer.json and .png")
    except (UsageError, RunError) as e:
        raise SystemExit(f"error: {e}")
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    main()
