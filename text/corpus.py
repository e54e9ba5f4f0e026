"""The documents that data.py tokenizes, as a datasets.Dataset: local files (a file, a quoted glob
or a folder, searched recursively) read by mugpt, or a Hugging Face dataset id."""
import glob
import itertools
import json
import os
import re
import socket
from pathlib import Path

from run.errors import UsageError

# What a folder is searched for; a glob's matches are text unless .json/.jsonl.
TEXT_SUFFIXES = (".txt", ".json", ".jsonl")


def hub_reachable(source: str) -> None:
    """One connection to the Hub first: offline, huggingface_hub would retry for half a minute,
    printing a line a try, before datasets gives up."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        return  # datasets reads its cache, if it has the dataset
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = re.sub(r"^\w+://", "", endpoint).split("/")[0]
    try:
        socket.create_connection((host.split(":")[0], 443), timeout=5).close()
    except OSError as e:
        raise UsageError(f"{source!r} is no local file, and the Hugging Face Hub ({host}) "
                         f"cannot be reached ({e.strerror or e}): pass local files with "
                         "--source=PATH, or set HF_HUB_OFFLINE=1 to use datasets' cache") from None


def load(source: str, text_field: str):
    """The documents of source, each with its text_field: local files if any match (a folder
    among the matches stands for its files), else a Hub dataset's train split."""
    import datasets

    matches = glob.glob(os.path.expanduser(source), recursive=True)
    files = sorted({str(p) for m in map(Path, matches)
                    for p in (m.rglob("*") if m.is_dir() else [m])
                    if p.is_file() and (p == m or p.suffix.lower() in TEXT_SUFFIXES)})
    if files:
        code = Path(__file__).read_text()
        stamp = repr([code] + [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files])
        gen_kwargs = dict(files=files, text_field=text_field, stamp=stamp)
        try:
            ds = datasets.Dataset.from_generator(documents, gen_kwargs=gen_kwargs)
        # datasets wraps documents' UsageError; no documents at all is a SchemaInferenceError.
        except datasets.exceptions.DatasetGenerationError as e:
            if isinstance(e.__cause__, datasets.arrow_writer.SchemaInferenceError):
                raise UsageError(f"{source} holds no text: its files are empty or blank") from None
            raise e.__cause__ if isinstance(e.__cause__, UsageError) else e
    # A path, not a Hub id: fail now, not after the Hub's retries.
    elif (matches or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source)
          or Path(source).suffix.lower() in TEXT_SUFFIXES or os.path.isdir(Path(source).parts[0])):
        raise UsageError(f"no files in {source!r} (folders are searched for .txt/.json/.jsonl): "
                         "check it, or quote a glob")
    else:
        hub_reachable(source)
        try:
            ds = datasets.load_dataset(source, split="train", trust_remote_code=False)
        except Exception as e:  # not found, no network, ...: datasets' own reason, on one line
            reason = " ".join(str(e).split())[:300]
            raise UsageError(f"no local files match {source!r}, and as a Hugging Face dataset id "
                             f"it failed: {type(e).__name__}: {reason}") from None
    if text_field not in ds.column_names:
        raise UsageError(f"{source} has no field {text_field!r} (fields: {ds.column_names}); "
                         "pass --text_field")
    return ds


def documents(files: list[str], text_field: str, stamp=None):
    """{text_field: text} for each document: a record of a .json/.jsonl file (an object a line),
    a paragraph of any other file (lines up to a blank line). `stamp` only keys datasets' cache
    of the documents (the files' sizes and times, and this code)."""
    for name in files:
        n = 0  # the records read, for the error
        try:
            with open(name, encoding="utf-8") as f:
                if Path(name).suffix.lower() in (".json", ".jsonl"):
                    records = map(json.loads, filter(str.strip, f))
                else:
                    records = ({text_field: "".join(p).rstrip("\n")}
                               for blank, p in itertools.groupby(f, str.isspace) if not blank)
                for n, record in enumerate(records, 1):
                    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                        raise UsageError(f"{name}: {str(record)[:60]} has no {text_field!r} text: "
                                         "pass --text_field, or fix it")
                    yield {text_field: record[text_field]}
        except UnicodeDecodeError as e:
            raise UsageError(f"{name} is not UTF-8 text ({e}): "
                             "convert it, or leave it out") from None
        except json.JSONDecodeError as e:
            raise UsageError(f"{name}, record {n + 1}: {e}; "
                             "write one JSON object a line, or name the file .txt") from None

