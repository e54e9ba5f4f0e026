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


def test_launch_help_lists_the_config_fields():
    r = run(["launch.py", "--help"])
    assert r.returncode == 0 and "each --config.FIELD=VALUE" in r.stdout
    import configs
    assert all(name in r.stdout.replace("\n", " ") for name in configs.Config.__dataclass_fields__)


def test_a_vocabulary_too_small_for_the_data_is_taken_from_meta_json(shakespeare, capsys):
    """shakespeare_char has 65 ids: a config of 10 gets 65 with a note, unless the command line
    set it (then data.py's check names the field, as before)."""
    import dataclasses

    import launch
    from conftest import tiny

    small = dataclasses.replace(tiny(), vocab_size=10)
    assert launch.vocabulary_of_the_data(small, []).vocab_size == 65
    assert "note: vocab_size=65, from shakespeare_char's meta.json" in capsys.readouterr().out
    assert launch.vocabulary_of_the_data(small, ["--config.vocab_size=10"]).vocab_size == 10
    assert launch.vocabulary_of_the_data(tiny(vocab_size=100), []).vocab_size == 100


def test_the_end_of_a_run_says_where_it_is_and_a_gpu_recipe_on_a_cpu_says_so(shakespeare, tmp_path):
    from conftest import TINY_RUN

    rundir = tmp_path / "run"
    r = run(["launch.py", *TINY_RUN, "--config.compute_dtype=bfloat16", "--config.max_steps=2",
             "--config.eval_interval=2", "--config.eval_batches=1", f"--rundir={rundir}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "computes in bfloat16, for GPUs and TPUs: on a CPU it is slow" in r.stdout
    assert (f"done: the checkpoints are in {rundir / 'checkpoints'}; read the run with "
            f"python sample.py --rundir={rundir}") in r.stdout


def test_plots_remakes_an_evidence_folder_and_has_help(tmp_path):
    """python -m tools.plots DIR: the README that docs/mup holds, remade from its JSON alone."""
    import shutil

    assert "evidence.json" in run(["-m", "tools.plots", "--help"]).stdout
    shutil.copy(ROOT / "docs/mup/evidence.json", tmp_path / "evidence.json")
    r = run(["-m", "tools.plots", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "README.md").read_text() == (ROOT / "docs/mup/README.md").read_text()
    r = run(["-m", "tools.plots", str(tmp_path / "none")])
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def readme_line(fragment: str) -> str:
    """The README's code line holding fragment, without its indent and its comment."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if fragment in line]
    assert len(lines) == 1, f"README.md no longer holds one line with {fragment!r}"
    return lines[0].split("  #")[0].strip()


def test_the_readmes_model_edits_train_and_sample(shakespeare, tmp_path):
    """README's SwiGLU and per-head temperature, their lines taken from README.md, made in a copy
    of the repo as a researcher would: the copy trains (its parameter count is the unedited
    model's plus the gate's L * D * F and the temperatures' L * H) and sample.py reads the run."""
    import shutil

    import equinox as eqx
    import jax

    import model
    from conftest import TINY_RUN, tiny

    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".git", "data", "runs", "docs", "exports", "__pycache__", ".pytest_cache"))
    (repo / "data").mkdir()
    (repo / "data" / "shakespeare_char").symlink_to(shakespeare)
    # (file, the line the edit is made at, what stands there after: "<line>" is that line)
    edits = [
        ("model.py", '    up: Float[Array, "D F"]',
         ["<line>", readme_line('gate: Float[Array, "D F"]')]),
        ("model.py", "        self.up = jnp.zeros((cfg.d_model, cfg.mlp_width))",
         ["<line>", readme_line("self.gate = jnp.zeros(")]),
        ("model.py", '        h_TF = tap("mlp_hidden", (self.fast_gelu or gelu)(h_TF))',
         [readme_line("g_TF = jnp.einsum("), readme_line("jax.nn.silu(g_TF) * h_TF")]),
        ("params.py", '        "blocks.mlp.up": Policy(',
         [readme_line('"blocks.mlp.gate": Policy(') + " " + readme_line("**hidden),"), "<line>"]),
        ("model.py", '    q_norm: Float[Array, "K"]',
         ["<line>", readme_line('temp: Float[Array, "H"]')]),
        ("model.py", "        self.q_norm, self.k_norm = jnp.ones(K), jnp.ones(K)",
         ["<line>", "self.temp = jnp.zeros(H)"]),  # README: "__init__: jnp.zeros(H)"
        ("model.py", "        attend_fn = self.fast_attend or attend",  # README: "before attend"
         [readme_line("jnp.exp(self.temp)"), "<line>"]),
        ("params.py", '        "blocks.attn.q_norm":',
         [readme_line('"blocks.attn.temp": Policy('), "<line>"]),
    ]
    assert "__init__: jnp.zeros(H)" in (ROOT / "README.md").read_text()
    for file, anchor, lines in edits:
        path = repo / file
        text = path.read_text()
        at = next(line for line in text.splitlines() if line.startswith(anchor))
        indent = " " * (len(at) - len(at.lstrip()))
        assert text.count(at + "\n") == 1, at
        made = [at if line == "<line>" else indent + line for line in lines]
        path.write_text(text.replace(at + "\n", "\n".join(made) + "\n"))

    rundir = tmp_path / "run"
    r = run(["launch.py", *TINY_RUN, "--config.mlp_ratio=2.6667", "--config.max_steps=4",
             "--config.eval_interval=4", "--config.eval_batches=1", f"--rundir={rundir}"], cwd=repo)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = tiny(mlp_ratio=2.6667)
    plain = sum(x.size for x in jax.tree.leaves(eqx.filter_eval_shape(model.GPT, cfg, {})))
    L, D, F, H = cfg.n_layer, cfg.d_model, cfg.mlp_width, cfg.n_head
    assert f"{plain + L * D * F + L * H:,} parameters" in r.stdout + r.stderr
    r = run(["sample.py", f"--rundir={rundir}", "--num_samples=1", "--max_new_tokens=8"], cwd=repo)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
