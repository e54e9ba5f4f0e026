"""The report of mup.py's evidence, made from evidence.json alone: a figure per part (matplotlib)
and README.md, whose every number is read from the JSON and whose every claim is printed only when
its numbers pass the threshold stated beside it: a 95% interval over seeds for the drifts and the
loss comparisons; one sd over seeds for "Wider is better?" (each wider width's mean against the
narrower's, by the larger of their sds), a weaker test, said in its section. Each file written
whole. Evidence made before seeds (no "seeds" key) is read too; its README says what it lacks.
open_out checks the folder before mup.py trains for it."""
import copy
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from run.errors import ArgumentParser, RunError, UsageError

TITLES = {"mup": "muP + CompleteP", "sp": "SP", "spmodel": "model.py's SP",
          "nodepth": "muP, depth rules off"}


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def slopes(sizes: list[int], table: dict[str, np.ndarray]) -> dict[str, list[float | None]]:
    """Per activation (table: name -> (sizes, steps + 1)) and step, the least-squares slope of
    log2 mean|x| against log2 size; None where an activation is 0 at some size (muP's logits at
    init: the readout starts at 0)."""
    fit = lambda y: float(np.polyfit(np.log2(sizes), np.log2(y), 1)[0]) if np.all(y > 0) else None
    return {name: [fit(col) for col in np.asarray(v).T] for name, v in table.items()}


