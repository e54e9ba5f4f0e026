"""Shared test setup: the repo on sys.path, tiny configs, and the shakespeare_char data."""
import concurrent.futures
import dataclasses
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken_cache")

import configs  # noqa: E402


def refuse_fork():
    """A library that forks this process (a multiprocessing pool: datasets' map, lm-eval's
    bootstrap) once JAX's threads run can leave the child deadlocked on a lock one of them held,
    and CI hanging with it: JAX only warns (from a fork hook, which cannot raise), so the tests
    refuse such a fork instead. subprocess does not go through os.fork."""
    fork = os.fork

    def guarded():
        if "jax" in sys.modules:
            raise RuntimeError("a test forked the pytest process while JAX's threads run (a "
                               "multiprocessing pool?): it can deadlock; use one process, or a "
                               "subprocess")
        return fork()
    os.fork = guarded


refuse_fork()

# The quick tier (python -m pytest -m quick tests): what a researcher runs after an edit of
# model.py, before a long run, in a minute or two (BENCHMARKS.md): the model against its numpy reference,
# causality, KV-cache decoding against the full forward, the loss and accumulation written out, a
# train step on 1 and 2 devices, export's self-check, the house's rules. "file::test" (all its
# parameters) or "file::test[param]"; the whole suite stays the CI command.
QUICK = {
    "test_model.py::test_forward_matches_numpy_reference",
    "test_model.py::test_causal",
    "test_sample.py::test_extend_gives_the_full_forward_logits",
    "test_train.py::test_loss_is_cross_entropy_written_out",
    "test_train.py::test_accumulation_equals_one_big_batch",
    "test_devices.py::test_one_step_on_two_devices_equals_one_device",
    "test_layout.py::test_no_folder_and_no_core_module_imports_a_command",
    "test_export.py::test_variant_pytorch_logits_equal_jax_logits[all]",  # every variant at once
    "test_export.py::test_new_parameter_is_refused_and_named[random]",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the edit-and-rerun tier (conftest.QUICK)")


def pytest_collection_modifyitems(config, items):
    found = set()
    for item in items:
        file = item.path.name
        if names := {f"{file}::{item.originalname}", f"{file}::{item.name}"} & QUICK:
            item.add_marker(pytest.mark.quick)
            found |= names
    if config.getoption("markexpr") == "quick" and (lost := QUICK - found):  # a test renamed
        raise pytest.UsageError(f"conftest.QUICK names tests that do not exist: {sorted(lost)}")


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


def small_bpe(shakespeare: Path) -> dict:
    """A dataset record (meta.json's vocab_size and tokenizer) of a byte-level BPE of 400 tokens
    (GPT-2's pre-tokenizer), trained on tiny-shakespeare's first 200k characters, its
    end-of-text the first id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([(shakespeare / "input.txt").read_text()[:200_000]], trainer)
    record = {"kind": "hf", "name": "test-bpe", "eos": tok.token_to_id("<|endoftext|>"),
              "json": tok.to_str()}
    return {"vocab_size": tok.get_vocab_size(), "tokenizer": record}


def prepare_shakespeare(download: bool = True) -> Path:
    """data/shakespeare_char prepared (from ../shared's copy of the text when the repo has none;
    downloaded only when `download`). Under a file lock: with pytest -n one worker prepares while
    the others wait, and none reads a half-written file."""
    import data

    out = ROOT / "data" / "shakespeare_char"
    text = SHARED / "data/tinyshakespeare/input.txt"
    if not download and not (out / "input.txt").exists() and not text.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".shakespeare_char.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "input.txt").exists() and text.exists():
            shutil.copy(text, out / "input.txt")
        if not (out / "meta.json").exists():
            data.prepare_shakespeare_char(out)
    return out


@pytest.fixture(scope="session", autouse=True)
def _shakespeare_when_at_hand():
    """Prepared before any test when its text is here, so no test depends on which test (or,
    with pytest -n, which worker) ran first."""
    prepare_shakespeare(download=False)


@pytest.fixture(autouse=True)
def _fresh_jit_after_monkeypatch(request):
    """JAX caches a function's trace by the function and its arguments' structure, not by what it
    calls: after a test that edits model.py's functions (monkeypatch), the next test's jax.jit of
    train.objective, say, would reuse the edited trace. Cleared after every such test."""
    yield
    if "monkeypatch" in request.fixturenames:
        import jax
        jax.clear_caches()


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """data/shakespeare_char prepared, downloaded when its text is nowhere here."""
    return prepare_shakespeare()


# JAX's persistent compilation cache, one per test session, for the subprocesses that run on one
# device alone: the tiny models' steps then compile once per session, not once per launch (most
# of a short launch's time on 2 cores). Never where a process has several devices or peers: an
# 8-device step loaded from the cache (XLA:CPU, jax 0.10.2) ran its collectives in different
# orders on different devices and hung (test_checkpoint's restore onto another mesh).
COMPILE_CACHE: dict[str, str] = {}
PYTHONPATH = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}  # the repo's modules, tests' probes


@pytest.fixture(scope="session", autouse=True)
def _compile_cache(tmp_path_factory):
    COMPILE_CACHE.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
                         JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                         JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def one_device(args: list[str], env: dict) -> bool:
    """Whether `python *args` runs JAX on one device in one process: a command of the repo's root
    (launch.py and the others start jax.distributed only under --multihost) or -c's code that
    neither sets a device count nor starts jax.distributed, and no simulated device count in
    XLA_FLAGS. The probes in tests/ set their own device counts; -m's modules may do anything."""
    if not args or "device_count" in env.get("XLA_FLAGS", "") or "--multihost" in args:
        return False
    if args[0] == "-c":
        return "jax_num_cpu_devices" not in args[1] and "jax.distributed" not in args[1]
    return args[0].endswith(".py") and "/" not in args[0]


@pytest.fixture(scope="session")
def env() -> dict:
    """The environment of one-device subprocesses that a test starts itself (to signal them):
    the repo on the path and the session's compilation cache."""
    return {**os.environ, **PYTHONPATH, **COMPILE_CACHE}


def run(args: list[str], env: dict | None = None, timeout: int = 600,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A Python subprocess in the repo root, or cwd (fresh JAX, own device count), with the
    session's compilation cache where it runs on one device alone."""
    full_env = {**os.environ, **PYTHONPATH, **(env or {})}
    if one_device(args, full_env):
        full_env = {**COMPILE_CACHE, **full_env}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def assert_same_step(many, one, what: str = "") -> None:
    """tests/fsdp_probe.py's saved step on a mesh against one device's: the losses, gradients,
    task scores and updated parameters, to float32 sums in another order (the probe's model is
    moved by 0.1 N(0, 1): by 0.3, SharedKV + ALiBi's gradients differed by 1e-4 between meshes)."""
    assert set(many.files) == set(one.files) and len(one.files) > 10, (many.files, one.files)
    for name in one.files:
        np.testing.assert_allclose(many[name], one[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}{name}")


def run_each(commands: list[list[str]], env: dict | None = None, timeout: int = 600,
             devices: list[int] | None = None) -> list[subprocess.CompletedProcess]:
    """run() of each command at once, in its order: the processes of a multi-host run, which
    must be alive together, or the comparisons of 1 against N devices, where one alone leaves a
    core idle while it imports and traces. devices: each command's simulated CPU devices (XLA's
    flag; a probe may set its own). A hang fails the test after `timeout` seconds."""
    flags = [{} if n is None else {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
             for n in devices or [None] * len(commands)]
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args, flag: run(args, {**(env or {}), **flag}, timeout),
                             commands, flags))


def document_mask_after_end_of_text(monkeypatch, end_id: int):
    """An edit of model.py: attention kept within documents, each closed by an end-of-text
    (end_id; GPT-2's is the vocabulary's last id), made in GPT.hidden where it has no cache. The
    full forward takes it; KV-cache decoding and an unedited export would attend across
    documents. Neither check's tokens held that id before (tests of check_cache and export)."""
    import jax.numpy as jnp
    import model

    plain_hidden, plain_positions, doc = model.GPT.hidden, model.positions, {}

    def hidden(self, tokens_T, start=0, cache=None, key=None):
        end_T = tokens_T == end_id
        doc["T"] = None if cache is not None else jnp.cumsum(end_T) - end_T
        return plain_hidden(self, tokens_T, start, cache, key)

    def positions(q_T, S, *args):
        at = plain_positions(q_T, S, *args)
        if doc.get("T") is None:
            return at
        causal_TT = jnp.tril(jnp.ones((q_T.shape[0],) * 2, bool))
        return at._replace(mask_TS=(doc["T"][:, None] == doc["T"][None]) & causal_TT)
    monkeypatch.setattr(model.GPT, "hidden", hidden)
    monkeypatch.setattr(model, "positions", positions)
