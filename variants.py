"""The seeds' variants side by side: docs/variants.md, remade by one command.

    python variants.py [--size=small|large|gpu|tiny] [--seeds=0,1,2] [--steps=N]
        [--out=runs/variants/report] [--remake]

trains the baseline and each variant (SharedKV, grouped-query attention with n_head / 4 key/value
heads, MUDD, ALiBi, MUDD + SharedKV) at the quickstart's recipe (configs/shakespeare_char_cpu.py,
its fast form: two CPU devices, data-parallel) from each seed (each its own initial model and
batch order: --config.seed), with launch.py in a subprocess each (runs/variants/SIZE/VARIANT/sSEED,
resumed when rerun; one there of another config, as another --steps, is refused). Then it
evaluates each final model on fixed validation batches at 1x, 2x and 4x the training length
(ALiBi's claim), and writes OUT/SIZE.json (every number, the commit, whether the tree was dirty,
the settings) and the markdown tables OUT/SIZE.md: mean ± sd over seeds, each
variant minus the baseline with its 95% interval, and each variant's loss at 2x and 4x the length
minus its own at 1x, seed by seed, with its 95% interval. With --out=docs/variants the tables also
go into docs/variants.md (between its markers); the default --out leaves tracked files alone.
--remake makes them again from OUT/SIZE.json, without training. Step times are recorded in the
JSON but not shown: a shared CPU's medians over 3 runs are not a timing (bench.py and
BENCHMARKS.md are).
"large" is the largest size the 2-core CPU trains in minutes (width 256, 8 layers; muP carries
the LR); "gpu" 14M parameters (width 384, 8 layers, 600 steps of 64 x 256 tokens, bfloat16) on
one GPU; "tiny" a toy size for the CPU test of the whole command.
"""
import dataclasses
import logging
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from run.errors import ArgumentParser

ROOT = Path(__file__).resolve().parent
VARIANTS = {
    "baseline": [],
    "sharedkv": ["--config.attention=sharedkv"],
    "gqa": ["--config.n_kv_head=N_HEAD/4"],
    "mudd": ["--config.connections=mudd"],
    "alibi": ["--config.position=alibi"],
    "mudd+sharedkv": ["--config.connections=mudd", "--config.attention=sharedkv"],
}
SIZES = {"small": [], "large": ["--config.d_model=256", "--config.n_head=8", "--config.n_layer=8"],
         "gpu": ["--config.d_model=384", "--config.n_head=12", "--config.n_layer=8",
                 "--config.block_size=256", "--config.batch_size=64", "--config.max_steps=600",
                 "--config.warmup_steps=60", "--config.eval_interval=600",
                 "--config.compute_dtype=bfloat16"],
         "tiny": ["--config.d_model=32", "--config.n_head=2", "--config.n_layer=2",
                  "--config.block_size=16", "--config.batch_size=4", "--config.eval_batches=2"]}
# sizes trained on the CPU split into two data-parallel devices (the quickstart's); others: one
# accelerator
CPU_SIZES = {"small", "large", "tiny"}
LENGTHS = (1, 2, 4)  # evaluation lengths, in training lengths