def coord(path: Path, axis: str, sizes: list[int], table: dict[str, np.ndarray],
          title: str) -> None:
    """One panel per activation: mean |x| against size, log-log, a line per step."""
    plt = pyplot()
    cols = 4
    rows = -(-len(table) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    colors = plt.cm.viridis(np.linspace(0, 0.9, next(iter(table.values())).shape[1]))
    for ax, (name, values) in zip(axes.flat, table.items()):
        for t, color in enumerate(colors):
            if np.all(values[:, t] > 0):
                ax.plot(sizes, values[:, t], "o-", color=color, ms=3, label=f"step {t}")
        # y spans at least 4 times the sizes' ratio, centred on the data, so that a slope's angle
        # reads the same in every panel
        positive = values[values > 0]
        mid = np.sqrt(positive.min() * positive.max())
        span = max(positive.max() / positive.min(), 4 * sizes[-1] / sizes[0])
        ax.set(xscale="log", yscale="log", title=name, ylim=(mid / span**0.5, mid * span**0.5))
        ax.set_xticks(sizes, [str(s) for s in sizes], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.minorticks_off()
    for ax in axes.flat[len(table):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel(axis), fig.supylabel("mean |x|"), fig.suptitle(title)
    save(fig, path)


def transfer(path: Path, axis: str, loss: dict[int, np.ndarray], lrs: list[float],
             title: str) -> None:
    """Final loss against log2 LR (loss: size -> a loss per LR), a curve per size, each optimum
    marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(loss)))
    log_lr = np.log2(lrs)
    for (size, row), color in zip(sorted(loss.items()), colors):
        ax.plot(log_lr, row, "o-", color=color, ms=3, label=f"{axis} {size}")
        if np.isfinite(row).any():
            best = np.nanargmin(row)
            ax.plot(log_lr[best], row[best], "*", color=color, ms=14, markeredgecolor="k")
    # Diverged runs (nan) are left out; the y range is the region around the optimum.
    finite = np.array([v for row in loss.values() for v in row if np.isfinite(v)])
    if finite.size:
        ax.set_ylim(finite.min() - 0.05, min(finite.max(), finite.min() + 0.6) + 0.05)
    ax.set_xticks(log_lr, [f"{lr:.2g}" for lr in lrs], fontsize=8)
    ax.set(xlabel="learning rate (log2 scale)", ylabel="final validation loss", title=title)
    ax.legend(fontsize=8)
    save(fig, path)


def curves(path: Path, steps: np.ndarray, train: dict[int, np.ndarray], title: str) -> None:
    """Train loss against step (train: width -> (seeds, windows)), the mean over seeds and its
    band of +- one standard deviation, a curve per width."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(train)))
    for (w, loss), color in zip(sorted(train.items()), colors):
        mean, std = loss.mean(axis=0), loss.std(axis=0)
        ax.plot(steps, mean, color=color, label=f"width {w}")
        ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.3)
    ax.set(xlabel="step", ylabel="train loss (window mean)", title=title, yscale="log")
    ax.legend(fontsize=8)
    save(fig, path)


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    pyplot().close(fig)


def upgrade(doc: dict) -> dict:
    """Evidence made before seeds (no "seeds" key: one seed per LR, coordinate checks of |x_t|
    alone) in today's form: a sweep's row per seed, a coordinate check's {"x": ...}."""
    if "seeds" in doc:
        return doc
    doc = copy.deepcopy(doc)
    for part, s in doc["settings"].items():
        wrap = {"sweep": lambda r: [r], "coord": lambda r: {"x": r}}.get(s["kind"], lambda r: r)
        doc["results"][part] = {k: wrap(r) for k, r in doc["results"].get(part, {}).items()}
    return doc


def tables(doc: dict, part: str) -> tuple[dict, list[int]]:
    """A part's results and the sizes done, in order."""
    results = {int(k): v for k, v in doc["results"].get(part, {}).items()}
    return results, sorted(results)


def coord_table(doc: dict, part: str, kind: str = "x") -> tuple[list[int], dict[str, np.ndarray]]:
    """kind "x": mean |x_t|, "dx": mean |x_t - x_0| (none in evidence made before seeds)."""
    results, sizes = tables(doc, part)
    if not sizes or kind not in results[sizes[0]]:
        return [], {}
    names = results[sizes[0]][kind]
    return sizes, {n: np.array([results[s][kind][n] for s in sizes]) for n in names}


def mean_sd(values) -> tuple[float, float]:
    """The mean and the sample standard deviation (nan for one value; both nan for none)."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if not v.size:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else float("nan")


def difference(a, b) -> tuple[float, float]:
    """mean(b) - mean(a) and the half-width of its 95% interval (Welch's t; nan with fewer than
    two values on either side): two independent sets of seeds."""
    a, b = (np.asarray([x for x in v if x is not None], dtype=float) for v in (a, b))
    if not (a.size and b.size):
        return float("nan"), float("nan")
    d = float(b.mean() - a.mean())
    if min(a.size, b.size) < 2:
        return d, float("nan")
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    if va + vb == 0:
        return d, 0.0
    from scipy import stats
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    return d, float(stats.t.ppf(0.975, df) * np.sqrt(va + vb))


def paired(a, b) -> tuple[float, float, float]:
    """The mean of b - a seed by seed (a[i] and b[i] of one seed: one model read twice), its sample
    sd and the half-width of its 95% interval (t with n - 1 degrees of freedom); sd and half-width
    nan for one seed. Pairing removes the seed's own level, which Welch's t would count as noise."""
    d = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    if d.size < 2:
        return float(d.mean()), float("nan"), float("nan")
    from scipy import stats
    sd = float(d.std(ddof=1))
    return float(d.mean()), sd, float(stats.t.ppf(0.975, d.size - 1) * sd / np.sqrt(d.size))


def cell(mean: float, sd: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f}" + ("" if np.isnan(sd) else f" ± {sd:.{digits}f}")


def optimum(row) -> float | None:
    """The best LR's place on the grid between grid points: the vertex of the parabola through
    the best point and its two neighbours, in grid steps (a factor 2 of LR each). A grid point
    alone moves by whole steps, too coarse to see a drift of one step over 8x depth. At the
    grid's edge, the edge (the optimum may lie beyond); None: every LR diverged."""
    row = np.array([np.nan if v is None else v for v in row], dtype=float)
    if not np.isfinite(row).any():
        return None
    i = int(np.nanargmin(row))
    if i in (0, len(row) - 1) or not np.isfinite(row[i - 1:i + 2]).all():
        return float(i)
    left, mid, right = row[i - 1:i + 2]
    return i + 0.5 * (left - right) / (left - 2 * mid + right)


def wider_is_better(doc: dict) -> tuple[int, list[tuple[int, list, list, bool, bool]]]:
    """The steps in a window, and per window after warmup: (its last step, the mean loss per
    width, its seed sd, whether each wider width is never worse beyond 1 sd (its mean at most the
    narrower's plus the larger of their sds), whether each is better beyond 1 sd (its mean below
    the narrower's minus the larger sd))."""
    s = doc["settings"].get("curves")
    results, sizes = tables(doc, "curves")
    if not s or len(sizes) < 2:
        return 0, []
    train = np.array([results[w]["train"] for w in sizes])  # (widths, seeds, windows)
    mean = train.mean(axis=1)
    std = train.std(axis=1, ddof=1) if train.shape[1] > 1 else np.zeros_like(mean)
    warmup = round(s["config"]["warmup_steps"] * s["steps"] / s["config"]["max_steps"])
    every = s["steps"] // train.shape[-1]
    rows = []
    for i in range(train.shape[-1]):
        if i * every < warmup:  # the window starts inside warmup
            continue
        noise = np.maximum(std[1:, i], std[:-1, i])
        gap = mean[:-1, i] - mean[1:, i]  # > 0: the wider is lower
        rows.append(((i + 1) * every, mean[:, i].tolist(), std[:, i].tolist(),
                     bool(np.all(gap >= -noise)), bool(np.all(gap > noise))))
    return every, rows


def sweep_stats(doc: dict, part: str) -> dict[int, dict]:
    """Per size: each seed's optimum (grid steps, plots.optimum) and its best loss."""
    out = {}
    for size, rows in tables(doc, part)[0].items():
        arr = [np.array([np.nan if v is None else v for v in r], dtype=float) for r in rows]
        out[size] = {"place": [optimum(r) for r in rows],
                     "loss": [float(np.nanmin(r)) if np.isfinite(r).any() else None for r in arr],
                     "rows": arr}
    return out


def drift_claim(title: str, axis: str, sizes: list[int], stats: dict, seeds: int,
                n_lrs: int) -> str:
    """The optimum's drift from the smallest size to the largest, and the claim its 95% interval
    allows: stays (within one grid step, a factor 2 of LR), moves, or not resolved. None when an
    optimum lies at the grid's edge (it may lie beyond) or every LR diverged."""
    first, last = stats[sizes[0]]["place"], stats[sizes[-1]]["place"]
    span = f"over {sizes[-1] / sizes[0]:g}x {axis} ({sizes[0]} -> {sizes[-1]})"
    if any(p is None or p in (0, n_lrs - 1) for p in first + last):
        return (f"- {title}: an optimum {span} lies at the grid's edge (or every LR diverged): "
                "not bracketed, so no claim about its drift.")
    d, h = difference(first, last)
    if seeds < 2 or np.isnan(h):
        return (f"- {title}: drift {d:+.2f} grid steps {span}; one seed per LR; no spread: "
                "no interval, so no claim that the optimum stays or moves.")
    said = f"drift {d:+.2f} ± {h:.2f} grid steps (95% interval)"
    if abs(d) + h < 1:
        return f"- {title}: the optimum stays (moves by less than one grid step) {span}: {said}."
    if abs(d) - h >= 1:
        return f"- {title}: the optimum moves (by one grid step or more) {span}: {said}."
    if abs(d) - h > 0:
        return (f"- {title}: the optimum moves {span} ({said}: the interval excludes 0), "
                "by less than one grid step or more: not resolved.")
    return f"- {title}: not resolved {span}: {said} reaches past one grid step."


# The width sweeps compared with muP's: (part, name, what it is)
CONTROLS = [("lr_width_sp", "SP", "SP here is GPT-2's (every LR the same, alpha_out 1, the readout "
             "drawn N(0, 1/D)): it differs from muP even at the base width."),
            ("lr_width_spmodel", "model.py's SP", "model.py's SP is `--config.param=sp` (every "
             "multiplier 1, alpha_out and the zero readout kept): what a user who turns muP off "
             "trains. At the base width it is muP, the same runs.")]


def sp_against_mup(doc: dict, st: dict) -> list[str]:
    """For each SP control that was run: where its best loss is lower than muP's (per swept width),
    and the user's comparison: the largest width trained at the LR that is best at the base width
    (each model's own), muP against it."""
    lines = []
    for part, name, what in CONTROLS:
        lines += against_mup(doc, st, part, name, what)
    return lines


def depth_rules_against_off(doc: dict) -> list[str]:
    """Per depth, the best loss with CompleteP's depth rules minus the best loss without them, and
    where either is lower beyond the 95% interval: the rules may cost loss at some depths."""
    on, off = sweep_stats(doc, "lr_depth"), sweep_stats(doc, "lr_depth_nodepth")
    depths = sorted(set(on) & set(off))
    if len(depths) < 2:
        return []
    lines = ["### The depth rules against none over depth", "",
             "Best loss over the grid, muP + CompleteP minus muP with the depth rules off (a "
             "difference counts only when its 95% interval excludes 0; at the base depth the two "
             "are the same runs):", ""]
    lower, spread = {"the rules": [], "no rules": []}, []
    for n in depths:
        d, h = difference(off[n]["loss"], on[n]["loss"])
        lines.append(f"- depth {n}: with the rules {cell(*mean_sd(on[n]['loss']), 3)}, without "
                     f"{cell(*mean_sd(off[n]['loss']), 3)}, difference {cell(d, h, 3)}")
        spread.append(not np.isnan(h))
        if abs(d) > h:  # False for nan: one seed
            lower["the rules" if d < 0 else "no rules"].append(str(n))
    if not any(spread):
        lines += ["", "One seed per LR; no spread: no claim either way.", ""]
    else:
        said = "; ".join(f"{who} at depth {', '.join(at)}" for who, at in lower.items() if at)
        lines += ["", f"Lower beyond the 95% interval: {said or 'neither, at any depth'}.", ""]
    return lines


def against_mup(doc: dict, st: dict, part: str, name: str, what: str) -> list[str]:
    mup, sp = sweep_stats(doc, "lr_width"), sweep_stats(doc, part)
    widths = sorted(set(mup) & set(sp))  # none: a part not run
    if not widths:
        return []
    seeds = min(len(mup[widths[0]]["loss"]), len(sp[widths[0]]["loss"]))
    lines = [f"### {name} against muP over width", "",
             f"{what} Best loss over the grid, muP minus {name} (a difference counts only when "
             "its 95% interval excludes 0):", ""]
    lower, resolved = [], []
    for w in widths:
        d, h = difference(sp[w]["loss"], mup[w]["loss"])
        lines.append(f"- width {w}: muP {cell(*mean_sd(mup[w]['loss']), 3)}, "
                     f"{name} {cell(*mean_sd(sp[w]['loss']), 3)}, muP - {name} {cell(d, h, 3)}")
        lower.append(name if d > 0 else "muP" if d < 0 else "neither")
        resolved.append(abs(d) > h)  # False for nan: one seed
    lines.append("")
    for who in (name, "muP"):
        if seeds < 2 and all(x == who for x in lower):
            lines.append(f"{who} has the lower loss at every swept width (one seed per LR; no "
                         "spread).")
        elif all(x == who for x in lower):
            beyond = ", ".join(str(w) for w, r in zip(widths, resolved) if r) or "none"
            if all(resolved):
                beyond = "every one"
            lines.append(f"{who} has the lower mean loss at every swept width; beyond the 95% "
                         f"interval at: {beyond}.")
    if len(set(lower)) > 1:
        # each side named only where it has a width: "X at widths none" says nothing
        at = {who: ", ".join(str(w) for w, x in zip(widths, lower) if x == who)
              for who in (name, "muP", "neither")}
        sides = [f"{who} at width{'s' * (',' in at[who])} {at[who]}" for who in (name, "muP")
                 if at[who]]
        sides += [f"equal at {at['neither']}"] * bool(at["neither"])
        beyond = ", ".join(f"{w} ({x})" for w, x, r in zip(widths, lower, resolved) if r) or "none"
        lines.append(f"The lower mean loss: {'; '.join(sides)}; beyond the 95% interval at: "
                     f"{beyond}.")
    base, top = st["lr_width"]["config"]["d_model"], widths[-1]
    lrs = st["lr_width"]["lrs"]
    if base in widths and top != base:
        picks = {}
        for who, stats in (("muP", mup), (name, sp)):
            # the mean over seeds; an LR where any seed diverged counts as diverged
            i = int(np.nanargmin(np.stack(stats[base]["rows"]).mean(axis=0)))
            picks[who] = (lrs[i], [float(r[i]) if np.isfinite(r[i]) else None
                                   for r in stats[top]["rows"]])
        d, h = difference(picks[name][1], picks["muP"][1])
        if seeds < 2 or np.isnan(h):
            verdict = "one seed per LR; no spread: no claim which is better"
        elif abs(d) <= h:
            verdict = "the 95% interval includes 0: neither is better"
        else:
            verdict = f"{name if d > 0 else 'muP'} is better (the 95% interval excludes 0)"
        lines += ["", f"Tuned at the base width {base} and trained at width {top} with the LR "
                  f"best at {base} (the grid point of the lowest mean loss): muP "
                  f"{cell(*mean_sd(picks['muP'][1]), 3)} at LR {picks['muP'][0]:.3g}, {name} "
                  f"{cell(*mean_sd(picks[name][1]), 3)} at LR {picks[name][0]:.3g}; muP - {name} "
                  f"{cell(d, h, 3)}: {verdict}."]
    return lines + [""]


def coord_rows(doc: dict, st: dict) -> list[str]:
    lines = []
    for part in (p for p in st if st[p]["kind"] == "coord"):
        s, cells = st[part], []
        for kind in ("x", "dx"):
            sizes, table = coord_table(doc, part, kind)
            fitted = [(abs(v), n, t) for n, vs in slopes(sizes, table).items()
                      for t, v in enumerate(vs) if t and v is not None] if len(sizes) > 1 else []
            cells.append("{:.3f} ({}, step {})".format(*max(fitted)) if fitted else
                         "not measured" if kind not in doc["results"].get(part, {}).get(
                             str(s["sizes"][0]), {"x": 0}) else "")
        readout = "zero" if not s.get("readout") and s["model"] != "sp" else "N(0, 1/(D/m))"
        lines.append(f"| {part} | {TITLES[s['model']]} | {s['axis']} "
                     f"{','.join(map(str, s['sizes']))} | {s['steps']} x {s['seeds']} | "
                     f"{s['lrs'][0]:.3g} | {readout} | {cells[0]} | {cells[1]} |")
    return lines


def readme(doc: dict) -> str:
    """DIR/README.md: every number from the JSON, every claim computed with its threshold."""
    legacy, doc = "seeds" not in doc, upgrade(doc)
    st = doc["settings"]
    preset = f" --preset={doc['preset']}" if doc.get("preset", "cpu") != "cpu" else ""
    seeds = f" --seeds={doc['seeds']}" if doc.get("seeds", 3) != 3 else ""
    lines = [f"# muP evidence: {doc['config_name']}", "",
             f"Made by `python mup.py evidence --out=DIR{preset}{seeds} "
             f"--config={doc['config_name']}{''.join(' ' + o for o in doc['overrides'])}` at "
             f"commit {doc['commit'] or 'unknown (not made in a git checkout)'}. Generated from "
             "evidence.json, which holds each part's full settings: do not edit, rerun. Method "
             "and reading: the repository's docs/mup.md.", ""]
    if doc["dirty"]:
        lines += ["**Made from a tree with uncommitted changes: the commit alone does not "
                  "reproduce it.**", ""]
    if stale := doc.get("stale"):
        dirty = " with uncommitted changes" * bool(stale["dirty"])
        lines += [f"**Stale: the code at commit {stale['commit'] or 'unknown'}{dirty} draws or "
                  "steps otherwise.** Its coordinate check at the base width differs from this "
                  f"one by {stale['drift']:.1e} (relative): the initial models, the batches or the "
                  "step changed after this was made. The numbers below are the code's of the "
                  "commit above; remake with the command above and a new --out.", ""]
    if legacy:
        lines += ["**Made before seeds: one seed per LR; no spread.** Each LR sweep ran one "
                  "initial model on one batch order, so no optimum below has an error bar and no "
                  "drift an interval; the coordinate checks measured |x_t| alone, at the training "
                  "LR, from a zero readout under muP; the curves' seeds shared their batches. "
                  "Remake with the command above (3 seeds) for the claims with intervals.", ""]
    done = sum(len(doc["results"].get(p, {})) for p in st)
    if done < (total := sum(len(st[p]["sizes"]) for p in st)):
        lines += [f"**Incomplete: {done} of {total} sizes measured.** Rerun the command to finish "
                  "(it resumes).", ""]
    lines += ["## Coordinate checks", "",
              "Least-squares slope of log2 mean|x_t| and of log2 mean|x_t - x_0| against log2 "
              "size, the largest over activations and steps after step 0; |slope| near 0 is flat.",
              "", "| part | model | sizes | steps x seeds | LR | readout at init | "
              "largest \\|slope\\|, \\|x_t\\| | largest \\|slope\\|, \\|x_t - x_0\\| |",
              "|---|---|---|---|---|---|---|---|"] + coord_rows(doc, st)
    lines += ["", "## Learning-rate sweeps", "",
              "Per size: the best LR's place on the grid (0 = the first LR below; between grid "
              "points, plots.optimum: the parabola through the best LR and its neighbours), mean "
              "± sd over seeds, the LR there, and the best validation loss, mean ± sd. Drift: "
              "the "
              "largest size's place minus the smallest's, with its 95% interval (Welch's t over "
              "seeds). The optimum is said to stay when that interval lies within ±1 grid step (a "
              "factor 2 in LR), to move when it lies beyond.", ""]
    for axis in ("width", "depth"):
        parts = [p for p in st if st[p]["kind"] == "sweep" and st[p]["axis"] == axis]
        if not parts:
            continue
        lrs = st[parts[0]]["lrs"]
        lines += [f"Grid: {', '.join(f'{lr:.3g}' for lr in lrs)}; {st[parts[0]]['steps']} steps; "
                  f"{st[parts[0]]['seeds']} seed(s).",
                  "", f"| {axis} | " + " | ".join(TITLES[st[p]["model"]] for p in parts) + " |",
                  "|---|" + "---|" * len(parts)]
        stats = {p: sweep_stats(doc, p) for p in parts}
        for size in sorted({s for r in stats.values() for s in r}):
            cells = []
            for p in parts:
                if size not in stats[p]:
                    cells.append("")
                    continue
                place, loss = mean_sd(stats[p][size]["place"]), mean_sd(stats[p][size]["loss"])
                cells.append("diverged" if np.isnan(place[0]) else
                             f"{cell(*place)} ({lrs[0] * 2**place[0]:.2g}), loss {cell(*loss, 3)}")
            lines.append(f"| {size} | " + " | ".join(cells) + " |")
        lines.append("")
        for p in parts:
            sizes = sorted(stats[p])
            if len(sizes) > 1:
                lines.append(drift_claim(TITLES[st[p]["model"]], axis, sizes, stats[p],
                                         st[p]["seeds"], len(lrs)))
        lines.append("")
    lines += sp_against_mup(doc, st) + depth_rules_against_off(doc)
    every, rows = wider_is_better(doc)
    if rows:
        widths = tables(doc, "curves")[1]
        lines += ["## Wider is better?", "", f"Train loss at the base LR, mean ± sd over "
                  f"{st['curves']['seeds']} seeds of each {every} steps, after warmup. Never "
                  "worse: each wider width's mean <= the narrower's + the larger sd; better: each "
                  "wider width's mean < the narrower's - the larger sd.", "",
                  "| step | " + " | ".join(f"width {w}" for w in widths) + " | never worse | "
                  "better |", "|---|" + "---|" * (len(widths) + 2)]
        for step, mean, std, ok, better in rows:
            cells = " | ".join(cell(m, s, 3) for m, s in zip(mean, std))
            lines.append(f"| {step} | {cells} | {'yes' if ok else 'NO'} | "
                         f"{'yes' if better else 'no'} |")
        worse = [r[0] for r in rows if not r[3]]
        after = next((r[0] for i, r in enumerate(rows) if all(x[4] for x in rows[i:])), None)
        lines += ["", ("Wider is never worse beyond 1 sd at any logged step after warmup"
                       if not worse else "Wider is worse beyond 1 sd at steps "
                       + ", ".join(map(str, worse)))
                  + (f"; better beyond 1 sd at every logged step from step {after}."
                     if after else "; not better beyond 1 sd at the last logged step."), ""]
    lines += ["## Figures", ""] + [f"![{p}]({p}.png)" for p in st if p in doc["results"]]
    return "\n".join(lines) + "\n"


def write(out: Path, doc: dict, part: str) -> None:
    """The figure of one part and README.md."""
    raw, doc = doc, upgrade(doc)
    s = doc["settings"][part]
    title = f"{doc['config_name']}, {TITLES[s['model']]}"
    if s["kind"] == "coord":
        sizes, table = coord_table(doc, part)
        moved = coord_table(doc, part, "dx")[1]
        table = {**table, **{f"{n} - at 0": v for n, v in moved.items()}}
        plot = lambda p: coord(p, s["axis"], sizes, table,
                               f"{title}: mean |x_t| and |x_t - x_0|, {s['steps']} steps")
    elif s["kind"] == "sweep":
        results, _ = tables(doc, part)
        loss = {k: np.array([[np.nan if v is None else v for v in row] for row in r],
                            dtype=float).mean(axis=0) for k, r in results.items()}
        plot = lambda p: transfer(p, s["axis"], loss, s["lrs"],
                                  f"{title}, {s['steps']} steps, mean of {s['seeds']} seed(s)")
    else:
        results, _ = tables(doc, part)
        train = {w: np.array(r["train"]) for w, r in results.items()}
        every = s["steps"] // next(iter(train.values())).shape[-1]
        steps = every * np.arange(1, s["steps"] // every + 1)
        plot = lambda p: curves(p, steps, train, f"{title}, LR {s['lrs'][0]:g}")
    write_atomic(out / f"{part}.png", plot)
    write_atomic(out / "README.md", lambda p: p.write_text(readme(raw)))


def open_out(text: str, new: dict, rules_now: dict) -> tuple[Path, dict]:
    """--out, checked before any training: a writable directory and its evidence.json ({} if
    none: then a new or empty one), which must be of these settings and rules: others are
    refused, never overwritten."""
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
        # a folder of other files (notes, or --out=. in the repo) is not evidence's: our README.md
        # would overwrite theirs. Hidden ones are ignored: none is overwritten, and a write killed
        # midway leaves its temporary (.NAME.PID.EXT, write_atomic)
        if any(not p.name.startswith(".") for p in out.iterdir()):
            raise UsageError(f"--out={out} holds files but no {path.name}: "
                             "pick an empty or new folder, or one that mup.py evidence wrote")
        return out, {}
    try:
        old = json.loads(path.read_text())
        differ = differences(old["settings"], new) + ["rules"] * (old["rules"] != rules_now)
        why = f"other settings ({', '.join(differ[:4])}{' ...' * (len(differ) > 4)} differ)"
        old["results"] = {p: {int(k): v for k, v in r.items()} for p, r in old["results"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not evidence's
        differ, why = True, "unrecorded settings"
    if differ:
        raise UsageError(f"--out={out} holds {path.name} of {why}: "
                         "pick another --out or delete the file")
    return out, old


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted names of the fields in which two settings differ."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix.rstrip(".")]
    return [d for k in {**old, **new} for d in differences(old.get(k), new.get(k), f"{prefix}{k}.")]


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
    """python -m tools.plots DIR: DIR's figures and README.md remade from its evidence.json (after a
    change of wording here, say), without training anything."""
    import json
    import sys

    ap = ArgumentParser(description=main.__doc__)
    ap.add_argument("dir", help="a folder that `python mup.py evidence --out=DIR` wrote")
    out = Path(ap.parse_args(argv).dir)
    try:
        doc = json.loads((out / "evidence.json").read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"error: {out}/evidence.json: {getattr(e, 'strerror', None) or e}: pass a "
                 "folder that mup.py evidence wrote")
    for part in doc["results"]:
        write(out, doc, part)
    print(f"{out}/README.md and its figures remade from evidence.json")


if __name__ == "__main__":
    main()
