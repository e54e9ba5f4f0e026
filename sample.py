"""Generate text from a run:
    python sample.py --rundir=DIR [--start=TEXT | --start=FILE:path] [--step=S]
    [--num_samples=N] [--max_new_tokens=N] [--temperature=T] [--top_k=K] [--top_p=P] [--seed=S]
    [--context=N]

Decoding keeps a key/value cache of S positions (--context, default block_size: the model was
trained on those) and runs in one jitted lax.scan, one token per step for all samples at once. A
longer prompt keeps its last S tokens, and when the cache is full the window slides by half: the
last S // 2 tokens are run again from position 0 (a fresh cache) and generation goes on, so every
new token sees S // 2 to S tokens.

Shapes as in model.py, plus S cache positions (--context) and N new tokens per sample."""
import argparse
import json
import logging
import sys
import time
from functools import partial
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

import data
import tokenization
from configs import Config, UsageError
from model import GPT, KVCache
from params import init_gpt


def empty_cache(model: GPT, S: int) -> KVCache:
    """A KV cache of S positions: zeros, L in front (SharedKV keeps the values only)."""
    attn = model.blocks.attn
    (L, _, K, _), G = attn.out.shape, attn.kv_heads
    zeros = jnp.zeros((L, S, G, K), model.dtype)
    return KVCache(None if attn.shared_kv else zeros, zeros)


def extend(model: GPT, cache: KVCache, tokens_T: jax.Array, start) -> tuple[jax.Array, KVCache]:
    """Run tokens_T at positions start..start+T-1 through the blocks, writing their keys and values
    into the cache there; each attends to the cache's positions up to its own. Serves the prefill
    (T = S, start 0) and each decode step (T = 1) by model.hidden itself, so training and decoding
    cannot drift apart. Returns the last block's output and the cache."""
    return model.hidden(tokens_T, start, cache)


def pick(logits_V: jax.Array, key: jax.Array, temperature, n_vocab: int, top_k: int,
         top_p: float) -> jax.Array:
    """One token: argmax at temperature 0, else a draw from softmax(logits / temperature) among the
    top_k likeliest tokens (0: all), then the smallest set holding top_p of the mass. The
    temperature is traced (no recompilation per value); top_k and top_p shape the program."""
    # The model pads its vocabulary (cfg.vocab_multiple); the padding rows are untrained ids the
    # tokenizer cannot decode.
    valid_V = jnp.arange(logits_V.shape[0]) < n_vocab
    greedy = jnp.argmax(jnp.where(valid_V, logits_V, -jnp.inf))
    # shifted to max 0, then masked: a tiny temperature gives -inf, a huge one 0, never inf - inf
    scaled_V = (logits_V - logits_V[greedy]) / jnp.where(temperature > 0, temperature, 1.0)
    logits_V = jnp.where(valid_V, scaled_V, -jnp.inf)
    if top_k:
        kth = jax.lax.top_k(logits_V, min(top_k, n_vocab))[0][-1]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    # nucleus sampling (Holtzman et al. 2020): keep a token if the mass before it is < top_p
    if top_p < 1:
        sorted_V = jnp.sort(logits_V)[::-1]
        probs_V = jax.nn.softmax(sorted_V)
        n_keep = jnp.sum(jnp.cumsum(probs_V) - probs_V < top_p)
        logits_V = jnp.where(logits_V < sorted_V[n_keep - 1], -jnp.inf, logits_V)
    return jnp.where(temperature > 0, jax.random.categorical(key, logits_V), greedy)


# not jax.jit: a model with tied embeddings holds a non-array leaf (eqx.nn.Shared)
@eqx.filter_jit
def generate(model: GPT, prompt_S: jax.Array, key: jax.Array, temperature: jax.Array, *,
             num_samples: int, max_new_tokens: int, n_vocab: int, top_k: int = 0,
             top_p: float = 1.0) -> jax.Array:
    """(num_samples, max_new_tokens) tokens following the prompt: prompt_S is its tokens padded
    with -1 to the cache length S (prompt_window), so one compilation serves every prompt length;
    key and temperature are traced arrays too (a Python float would be compiled in). The shared
    prompt is prefilled once and its cache copied to every sample; then a lax.scan, one token a
    step, the batch added by jax.vmap around extend. Sample b's step i draws with
    fold_in(fold_in(key, b), i), so a sample does not depend on how many others are drawn."""
    S, B = prompt_S.shape[0], num_samples
    n_prompt, prompt_S = jnp.sum(prompt_S >= 0), jnp.maximum(prompt_S, 0)
    keep = S // 2  # tokens kept when the window slides
    sample_keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    pick_B = jax.vmap(partial(pick, n_vocab=n_vocab, top_k=top_k, top_p=top_p), (0, 0, None))
    extend_B = jax.vmap(extend, in_axes=(None, 0, 0, None))

    def draw(logits_BV, i):
        keys_B = jax.vmap(jax.random.fold_in, (0, None))(sample_keys_B, i)
        return pick_B(logits_BV, keys_B, temperature)

    x_SD, cache = extend(model, empty_cache(model, S), prompt_S, 0)
    logits_V = model.logits(jax.lax.dynamic_slice_in_dim(x_SD, n_prompt - 1, 1))[0]
    first_B = draw(jnp.broadcast_to(logits_V, (B, *logits_V.shape)), 0)
    cache_B = jax.tree.map(lambda c: jnp.broadcast_to(c, (B, *c.shape)), cache)
    window_BS = jnp.broadcast_to(prompt_S, (B, S))  # the tokens whose keys the cache holds

    def slide(cache_B, window_BS):
        window_BS = jnp.roll(window_BS, keep - S, axis=1)  # the last `keep` tokens to the front
        # Rerun from position 0: positions >= keep get keys of the rolled-over tokens, which the
        # position mask hides until the new tokens overwrite them.
        return extend_B(model, cache_B, window_BS, 0)[1], window_BS, jnp.int32(keep)

    def step(carry, i):
        cache_B, window_BS, token_B, pos = carry  # token_B: the newest, not yet in the cache
        # pos is one number for all samples (they share the prompt), so this cond is a real branch,
        # not a select that would run the slide's prefill at every step.
        unchanged = lambda c, w: (c, w, pos)
        cache_B, window_BS, pos = jax.lax.cond(pos == S, slide, unchanged, cache_B, window_BS)
        window_BS = jax.lax.dynamic_update_slice_in_dim(window_BS, token_B[:, None], pos, axis=1)
        x_B1D, cache_B = extend_B(model, cache_B, token_B[:, None], pos)
        token_B = draw(jax.vmap(model.logits)(x_B1D)[:, 0], i)
        return (cache_B, window_BS, token_B, pos + 1), token_B

    carry = (cache_B, window_BS, first_B, n_prompt.astype(jnp.int32))
    _, rest_NB = jax.lax.scan(step, carry, jnp.arange(1, max_new_tokens))
    return jnp.concatenate([first_B[:, None], rest_NB.T], axis=1)


