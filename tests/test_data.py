"""Preparing and reading token bins."""
import dataclasses
import hashlib
import json
import re
import sys
import time

import numpy as np
import pytest

import data
from run import reading
from run.errors import UsageError
from conftest import ROOT, run, run_each, tiny


def test_shakespeare_char_counts(shakespeare):
    meta = json.loads((shakespeare / "meta.json").read_text())
    assert hashlib.sha256((shakespeare / "input.txt").read_bytes()).hexdigest() == data.SHAKESPEARE_SHA256
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (1_003_854, 111_540, 65)
    assert meta["dtype"] == "uint16"
    train = data.load_split(tiny(), "train")
    assert isinstance(train, np.memmap) and train.size == 1_003_854
    encode, decode = reading.tokenizer(meta)
    text = (shakespeare / "input.txt").read_text()
    assert decode(train[:1000].tolist()) == text[:1000]  # the bins hold the text itself
    line = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert decode(encode(line)) == line
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


def test_every_token_of_a_split_is_read_the_last_one_as_a_target():
    """Offsets are drawn from every place a sequence's T + 1 tokens fit (nanoGPT's get_batch):
    tokens 0..N-1, each token its offset, so the draws show which offsets can occur."""
    N, T = 12, 4
    x, y = data.get_batch(np.arange(N, dtype=np.uint16), 0, data.TRAIN, 0, 2000, T)
    assert set(x[:, 0].tolist()) == set(range(N - T))  # the last start, N - T - 1, among them
    assert x.min() == 0 and y.max() == N - 1
    x, y = data.get_batch(np.arange(T + 1, dtype=np.uint16), 0, data.TRAIN, 0, 3, T)
    np.testing.assert_array_equal(x, np.tile(np.arange(T), (3, 1)))  # a split of T + 1: itself
    np.testing.assert_array_equal(y, x + 1)


def documented_batch(seed: int, stream: int, step: int, G: int, B: int, T: int, N: int):
    """get_batch's docstring written out for tokens 0, 1, ..., N-1 (a token is its offset): step's
    G * B sequences start at offsets drawn uniformly from [0, N - T) by numpy's PCG64 seeded
    with the SeedSequence of (seed, stream, step), microbatch g's row b the (g B + b)-th draw;
    the targets are the next tokens. (G, B, T) each."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, step])))
    starts = rng.integers(0, N - T, size=G * B).reshape(G, B)
    x = starts[..., None] + np.arange(T)
    return x, x + 1


def test_the_batch_of_each_step_is_the_documented_one():
    """data.global_batch for steps 0..4 (two microbatches, one process, its one device) against
    the formula; two processes: the next test."""
    import jax
    from jax.sharding import NamedSharding

    import train

    N, G, B, T = 5000, 2, 8, 16
    tokens = np.arange(N, dtype=np.uint16)
    sharding = NamedSharding(train.make_mesh(tiny()), train.BATCH_SPEC)
    for step in range(5):
        got = data.global_batch(tokens, 3, data.TRAIN, step, sharding, (G, B, T))
        for a, want in zip(jax.device_get(got), documented_batch(3, data.TRAIN, step, G, B, T, N)):
            np.testing.assert_array_equal(a, want)
    # another stream draws other offsets (the evaluations' fixed sets are not training batches)
    x, _ = data.global_batch(tokens, 3, data.EVAL_VAL, 0, sharding, (G, B, T))
    assert not np.array_equal(jax.device_get(x), documented_batch(3, data.TRAIN, 0, G, B, T, N)[0])


def test_two_processes_read_the_documented_batches():
    """Two processes x 2 devices (jax.distributed on 127.0.0.1): each one's shards of steps
    0..4, on a 1 x 4 and a 2 x 2 mesh, are the formula's rows (tests/batch_probe.py asserts)."""
    from test_multihost import free_port

    probe, port = str(ROOT / "tests/batch_probe.py"), free_port()
    results = run_each([[probe, f"127.0.0.1:{port}", str(i)] for i in range(2)], None, 120, [2, 2])
    for i, r in enumerate(results):
        assert r.returncode == 0 and f"process {i}: ok" in r.stdout, r.stderr[-3000:]


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


def eot_counts(out):
    """The documents in each split: <|endoftext|> ends each one (GPT-2's id 50256)."""
    return [int((np.fromfile(out / f"{split}.bin", dtype=np.uint16) == 50256).sum()) for split in ("train", "val")]


@pytest.mark.parametrize("n_docs, val_fraction, n_val", [(200, None, 20), (10_500, None, 1000), (200, 0.25, 50)])
def test_val_split_is_a_tenth_of_the_documents_at_most_1000(tmp_path, n_docs, val_fraction, n_val):
    """In a process of its own, as `python data.py` prepares: over 1000 documents, datasets' map
    forks workers on a machine of 4 cores or more, which this JAX-threaded process must not do."""
    (tmp_path / "c.txt").write_text("\n\n".join(f"d{i}" for i in range(n_docs)))
    script = ("import json, sys, data; from pathlib import Path\n"
              "data.prepare_text(Path(sys.argv[1]), sys.argv[2], val_fraction=json.loads(sys.argv[3]))")
    r = run(["-c", script, str(tmp_path / "out"), str(tmp_path / "c.txt"), json.dumps(val_fraction)])
    assert r.returncode == 0, r.stderr
    assert eot_counts(tmp_path / "out") == [n_docs - n_val, n_val]


