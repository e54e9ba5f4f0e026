"""The seeds' variants (grouped-query and SharedKV attention, ALiBi, MUDD connections) against the
numpy reference written from the papers' equations, their KV caches, FSDP and resume."""
import dataclasses
import json
import re

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import model as M
from layers.positions import alibi_bias
from inference import decode
import params
from conftest import ROOT, TINY_RUN, assert_same_step, run, run_each, tiny
from test_checkpoint import final_state, launch_args, records, tiny_config
from test_model import numpy_forward, random_gpt

VARIANTS = {
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "sharedkv": dict(attention="sharedkv"),
    "sharedkv_gqa": dict(attention="sharedkv", n_kv_head=2),
    "alibi": dict(position="alibi"),
    "mudd": dict(connections="mudd"),
    "mudd_sharedkv": dict(connections="mudd", attention="sharedkv"),
    "all": dict(connections="mudd", attention="sharedkv", n_kv_head=2, position="alibi"),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_numpy_reference(name):
    """Every parameter random (MUDD's W2 and b too, so its streams differ), under muP with
    CompleteP's branch scale and an input multiplier, so that no factor hides."""
    cfg = tiny(n_layer=2, n_head=4, d_model=32, param="mup", d_base=16, depth_base=1,
               alpha_in=1.5, **VARIANTS[name])
    gpt = random_gpt(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 12)
    want = numpy_forward(gpt, cfg, tokens)
    np.testing.assert_allclose(np.asarray(gpt(jnp.asarray(tokens))), want, rtol=2e-4, atol=2e-4)


def test_alibi_slopes_are_the_papers():
    """Press et al. 2022: for 8 heads 1/2, 1/4, ..., 1/256; for 6, not a power of two, the 4-head
    slopes then every other one of the 8-head slopes (their code's interleaving). The bias of a key
    3 positions back is -3 m_h; of a key ahead, +m_h (the mask hides those)."""
    slopes = lambda H: -alibi_bias(jnp.arange(2), jnp.arange(2), H)[:, 1, 0]
    np.testing.assert_allclose(slopes(8), [2.0 ** -i for i in range(1, 9)], rtol=1e-6)
    want6 = np.array([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])
    np.testing.assert_allclose(slopes(6), want6, rtol=1e-6)
    bias = alibi_bias(jnp.arange(5, 6), jnp.arange(2, 7), 6)  # query at 5, keys at 2..6
    np.testing.assert_allclose(bias[:, 0], -want6[:, None] * np.array([3, 2, 1, 0, -1]), rtol=1e-6)


def test_mudd_at_init_is_the_baseline_and_its_weights_matter():
    """W2 = 0 and b one-hot on the newest state: each stream is that state, so MUDD's model is
    the residual one with the same blocks (to float32 rounding: its projections of the three
    streams are three matmuls, the baseline's one); random W2 make it another function."""
    base_cfg = tiny(n_layer=3, n_head=4, d_model=32)
    base = random_gpt(base_cfg)
    mudd = params.init_gpt(dataclasses.replace(base_cfg, connections="mudd"), jax.random.key(5))
    mudd = eqx.tree_at(lambda m: (m.emb, m.blocks), mudd, (base.emb, base.blocks))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 65, 16))
    np.testing.assert_allclose(mudd(tokens), base(tokens), rtol=1e-5, atol=1e-5)
    w2 = [jax.random.normal(jax.random.key(i), c.w2.shape) for i, c in enumerate(mudd.mudd)]
    moved = eqx.tree_at(lambda m: [c.w2 for c in m.mudd], mudd, w2)
    assert not np.allclose(moved(tokens), base(tokens), atol=1e-2)


