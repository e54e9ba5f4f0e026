"""Time the real train step:
    python bench.py --config=NAME [--config.FIELD=VALUE ...] [--steps=N] [--torch] [--trace=DIR]
                    [--checkpoint=DIR] [--time-to=LOSS [--rundir=DIR]]

The step is train.setup()'s, the code path training uses (kernels' self-check included), timed on
random tokens once compiled and warmed up. It prints one JSON line, with the commit and the
command. What each flag adds: --help, and README.md's Performance (a trace opens in tensorboard's
profile tab or ui.perfetto.dev). Split a CPU into N devices with
XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""
import collections
import contextlib
import gzip
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import configs
from run.devices import default_memory_fraction
from configs import Config
from run.errors import ArgumentParser, RunError, UsageError
from run.rundir import check_writable, git_state

# with --torch: JAX and PyTorch are timed in this many alternating blocks, and medians reported
TORCH_BLOCKS = 6


def time_calls(step, state: tuple, batch: tuple, sharding, calls: int) -> tuple[float, tuple]:
    """Seconds per step over `calls` steps, and the state after them. Each step puts its batch on
    the devices as training does."""
    import jax

    t0 = time.perf_counter()
    for _ in range(calls):
        *state, metrics = step(*state, *jax.device_put(batch, sharding))
    jax.block_until_ready(metrics)
    return (time.perf_counter() - t0) / calls, tuple(state)


def trace_ops(step, state: tuple, batch: tuple, sharding, trace_dir: str, top: int = 25) -> dict:
    """Trace 3 steps with jax.profiler and sum, per op name, the time XLA's ops took: on a GPU or
    TPU the device's kernels, on a CPU the XLA:CPU thunks (all devices together). Milliseconds a
    step, largest first."""
    import jax

    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    time_calls(step, state, batch, sharding, 3)
    jax.profiler.stop_trace()
    newest = max(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
    trace = json.load(gzip.open(newest))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    on_device = any("/device:" in name for name in process.values())
    loop = re.compile(r"(while|conditional|call)(\.\d+)?$")  # loops contain the ops counted
    total = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        if on_device:
            ours = "/device:" in process.get(e["pid"], "")
        else:
            ours = "hlo_op" in e.get("args", {})
        if ours and not loop.match(e["name"]):
            total[e["name"]] += e["dur"] / 1e3 / 3
    return dict(total.most_common(top))


def matmul_peak(dtype: str) -> float:
    """FLOP/s of a 2048^3 matmul in the compute dtype: the best this process gets on this CPU."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((2048, 2048), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        out = f(a)
    out.block_until_ready()
    return 10 * 2 * 2048**3 / (time.perf_counter() - t0)


