"""Shared test setup: the repo on sys.path, tiny configs, and the shakespeare_char data."""
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken_cache")

import configs  # noqa: E402


# launch.py arguments for a tiny model on shakespeare_char, shared by the end-to-end runs. learning_rate
# = min_lr keeps the schedule flat after warmup, so runs that differ only in max_steps take the same steps.
# One CPU device unless a test says otherwise (XLA_FLAGS): they compare with one-device runs in-process.
TINY_RUN = ["--config=shakespeare_char_cpu", "--config.n_layer=2", "--config.d_model=32",
            "--config.n_head=2", "--config.block_size=16", "--config.batch_size=8",
            "--config.warmup_steps=4", "--config.learning_rate=2e-3", "--config.min_lr=2e-3"]


def tiny(**overrides) -> configs.Config:
    """A model small enough for a CPU test in seconds, on shakespeare_char."""
    base = dict(dataset="shakespeare_char", vocab_size=65, n_layer=2, n_head=2, d_model=32, block_size=16,
                batch_size=8, compute_dtype="float32", max_steps=10, warmup_steps=0, eval_interval=5,
                eval_batches=2, log_interval=5)
    return dataclasses.replace(configs.Config(), **{**base, **overrides})


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """data/shakespeare_char prepared (from ../shared's copy of the text when the repo has none)."""
    import data

    out = ROOT / "data" / "shakespeare_char"
    if not (out / "input.txt").exists() and (SHARED / "data/tinyshakespeare/input.txt").exists():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHARED / "data/tinyshakespeare/input.txt", out / "input.txt")
    if not (out / "meta.json").exists():
        data.prepare_shakespeare_char(out)
    return out


def run(args: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """A Python subprocess in the repo root (fresh JAX, own device count)."""
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
