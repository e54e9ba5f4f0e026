"""Prepare token bins, and read batches from them.

    python data.py shakespeare_char            # characters of tiny-shakespeare (downloaded when absent)
    python data.py openwebtext                 # HF openwebtext, GPT-2 BPE
    python data.py NAME --source=HF_ID|FILES   # any HF dataset id, or local .txt/.json/.jsonl files

Each writes data/NAME/: train.bin and val.bin (flat token ids, uint16 when the vocabulary fits,
else uint32) and meta.json (vocabulary, dtype, token counts, and how to encode/decode text).
"""
import argparse
import glob
import hashlib
import json
import math
import os
import urllib.request
from pathlib import Path

import numpy as np

from configs import Config, UsageError

ROOT = Path(__file__).resolve().parent
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
HF_SOURCES = {"openwebtext": "Skylion007/openwebtext"}
# Streams of the (seed, stream, step) batch generator: training batches and the two fixed eval sets.
TRAIN, EVAL_TRAIN, EVAL_VAL = 0, 1, 2


def data_dir(cfg: Config) -> Path:
    return ROOT / cfg.data_root / cfg.dataset


def write_dataset(out: Path, splits: dict, vocab_size: int, tokenizer: dict) -> None:
    """Write {split}.bin from each split's chunks of token ids, one chunk in memory at a time (openwebtext's
    9B ids as int64 are 72 GB), then meta.json: removed first and written last, so a dataset cut off
    halfway has none and load_split refuses it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    counts = {}
    for split, chunks in splits.items():
        counts[f"{split}_tokens"] = 0
        with open(out / f"{split}.bin", "wb") as f:
            for chunk in map(np.asarray, chunks):
                assert chunk.size == 0 or 0 <= int(chunk.min()) <= int(chunk.max()) < vocab_size
                chunk.astype(dtype).tofile(f)
                counts[f"{split}_tokens"] += chunk.size
    meta = {"vocab_size": vocab_size, "dtype": np.dtype(dtype).name, **counts, "tokenizer": tokenizer}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def prepare_shakespeare_char(out: Path) -> None:
    """Characters of tiny-shakespeare: the first 90% train, the last 10% val (as nanoGPT)."""
    src = out / "input.txt"
    if not src.exists():
        out.mkdir(parents=True, exist_ok=True)
        print(f"downloading {SHAKESPEARE_URL}")
        urllib.request.urlretrieve(SHAKESPEARE_URL, src)
    if hashlib.sha256(src.read_bytes()).hexdigest() != SHAKESPEARE_SHA256:
        raise UsageError(f"{src} does not have the tiny-shakespeare sha256 {SHAKESPEARE_SHA256}; delete it to download again")
    text = src.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
    n = int(len(ids) * 0.9)
    write_dataset(out, {"train": [ids[:n]], "val": [ids[n:]]}, len(chars), {"kind": "char", "chars": "".join(chars)})


def prepare_text(out: Path, source: str, text_field: str = "text", val_fraction: float = 0.0005) -> None:
    """GPT-2 BPE (tiktoken, encode_ordinary + <|endoftext|> after each document) of a HF dataset id
    or of local files; the split and shard-wise writing follow nanoGPT's prepare.py."""
    import datasets
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    files = sorted(glob.glob(source, recursive=True)) if not Path(source).is_dir() else \
        sorted(str(p) for p in Path(source).iterdir() if p.suffix in (".txt", ".json", ".jsonl"))
    if files:  # local corpus: .txt split into paragraphs (blank lines), .json/.jsonl one document per record
        kind = "text" if files[0].endswith(".txt") else "json"
        kwargs = {"sample_by": "paragraph"} if kind == "text" else {}
        ds = datasets.load_dataset(kind, data_files=files, split="train", **kwargs)
    else:
        try:
            ds = datasets.load_dataset(source, split="train", trust_remote_code=False)
        except Exception as e:  # not found, no network, ...: datasets' own reason, on one line
            reason = " ".join(str(e).split())[:300]
            raise UsageError(f"no local files match {source!r}, and as a Hugging Face dataset id it failed: "
                             f"{type(e).__name__}: {reason}") from None
    if text_field not in ds.column_names:
        raise UsageError(f"{source} has no field {text_field!r} (fields: {ds.column_names}); pass --text_field")
    if len(ds) < 2:
        raise UsageError(f"{source} has {len(ds)} document(s); at least 2 are needed for a train/val split")
    split = ds.train_test_split(test_size=max(1, round(val_fraction * len(ds))), seed=2357, shuffle=True)
    encode = lambda row: {"ids": enc.encode_ordinary(row[text_field]) + [enc.eot_token]}
    nproc = max(1, min(8, (os.cpu_count() or 2) // 2)) if len(ds) > 1000 else None

    def chunks(part, name: str):  # the ids shard by shard, each read from datasets' on-disk cache in turn
        tokens = part.map(encode, remove_columns=part.column_names, num_proc=nproc, desc=f"tokenizing {name}")
        shards = min(1024, len(tokens))
        return (np.concatenate(tokens.shard(shards, i, contiguous=True).with_format("numpy")["ids"]) for i in range(shards))

    write_dataset(out, {"train": chunks(split["train"], "train"), "val": chunks(split["test"], "val")}, enc.n_vocab,
                  {"kind": "tiktoken", "encoding": "gpt2"})


def tokenizer(meta: dict):
    """(encode, decode) between text and token ids, as meta.json's tokenizer entry says."""
    tok = meta["tokenizer"]
    if tok["kind"] == "char":
        index = {c: i for i, c in enumerate(tok["chars"])}

        def encode(text: str) -> list[int]:
            unknown = sorted(set(text) - index.keys())
            if unknown:
                raise UsageError(f"characters {''.join(unknown)!r} are not in the dataset's vocabulary")
            return [index[c] for c in text]

        return encode, lambda ids: "".join(tok["chars"][i] for i in ids)
    import tiktoken

    enc = tiktoken.get_encoding(tok["encoding"])
    return (lambda text: enc.encode_ordinary(text)), (lambda ids: enc.decode(list(ids)))


def read_meta(cfg: Config) -> dict:
    path = data_dir(cfg) / "meta.json"
    if not path.exists() and cfg.dataset == "shakespeare_char":  # 1 MB: prepared where first needed (the quickstart)
        prepare_shakespeare_char(path.parent)
    if not path.exists():
        raise UsageError(f"no dataset at {path.parent}: prepare it with `python data.py {cfg.dataset}`")
    return json.loads(path.read_text())


def run_tokenizer(rundir, cfg: Config, launching: bool = False) -> dict:
    """meta.json's vocab_size and tokenizer as the run has them: launch.py keeps a copy in RUNDIR/tokenizer.json,
    so that sample.py decodes a run whatever becomes of its dataset, and a resume refuses a dataset that
    was prepared again with another vocabulary (its token ids would mean other text)."""
    path = rundir / "tokenizer.json"
    if path.exists() and not launching:
        return json.loads(path.read_text())
    meta = read_meta(cfg)
    meta = {"vocab_size": meta["vocab_size"], "tokenizer": meta["tokenizer"]}
    if launching and path.exists() and json.loads(path.read_text()) != meta:
        raise UsageError(f"{data_dir(cfg)} has another vocabulary than the one {rundir} trained with ({path}): "
                         f"prepare the dataset as it was, or start a new --rundir")
    if launching:
        path.write_text(json.dumps(meta, indent=1))
    return meta


def load_split(cfg: Config, split: str) -> np.ndarray:
    """The split's tokens as a read-only np.memmap (never read whole into RAM), after checks that
    it is intact and fits the model."""
    meta, path = read_meta(cfg), data_dir(cfg) / f"{split}.bin"
    redo = f"rerun `python data.py {cfg.dataset}`"
    if not path.exists():
        raise UsageError(f"{path} is missing; {redo}")
    dtype = np.dtype(meta["dtype"])
    if path.stat().st_size != meta[f"{split}_tokens"] * dtype.itemsize:
        raise UsageError(f"{path} is truncated or corrupt: {path.stat().st_size} bytes, meta.json says "
                         f"{meta[f'{split}_tokens']} {dtype.name} tokens; {redo}")
    if meta["vocab_size"] > cfg.vocab_size:
        raise UsageError(f"dataset {cfg.dataset} has token ids up to {meta['vocab_size'] - 1}, beyond the model's "
                         f"vocab_size={cfg.vocab_size}; set --config.vocab_size={meta['vocab_size']}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if tokens.size <= 2**28 and tokens.size and int(tokens.max()) >= meta["vocab_size"]:  # a scan costs < 1 s
        raise UsageError(f"{path} holds token id {int(tokens.max())} >= its vocab_size {meta['vocab_size']}: corrupt; {redo}")
    if tokens.size < cfg.block_size + 2:
        raise UsageError(f"block_size={cfg.block_size} is longer than the {split} split of {cfg.dataset} "
                         f"({tokens.size} tokens); lower --config.block_size")
    return tokens


def get_batch(tokens: np.ndarray, seed: int, stream: int, step: int, n_seqs: int, block: int,
              rows: slice | np.ndarray = slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, (n_seqs, block) int32 each, at offsets drawn from (seed, stream,
    step) alone: a resumed run reads exactly the batches it would have read. `rows` picks this
    process's share of the sequences (global_batch) without reading the others."""
    starts = np.random.default_rng([seed, stream, step]).integers(0, tokens.size - block - 1, size=n_seqs)[rows]
    buf = np.stack([tokens[s:s + block + 1] for s in starts]).astype(np.int32)
    return buf[:, :-1], buf[:, 1:]


def global_batch(tokens: np.ndarray, seed: int, stream: int, step: int | range, sharding, shape: tuple) -> tuple:
    """get_batch's sequences as two jax.Arrays of `shape` (..., B, T), B sharded by `sharding` and the
    leading dims (microbatches) whole; for a range of steps, theirs stacked on a new leading axis. Each
    process reads only the rows its devices hold, straight from the memmap (midGPT copies all of
    train.bin into every host's RAM), and make_array_from_process_local_data joins the processes' shares."""
    import jax  # here, so that preparing data does not wait for jax to load

    *lead, B, T = shape
    steps, shape = (step, (len(step), *shape)) if isinstance(step, range) else ([step], tuple(shape))
    held = sharding.addressable_devices_indices_map(shape).values()
    mine = np.unique(np.concatenate([np.arange(B)[index[-2]] for index in held]))  # this process's rows of B
    G = math.prod(lead)
    rows = (np.arange(G)[:, None] * B + mine).ravel()
    x, y = zip(*(get_batch(tokens, seed, stream, s, G * B, T, rows=rows) for s in steps))
    return tuple(jax.make_array_from_process_local_data(sharding, np.stack(a).reshape(*shape[:-2], len(mine), T), shape)
                 for a in (x, y))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="dataset name: the folder under data/ (shakespeare_char, openwebtext, ...)")
    ap.add_argument("--source", help="HF dataset id, a folder, or a glob of local .txt/.json/.jsonl files")
    ap.add_argument("--text_field", default="text", help="the text column of a HF or JSON dataset")
    args = ap.parse_args()
    out = ROOT / Config.data_root / args.name
    try:
        if args.name == "shakespeare_char":
            prepare_shakespeare_char(out)
        elif args.source or args.name in HF_SOURCES:
            prepare_text(out, args.source or HF_SOURCES[args.name], args.text_field)
        else:
            raise UsageError(f"don't know where {args.name!r} comes from: pass --source=HF_ID or --source='files/*.txt'")
    except UsageError as e:
        raise SystemExit(f"error: {e}")
    meta = json.loads((out / "meta.json").read_text())
    print(f"{out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']}")


if __name__ == "__main__":
    main()
