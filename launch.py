"""Train a GPT:  python launch.py --config=NAME [--rundir=DIR] [--config.FIELD=VALUE ...]
Resume one:     python launch.py --rundir=DIR [--config.FIELD=VALUE ...]

The config is configs/NAME.py with typed overrides from the command line. The run directory
(default runs/NAME-TIMESTAMP, or gs://...) gets config.json, run.json (git commit, dirty tree,
command), dataset.json, metrics.jsonl, tensorboard events, checkpoints/ and checkpoints.json; an
existing one resumes, as its config.json says unless --config is given.
"""
import dataclasses
import sys

from etils import epath

import configs
from configs import apply_overrides
from run import interrupt
from run.devices import default_memory_fraction
from run.errors import ArgumentParser, RunError, UsageError
from run.rundir import check_dataset, open_rundir, resume_config

MULTIHOST = ("coordinator_address", "num_processes", "process_id")  # jax.distributed's arguments


def parse_args(argv: list[str]):
    fields = ", ".join(configs.Config.__dataclass_fields__)
    epilog = (f"Config fields, each --config.FIELD=VALUE (their defaults and meaning: "
              f"configs/__init__.py): {fields}.\n\nOn TPU VMs and under SLURM, --multihost alone "
              f"will do.")
    ap = ArgumentParser(description=__doc__.split("\n")[0], epilog=epilog)
    ap.add_argument("--config", help=f"one of: {', '.join(configs.available())} (to resume a "
                                     f"--rundir: its own)")
    ap.add_argument("--rundir", help="default runs/NAME-TIMESTAMP; an existing one is resumed")
    ap.add_argument("--restart", action="store_true",
                    help="train a run whose checkpoints are all lost again from step 0")
    ap.add_argument("--debug", action="store_true",
                    help="profile a few steps into the run directory and stop, saving nothing")
    ap.add_argument("--multihost", action="store_true",
                    help="jax.distributed.initialize() first (TPU pods, clusters)")
    ap.add_argument("--coordinator_address", help="multi-host: host:port of process 0")
    ap.add_argument("--num_processes", type=int, help="multi-host: the number of processes")
    ap.add_argument("--process_id", type=int, help="multi-host: this process's index")
    return ap.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    interrupt.exit_on_signals("a run directory resumes from its last checkpoint when given "
                              "again as --rundir")  # the training loop takes them over meanwhile
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.config is None:  # resume, as the run's config.json says
            args.config, cfg = resume_config(args.rundir, overrides)
        else:
            cfg = apply_overrides(configs.load(args.config), overrides)
            cfg = vocabulary_of_the_data(cfg, overrides)
        given = [f for f in MULTIHOST if getattr(args, f) is not None]
        if given and not args.multihost:  # else each host would train alone, in one run directory
            raise UsageError(f"--{given[0]} is for multi-host runs: add --multihost")
        if args.multihost and not args.rundir:
            raise UsageError("--multihost needs --rundir: the default's timestamp differs by host")
        default_memory_fraction()
        import jax  # after parsing: a typo should not wait for jax to load

        from run import distributed

        if args.multihost:  # before anything else starts jax's backends
            distributed.join(*(getattr(args, f) for f in MULTIHOST))
        from run import checkpoint
        import data
        import params
        import train

        if not args.debug:
            checkpoint.quiet_failed_saves()
        with distributed.fail_together():  # from here on, an error in one process stops them all
            cfg.check(jax.device_count())
            # bad data is reported before the run directory is written; a resume's dataset
            # prepared again as such first (its new vocabulary is not the fault to name)
            if args.rundir and "://" not in args.rundir:  # gs:// is reached in open_rundir
                check_dataset(epath.Path(args.rundir), data.read_meta(cfg), data.data_dir(cfg))
            data.load_split(cfg, "train"), data.load_split(cfg, "val")
            params.check(cfg, jax.device_count())  # an edited model.py's parameter without a row
            # Process 0 checks and writes the run directory; the others only train in it. A
            # signal while it is written waits until its undo is registered: a Ctrl-C just after
            # "run directory ..." is printed must not leave a config.json of a run never trained
            began = []
            with interrupt.held():
                rundir, undo = (open_rundir(args.rundir, args.config, cfg, args.restart,
                                            saves=not args.debug)
                                if jax.process_index() == 0 else (epath.Path(args.rundir), None))
                if undo:  # Ctrl-C while it compiles: the same undo (run/interrupt.py)
                    interrupt.UNDO.append(lambda: began or undo())
            if jax.default_backend() == "cpu" and cfg.compute_dtype == "bfloat16":
                print(f"note: {args.config} computes in bfloat16, for GPUs and TPUs: on a CPU it "
                      "is slow (the CPU recipe: --config=shakespeare_char_cpu, float32)")
            try:
                done = train.train(cfg, rundir, debug=args.debug, started=lambda: began.append(1))
                if done is not None and not args.debug and jax.process_index() == 0:
                    print(f"done: the checkpoints are in {rundir / 'checkpoints'}; read the run "
                          f"with python sample.py --rundir={rundir}")
            # refused before its first step, or stopped there by any other error (a bug's
            # traceback too): the run as it was, not a config.json that says what never ran
            except BaseException:
                if undo and not began:
                    undo()
                raise
            finally:  # done or undone: a later signal in this process must not undo again
                interrupt.UNDO.clear()
    except (UsageError, RunError) as e:
        sys.exit(f"error: {e}")


def vocabulary_of_the_data(cfg: configs.Config, overrides: list[str]) -> configs.Config:
    """A new run's vocab_size from its dataset's meta.json, where the config's is too small for
    the data and the command line did not set it: said in one line."""
    import data  # numpy only

    if any(arg.startswith("--config.vocab_size=") for arg in overrides):
        return cfg
    try:
        vocab = int(data.read_meta(cfg)["vocab_size"])
    except (UsageError, KeyError, TypeError, ValueError):
        return cfg  # no dataset yet, or a bad meta.json: data.py's checks say which
    if vocab <= cfg.vocab_size:
        return cfg
    print(f"note: vocab_size={vocab}, from {cfg.dataset}'s meta.json (the config has "
          f"{cfg.vocab_size})")
    return dataclasses.replace(cfg, vocab_size=vocab)


if __name__ == "__main__":
    main()
