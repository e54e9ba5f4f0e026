"""Generate text from a run:
    python sample.py --rundir=DIR [--start=TEXT | --start=FILE:path] [--step=S]
    [--num_samples=N] [--max_new_tokens=N] [--temperature=T] [--top_k=K] [--top_p=P] [--seed=S]
    [--context=N]

The decoding (a KV cache, one jitted lax.scan, the window sliding by half past --context) is
inference/decode.py's; reading the run is run/reading.py's."""
import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from etils import epath

from inference.decode import check_cache, generate, prompt_window
from run.errors import ArgumentParser, UsageError, out_of_memory
from run.reading import read_config, read_dataset_record, restore_model, tokenizer
from text.tokenization import special_ids


def read_prompt(start: str) -> str:
    if start.startswith("FILE:"):
        path = Path(start.removeprefix("FILE:"))
        if not path.is_file():
            what = "a directory" if path.is_dir() else "no such file"
            raise UsageError(f"--start=FILE:{path}: {what}")
        try:
            start = path.read_text()
        except UnicodeDecodeError:
            raise UsageError(f"--start=FILE:{path} is not UTF-8 text") from None
    if not start:
        raise UsageError("the prompt is empty: pass --start=TEXT (a newline, say) or "
                         "--start=FILE:path")
    return start


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (default sys.argv's), checked: a bad value is a UsageError."""
    ap = ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rundir", required=True, help="a run directory written by launch.py")
    ap.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    ap.add_argument("--start", default="\n",
                    help="the prompt, or FILE:path to read it from a file (default a newline); "
                         "of a prompt longer than the context, its last tokens are kept")
    ap.add_argument("--num_samples", type=int, default=3)
    ap.add_argument("--max_new_tokens", type=int, default=500,
                    help="tokens to generate per sample; "
                         "past the context the window slides by half of it")
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy (argmax)")
    ap.add_argument("--top_k", type=int, default=0,
                    help="sample among the k most likely tokens only (0: all)")
    ap.add_argument("--top_p", type=float, default=1.0,
                    help="nucleus sampling: the smallest set of tokens holding this mass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int,
                    help="the tokens the model sees (default: block_size); past block_size, "
                         "ALiBi extrapolates, RoPE meets positions it never trained on")
    args = ap.parse_args(argv)
    checks = (
        # past ~2**30 samples XLA aborts the process while it sizes the buffers
        ("num_samples", 1 <= args.num_samples <= 2**20, "at least 1 and at most 2**20 a call"),
        ("max_new_tokens", 1 <= args.max_new_tokens < 2**31, "at least 1 and below 2**31"),
        ("seed", 0 <= args.seed < 2**31, "in [0, 2**31)"),  # as launch.py's --config.seed
        ("temperature", 0 <= args.temperature < float("inf"), "finite and at least 0 (0: greedy)"),
        ("top_k", args.top_k >= 0, "at least 0 (0: off)"),
        ("top_p", 0 < args.top_p <= 1, "in (0, 1]"),
        ("context", args.context is None or args.context >= 2, "at least 2"),
    )
    for name, ok, need in checks:
        if not ok:
            raise UsageError(f"--{name}={getattr(args, name)} must be {need}")
    return args


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
        rundir = epath.Path(args.rundir)  # local, or gs://
        cfg = read_config(rundir)
        encode, decode = tokenizer(meta := read_dataset_record(rundir, cfg))
        prompt = encode(read_prompt(args.start))
        if not prompt:  # generate would start after a padding id 0 at position 0, as if prompted
            raise UsageError(f"--start={args.start!r} is no token in this run's tokenizer (it "
                             f"drops what the prompt holds): pass a prompt it keeps")
        S = args.context or cfg.block_size
        if len(prompt) > S:
            print(f"note: the prompt has {len(prompt)} tokens; keeping its last {S}",
                  file=sys.stderr)
        if S > cfg.block_size and cfg.position == "rope":
            print(f"note: --context={S} is past block_size={cfg.block_size}: RoPE's positions "
                  f"beyond it were never trained (ALiBi's extrapolate)", file=sys.stderr)
        model, step = restore_model(rundir, cfg, args.step)
    except UsageError as e:
        sys.exit(f"error: {e}")
    prompt = prompt[-S:]
    inputs = (model, prompt_window(prompt, S), jax.random.key(args.seed),
              jnp.float32(args.temperature))
    settings = dict(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                    n_vocab=meta["vocab_size"], top_k=args.top_k, top_p=args.top_p)
    try:
        check_cache(model, cfg, S, special_ids(meta["tokenizer"]))  # an edit decoding misses
        t0 = time.perf_counter()
        compiled = generate.lower(*inputs, **settings).compile()
        t1 = time.perf_counter()
        tokens_BN = jax.device_get(compiled(*inputs, **settings))
    except UsageError as e:
        sys.exit(f"error: {e}")
    except jax.errors.JaxRuntimeError as e:  # XLA's out of memory: a traceback
        if (oom := out_of_memory(e)) is None:
            raise
        # the prompt's window is read in one pass: S x S attention scores a head (a long
        # --context may be meant: ALiBi extrapolates, so it is not refused before)
        sys.exit(f"error: out of memory ({oom[:100]}): the prompt is read "
                 f"in one pass of {S} x {S} attention scores a head: lower --context (the "
                 f"model's block_size is {cfg.block_size}) or --num_samples")
    t2 = time.perf_counter()
    for tokens_N in tokens_BN:
        print(decode(prompt + tokens_N.tolist()))  # together: a BPE character may span the two
        print("-" * 40)
    seconds, device = t2 - t1, jax.devices()[0].device_kind
    print(f"{rundir} step {step}: {tokens_BN.size} tokens "
          f"({args.num_samples} x {args.max_new_tokens}) in {seconds:.2f} s: "
          f"{tokens_BN.size / seconds:,.0f} tokens/s on {device} "
          f"(compilation, {t1 - t0:.1f} s, not counted)")


if __name__ == "__main__":
    main()