def prompt_window(prompt: list[int], S: int) -> jax.Array:
    """The prompt's last S tokens, padded with -1 to S tokens: generate's fixed shape."""
    window = np.full(S, -1, np.int32)  # numpy: each eager jnp op here compiled on its own
    window[:len(prompt[-S:])] = prompt[-S:]
    return jnp.asarray(window)


def preview(model: GPT, cfg: Config, prompt: list[int], n: int = 128) -> str:
    """One short sample for the training log (train.py writes one at each evaluation): the prompt
    and n tokens at temperature 1, drawn with the same key every time, so successive ones show what
    training changed."""
    meta = data.read_meta(cfg)
    prompt_S = prompt_window(prompt, cfg.block_size)
    tokens_1N = generate(model, prompt_S, jax.random.key(cfg.seed), jnp.float32(1.0),
                         num_samples=1, max_new_tokens=n, n_vocab=meta["vocab_size"])
    return tokenizer(meta)[1](prompt + jax.device_get(tokens_1N)[0].tolist())


def tokenizer(meta: dict):
    """(encode, decode) between text and token ids, as a dataset's meta.json says."""
    return tokenization.load(meta["tokenizer"])


def read_dataset_record(rundir: epath.Path, cfg: Config) -> dict:
    """launch.py's copy of the dataset's meta.json, else (an older run, or unreadable) its own."""
    try:
        return json.loads((rundir / "dataset.json").read_text())
    except (OSError, ValueError):
        return data.read_meta(cfg)


def read_config(rundir: epath.Path) -> Config:
    """The run's resolved config (launch.py's config.json); missing fields get today's defaults."""
    if not rundir.is_dir():
        raise UsageError(f"no run directory {rundir}")
    if not (rundir / "config.json").exists():
        raise UsageError(f"{rundir} holds no run: it has no config.json")
    saved = json.loads((rundir / "config.json").read_text())
    if unknown := sorted(set(saved) - set(Config.__dataclass_fields__)):
        fields = ", ".join(unknown)
        raise UsageError(f"{rundir}/config.json has fields this code does not know ({fields}): "
                         "a run of another version of mugpt")
    return Config(**saved)


def restore_model(rundir: epath.Path, cfg: Config, step: int | None) -> tuple[GPT, int]:
    """The model of the run's checkpoint of `step` (default: the latest), on one device: sampling
    needs no mesh and no optimizer state. It runs model.py's functions, no fused kernels."""
    import checkpoint  # with orbax, slow to load: bad arguments are reported before it

    # orbax warns of each option a read-only manager overrides
    logging.getLogger("absl").setLevel(logging.ERROR)
    mngr = checkpoint.checkpoint_manager(rundir, cfg, read_only=True)
    steps = sorted(mngr.all_steps())
    if not steps:
        raise UsageError(f"{rundir} has no checkpoint yet (training writes one every "
                         f"ckpt_interval={cfg.ckpt_interval} steps and at the end)")
    if step is not None and step not in steps:
        have = ", ".join(map(str, steps))
        raise UsageError(f"--step={step}: {rundir} has checkpoints of steps {have} only")
    step = steps[-1] if step is None else step
    placeholders = init_gpt(cfg, jax.random.key(0))  # on the default device; replaced
    try:
        return checkpoint.restore_model(mngr, placeholders, step), step
    except checkpoint.Damaged as e:  # left as it is: someone else's run, perhaps still training
        others = ", ".join(str(s) for s in steps if s != step)
        raise UsageError(f"{e}" + (f" (pass --step=: there are also {others})" if others else ""))


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
    ap = argparse.ArgumentParser(description=__doc__,
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
        ("num_samples", args.num_samples >= 1, "at least 1"),
        ("max_new_tokens", args.max_new_tokens >= 1, "at least 1"),
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
    t0 = time.perf_counter()
    compiled = generate.lower(*inputs, **settings).compile()
    t1 = time.perf_counter()
    tokens_BN = jax.device_get(compiled(*inputs, **settings))
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
