"""muP's evidence, remade by one command (muP: Tensor Programs V, Yang et al. 2022, arXiv
2203.03466; its depth rules: CompleteP, Dey et al. 2025, arXiv 2505.01618):

    python mup.py evidence --out=docs/mup [--preset=cpu|gpu|tiny] [--seeds=3] [--parts=P,...]
        [--config=shakespeare_char_cpu] [--config.F=V]

Each part (PARTS) trains the real model (train.setup's step), on one device, at widths d_model x
the preset's scales (more heads, the head dim stays) or depths n_layer x its scales. Every part
runs --seeds seeds, each its own initial model and its own batch order. Coordinate checks (as
microsoft/mup's): mean |x_t| and mean |x_t - x_0| of each activation model.tap names, over a few
steps on one batch at COORD_LR x the config's LR, from a nonzero readout (flat in width under muP,
in depth under CompleteP). LR sweeps: the validation loss per LR and seed (muP's best LR should
stay put, SP's move; README.md says what the seeds resolve). Curves: the train loss at the base LR.
DIR/evidence.json holds the git commit (and whether the tree was dirty), the rules' fingerprint
(rules()), the draws (draws(): what the initial models, batches and one step give), each part's
settings (its full resolved config too) and results, written after each size: the same command
resumes; an --out of other settings, of other draws (drift()), or of files but no evidence.json,
is refused, and complete evidence of other draws is marked stale. README.md and the figures come
from the JSON (tools/plots.py), every claim there computed with its threshold."""
import argparse
import dataclasses
import json
import signal
import time

import equinox as eqx
import numpy as np

import configs
import model as M
import optimizers
import params
from tools import plots
from tools.sweeps import coord_check, train_runs
from run import interrupt, rundir
from configs import Config
from run.errors import ArgumentParser, RunError, UsageError

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
# the largest relative difference at which a recomputed coordinate check is still the same code's:
# float rounding on another CPU stays far below it, another initial draw or batch lands far above
DRIFT = 1e-3


@dataclasses.dataclass(frozen=True)
class Preset:
    """Sizes as multiples of the base, steps per kind, the LR grid (multiples of the base LR), the
    config's overrides, and how many LRs one program trains at once (memory, not results)."""
    scales: dict
    steps: dict
    lr_factors: list
    overrides: list
    lrs_per_program: int = 8


# cpu: sized for a 2-core CPU and 3 seeds (docs/mup.md says how long), so LR sweeps over
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


def rules(optimizer: str = "adamw") -> dict:
    """The rules' fingerprint: every policy row's multipliers and init std, the forward
    multipliers and the LR schedule at a reference shape where no factor is 1 (m = 4, d = 2), as
    the code computes them now for the evidence's optimizer (Muon's hidden rows are its own).
    evidence.json records it: a rule changed in params.py, model.py or optimizers.py's schedule
    makes the evidence stale (tests/test_mup.py)."""
    ref = Config(param="mup", d_model=128, n_head=4, d_base=32, n_layer=4, depth_base=2,
                 vocab_size=65, attn_tau=8.0, alpha_in=2.0, alpha_out=0.5, learning_rate=1e-2,
                 min_lr=1e-3, warmup_steps=4, max_steps=16, connections="mudd",
                 optimizer=optimizer)
    rows = {name: [p.init_std, p.init_mean, p.lr_mult, p.eps_mult, p.decay]
            for name, p in params.policy_rows(ref).items()}
    gpt = eqx.filter_eval_shape(M.GPT, ref)
    forward = {"alpha_in": gpt.alpha_in, "readout_mult": gpt.readout_mult,
               "branch_mult": float(gpt.blocks.branch_mult), "attn_scale": gpt.blocks.attn.scale}
    schedule = optimizers.lr_schedule(ref)
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


def draws(s: dict) -> dict:
    """The coordinate check `s` at the base width through its first step, every seed: what the
    initial models, the batches and one step give. evidence.json records it at its first run."""
    return measure({**s, "steps": 1}, s["config"]["d_model"])


def drift(doc: dict) -> float | None:
    """How far the current code is from the code that made `doc`: the largest relative difference
    between its draws (or, in evidence made before they were recorded, its coordinate check at
    the base width) and this code's. None where there is nothing to compare: no such result yet,
    or evidence made before seeds (its checks ran otherwise)."""
    s, done = doc["settings"].get("coord_width"), doc["results"].get("coord_width", {})
    base = s and s["config"]["d_model"]
    old = doc.get("draws") or done.get(base, done.get(str(base)))
    if "seeds" not in doc or old is None:
        return None
    new = draws(s)
    pairs = [(a, b) for kind in new for name, v in new[kind].items()
             for a, b in zip(v, old[kind][name]) if a or b]  # x_0 - x_0 is 0 in both
    return max(abs(a - b) / abs(b) if b else float("inf") for a, b in pairs)


