"""The first hour of a newcomer: each friction met is one clear line, not a wait or a traceback."""
import time

import pytest

from conftest import ROOT, run


def test_an_unreachable_hub_is_one_line_at_once(tmp_path):
    """A dataset id while the Hub cannot be reached (here: a closed port on this machine) stops
    with one line naming the way out, without huggingface_hub's half a minute of retries."""
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1}, unk_token="[UNK]")
    tokenizers.Tokenizer(words).save(str(tmp_path / "tokenizer.json"))  # no download for it
    t0 = time.monotonic()
    r = run(["data.py", "newcomer_hub", "--source=someone/nosuchds",
             f"--tokenizer={tmp_path / 'tokenizer.json'}"],
            {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: 'someone/nosuchds' is no local file, and the Hugging Face Hub "
                           "(127.0.0.1:9) cannot be reached"), line
    assert "--source=PATH" in line and time.monotonic() - t0 < 30
    assert not (ROOT / "data" / "newcomer_hub").exists()