@pytest.mark.parametrize("name", ["baseline", *VARIANTS])
def test_every_matmul_runs_in_the_compute_dtype(name):
    """With compute_dtype bfloat16 every matrix product of the forward takes bf16 operands (the
    logits are cast to float32 after theirs): a float32 parameter mixed into the stream (MUDD's b
    did it) would make the blocks run in float32, at half speed and refused by cuDNN's attention."""
    cfg = tiny(n_layer=2, n_head=4, d_model=32, compute_dtype="bfloat16", **VARIANTS.get(name, {}))
    gpt = random_gpt(cfg)

    def products(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield [str(v.aval.dtype) for v in eqn.invars]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from products(sub)

    found = list(products(jax.make_jaxpr(gpt)(jnp.arange(12)).jaxpr))
    assert len(found) >= 3 * cfg.n_layer and all(d == ["bfloat16"] * 2 for d in found), found


@pytest.mark.parametrize("name", ["gqa", "sharedkv", "alibi", "mudd", "all"])
def test_kv_cache_decoding_equals_the_full_forward(name):
    """A prefill of 5 tokens, then single-token steps through GPT.hidden's cache: every position's
    logits equal the full forward's. SharedKV's cache holds the values only: half of MHA's bytes
    (and GQA's is G/H of it)."""
    cfg = tiny(block_size=16, n_head=4, **VARIANTS[name])
    model = random_gpt(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 65, 16))
    want = np.asarray(model(tokens))
    hidden = eqx.filter_jit(lambda m, t, start, c: m.hidden(t, start, c))
    x, cache = hidden(model, tokens[:5], 0, decode.empty_cache(model, 16))
    got = [model.logits(x)]
    for t in range(5, 16):
        x, cache = hidden(model, tokens[t:t + 1], jnp.int32(t), cache)
        got.append(model.logits(x))
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-4, atol=1e-4)
    mha = decode.empty_cache(M.GPT(tiny(block_size=16, n_head=4)), 16)
    nbytes = lambda c: sum(a.nbytes for a in jax.tree.leaves(c))
    G = cfg.kv_heads / cfg.n_head
    assert nbytes(decode.empty_cache(model, 16)) == nbytes(mha) * G / (2 if "sharedkv" in str(VARIANTS[name]) else 1)


@pytest.mark.parametrize("override,message", [
    ("--config.n_kv_head=3", "n_kv_head=3 must divide n_head=2 (or be none: as many as n_head)"),
    ("--config.attention=mqa", "--config.attention='mqa': allowed values are mha, sharedkv"),
    ("--config.position=nope", "--config.position='nope': allowed values are rope, alibi"),
])
def test_a_bad_variant_is_one_line(override, message, tmp_path):
    r = run(["launch.py", *TINY_RUN, f"--rundir={tmp_path / 'run'}", override])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"error: {message}"
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """fsdp_probe.py's step on 1 and on 4 devices, for two sets of variants that together take
    every code path (SharedKV, ALiBi, MUDD over SharedKV's three streams; GQA, MUDD's four)."""
    runs = [(variants, devices, tmp_path_factory.mktemp("fsdp") / f"{devices}.npz")
            for variants in (("attention=sharedkv", "position=alibi", "connections=mudd",
                              "n_kv_head=2"), ("n_kv_head=2", "connections=mudd"))
            for devices in (1, 4)]
    done = run_each([[str(ROOT / "tests/fsdp_probe.py"), str(devices), str(path), "1", *variants]
                     for variants, devices, path in runs])
    for r in done:
        assert r.returncode == 0, r.stderr
    return {(variants, devices): np.load(path) for variants, devices, path in runs}


def test_variants_on_4_fsdp_devices_equal_one_device(fsdp_runs):
    for variants in {v for v, _ in fsdp_runs}:
        assert_same_step(fsdp_runs[variants, 4], fsdp_runs[variants, 1], f"{variants}: ")