def evidence(name: str, overrides: list[str], preset: str, seeds: int, out_text: str,
             now: tuple[str, ...] = tuple(PARTS)) -> None:
    """Every size of the parts `now` not yet in DIR/evidence.json; the files after each."""
    cfg = evidence_config(name, preset, overrides)
    parts, rules_now = settings(cfg, preset, seeds), rules(cfg.optimizer)
    out, old = plots.open_out(out_text, parts, rules_now)
    results = old.get("results", {})
    missing = [(p, size) for p, s in parts.items() for size in s["sizes"]
               if size not in results.get(p, {})]
    todo = [(p, size) for p, size in missing if p in now]
    print(f"{out}/evidence.json has these settings' results: {len(todo)} sizes left" * bool(old))
    # the code that measured: this process's, before any training (the file's if nothing is left);
    # a dirty tree is labelled in the JSON and the README
    commit = rundir.git_state() if todo else {k: old[k] for k in ("commit", "dirty")}
    # results of two codes' draws must not mix; complete evidence is marked stale in its README
    far = drift(old) if old else None
    drawn = old.get("draws") if old else "coord_width" in parts and draws(parts["coord_width"])
    stale = {"stale": {"drift": far, **rundir.git_state()}} if (far or 0) > DRIFT else {}
    if stale and todo:
        raise UsageError(f"--out={out} was made by other code: its coordinate check at the base "
                         f"width differs from this code's by {far:.1e} (the initial models, the "
                         "batches or the step changed): pick a new --out")
    start = time.monotonic()
    for done, (part, size) in enumerate(todo + [(None, None)]):  # the last writes every figure
        if part:
            print(f"[{done + 1}/{len(todo)}] {part}, {parts[part]['axis']} {size}: training "
                  f"{len(parts[part].get('lrs', [0]))} LR(s) x {seeds} seed(s)", flush=True)
            results.setdefault(part, {})[size] = measure(parts[part], size,
                                                         PRESETS[preset].lrs_per_program)
        doc = {"config_name": name, "overrides": overrides, "preset": preset, "seeds": seeds,
               **commit, **stale, **({"draws": drawn} if drawn else {}), "rules": rules_now,
               "settings": parts,
               "results": {p: dict(sorted(r.items())) for p, r in results.items()}}
        doc = json.loads(json.dumps(doc))  # sizes as strings, as a reread file has them
        # evidence.json first: a run stopped in between leaves a folder that open_out takes as ours
        plots.write_atomic(out / "evidence.json", lambda p: p.write_text(json.dumps(doc, indent=1)))
        for p in [part] if part else doc["results"]:
            plots.write(out, doc, p)
        if part:  # sizes differ in cost: the estimate is the mean so far times those left
            spent = time.monotonic() - start
            left = spent / (done + 1) * (len(todo) - done - 1)
            print(f"[{done + 1}/{len(todo)}] {part}, {parts[part]['axis']} {size}: done; "
                  f"{spent / 60:.1f} min so far, about {left / 60:.0f} min left", flush=True)
    later = len(missing) - len(todo)
    print(f"{later} sizes of other parts left (rerun without --parts): " * bool(later) +
          f"{'the parts asked' if later else 'all parts'} done: {out}/README.md")


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["evidence"])
    ap.add_argument("--config", default="shakespeare_char_cpu",
                    help=f"one of: {', '.join(configs.available())}")
    ap.add_argument("--preset", default="cpu", choices=list(PRESETS),
                    help="sizes, steps and LR grid (PRESETS)")
    ap.add_argument("--seeds", type=int, default=SEEDS, help="seeds per size and LR (>= 1)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="the parts to measure in this run (default all); the same --out and "
                         "command without --parts measure the others later")
    args, overrides = ap.parse_known_args(argv)  # --config.FIELD=VALUE, as launch.py takes them

    # each file is written whole (plots.write_atomic): out at once, and the same command goes on
    previous = interrupt.exit_on_signals("rerun the same command to continue")
    try:
        if args.seeds < 1:
            raise UsageError(f"--seeds={args.seeds}: at least 1 (3 or more for a spread)")
        now = tuple(args.parts.split(","))
        if unknown := [p for p in now if p not in PARTS]:
            raise UsageError(f"--parts: no part {unknown[0]!r}; the parts: {', '.join(PARTS)}")
        cfg = evidence_config(args.config, args.preset, overrides)
        for s in settings(cfg, args.preset, args.seeds).values():  # all before any training
            for size in s["sizes"]:
                resize(Config(**s["config"]), s["axis"], size).check(1)
        evidence(args.config, overrides, args.preset, args.seeds, args.out, now)
    except (UsageError, RunError) as e:
        raise SystemExit(f"error: {e}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    main()
