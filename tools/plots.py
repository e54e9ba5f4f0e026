"""The report of mup.py's evidence, made from evidence.json alone: a figure per part (matplotlib)
and README.md, whose every number is read from the JSON; each file written whole."""
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from run.errors import RunError

TITLES = {"mup": "muP + CompleteP", "sp": "SP", "nodepth": "muP, depth rules off"}


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


def tables(doc: dict, part: str) -> tuple[dict, list[int]]:
    """A part's results and the sizes done, in order."""
    results = {int(k): v for k, v in doc["results"].get(part, {}).items()}
    return results, sorted(results)


def coord_table(doc: dict, part: str) -> tuple[list[int], dict[str, np.ndarray]]:
    results, sizes = tables(doc, part)
    names = results[sizes[0]] if sizes else {}
    return sizes, {n: np.array([results[s][n] for s in sizes]) for n in names}


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


def wider_is_better(doc: dict) -> tuple[int, list[tuple[int, list, list, bool]]]:
    """The steps in a window, and per window after warmup: (its last step, the mean loss per
    width, its seed std, whether each wider width's mean is at most the narrower's plus the
    larger of their seed stds)."""
    s = doc["settings"]["curves"]
    results, sizes = tables(doc, "curves")
    if len(sizes) < 2:
        return 0, []
    train = np.array([results[w]["train"] for w in sizes])  # (widths, seeds, windows)
    mean, std = train.mean(axis=1), train.std(axis=1)
    warmup = round(s["config"]["warmup_steps"] * s["steps"] / s["config"]["max_steps"])
    every = s["steps"] // train.shape[-1]
    rows = []
    for i in range(train.shape[-1]):
        if i * every < warmup:  # the window starts inside warmup
            continue
        noise = np.maximum(std[1:, i], std[:-1, i])
        ok = bool(np.all(mean[1:, i] <= mean[:-1, i] + noise))
        rows.append(((i + 1) * every, mean[:, i].tolist(), std[:, i].tolist(), ok))
    return every, rows


