"""Prepare token bins, and read batches from them.

    python data.py shakespeare_char           # tiny-shakespeare's characters (fetched if absent)
    python data.py openwebtext                # HF openwebtext, GPT-2 BPE
    python data.py NAME --source=HF_ID|FILES  # a HF dataset id, or local .txt/.json/.jsonl files
        [--tokenizer=gpt2|HF_ID|path/to/tokenizer.json]  # default: GPT-2's BPE (tiktoken)

Each writes data/NAME/: train.bin and val.bin (flat token ids, uint16 when the vocabulary fits,
else uint32) and meta.json (vocabulary, dtype, token counts, and how to encode/decode text).
"""
import argparse
import hashlib
import json
import os
import sys
import urllib.request
from pathlib import Path

import numpy as np

from text import corpus, tokenization
from configs import Config
from run.errors import ArgumentParser, UsageError

ROOT = Path(__file__).resolve().parent
SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
HF_SOURCES = {"openwebtext": "Skylion007/openwebtext"}
# Streams of the (seed, stream, step) batch generator: training batches, and two fixed eval sets.
TRAIN, EVAL_TRAIN, EVAL_VAL = 0, 1, 2


def data_dir(cfg: Config) -> Path:
    return ROOT / cfg.data_root / cfg.dataset


def write_dataset(out: Path, splits: dict, vocab_size: int, tokenizer: dict) -> None:
    """Write {split}.bin a chunk of ids at a time (openwebtext's 9B ids as int64 are 72 GB), each
    aside as {split}.bin.tmp; then meta.json removed, the bins renamed into place and meta.json
    written last: a write cut off or refused halfway leaves the old dataset, or none."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    meta = {"vocab_size": vocab_size, "dtype": dtype.name}
    try:
        for split, chunks in splits.items():
            meta[f"{split}_tokens"] = 0
            # renamed into place below: a reader's memmap keeps the old inode (not a SIGBUS)
            with open(out / f"{split}.bin.tmp", "wb") as f:
                for chunk in map(np.asarray, chunks):
                    if chunk.size and not 0 <= int(chunk.min()) <= int(chunk.max()) < vocab_size:
                        raise UsageError(f"the tokenizer gave id {int(chunk.max())}, outside its "
                                         f"vocabulary of {vocab_size}: check the tokenizer; "
                                         f"{out} is as it was")
                    chunk.astype(dtype).tofile(f)
                    meta[f"{split}_tokens"] += chunk.size
    except BaseException:
        for split in splits:
            (out / f"{split}.bin.tmp").unlink(missing_ok=True)
        raise
    (out / "meta.json").unlink(missing_ok=True)
    for split in splits:
        os.replace(out / f"{split}.bin.tmp", out / f"{split}.bin")
    meta["tokenizer"] = tokenizer
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"{out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, "
          f"vocab {vocab_size}")


def prepare_shakespeare_char(out: Path) -> None:
    """Characters of tiny-shakespeare: the first 90% train, the last 10% val (as nanoGPT)."""
    src = out / "input.txt"
    if not src.exists():
        print(f"downloading {SHAKESPEARE_URL}")
        # Read whole (1 MB) before writing: a failed download leaves no partial input.txt.
        try:
            text = urllib.request.urlopen(SHAKESPEARE_URL, timeout=60).read()
        except Exception as e:  # offline (URLError), a timeout, a cut-off read
            raise UsageError(f"cannot download {SHAKESPEARE_URL} ({e}): "
                             f"get internet, or put the file at {src}") from None
        out.mkdir(parents=True, exist_ok=True)
        src.write_bytes(text)
    if hashlib.sha256(src.read_bytes()).hexdigest() != SHAKESPEARE_SHA256:
        raise UsageError(f"{src} does not have the tiny-shakespeare sha256 {SHAKESPEARE_SHA256}; "
                         "delete it to download again")
    chars, ids = np.unique(list(src.read_text()), return_inverse=True)  # each char's index
    n = int(len(ids) * 0.9)
    tokenizer = {"kind": "char", "chars": "".join(chars)}
    write_dataset(out, {"train": [ids[:n]], "val": [ids[n:]]}, len(chars), tokenizer)


def prepare_text(out: Path, source: str, text_field: str = "text",
                 val_fraction: float | None = None, tokenizer: str = "gpt2") -> None:
    """The tokens of a HF dataset id or local files (text/corpus.py), each document followed by the
    end-of-text id, split by shuffled documents as nanoGPT's prepare.py does. tokenizer:
    text/tokenization.py's for_documents (GPT-2's BPE by tiktoken, a tokenizer.json, a Hub id)."""
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise UsageError(f"--val_fraction={val_fraction} is not between 0 and 1")
    record, vocab_size, encode = tokenization.for_documents(tokenizer)
    ds = corpus.load(source, text_field)
    if len(ds) < 2:  # a text file's documents are its paragraphs
        raise UsageError(f"{source} has {len(ds)} document(s); a train/val split needs 2 "
                         "(separate them by blank lines)")
    # nanoGPT holds out 0.0005 of openwebtext's 8M documents (~4000); a small corpus needs more.
    default = max(min(len(ds) // 10, 1000), round(0.0005 * len(ds)))
    n_val = round(val_fraction * len(ds)) if val_fraction else default
    n_val = min(max(1, n_val), len(ds) - 1)
    split = ds.train_test_split(test_size=n_val, seed=2357, shuffle=True)
    # half the cores on a large corpus, else none (datasets forks a pool even for one worker)
    workers = min(8, (os.cpu_count() or 2) // 2) if len(ds) > 1000 else 0
    tokens = split.map(lambda row: {"ids": encode(row[text_field])}, remove_columns=ds.column_names,
                       num_proc=workers if workers > 1 else None, desc="tokenizing")

    def chunks(part):  # the ids 8192 documents at a time, read in turn from datasets' disk cache
        return (np.concatenate(batch["ids"]) for batch in part.with_format("numpy").iter(8192))

    splits = {"train": chunks(tokens["train"]), "val": chunks(tokens["test"])}
    write_dataset(out, splits, vocab_size, record)


def read_meta(cfg: Config) -> dict:
    path = data_dir(cfg) / "meta.json"
    # 1 MB of text: prepared where first needed, so the quickstart is one command.
    if not path.exists() and cfg.dataset == "shakespeare_char":
        prepare_shakespeare_char(path.parent)
    if not path.exists():
        raise UsageError(f"no dataset at {path.parent}: "
                         f"prepare it with `python data.py {cfg.dataset}`")
    # All that load_split and tokenizer read: a hand-edited file is one line, not a KeyError.
    try:
        meta = json.loads(path.read_text())
        np.dtype(meta["dtype"])
        int(meta["vocab_size"]), int(meta["train_tokens"]), int(meta["val_tokens"])
        tokenizer = meta["tokenizer"]
        tokenizer[{"char": "chars", "hf": "json"}.get(tokenizer["kind"], "encoding")]
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is corrupt: rerun `python data.py {cfg.dataset}`") from None
    return meta


def load_split(cfg: Config, split: str) -> np.ndarray:
    """The split's tokens as a read-only np.memmap (never read whole into RAM), once checked."""
    meta, path = read_meta(cfg), data_dir(cfg) / f"{split}.bin"
    redo = f"rerun `python data.py {cfg.dataset}`"
    if not path.exists():
        raise UsageError(f"{path} is missing; {redo}")
    dtype = np.dtype(meta["dtype"])
    n_tokens = meta[f"{split}_tokens"]
    if path.stat().st_size != n_tokens * dtype.itemsize:
        raise UsageError(f"{path} is truncated or corrupt: {path.stat().st_size} bytes, "
                         f"meta.json says {n_tokens} {dtype.name} tokens; {redo}")
    if meta["vocab_size"] > cfg.vocab_size:
        raise UsageError(f"dataset {cfg.dataset} has token ids up to {meta['vocab_size'] - 1}, "
                         f"beyond the model's vocab_size={cfg.vocab_size}; "
                         f"set --config.vocab_size={meta['vocab_size']}")
    # Checked before the memmap, which refuses an empty file. A sequence reads block_size + 1
    # tokens (its inputs and, one further, its targets).
    if n_tokens < cfg.block_size + 1:
        fix = split == "val" and cfg.dataset != "shakespeare_char"
        more = ", or prepare it again with a larger --val_fraction" if fix else ""
        raise UsageError(f"block_size={cfg.block_size} (+1 for the targets) is longer than the "
                         f"{split} split of {cfg.dataset} ({n_tokens} tokens); lower "
                         f"--config.block_size{more}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    # Small splits are checked whole; openwebtext's is too big to read through at every start.
    if tokens.size <= 2**28 and int(tokens.max()) >= meta["vocab_size"]:
        raise UsageError(f"{path} holds token id {int(tokens.max())} >= "
                         f"its vocab_size {meta['vocab_size']}: corrupt; {redo}")
    return tokens


def get_batch(tokens: np.ndarray, seed: int, stream: int, step: int, n_seqs: int, block: int,
              rows: slice | np.ndarray = slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, (n_seqs, block) int32 each, at offsets drawn from (seed,
    stream, step) alone: a resumed run reads exactly the batches it would have read. `rows` picks
    this process's share of the sequences (global_batch) without reading the others."""
    rng = np.random.default_rng([seed, stream, step])
    # every offset whose block + 1 tokens fit, the last one too: a split's last token is a target
    starts = rng.integers(0, tokens.size - block, size=n_seqs)[rows]
    buf = np.stack([tokens[s:s + block + 1] for s in starts]).astype(np.int32)
    return buf[:, :-1], buf[:, 1:]


def global_batch(tokens: np.ndarray, seed: int, stream: int, step: int, sharding,
                 shape: tuple) -> tuple:
    """get_batch's sequences as two jax.Arrays of `shape` (..., B, T): B sharded by `sharding`,
    the leading (microbatch) dims whole. Each process reads only the rows of B its devices hold,
    straight from the memmap (midGPT copies train.bin into every host's RAM)."""
    import jax  # here, so that preparing data does not wait for jax to load

    *lead, B, T = shape
    held = sharding.addressable_devices_indices_map(shape).values()
    mine = np.unique(np.concatenate([np.arange(B)[index[-2]] for index in held]))
    G = int(np.prod(lead))
    rows = (np.arange(G)[:, None] * B + mine).ravel()
    x, y = get_batch(tokens, seed, stream, step, G * B, T, rows=rows)
    local = (a.reshape(*lead, len(mine), T) for a in (x, y))
    return tuple(jax.make_array_from_process_local_data(sharding, a, shape) for a in local)


def check_name(name: str) -> None:
    """NAME is one folder of data/: a path would write elsewhere ("" into data/ itself, ../x beside
    the repo) or past the guard on the fixed shakespeare_char (shakespeare_char/, or
    Shakespeare_Char, the same folder on a case-insensitive disk: macOS's, Windows')."""
    if name in ("", ".", "..") or "/" in name or os.sep in name or (os.altsep or "/") in name:
        raise UsageError(f"dataset name {name!r} is not a folder name: NAME is the dataset's "
                         f"folder under {Config.data_root}/, without / or .. (mycorpus, say)")
    if name != "shakespeare_char" and name.strip(" .").casefold() == "shakespeare_char":
        raise UsageError(f"dataset name {name!r} is the fixed shakespeare_char's folder on some "
                         f"disks: name your dataset otherwise")


def main():
    ap = ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="dataset name: the folder under data/ "
                                 "(shakespeare_char, openwebtext, ...)")
    ap.add_argument("--source", help="HF dataset id, or local files: a file, a quoted glob, "
                                     "a folder (searched recursively)")
    ap.add_argument("--text_field", default="text", help="the text column of a HF or JSON dataset")
    ap.add_argument("--tokenizer", default="gpt2", help="gpt2 (tiktoken), a Hugging Face "
                                                         "tokenizer's id or its tokenizer.json")
    ap.add_argument("--val_fraction", type=float, help="the documents held out for val "
                                                       "(default: 10%%, <= 1000, >= 0.0005)")
    args = ap.parse_args()
    out = ROOT / Config.data_root / args.name
    try:
        check_name(args.name)
        fixed = (args.source, args.val_fraction is not None, args.tokenizer != "gpt2")
        if args.name == "shakespeare_char" and any(fixed):
            raise UsageError("shakespeare_char is the fixed tiny-shakespeare text (no --source, "
                             "--val_fraction, --tokenizer): for your own text, use another NAME")
        elif args.name == "shakespeare_char":
            prepare_shakespeare_char(out)
        elif args.source or args.name in HF_SOURCES:
            source = args.source or HF_SOURCES[args.name]
            if (out / "meta.json").exists():  # documented, but a run on it then cannot resume
                print(f"note: replacing the dataset in {out}: a run trained on it resumes only "
                      "on the same tokens (prepare it as it was)", file=sys.stderr)
            prepare_text(out, source, args.text_field, args.val_fraction, args.tokenizer)
        else:
            raise UsageError(f"don't know where {args.name!r} comes from: "
                             "pass --source=HF_ID or --source='files/*.txt'")
    except UsageError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
