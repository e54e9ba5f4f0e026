"""Downstream evaluation of a run:
    python eval.py --rundir=RUN --tasks=hellaswag,lambada,path/to/task.jsonl [--step=N]
    [--limit=N] [--batch_size=B]

prints one JSON line of accuracies. The task formats and how they are scored:
inference/tasks.py."""
import argparse
import json
import sys

from run.errors import ArgumentParser, UsageError, out_of_memory


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rundir", required=True, help="a run directory written by launch.py")
    ap.add_argument("--tasks", required=True, help="comma-separated task names or .jsonl files")
    ap.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    ap.add_argument("--limit", type=int, help="the first N examples of each task only")
    ap.add_argument("--batch_size", type=int, default=32,
                    help="sequences per jitted batch (rounded up to a multiple of the devices)")
    args = ap.parse_args(argv)
    for name in ("limit", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            sys.exit(f"error: --{name}={getattr(args, name)}: pass a number of 1 or more")
    import equinox as eqx  # after parsing: a misspelt flag should not wait for JAX to load
    import jax
    from etils import epath
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from inference.tasks import Tasks
    from run import reading

    try:
        rundir = epath.Path(args.rundir)
        cfg = reading.read_config(rundir)
        meta = reading.read_dataset_record(rundir, cfg)
        tasks = Tasks(args.tasks.split(","), reading.tokenizer(meta)[0], meta["vocab_size"],
                      cfg.block_size, args.limit)
        model, step = reading.restore_model(rundir, cfg, args.step)
    except UsageError as e:
        sys.exit(f"error: {e}")
    mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Auto,))
    params, static = eqx.partition(model, eqx.is_array)  # every device holds all of the model
    model = eqx.combine(jax.device_put(params, NamedSharding(mesh, P())), static)
    batch = -(-args.batch_size // jax.device_count()) * jax.device_count()
    try:
        scores = tasks(model, NamedSharding(mesh, P("batch")), batch)
    except (jax.errors.JaxRuntimeError, MemoryError) as e:  # XLA's or numpy's: a traceback
        if (oom := out_of_memory(e)) is None:
            raise
        sys.exit(f"error: out of memory ({oom[:100]}): lower --batch_size={args.batch_size}")
    print(json.dumps({"step": step, **scores}))


if __name__ == "__main__":
    main()