def time_torch(step, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def kernels_in(gpt) -> dict[str, str]:
    """{model.py function: the fast path (fused/fast_paths.py) that select chose for it here}."""
    from fused import fast_paths

    attn, mlp = gpt.blocks.attn, gpt.blocks.mlp
    fast = {"attend": attn.fast_attend, "qk_norm_rope": attn.fast_qk_norm_rope,
            "gelu": mlp.fast_gelu, "cross_entropy": gpt.fast_cross_entropy}
    what = {path.fn: path.what for path in fast_paths.FAST_PATHS}
    return {name: what.get(fn, "?") for name, fn in fast.items() if fn}


def variant(cfg: Config) -> dict:
    """The architecture options of model.py the run uses."""
    return {"attention": cfg.attention, "kv_heads": cfg.kv_heads, "position": cfg.position,
            "connections": cfg.connections}


def in_force(platform: str) -> dict:
    """The XLA flags, and on a GPU the fraction of its memory JAX's allocator takes (launch.py's
    default unless XLA_PYTHON_CLIENT_MEM_FRACTION was set): what else shapes a measurement."""
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return {"xla_flags": os.environ.get("XLA_FLAGS", ""),
            "memory_fraction": float(fraction) if platform == "gpu" and fraction else None}


def time_to(cfg: Config, target: float, rundir: str | None) -> dict:
    """Train cfg; the wall time from the call to the first evaluation with a val loss at most
    target (compiling, evaluations included), from the run's events by tensorboard's reader."""
    from etils import epath
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    import jax

    import train

    if rundir and Path(rundir).exists() and any(Path(rundir).iterdir()):
        raise UsageError(f"--rundir={rundir} is not empty: --time-to times a run from step 0 in "
                         "a new folder (a run there would be resumed, and its events read); "
                         "name another --rundir")
    rundir = rundir or tempfile.mkdtemp(prefix="mugpt-time-to-")
    start = time.time()
    with contextlib.redirect_stdout(sys.stderr):  # the run's lines: stdout stays one JSON line
        train.train(cfg, epath.Path(rundir))
    events = EventAccumulator(rundir)
    events.Reload()
    val = events.Scalars("loss/val")
    first = next((e for e in val if e.value <= target), None)
    return {"device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
            **in_force(jax.devices()[0].platform),
            "jax_version": jax.__version__, "target_val_loss": target, "reached": bool(first),
            "wall_s": round(first.wall_time - start, 1) if first else None,
            "step": first.step if first else None, "val_loss": first.value if first else None,
            "best_val_loss": min(e.value for e in val), "max_steps": cfg.max_steps,
            "eval_interval": cfg.eval_interval, "dropout": cfg.dropout, "rundir": rundir,
            **variant(cfg)}


def time_checkpoint(cfg: Config, state: tuple, where: str) -> dict:
    """Seconds to save `state` as training does, waiting until it is written, and milliseconds for
    run/written.py's record of its files and the check of them at restore: what telling damage from
    another model costs."""
    from etils import epath

    from run import checkpoint
    from run import written

    mngr = checkpoint.checkpoint_manager(epath.Path(where).absolute(), cfg)
    t0 = time.perf_counter()
    checkpoint.save_checkpoint(mngr, 1, *state, {})
    mngr.wait_until_finished()
    t1 = time.perf_counter()
    step_dir = mngr.directory / "1"
    written.record(step_dir)  # (again: the save wrote the same record once)
    t2 = time.perf_counter()
    assert written.damage(step_dir) is None
    t3 = time.perf_counter()
    size = sum(p.stat().length for p in written.files(step_dir).values())
    return {"checkpoint_bytes": size, "checkpoint_save_s": round(t1 - t0, 2),
            "record_ms": round(1e3 * (t2 - t1), 2), "check_ms": round(1e3 * (t3 - t2), 2)}


def bench(cfg: Config, steps: int, with_torch: bool = False, trace_dir: str | None = None,
          checkpoint_dir: str | None = None) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    import params
    from run import metrics
    import train

    cfg.check(jax.device_count())
    mesh = train.make_mesh(cfg)
    s = train.setup(cfg, mesh)
    rng = np.random.default_rng(0)
    shape = (cfg.grad_accum, cfg.microbatch_size, cfg.block_size)
    x, y = (rng.integers(0, cfg.vocab_size, shape, dtype=np.int32) for _ in range(2))
    sharding = NamedSharding(mesh, train.BATCH_SPEC)
    # the first step traces and compiles; two more warm up
    first_s, state = time_calls(s.step, (s.model, s.opt_state), (x, y), sharding, 1)
    _, state = time_calls(s.step, state, (x, y), sharding, 2)
    if with_torch:
        from tools.bench_torch import torch_step
        # alternating blocks, so that the machine's drift over the run hits both alike
        torch_fn, blocks = torch_step(cfg, s.model), min(TORCH_BLOCKS, steps)
        jax_s, torch_s = [], []
        for b in range(blocks):
            n = steps // blocks + (b < steps % blocks)
            # one untimed step of each first, so that the other framework's threads settle
            _, state = time_calls(s.step, state, (x, y), sharding, 1)
            step_s, state = time_calls(s.step, state, (x, y), sharding, n)
            jax_s.append(step_s)
            torch_fn()
            torch_s.append(time_torch(torch_fn, n))
        step_s, torch_s = float(np.median(jax_s)), float(np.median(torch_s))
    else:
        step_s, state = time_calls(s.step, state, (x, y), sharding, steps)
    if trace_dir:
        ops = trace_ops(s.step, state, (x, y), sharding, trace_dir)
        print(f"ms a step in the ops that took the most, traced into {trace_dir}:",
              file=sys.stderr)
        print("\n".join(f"{ms:9.3f}  {name}" for name, ms in ops.items()), file=sys.stderr)
    device = jax.devices()[0]
    flops = params.flops_per_token(s.model, cfg.block_size)
    # MaxText's and llm.c's accounting: attention's scores and their use for the causal half only
    causal = flops - (flops - params.flops_per_token(s.model, 0)) // 2  # 6N + 6·L·H·K·T
    tokens_per_s = cfg.batch_size * cfg.block_size / step_s
    peak = metrics.peak_flops(device)
    mfu = lambda f: round(tokens_per_s * f / (peak * jax.device_count()), 4) if peak else None
    memory = device.memory_stats() or {}
    result = {
        "device_kind": device.device_kind, "device_count": jax.device_count(),
        "jax_version": jax.__version__, "tokens_per_s": round(tokens_per_s, 1),
        "step_ms": round(1e3 * step_s, 2), "flops_per_token": flops,
        "flops_formula": "6N + 12*L*H*K*T (PaLM app. B; N = the block and readout matrices)",
        "flops_per_token_causal": causal, "mfu": mfu(flops), "mfu_causal": mfu(causal),
        "peak_flops": peak,
        "compile_s": round(first_s - step_s, 2),
        "peak_memory_bytes": memory.get("peak_bytes_in_use"), "compute_dtype": cfg.compute_dtype,
        "remat": cfg.remat, "scan_unroll": cfg.scan_unroll,
        "kernels": sorted(kernels_in(s.model)), "kernel_impls": kernels_in(s.model),
        **variant(cfg), **in_force(device.platform),
    }
    if device.platform == "cpu":
        measured = matmul_peak(cfg.compute_dtype)
        result |= {"matmul_peak_flops": round(measured),
                   "fraction_of_matmul_peak": round(tokens_per_s * flops / measured, 4)}
    if with_torch:
        result |= {"torch_step_ms": round(1e3 * torch_s, 2),
                   "step_over_torch": float(f"{step_s / torch_s:.4g}")}
    if checkpoint_dir:
        result |= time_checkpoint(cfg, state, checkpoint_dir)
    return result


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help=f"one of: {', '.join(configs.available())}")
    ap.add_argument("--steps", type=int, default=20, help="timed steps after compile and warmup")
    ap.add_argument("--torch", action="store_true", help="also time an eager PyTorch version")
    ap.add_argument("--trace", metavar="DIR", help="also trace 3 calls into DIR; print the top ops")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="also save the state as a checkpoint into DIR (a new directory) and time "
                         "it, with its files' record (run/written.py) and the check at restore")
    ap.add_argument("--time-to", type=float, metavar="LOSS",
                    help="train instead; the wall time to the first val loss <= LOSS")
    ap.add_argument("--rundir", help="with --time-to: the run directory (default: a new one)")
    args, overrides = ap.parse_known_args()
    default_memory_fraction()  # before jax starts, as a training run
    try:
        if args.steps < 1:
            raise UsageError(f"--steps={args.steps} must be at least 1")
        if args.time_to is not None and not 0 < args.time_to < float("inf"):  # nan: never reached
            raise UsageError(f"--time-to={args.time_to} must be a loss above 0 and finite")
        if args.torch and importlib.util.find_spec("torch") is None:
            raise UsageError("--torch needs PyTorch, which is not installed: pip install torch")
        cfg = configs.apply_overrides(configs.load(args.config), overrides)
        if args.checkpoint and Path(args.checkpoint).exists():
            raise UsageError(f"--checkpoint={args.checkpoint} exists: name a new directory")
        if args.rundir and args.time_to is None:  # else silently unused
            raise UsageError("--rundir is --time-to's run directory: add --time-to=LOSS or drop it")
        for flag in ("--checkpoint", "--rundir"):  # written at the end: refused now, not then
            if path := getattr(args, flag[2:]):
                check_writable(flag, path)
        if args.torch and variant(cfg) != variant(configs.Config(n_head=cfg.n_head)):
            raise UsageError("--torch times the plain GPT (mha, rope, residual) only: drop the "
                             "--config.attention/n_kv_head/position/connections overrides")
        if args.trace:
            try:
                Path(args.trace).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UsageError(f"cannot write --trace={args.trace}: {e.strerror or e}") from None
        import train  # after parsing, as launch.py: a typo should not wait for jax to load
        if args.time_to is not None:
            result = time_to(cfg, args.time_to, args.rundir)
        else:
            result = train.explain_out_of_memory(bench)(cfg, args.steps, args.torch, args.trace,
                                                           args.checkpoint)
        command = " ".join(["python bench.py", *sys.argv[1:]])
        print(json.dumps({"name": args.config, **result, **git_state(), "command": command}))
    except (UsageError, RunError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