def test_a_source_that_matches_nothing_fails_at_once(tmp_path):
    for source in [tmp_path / "none*.txt", tmp_path / "none.txt", "data/no_such_corpus", tmp_path]:  # tmp_path: empty
        start = time.monotonic()
        with pytest.raises(UsageError, match=f"no files in '{re.escape(str(source))}'.*check it, or quote a glob"):
            data.prepare_text(tmp_path / "out", str(source))
        assert time.monotonic() - start < 5  # not the Hub's retries
    with pytest.raises(UsageError, match="--val_fraction=1.0 is not between 0 and 1"):
        data.prepare_text(tmp_path / "out", str(tmp_path), val_fraction=1.0)


def test_any_suffix_is_text_folders_are_searched_and_each_file_is_read_by_its_kind(tmp_path):
    import tiktoken

    (tmp_path / "corpus" / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "corpus" / "sub" / "deeper" / "a.TXT").write_text("alpha one\nline two\n\n\n  \nalpha three\n")
    (tmp_path / "corpus" / "sub" / "b.jsonl").write_text('{"text": "json doc\\n\\nwith a blank line", "id": 1}\n\n{"text": "json two"}\n')
    (tmp_path / "corpus" / "notes.md").write_text("md one\n\nmd two")  # not .txt: a folder search passes over it
    enc = tiktoken.get_encoding("gpt2")
    for source, docs in [(tmp_path / "corpus", ["alpha one\nline two", "alpha three", "json doc\n\nwith a blank line", "json two"]),
                         (tmp_path / "corpus" / "*.md", ["md one", "md two"])]:
        data.prepare_text(tmp_path / "out", str(source))
        ids = np.concatenate([np.fromfile(tmp_path / "out" / f"{split}.bin", dtype=np.uint16) for split in ("train", "val")])
        assert sorted(enc.decode(ids.tolist()).split("<|endoftext|>")) == sorted(docs + [""])


@pytest.mark.parametrize("name, content, error", [
    ("empty.txt", b"", "holds no text: its files are empty or blank"),
    ("latin1.txt", "caf\u00e9\n\nna\u00efve".encode("latin-1"), "latin1.txt is not UTF-8 text .*convert it"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', "bad.jsonl, record 2: Expecting .*one JSON object a line"),
    ("null.jsonl", b'{"text": "a"}\n{"text": null}\n', "null.jsonl: {'text': None} has no 'text' text: pass --text_field"),
    ("other.json", b'{"body": "a"}\n', "other.json: {'body': 'a'} has no 'text' text: pass --text_field"),
])
def test_bad_local_files_are_one_line_naming_the_file(tmp_path, name, content, error):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "fine.txt").write_text("x\n\ny")
    (tmp_path / "c" / name).write_bytes(content)
    with pytest.raises(UsageError, match=error):
        data.prepare_text(tmp_path / "out", str(tmp_path / "c" / name))
    if content:  # beside a good file: the same error, naming the bad one
        with pytest.raises(UsageError, match=error):
            data.prepare_text(tmp_path / "out", str(tmp_path / "c"))


def test_the_command_line_reports_bad_input_in_one_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    for args, error in [(["latin1_refused", f"--source={tmp_path / 'latin1.txt'}"], "latin1.txt is not UTF-8"),
                        (["shakespeare_char", "--source=x.txt"], "shakespeare_char is the fixed tiny-shakespeare text")]:
        result = run(["data.py", *args], timeout=120)  # above the error, only datasets' progress bars
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.splitlines()[-1].startswith("error: ") and error in result.stderr.splitlines()[-1]


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "shakespeare_char/", "./shakespeare_char",
                                  "Shakespeare_Char", "shakespeare_char."])
def test_a_dataset_name_that_is_no_folder_name_is_refused(tmp_path, monkeypatch, name):
    """data.py NAME writes data/NAME: "" wrote into data/ itself, ../x beside the repo, and
    shakespeare_char/ went past the guard, over the fixed dataset. Refused before anything is read
    (the source here does not exist: without the check, the error would be about it)."""
    monkeypatch.setattr(sys, "argv", ["data.py", name, f"--source={tmp_path / 'none.txt'}"])
    with pytest.raises(SystemExit) as e:
        data.main()
    assert str(e.value.code).startswith(f"error: dataset name {name!r} "), e.value.code
    assert "\n" not in str(e.value.code)