def readme(doc: dict) -> str:
    """DIR/README.md: every number from the JSON."""
    st = doc["settings"]
    lines = [f"# muP evidence: {doc['config_name']}", "",
             f"Made by `python mup.py evidence --out=DIR --config={doc['config_name']}"
             f"{''.join(' ' + o for o in doc['overrides'])}` at commit "
             f"{doc['commit']}{' (with uncommitted changes)' * doc['dirty']}. Generated from "
             "evidence.json, which holds each part's full settings: do not edit, rerun. "
             "Method and reading: ../mup.md.", ""]
    done = sum(len(doc["results"].get(p, {})) for p in st)
    if done < (total := sum(len(st[p]["sizes"]) for p in st)):
        lines += [f"**Incomplete: {done} of {total} sizes measured.** Rerun the command to finish "
                  "(it resumes).", ""]
    lines += ["## Coordinate checks", "",
             "Least-squares slope of log2 mean|x| against log2 size, over every activation; "
             "|slope| near 0 is flat.", "",
             "| part | model | sizes | steps x seeds | largest \\|slope\\| after step 0 | at |",
             "|---|---|---|---|---|---|"]
    for part in (p for p in st if st[p]["kind"] == "coord"):
        sizes, table = coord_table(doc, part)
        if len(sizes) < 2:
            continue
        fitted = [(abs(v), n, t) for n, vs in slopes(sizes, table).items()
                  for t, v in enumerate(vs) if t and v is not None]
        worst, name, t = max(fitted)
        lines.append(f"| {part} | {TITLES[st[part]['model']]} | {st[part]['axis']} "
                     f"{','.join(map(str, sizes))} | {st[part]['steps']} x {st[part]['seeds']} "
                     f"| {worst:.3f} | {name}, step {t} |")
    lines += ["", "## Learning-rate sweeps", "",
              "Per size: the best LR's place on the grid (0 = the first LR below), between grid "
              "points (the LR there; plots.optimum: the parabola through the best LR and its "
              "neighbours), and the validation loss there. Drift: the largest minus the smallest place, in grid "
              "steps (factors of 2), and whether it moves one way as the size grows.", ""]
    for axis in ("width", "depth"):
        parts = [p for p in st if st[p]["kind"] == "sweep" and st[p]["axis"] == axis]
        lrs = st[parts[0]]["lrs"]
        lines += [f"Grid: {', '.join(f'{lr:.3g}' for lr in lrs)}; {st[parts[0]]['steps']} steps.",
                  "", f"| {axis} | " + " | ".join(TITLES[st[p]["model"]] for p in parts) + " |",
                  "|---|" + "---|" * len(parts)]
        results = {p: tables(doc, p)[0] for p in parts}
        places = {p: {s: optimum(r) for s, r in results[p].items()} for p in parts}
        for size in sorted({s for r in results.values() for s in r}):
            cells = []
            for p in parts:
                place, row = places[p].get(size), results[p].get(size)
                cells.append("" if row is None else "diverged" if place is None else
                             f"{place:.2f} ({lrs[0] * 2**place:.2g}), "
                             f"loss {np.nanmin(np.array(row, dtype=float)):.3f}")
            lines.append(f"| {size} | " + " | ".join(cells) + " |")
        drift = []
        for p in parts:
            found = [v for _, v in sorted(places[p].items()) if v is not None] or [0.0]
            steps = np.diff(found)
            way = "one way" if np.all(steps < 0) or np.all(steps > 0) else "not one way"
            drift.append(f"{np.ptp(found):.2f} steps, {way}")
        lines += ["| drift | " + " | ".join(drift) + " |", ""]
    every, rows = wider_is_better(doc)
    if rows:
        widths = tables(doc, "curves")[1]
        lines += ["## Wider is better", "", f"Train loss at the base LR, mean over "
                  f"{st['curves']['seeds']} seeds (+- their std) of each {every} "
                  "steps, after warmup; ok: each wider width's mean <= the narrower's + the larger "
                  "std.", "", "| step | " + " | ".join(f"width {w}" for w in widths) + " | ok |",
                  "|---|" + "---|" * (len(widths) + 1)]
        for step, mean, std, ok in rows:
            cells = " | ".join(f"{m:.3f} +- {s:.3f}" for m, s in zip(mean, std))
            lines.append(f"| {step} | {cells} | {'yes' if ok else 'NO'} |")
        verdict = "at every" if all(r[3] for r in rows) else "NOT at every"
        lines += ["", f"Wider is better {verdict} logged step after warmup.", ""]
    lines += ["## Figures", ""] + [f"![{p}]({p}.png)" for p in st if p in doc["results"]]
    return "\n".join(lines) + "\n"


def write(out: Path, doc: dict, part: str) -> None:
    """The figure of one part and README.md."""
    s = doc["settings"][part]
    title = f"{doc['config_name']}, {TITLES[s['model']]}"
    if s["kind"] == "coord":
        sizes, table = coord_table(doc, part)
        plot = lambda p: coord(p, s["axis"], sizes, table, f"{title}: mean |x|, {s['steps']} steps")
    elif s["kind"] == "sweep":
        results, _ = tables(doc, part)
        loss = {k: np.array([np.nan if v is None else v for v in r]) for k, r in results.items()}
        plot = lambda p: transfer(p, s["axis"], loss, s["lrs"], f"{title}, {s['steps']} steps")
    else:
        results, _ = tables(doc, part)
        train = {w: np.array(r["train"]) for w, r in results.items()}
        every = s["steps"] // next(iter(train.values())).shape[-1]
        steps = every * np.arange(1, s["steps"] // every + 1)
        plot = lambda p: curves(p, steps, train, f"{title}, LR {s['lrs'][0]:g}")
    write_atomic(out / f"{part}.png", plot)
    write_atomic(out / "README.md", lambda p: p.write_text(readme(doc)))


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
