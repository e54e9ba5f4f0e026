"""Any tokenizer: a Hugging Face `tokenizers` BPE trained here on the Shakespeare text (offline),
through data.py, training, sample.py and export."""
import json
import shutil

import numpy as np
import pytest

from conftest import ROOT, TINY_RUN, run

tokenizers = pytest.importorskip("tokenizers")
NAME = "test_bpe300"  # data/NAME, removed at the end


@pytest.fixture(scope="module")
def bpe(shakespeare, tmp_path_factory):
    """A byte-level BPE of 300 ids (256 bytes, <|endoftext|>, 43 merges) in a tokenizer.json,
    and data/NAME prepared with it from the text's paragraphs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(shakespeare / "input.txt")], trainer)
    tok.save(str(path))
    r = run(["data.py", NAME, f"--source={shakespeare / 'input.txt'}", f"--tokenizer={path}"])
    assert r.returncode == 0, r.stderr[-2000:]
    yield tok, ROOT / "data" / NAME
    shutil.rmtree(ROOT / "data" / NAME, ignore_errors=True)


def test_meta_records_the_tokenizer_and_the_ids_round_trip(bpe):
    from run import reading

    tok, out = bpe
    meta = json.loads((out / "meta.json").read_text())
    eos = tok.token_to_id("<|endoftext|>")
    assert meta["vocab_size"] == 300 and meta["tokenizer"]["kind"] == "hf"
    assert meta["tokenizer"]["eos"] == eos
    ids = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    assert ids.max() < 300 and (ids == eos).sum() > 100  # one separator after each paragraph
    encode, decode = reading.tokenizer(meta)
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak."
    assert encode(text) == tok.encode(text).ids and decode(encode(text)) == text
    # the bins hold the paragraphs, each followed by the separator: decoded, the text itself
    first = ids[:np.argmax(ids == eos)].tolist()
    source = (out.parents[1] / "data/shakespeare_char/input.txt").read_text()
    assert decode(first) in source and len(first) > 5


def test_training_sampling_and_export_on_the_tokenizer(bpe, tmp_path):
    """A tiny run on the 300-id vocabulary: its loss falls below ln 300 (5.70), sample.py decodes
    with the same tokenizer, and the export's tokenizer gives the same ids."""
    rundir = tmp_path / "run"
    args = [f"--config.dataset={NAME}", "--config.vocab_size=300", "--config.max_steps=30",
            "--config.eval_interval=30", "--config.eval_batches=2"]
    r = run(["launch.py", *TINY_RUN, *args, f"--rundir={rundir}"])
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads((rundir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["val_loss"] < 5.5
    r = run(["sample.py", f"--rundir={rundir}", "--start=ROMEO:", "--num_samples=1",
             "--max_new_tokens=20"])
    assert r.returncode == 0 and r.stdout.startswith("ROMEO:"), r.stderr[-2000:]
    transformers = pytest.importorskip("transformers")
    from etils import epath

    import export

    export.export(epath.Path(rundir), tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    text = "KING RICHARD III:\nNow is the winter"
    assert hf_tok(text)["input_ids"] == bpe[0].encode(text).ids
    assert hf_tok.eos_token == "<|endoftext|>"