def overrides(size: str, variant: str, seed: int, steps: int | None) -> list[str]:
    args = [*SIZES[size], *VARIANTS[variant], f"--config.seed={seed}"]
    if steps:  # a shorter schedule, for a smoke test of this script
        args += [f"--config.max_steps={steps}", f"--config.warmup_steps={steps // 10}",
                 f"--config.eval_interval={steps}"]
    n_head = int(next((a.split("=")[1] for a in args if a.startswith("--config.n_head=")), 4))
    return [a.replace("N_HEAD/4", str(max(n_head // 4, 1))) for a in args]


def check_run(rundir: Path, args: list[str], size: str) -> None:
    """A run already in rundir is resumed only into the config it was started with: launch.py lets
    a run change max_steps (to extend it), but a --steps=20 run resumed to 25 has run past the end
    of its own cosine schedule, and is no 25-step run. Another config is refused in one line."""
    import configs
    from run.errors import UsageError
    from run.rundir import saved_config

    if not (rundir / "config.json").exists():
        return  # nothing trained there yet
    replica = f"--config.mesh_replica={2 if size in CPU_SIZES else 1}"  # as train_run's launch
    cfg = configs.apply_overrides(configs.load("shakespeare_char_cpu"), [replica, *args])
    try:
        saved = saved_config(rundir)
    except UsageError as e:  # its fix in this command's flag
        sys.exit(f"error: {e}".replace("--rundir", "--runs"))
    differ = [f"{n}={saved[n]!r} there, {v!r} here" for n, v in dataclasses.asdict(cfg).items()
              if saved[n] != v]
    if differ:
        sys.exit(f"error: {rundir} holds a run of another config ({'; '.join(differ[:3])}"
                 f"{' ...' * (len(differ) > 3)}): pass another --runs, or remove the folder")


def train_run(rundir: Path, args: list[str], size: str) -> None:
    """launch.py as the README's quickstart runs it (on an accelerator, one device), unless the
    run has its last checkpoint."""
    import configs

    steps = configs.apply_overrides(configs.load("shakespeare_char_cpu"), args).max_steps
    if (rundir / "checkpoints" / str(steps)).is_dir():
        return
    cpu = size in CPU_SIZES
    env = {**os.environ, **({"JAX_NUM_CPU_DEVICES": "2"} if cpu else {})}
    cmd = [sys.executable, "launch.py", "--config=shakespeare_char_cpu",
           f"--config.mesh_replica={2 if cpu else 1}", f"--rundir={rundir}", *args]
    rundir.mkdir(parents=True, exist_ok=True)
    log = rundir / "launch.log"  # the child's progress bar and lines: tail -f it to follow
    print(f"  training: tail -f {log}", flush=True)
    with log.open("w") as f:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    if r.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{log.read_text()[-2000:]}")


def measure(rundir: Path, args: list[str]) -> dict:
    """The run's final model: validation loss at each length, its size, FLOPs, KV cache and the
    training step's time (the median of metrics.jsonl's logged tokens/s)."""
    import equinox as eqx
    import jax
    from etils import epath

    from run import checkpoint
    import configs
    import data
    import params
    from inference import decode
    import train

    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on a read-only manager
    cfg = configs.apply_overrides(configs.load("shakespeare_char_cpu"), args)
    mesh = train.make_mesh(cfg, jax.devices()[:1])
    skeleton = eqx.filter_eval_shape(params.init_gpt, cfg, jax.random.key(0))  # shapes alone
    mngr = checkpoint.checkpoint_manager(epath.Path(rundir), cfg, read_only=True)
    gpt = checkpoint.restore_model(mngr, skeleton)
    tokens = {s: data.load_split(cfg, s) for s in ("train", "val")}
    val = {}
    for n in LENGTHS:  # fixed validation batches of each length
        longer = configs.apply_overrides(cfg, [f"--config.block_size={n * cfg.block_size}",
                                               "--config.mesh_replica=1"])
        val[n] = train.evaluate(gpt, longer, tokens["train"], tokens["val"], mesh)["val_loss"]
    lines = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    speeds = [x["tokens_per_s"] for x in lines if x.get("tokens_per_s") and "loss" in x]
    cache = decode.empty_cache(gpt, 1)
    return {"val_loss": val[1], "val_loss_at": val,
            "params": sum(x.size for x in jax.tree.leaves(eqx.filter(gpt, eqx.is_array))),
            "flops_per_token": params.flops_per_token(gpt, cfg.block_size),
            "kv_cache_bytes_per_token": sum(x.nbytes for x in jax.tree.leaves(cache)),
            "step_ms": 1e3 * cfg.batch_size * cfg.block_size / statistics.median(speeds)}


def table(results: dict, seeds: list[int]) -> str:
    """Markdown: mean ± sd over seeds per variant, and its val loss minus the baseline's with the
    95% interval of the difference (Welch's t; "resolved" when it excludes 0); then lengths()."""
    from tools import plots

    def mean_std(values):
        sd = statistics.stdev(values) if len(values) > 1 else float("nan")
        return plots.cell(statistics.mean(values), sd, 4)

    def against_baseline(runs):
        if "baseline" not in results or runs is results["baseline"]:
            return ""
        d, h = plots.difference([r["val_loss"] for r in results["baseline"].values()],
                                [r["val_loss"] for r in runs.values()])
        if h != h:  # one seed
            return f"{d:+.4f} (one seed: no interval)"
        return f"{d:+.4f} ± {h:.4f}" + (" (resolved)" if abs(d) > h else "")

    head = ("| variant | val loss | minus baseline (95%) | params | FLOPs/token | "
            "KV cache B/token | " + " | ".join(f"val @ {n}x length" for n in LENGTHS[1:]) + " |")
    rows = [head, "|" + "---|" * (5 + len(LENGTHS))]
    for variant, runs in results.items():
        first = runs[str(seeds[0])]
        cells = [variant, mean_std([r["val_loss"] for r in runs.values()]), against_baseline(runs),
                 f"{first['params']:,}", f"{first['flops_per_token']:.3g}",
                 str(first["kv_cache_bytes_per_token"])]
        cells += [mean_std([r["val_loss_at"][str(n)] for r in runs.values()]) for n in LENGTHS[1:]]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + lengths(results)


def lengths(results: dict) -> str:
    """Markdown: per variant, its val loss at each longer length minus its own at the training
    length, seed by seed (one model read at two lengths: paired, so a seed's level cancels), mean
    ± sd over seeds and the 95% interval; "grows" or "falls" only when the interval excludes 0."""
    from tools import plots

    def change(runs, n):
        at = lambda k: [r["val_loss_at"][k] for r in runs.values()]
        d, sd, h = plots.paired(at("1"), at(str(n)))
        if h != h:  # one seed
            return f"{d:+.3f} (one seed: no interval)"
        said = "grows" if d - h > 0 else "falls" if d + h < 0 else "not resolved"
        return f"{d:+.3f} ± {sd:.3f} [{d - h:+.3f}, {d + h:+.3f}]: {said}"

    rows = ["Val loss at a longer length minus at the training length, each seed's model read at",
            "both: mean ± sd over seeds [95% interval, t over seeds]; \"grows\" or \"falls\" only",
            "when the interval excludes 0.", "",
            "| variant | " + " | ".join(f"{n}x minus 1x" for n in LENGTHS[1:]) + " |",
            "|---|" + "---|" * (len(LENGTHS) - 1)]
    for variant, runs in results.items():
        rows.append(f"| {variant} | " + " | ".join(change(runs, n) for n in LENGTHS[1:]) + " |")
    return "\n".join(rows) + "\n"


def docs_text(report: dict) -> str:
    """docs/variants.md's block for a report (OUT/SIZE.json's contents): its command, commit and
    tables."""
    s = report["settings"]
    dirty = " (with uncommitted changes: the commit alone does not reproduce it)" * bool(
        s.get("dirty"))  # reports made before it was recorded have no "dirty"
    return f"`{s['command']}` at {s['commit']}{dirty}:\n\n" + table(report["results"], s["seeds"])


def write_report(out: Path, report: dict) -> None:
    """OUT/SIZE.md, and docs/variants.md's block when OUT is docs/variants."""
    size = report["settings"]["size"]
    (out / f"{size}.md").write_text(table(report["results"], report["settings"]["seeds"]))
    if out.resolve() == ROOT / "docs" / "variants":  # not a smoke test's: docs/variants.md shows it
        put_in_docs(size, docs_text(report))


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, help="a shorter schedule (a smoke test)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of these")
    ap.add_argument("--out", default="runs/variants/report",
                    help="docs/variants also remakes docs/variants.md's table")
    ap.add_argument("--runs", default="runs/variants", help="where the runs train")
    ap.add_argument("--remake", action="store_true",
                    help="OUT/SIZE.md (and docs/variants.md's block) from OUT/SIZE.json; "
                    "nothing trains")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:  # 0 would read as "no --steps": the full schedule
        sys.exit(f"error: --steps={args.steps}: pass a positive number of steps, or leave --steps "
                 "out for the size's full schedule")
    if args.remake:
        path = ROOT / args.out / f"{args.size}.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"error: {path}: {getattr(e, 'strerror', None) or e}: pass the --out and "
                     "--size of a report variants.py wrote")
        write_report(ROOT / args.out, report)
        print(table(report["results"], report["settings"]["seeds"]))
        return
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        sys.exit(f"error: --seeds={args.seeds}: pass integers separated by commas, e.g. 0,1,2")
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        sys.exit(f"error: unknown variant {unknown[0]!r}; the variants: {', '.join(VARIANTS)}")
    runs = [(seed, variant, ROOT / args.runs / args.size / variant / f"s{seed}",
             overrides(args.size, variant, seed, args.steps))
            for seed in seeds for variant in names]
    for _, _, rundir, run_args in runs:  # all before any trains: a refusal costs no training
        check_run(rundir, run_args, args.size)
    from run.rundir import git_state
    state = git_state()  # of the code the runs train with, not of an edit made meanwhile
    results = {variant: {} for variant in names}
    n, start = len(seeds) * len(names), time.monotonic()
    # every variant's first seed first: an early stop still compares them all
    for seed, variant, rundir, run_args in runs:
        k = sum(map(len, results.values()))  # runs done so far
        left = (time.monotonic() - start) / k * (n - k) / 60 if k else None
        eta = f", about {left:.0f} min left" if k else ""
        print(f"[{k + 1}/{n}] {variant} seed {seed}: {rundir}{eta}", flush=True)
        train_run(rundir, run_args, args.size)
        results[variant][str(seed)] = measure(rundir, run_args)
    results = json.loads(json.dumps(results))  # the lengths' keys as the file will hold them
    commit = (state["commit"] or "unknown")[:7]
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    # the command as anyone reruns it: where the runs trained (--runs) changes no number
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--runs")]
    settings = {"command": " ".join(["python variants.py", *shown]), "commit": commit,
                "dirty": state["dirty"], "size": args.size, "seeds": seeds, "steps": args.steps,
                "overrides": {v: overrides(args.size, v, 0, args.steps) for v in names}}
    report = {"settings": settings, "results": results}
    (out / f"{args.size}.json").write_text(json.dumps(report, indent=1))
    write_report(out, report)
    print(table(results, seeds))


def put_in_docs(size: str, text: str) -> None:
    """The table into docs/variants.md, between its markers for this size."""
    doc = ROOT / "docs" / "variants.md"
    start, end = f"<!-- variants.py {size} -->\n", f"<!-- end variants.py {size} -->"
    page = doc.read_text() if doc.exists() else ""
    if start in page and end in page:
        before, rest = page.split(start, 1)
        doc.write_text(before + start + text + rest[rest.index(end):])


if __name__ == "__main__":
    main()