def test_preparing_again_leaves_a_running_reader_the_old_tokens(tmp_path):
    import tiktoken

    corpus, out = tmp_path / "corpus.txt", tmp_path / "data" / "c"
    corpus.write_text("\n\n".join(f"first corpus {i}" for i in range(40)))
    data.prepare_text(out, str(corpus))
    old = np.memmap(out / "train.bin", dtype=np.uint16, mode="r")  # as a training run holds it
    before = np.array(old)
    second = [f"the second, longer corpus: document {i}" for i in range(80)]
    corpus.write_text("\n\n".join(second))  # the same file edited: datasets' cache of it must not answer
    data.prepare_text(out, str(corpus))
    np.testing.assert_array_equal(old, before)
    cfg = tiny(dataset="c", data_root=str(tmp_path / "data"), vocab_size=50257, block_size=8)
    ids = np.concatenate([data.load_split(cfg, "train"), data.load_split(cfg, "val")])
    assert sorted(tiktoken.get_encoding("gpt2").decode(ids.tolist()).split("<|endoftext|>")) == sorted(second + [""])
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_preparing_a_dataset_again_says_it_replaces_one(tmp_path, monkeypatch, capsys):
    """Replacing is documented, but a run trained on the old tokens then cannot resume: said."""
    monkeypatch.setattr(data, "ROOT", tmp_path)
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"document {i}" for i in range(20)))
    monkeypatch.setattr(sys, "argv", ["data.py", "c", f"--source={tmp_path / 'corpus.txt'}"])
    for again in (False, True):
        data.main()
        assert ("note: replacing the dataset in" in capsys.readouterr().err) == again
    assert (tmp_path / "data" / "c" / "meta.json").exists()


def test_offline_downloads_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # nothing listens on port 9
    with pytest.raises(UsageError, match=f"get internet, or put the file at {tmp_path / 'sc' / 'input.txt'}"):
        data.prepare_shakespeare_char(tmp_path / "sc")
    assert not (tmp_path / "sc" / "input.txt").exists()
    # tiktoken fetches the GPT-2 files over https when its cache lacks them: an empty cache and a proxy that
    # refuses make that fail at once, as offline
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    code = "from text import tokenization; tokenization.encoding('gpt2')"
    result = run(["-c", f"from configs import UsageError\ntry:\n {code}\nexcept UsageError as e:\n print(e)"], env=env, timeout=60)
    assert "cannot load tiktoken's gpt2 encoding" in result.stdout and "TIKTOKEN_CACHE_DIR" in result.stdout, result.stderr


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


def test_a_write_cut_off_or_refused_leaves_the_old_dataset(small_dataset):
    """Ctrl-C halfway through tokenizing, or a tokenizer whose ids pass its vocabulary size (a
    tokenizer.json with holes in its ids): the dataset there before is whole, no .tmp stays."""
    cfg, path = small_dataset
    before = np.array(data.load_split(cfg, "train"))

    def failing():
        yield np.arange(10)
        raise KeyboardInterrupt  # as Ctrl-C halfway through tokenizing

    with pytest.raises(KeyboardInterrupt):
        data.write_dataset(path, {"train": failing(), "val": [np.arange(10)]}, 50, {"kind": "char", "chars": "x" * 50})
    with pytest.raises(UsageError, match="the tokenizer gave id 60, outside its vocabulary of 50: .* is as it was"):
        data.write_dataset(path, {"train": [np.arange(10)], "val": [np.arange(61)]}, 50, {"kind": "char", "chars": "x" * 50})
    np.testing.assert_array_equal(data.load_split(cfg, "train"), before)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "train.bin", "val.bin"]


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
    with pytest.raises(UsageError, match=r"block_size=64 \(\+1 for the targets\) is longer than "
                       "the val split.*a larger --val_fraction"):
        data.load_split(dataclasses.replace(cfg, block_size=64), "val")
    # a sequence reads block_size + 1 tokens: the 40-token split holds one of 39, none of 40
    assert data.load_split(dataclasses.replace(cfg, block_size=39), "val").size == 40
    with pytest.raises(UsageError, match=r"block_size=40 \(\+1 for the targets\) is longer"):
        data.load_split(dataclasses.replace(cfg, block_size=40), "val")
    with pytest.raises(UsageError, match="python data.py nothing"):
        data.load_split(dataclasses.replace(cfg, dataset="nothing"), "train")


def test_a_corrupt_meta_json_is_one_line(small_dataset):
    cfg, path = small_dataset
    meta = json.loads((path / "meta.json").read_text())
    for text in ['{"vocab_size": 50, "dtype": "uint16", ', "[]", json.dumps({k: v for k, v in meta.items() if k != "val_tokens"}),
                 json.dumps({**meta, "dtype": "uint17"}), json.dumps({**meta, "train_tokens": None}),
                 json.dumps({**meta, "tokenizer": {"kind": "char"}}), json.dumps({**meta, "tokenizer": "char"})]:
        (path / "meta.json").write_text(text)
        with pytest.raises(UsageError, match=f"{path / 'meta.json'} is corrupt: rerun `python data.py small`"):
            data.load_split(cfg, "train")
