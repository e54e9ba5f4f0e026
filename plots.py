"""The figures of mup.py's results (matplotlib, written to files): docs/mup/ and docs/sp/ hold
them."""
from pathlib import Path

import numpy as np


def coord(path: Path, axis: str, sizes: list[int], table: dict[str, np.ndarray],
          title: str) -> None:
    """One panel per activation: mean |x| against size, log-log, a line per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ylim = (mid / np.sqrt(span), mid * np.sqrt(span))
        ax.set(xscale="log", yscale="log", title=name, ylim=ylim)
        ax.set_xticks(sizes, [str(s) for s in sizes], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.minorticks_off()
    for ax in axes.flat[len(table):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.supxlabel(axis), fig.supylabel("mean |x|"), fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def transfer(path: Path, loss: dict[int, np.ndarray], lrs: list[float], title: str) -> None:
    """Final loss against log2 LR (loss: width -> a loss per LR), a curve per width, each optimum
    marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(loss)))
    log_lr = np.log2(lrs)
    for (w, row), color in zip(sorted(loss.items()), colors):
        ax.plot(log_lr, row, "o-", color=color, ms=3, label=f"width {w}")
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
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
