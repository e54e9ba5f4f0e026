"""Preparing and reading token bins."""
import dataclasses
import hashlib
import json

import numpy as np
import pytest

import data
from configs import UsageError
from conftest import tiny


def test_shakespeare_char_counts(shakespeare):
    meta = json.loads((shakespeare / "meta.json").read_text())
    assert hashlib.sha256((shakespeare / "input.txt").read_bytes()).hexdigest() == data.SHAKESPEARE_SHA256
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (1_003_854, 111_540, 65)
    assert meta["dtype"] == "uint16"
    train = data.load_split(tiny(), "train")
    assert isinstance(train, np.memmap) and train.size == 1_003_854
    encode, decode = data.tokenizer(meta)
    text = (shakespeare / "input.txt").read_text()
    assert decode(train[:1000].tolist()) == text[:1000]  # the bins hold the text itself
    sample = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert decode(encode(sample)) == sample
    with pytest.raises(UsageError, match="not in the dataset's vocabulary"):
        encode("café")


def test_batch_is_a_function_of_seed_and_step(shakespeare):
    tokens = data.load_split(tiny(), "train")
    a = data.get_batch(tokens, 0, data.TRAIN, 7, 8, 32)
    b = data.get_batch(tokens, 0, data.TRAIN, 7, 8, 32)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one
    assert not np.array_equal(a[0], data.get_batch(tokens, 0, data.TRAIN, 8, 8, 32)[0])
    assert not np.array_equal(a[0], data.get_batch(tokens, 1, data.TRAIN, 7, 8, 32)[0])
    assert not np.array_equal(a[0], data.get_batch(tokens, 0, data.EVAL_TRAIN, 7, 8, 32)[0])
    rows = data.get_batch(tokens, 0, data.TRAIN, 7, 8, 32, rows=slice(4, 8))  # one process's share
    np.testing.assert_array_equal(rows[0], a[0][4:])


@pytest.mark.parametrize("source", ["folder", "absolute glob"])
def test_gpt2_bpe_on_a_local_corpus(tmp_path, source):
    import tiktoken

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    paragraphs = [f"Paragraph {i}: the quick brown fox jumps over the lazy dog, {i * i} times.\nA second line."
                  for i in range(40)]
    (corpus / "a.txt").write_text("\n\n".join(paragraphs[:20]))
    (corpus / "b.txt").write_text("\n\n".join(paragraphs[20:]))
    out = tmp_path / "data" / "mycorpus"
    data.prepare_text(out, str(corpus) if source == "folder" else str(corpus / "*.txt"), val_fraction=0.1)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16" and meta["tokenizer"]["kind"] == "tiktoken"
    enc = tiktoken.get_encoding("gpt2")
    cfg = tiny(dataset="mycorpus", data_root=str(tmp_path / "data"), vocab_size=50257, block_size=8)
    ids = np.concatenate([data.load_split(cfg, "train"), data.load_split(cfg, "val")])
    docs = enc.decode(ids.tolist()).split("<|endoftext|>")
    assert docs[-1] == "" and sorted(docs[:-1]) == sorted(paragraphs)  # every paragraph once, EOT after each
    assert (ids == enc.eot_token).sum() == 40
    assert meta["val_tokens"] > 0 and meta["train_tokens"] > meta["val_tokens"]


def test_a_source_that_matches_nothing_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="no local files match .*none\\*.txt.*FileNotFoundError"):
        data.prepare_text(tmp_path / "out", str(tmp_path / "none*.txt"))


def test_uint32_when_the_vocabulary_is_large_written_in_chunks(tmp_path):
    ids = np.array([0, 70_000, 65_536, 3, 99_999] * 10)
    data.write_dataset(tmp_path / "big", {"train": np.split(ids, [7, 7, 30]), "val": [ids[:20]]}, 100_000,
                       {"kind": "tiktoken", "encoding": "none"})
    cfg = tiny(dataset="big", data_root=str(tmp_path), vocab_size=100_000, block_size=4)
    tokens = data.load_split(cfg, "train")
    assert tokens.dtype == np.uint32
    np.testing.assert_array_equal(tokens, ids)


@pytest.fixture
def small_dataset(tmp_path):
    ids = np.arange(200) % 50
    data.write_dataset(tmp_path / "small", {"train": [ids], "val": [ids[:40]]}, 50, {"kind": "char", "chars": "x" * 50})
    return dataclasses.replace(tiny(dataset="small", data_root=str(tmp_path), vocab_size=50, block_size=16)), tmp_path / "small"


def test_a_write_cut_off_leaves_no_dataset(small_dataset):
    cfg, path = small_dataset

    def failing():
        yield np.arange(10)
        raise KeyboardInterrupt  # as Ctrl-C halfway through tokenizing

    with pytest.raises(KeyboardInterrupt):
        data.write_dataset(path, {"train": failing(), "val": [np.arange(10)]}, 50, {"kind": "char", "chars": "x" * 50})
    with pytest.raises(UsageError, match="no dataset at .*python data.py small"):
        data.load_split(cfg, "train")


def test_truncated_bin_is_reported(small_dataset):
    cfg, path = small_dataset
    with open(path / "train.bin", "r+b") as f:
        f.truncate(101)
    with pytest.raises(UsageError, match="truncated or corrupt.*python data.py small"):
        data.load_split(cfg, "train")


def test_ids_beyond_the_vocabulary_are_reported(small_dataset):
    cfg, path = small_dataset
    with pytest.raises(UsageError, match="vocab_size=50"):
        data.load_split(dataclasses.replace(cfg, vocab_size=40), "train")
    corrupt = np.fromfile(path / "train.bin", dtype=np.uint16)
    corrupt[7] = 999
    corrupt.tofile(path / "train.bin")
    with pytest.raises(UsageError, match="token id 999"):
        data.load_split(cfg, "train")


def test_block_longer_than_data_and_missing_data_are_reported(small_dataset):
    cfg, path = small_dataset
    with pytest.raises(UsageError, match="block_size=64 is longer than the val split"):
        data.load_split(dataclasses.replace(cfg, block_size=64), "val")
    with pytest.raises(UsageError, match="python data.py nothing"):
        data.load_split(dataclasses.replace(cfg, dataset="nothing"), "train")
