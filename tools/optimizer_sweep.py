"""AdamW, Lion and Muon side by side, each at its own best learning rate (issue 44's comparison):

    python -m tools.optimizer_sweep --out=docs/optimizers_cpu [--steps=100] [--seeds=3]
        [--config=shakespeare_char_cpu] [--config.F=V ...]

For each optimizer, one LR sweep at the config's shape (tools/sweeps.train_runs: every LR and seed
in one vmapped program; seed i its own initial model and batch order, the same at every LR; the
config's schedule compressed to --steps). Its best LR is the grid point of the lowest mean
validation loss over seeds. At that LR: the validation loss (mean ± sd), its difference from
AdamW's with the 95% interval (Welch's t; a difference is claimed only when the interval excludes
0), and the steps each seed's train loss (averaged over windows of 10 steps) takes to reach the
target, the highest of the optimizers' final mean train losses (each optimizer reaches it on
average; a seed that does not is counted as never), with their difference from AdamW's and its
95% interval, claimed on the same rule (none when a seed never reaches the target).
OUT/optimizers.json holds every number, the settings, the commit and whether the tree was dirty;
OUT/README.md is made from it; `--remake` makes it again from the JSON, without training:

    python -m tools.optimizer_sweep --out=docs/optimizers_cpu --remake"""
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

import configs
from run import rundir
from run.errors import ArgumentParser, RunError, UsageError
from tools import plots, sweeps

# optimizer: its LR grid as multiples of the config's LR. Lion's sign update is larger than Adam's
# per coordinate: its best LR lies 3-10x lower (Chen et al. 2023, Sec. 5), so its grid sits 8x
# lower.
OPTIMIZERS = {"adamw": [2.0**k for k in range(-4, 4)], "lion": [2.0**k for k in range(-7, 1)],
              "muon": [2.0**k for k in range(-4, 4)]}
EVERY = 10  # steps per window of the train loss


def with_optimizer(cfg: configs.Config, name: str) -> configs.Config:
    """cfg trained by `name`, the other optimizers' fields (configs.ONLY_FOR) at their defaults:
    a config's Adam betas (shakespeare_char_cpu's beta1 0.8, shakespeare_char's beta2 0.99) are
    tuned for AdamW, and Config.check refuses them under Lion rather than leave them unused."""
    default = configs.Config()
    return dataclasses.replace(cfg, optimizer=name, **{
        field: getattr(default, field) for field, (choice, users) in configs.ONLY_FOR.items()
        if choice == "optimizer" and name not in users})


def sweep(cfg: configs.Config, factors: list[float], seeds: int, steps: int) -> dict:
    lrs = [cfg.learning_rate * f for f in factors]
    loss, val = sweeps.train_runs(cfg, lrs, seeds, steps)  # (LRs, seeds, steps), (LRs, seeds)
    val = np.where(np.isfinite(val), val, np.nan)
    best = int(np.nanargmin(np.nanmean(val, axis=1)))
    windows = loss[best].reshape(seeds, -1, EVERY).mean(axis=-1)  # (seeds, steps / EVERY)
    return {"lrs": lrs, "val": [[None if np.isnan(v) else float(v) for v in row] for row in val],
            "best": best, "train": windows.tolist()}


def steps_to(windows: list[list[float]], target: float) -> list[int | None]:
    """Per seed, the last step of the first window whose mean train loss is at most target."""
    return [next(((i + 1) * EVERY for i, v in enumerate(w) if v <= target), None) for w in windows]


def claim(d: float, h: float, steps: int) -> str:
    """What a difference from AdamW's loss (d, with its 95% half-width h) allows one to say."""
    if np.isnan(h):
        return "no claim against AdamW: one seed, no interval"
    if abs(d) <= h:
        return f"not distinguishable from AdamW at {steps} steps (the 95% interval includes 0)"
    better = "better" if d < 0 else "worse"
    return f"{better} than AdamW at {steps} steps (the 95% interval excludes 0)"


def steps_claim(base: list[int | None], reached: list[int | None]) -> tuple[str, str]:
    """The table's cell and the sentence for the steps to the target minus AdamW's (95%)."""
    if None in base or None in reached:  # "never" has no number: a mean over the rest would flatter
        return "", "no difference computed: a seed never reaches the target"
    d, h = plots.difference(base, reached)
    if np.isnan(h):
        return f"{d:+.1f}", f"{d:+.1f} against AdamW's: one seed, no interval"
    said = f"{d:+.1f} ± {h:.1f} against AdamW's (95% interval)"
    if abs(d) <= h:
        return plots.cell(d, h, 1), f"{said}: not resolved (the interval includes 0)"
    fewer = "fewer" if d < 0 else "more"
    return plots.cell(d, h, 1) + " (resolved)", f"{said}: {fewer} steps (the interval excludes 0)"