def test_a_variant_run_resumes_exactly(shakespeare, tmp_path, env):
    """Every variant at once: 8 steps straight, and 4 then a resume to 8: the same metrics and
    bitwise the same final parameters and optimizer state."""
    variants = ["--config.attention=sharedkv", "--config.position=alibi",
                "--config.connections=mudd", "--config.n_kv_head=1", "--config.ckpt_interval=4",
                "--config.eval_interval=4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for rundir, steps in ((straight, 8), (resumed, 4), (resumed, 8)):
        r = run(launch_args(rundir, *variants, f"--config.max_steps={steps}"), env)
        assert r.returncode == 0, r.stderr
    assert records(resumed) == records(straight)
    cfg = tiny_config(*variants, "--config.max_steps=8")
    for a, b in zip(final_state(resumed, cfg), final_state(straight, cfg), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["gqa", "sharedkv", "alibi", "mudd"])
def test_coordinate_check_over_width_holds_for_each_variant(shakespeare, name):
    """mup.py's coordinate check, widths 64 -> 256, steps 1-4, with the baseline's threshold: every
    activation (MUDD's streams included: they are the blocks' inputs) keeps its size under muP.
    GQA keeps its ratio of query to key/value heads as the heads grow (mup.resize)."""
    from test_mup import coord_table, max_abs_slope, mup_tiny
    widths, cfg = [64, 128, 256], mup_tiny(dataset="shakespeare_char", **VARIANTS[name])
    worst, fitted = max_abs_slope(coord_table(cfg, "width", widths, steps=4), widths, range(1, 5))
    assert worst <= 0.15, fitted


@pytest.mark.parametrize("name", ["mqa", "sharedkv", "mudd_sharedkv"])
def test_flops_per_token_count_each_variants_matrices(name):
    """6N + 12 L H K T written out: the projection has H + 2G heads (SharedKV H + G); MUDD adds,
    after block i, W1 (D x CJ), W2 (CJ x CJ) and C x J multiply-adds of a D-vector per token
    (J = i + 2 states; C = 3 streams with SharedKV, 1 after the last block)."""
    cfg = tiny(n_layer=3, d_model=32, n_head=4, block_size=16, **VARIANTS[name])
    L, D, H, K, F, V, T = 3, 32, 4, 8, 128, cfg.model_vocab, 16
    G = cfg.n_kv_head or H
    heads = H + (G if cfg.attention == "sharedkv" else 2 * G)
    N = L * (D * heads * K + H * K * D + 2 * D * F) + V * D
    for i in range(L if cfg.connections == "mudd" else 0):
        C, J = (3 if i < L - 1 else 1), i + 2
        N += D * C * J + (C * J) ** 2 + C * J * D
    gpt = eqx.filter_eval_shape(M.GPT, cfg)
    assert params.flops_per_token(gpt, T) == 6 * N + 12 * L * H * K * T


def test_variants_command_dry_run_at_the_tiny_size(shakespeare, tmp_path):
    """`python variants.py --size=tiny`: the baseline and SharedKV, one seed, 2 steps, through launch.py
    as the real sizes run (gpu's too, on one device). The command it records names no machine path
    (--runs left out); docs/variants.md is untouched (the default --out is under runs/); one seed says
    it has no interval."""
    import json
    import time
    docs = (ROOT / "docs" / "variants.md").read_bytes()
    start = time.time()
    r = run(["variants.py", "--size=tiny", "--steps=2", "--seeds=0", "--variants=baseline,sharedkv",
             f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"], timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    print(f"variants.py --size=tiny dry run: {time.time() - start:.0f} s")
    report = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert report["settings"]["command"] == (f"python variants.py --size=tiny --steps=2 --seeds=0 "
                                             f"--variants=baseline,sharedkv --out={tmp_path / 'out'}")
    assert set(report["results"]) == {"baseline", "sharedkv"} and "dirty" in report["settings"]
    assert "(one seed: no interval)" in (tmp_path / "out" / "tiny.md").read_text()
    assert (ROOT / "docs" / "variants.md").read_bytes() == docs


def test_variants_table_gives_each_variant_minus_the_baseline_with_welchs_interval():
    """The table's "minus baseline" against scipy's Welch t-test confidence interval (unequal variances),
    an independent computation; "resolved" only when the interval excludes 0."""
    from scipy import stats
    import variants
    loss = {"baseline": [1.70, 1.72, 1.69], "a": [1.60, 1.61, 1.63], "b": [1.71, 1.66, 1.74]}
    results = {v: {str(i): {"val_loss": x, "val_loss_at": {"1": x, "2": x, "4": x}, "params": 1,
                            "flops_per_token": 1.0, "step_ms": 1.0, "kv_cache_bytes_per_token": 1}
                    for i, x in enumerate(xs)} for v, xs in loss.items()}
    md = variants.table(results, [0, 1, 2])
    for v, resolved in (("a", True), ("b", False)):
        ci = stats.ttest_ind(loss[v], loss["baseline"], equal_var=False).confidence_interval(0.95)
        d, h = (ci.high + ci.low) / 2, (ci.high - ci.low) / 2
        assert f"| {v} | {np.mean(loss[v]):.4f} ± {np.std(loss[v], ddof=1):.4f} | {d:+.4f} ± {h:.4f}" \
            f"{' (resolved)' if resolved else ''} |" in md


def test_variants_table_gives_each_variants_change_with_length_paired_over_seeds():
    """The loss at 2x and 4x the length minus at 1x, seed by seed, against scipy's paired t-test
    interval, an independent computation: "grows" only when it lies above 0, "falls" below,
    else "not resolved"; one seed has no interval. The table shows no step time."""
    from scipy import stats
    import variants
    at = {"rope": ([1.70, 1.65, 1.69], [1.72, 1.68, 1.72], [1.83, 1.79, 1.83]),
          "alibi": ([1.78, 1.75, 1.80], [1.77, 1.735, 1.79], [1.76, 1.75, 1.78]),
          "noisy": ([1.70, 1.70, 1.70], [1.75, 1.68, 1.72], [1.60, 1.75, 1.80])}
    results = {v: {str(i): {"val_loss": one[i], "params": 1, "flops_per_token": 1.0,
                            "step_ms": 123.4, "kv_cache_bytes_per_token": 1,
                            "val_loss_at": {"1": one[i], "2": two[i], "4": four[i]}}
                   for i in range(3)} for v, (one, two, four) in at.items()}
    md = variants.table(results, [0, 1, 2])
    verdicts = set()  # the made-up losses give each verdict, and "not resolved" on either side of 0
    for v, (one, *longer) in at.items():
        cells = []
        for x in longer:
            d = np.subtract(x, one)
            ci = stats.ttest_rel(x, one).confidence_interval(0.95)
            said = "grows" if ci.low > 0 else "falls" if ci.high < 0 else "not resolved"
            verdicts.add((said, d.mean() > 0))
            cells.append(f"{d.mean():+.3f} ± {d.std(ddof=1):.3f} [{ci.low:+.3f}, {ci.high:+.3f}]: "
                         f"{said}")
        assert f"| {v} | {cells[0]} | {cells[1]} |" in md, md
    assert verdicts == {("grows", True), ("falls", False), ("not resolved", True),
                        ("not resolved", False)}
    assert "123.4" not in md and "step" not in md
    one_seed = {v: {"0": r["0"]} for v, r in results.items()}
    assert "| alibi | -0.010 (one seed: no interval) |" in variants.table(one_seed, [0])


def test_docs_variants_tables_are_current():
    """docs/variants/small.md and docs/variants.md's block are what variants.table makes from
    docs/variants/small.json: a change of the generator without the remade docs fails here."""
    import json
    import variants
    report = json.loads((ROOT / "docs" / "variants" / "small.json").read_text())
    remake = "python variants.py --out=docs/variants --remake"
    md = variants.table(report["results"], report["settings"]["seeds"])
    assert (ROOT / "docs" / "variants" / "small.md").read_text() == md, f"stale: {remake}"
    start, end = "<!-- variants.py small -->\n", "<!-- end variants.py small -->"
    page = (ROOT / "docs" / "variants.md").read_text()
    block = page.split(start, 1)[1].split(end, 1)[0]
    assert block == variants.docs_text(report), f"stale: {remake}"


@pytest.mark.parametrize("args,message", [
    (["--seeds=x"], "error: --seeds=x: pass integers separated by commas, e.g. 0,1,2"),
    (["--variants=mla"], "error: unknown variant 'mla'; the variants: "),
])
def test_the_variants_command_refuses_bad_flags_in_one_line(args, message):
    r = run(["variants.py", *args])
    assert r.returncode == 1 and r.stderr.startswith(message) and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_the_variants_command_refuses_steps_below_1_before_writing(steps, tmp_path, monkeypatch):
    """--steps=0 is not the size's full schedule, nor -5 a failed launch: each is refused in one
    line before any run trains or any file is written."""
    import variants

    def train_run(*_):
        raise AssertionError("trained")
    monkeypatch.setattr(variants, "train_run", train_run)
    with pytest.raises(SystemExit, match="^" + re.escape(
            f"error: --steps={steps}: pass a positive number of steps")) as e:
        variants.main(["--size=tiny", "--variants=baseline", "--seeds=0", f"--steps={steps}",
                       f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}"])
    assert "\n" not in str(e.value.code) and not list(tmp_path.iterdir())


def test_the_variants_command_resumes_no_run_into_another_schedule(shakespeare, tmp_path,
                                                                    monkeypatch):
    """A run trained for --steps=2 is not resumed to 3 steps (its 2-step cosine schedule run past
    its end, reported as the 3-step result): refused in one line, naming the folder and the fix,
    before any run trains, the run's files (its launch.log too) as they were. The same command
    again reuses the run."""
    import subprocess
    import variants
    args = ["--size=tiny", "--variants=baseline", "--seeds=0", f"--runs={tmp_path / 'runs'}",
            f"--out={tmp_path / 'out'}"]
    r = run(["variants.py", *args, "--steps=2"], timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    rundir = tmp_path / "runs" / "tiny" / "baseline" / "s0"
    files = lambda: {p: p.read_bytes() for p in rundir.rglob("*") if p.is_file()}
    before = files()
    r = run(["variants.py", *args, "--steps=3"], timeout=1200)
    assert (r.returncode, r.stderr) == (1, f"error: {rundir} holds a run of another config "
                                           "(max_steps=2 there, 3 here; eval_interval=2 there, 3 "
                                           "here): pass another --runs, or remove the folder\n")
    assert files() == before
    launch = subprocess.run

    def no_launch(cmd, *a, **k):  # git's commands run, launch.py's not
        assert "launch.py" not in cmd, "trained"
        return launch(cmd, *a, **k)
    monkeypatch.setattr(subprocess, "run", no_launch)
    monkeypatch.setattr(variants, "measure", lambda *_: {"reused": True})
    monkeypatch.setattr(variants, "write_report", lambda *_: None)
    monkeypatch.setattr(variants, "table", lambda *_: "")
    variants.main([*args, "--steps=2"])
    assert json.loads((tmp_path / "out" / "tiny.json").read_text())["results"] == {
        "baseline": {"0": {"reused": True}}}