def readme(doc: dict) -> str:
    res, s = doc["results"], doc["settings"]
    finals = [np.mean([w[-1] for w in r["train"]]) for r in res.values()]
    target = float(max(finals))
    base = res["adamw"]["val"][res["adamw"]["best"]] if "adamw" in res else None  # per seed
    base_steps = steps_to(res["adamw"]["train"], target) if "adamw" in res else None
    lines = ["# AdamW, Lion and Muon at their best learning rates", "",
             f"Made by `{s['command']}` at commit {doc['commit'] or 'unknown (no git checkout)'}"
             + (" **with uncommitted changes**" if doc["dirty"] else "")
             + f"; {doc['minutes']:.0f} min on the machine that made it. Generated from "
             "optimizers.json: do not edit, rerun. How it is made: tools/optimizer_sweep.py.", "",
             f"Config `{' '.join([s['config'], *s['overrides']])}`, {s['steps']} steps (its "
             f"schedule compressed), {s['seeds']} seeds, each optimizer's LR grid 8 points a "
             f"factor 2 apart. Target train loss: {target:.3f} (the highest of the final means).",
             "", "| optimizer | best LR (grid point) | val loss | minus AdamW (95%) | "
             f"steps to train loss {target:.3f} | steps minus AdamW (95%) |",
             "|---|---|---|---|---|---|"]
    claims = []
    for name, r in res.items():
        i, n = r["best"], len(r["lrs"])
        val = r["val"][i]
        edge = " (grid edge)" if i in (0, n - 1) else ""
        cells = [name, f"{r['lrs'][i]:.3g} ({i}/{n - 1}){edge}", plots.cell(*plots.mean_sd(val), 3)]
        if base is None or name == "adamw":
            cells.append("")
        else:
            d, h = plots.difference(base, val)
            cells.append(plots.cell(d, h, 3) + (" (resolved)" if abs(d) > h else ""))
            claims.append(f"- {name}: {claim(d, h, s['steps'])}" + (
                "; its best LR is at the grid's edge: the optimum may lie beyond" if edge else ""))
        reached = steps_to(r["train"], target)
        cells.append(plots.cell(*plots.mean_sd(reached), 0)
                     + (f" ({reached.count(None)} seed(s) never)" if None in reached else ""))
        if base is None or name == "adamw":
            cells.append("")
        else:
            cell, said = steps_claim(base_steps, reached)
            cells.append(cell)
            claims.append(f"- {name}, steps to the target: {said}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + claims) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="shakespeare_char_cpu")
    ap.add_argument("--steps", type=int, default=100, help=f"a multiple of {EVERY}")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--remake", action="store_true",
                    help="OUT/README.md made again from OUT/optimizers.json; nothing trains")
    args, overrides = ap.parse_known_args(argv)
    if args.remake:
        remake(Path(args.out))
        return
    try:
        names = args.optimizers.split(",")
        if unknown := [n for n in names if n not in OPTIMIZERS]:
            raise UsageError(f"--optimizers: unknown {unknown[0]!r}; one of "
                             f"{', '.join(OPTIMIZERS)}")
        if args.steps <= 0 or args.steps % EVERY or args.seeds < 1:
            raise UsageError(f"--steps={args.steps} must be a positive multiple of {EVERY} and "
                             f"--seeds={args.seeds} at least 1")
        cfg = dataclasses.replace(configs.apply_overrides(configs.load(args.config), overrides),
                                  mesh_replica=1)
        cfgs = {n: with_optimizer(cfg, n) for n in names}  # all checked before any training
        for cfg in cfgs.values():
            cfg.check(1)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        state, start, results = rundir.git_state(), time.monotonic(), {}
        for n, cfg in cfgs.items():
            print(f"{n}: {len(OPTIMIZERS[n])} LRs x {args.seeds} seeds, {args.steps} steps",
                  flush=True)
            results[n] = sweep(cfg, OPTIMIZERS[n], args.seeds, args.steps)
        shown = ["--out=DIR" if a.startswith("--out") else a for a in argv or []]  # no paths
        command = " ".join(["python -m tools.optimizer_sweep", *shown])
        doc = {"commit": state["commit"], "dirty": state["dirty"],
               "minutes": (time.monotonic() - start) / 60,
               "settings": {"command": command, "config": args.config, "overrides": overrides,
                            "steps": args.steps, "seeds": args.seeds},
               "results": results}
        (out / "optimizers.json").write_text(json.dumps(doc, indent=1))
        (out / "README.md").write_text(readme(doc))
        print(readme(doc))
    except (UsageError, RunError) as e:
        raise SystemExit(f"error: {e}")


def remake(out: Path) -> None:
    """OUT/README.md from OUT/optimizers.json (after a change of wording here)."""
    try:
        doc = json.loads((out / "optimizers.json").read_text())
        (out / "README.md").write_text(readme(doc))
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {out}/optimizers.json: {getattr(e, 'strerror', None) or e}: "
                         "pass a folder that tools.optimizer_sweep wrote")
    print(f"{out}/README.md remade from optimizers.json")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
