"""muP and CompleteP against their invariants: SP at the base shape, update sizes, coordinate checks
and learning-rate transfer. Each check has an SP control that must fail it, or it would prove nothing."""
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import time

import equinox as eqx
import jax
import numpy as np
import pytest

import configs
import mup
import params
import train
from conftest import ROOT, run, tiny


def mup_tiny(**overrides):
    """A tiny muP config with its base at width 64, depth 2, and 16-wide heads: attn_tau = 4 makes muP's
    tau / 16 exactly SP's 1 / sqrt(16), so muP at the base shape is SP bit for bit."""
    base = dict(param="mup", d_model=64, n_head=4, n_layer=2, d_base=64, depth_base=2, attn_tau=4.0, block_size=16,
                batch_size=4, learning_rate=2e-3, min_lr=2e-3)
    return tiny(**{**base, **overrides})


def batch(cfg, seed=0):
    x = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, cfg.batch_size, cfg.block_size + 1)).astype(np.int32)
    return x[..., :-1], x[..., 1:]


def arrays_of(gpt):
    return jax.tree.leaves(eqx.filter(gpt, eqx.is_array))


def train_steps(cfg, n):
    """Logits of a random-parameter model and the parameters after n steps from init."""
    s = train.setup(cfg, train.make_mesh(cfg))
    x, y = batch(cfg)
    leaves, tree = jax.tree.flatten(eqx.filter(s.model, eqx.is_array))
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = jax.tree.unflatten(tree, [a + 0.3 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])
    logits = np.asarray(jax.vmap(eqx.combine(noisy, eqx.filter(s.model, eqx.is_array, inverse=True)))(x[0]))
    gpt, opt_state = s.model, s.opt_state
    for _ in range(n):
        gpt, opt_state, _ = s.step(gpt, opt_state, x, y)
    return logits, arrays_of(gpt)


def test_configs_keep_sp_at_their_base_and_xl_reuses_the_base_lr():
    """Every shipped config is muP based at its own shape: each multiplier 1, attention 1/sqrt(head_dim),
    i.e. the SP model it was before muP. openwebtext_xl keeps openwebtext's LR, and muP rescales it:
    hidden matrices get lr * 768/1600, residual branches 12/48."""
    for name in ("shakespeare_char", "shakespeare_char_cpu", "openwebtext"):
        cfg = configs.load(name)
        assert cfg.param == "mup" and cfg.width_mult == 1 and cfg.depth_mult == 1, name
        assert all(p.lr_mult == 1 and p.eps_mult == 1 for p in params.policy_rows(cfg).values()), name
        assert cfg.attn_scale == pytest.approx(1 / math.sqrt(cfg.head_dim), rel=1e-12), name
    base, xl = configs.load("openwebtext"), configs.load("openwebtext_xl")
    assert (xl.learning_rate, xl.min_lr, xl.weight_decay) == (base.learning_rate, base.min_lr, base.weight_decay)
    assert params.policy_rows(xl)["blocks.mlp.up"].lr_mult == pytest.approx(768 / 1600)
    assert params.policy_rows(xl)["emb.embed"].lr_mult == 1
    assert 1 / xl.depth_mult == 12 / 48 and xl.attn_scale == 1 / 8


@pytest.mark.parametrize("tie", [False, True])
def test_mup_is_sp_at_the_base_shape(tie):
    """At m = 1 (and L = depth_base) muP and SP are one model with one optimizer: identical logits and
    identical parameters after two steps (the first moves only the zero-initialised readout)."""
    sp = dataclasses.replace(mup_tiny(norm_gain=True, tie_embeddings=tie, alpha_in=1.5, alpha_out=0.5), param="sp")
    logits_sp, after_sp = train_steps(sp, 2)
    logits_mup, after_mup = train_steps(dataclasses.replace(sp, param="mup"), 2)
    np.testing.assert_array_equal(logits_mup, logits_sp)
    for a, b in zip(after_mup, after_sp):
        np.testing.assert_array_equal(a, b)
    if not tie:  # control: away from the base (m = 2, L = 2 * depth_base) the two differ
        logits_far, after_far = train_steps(dataclasses.replace(sp, param="mup", d_base=32, depth_base=1), 2)
        assert not np.allclose(logits_far, logits_sp)
        assert not all(np.allclose(a, b) for a, b in zip(after_far, after_sp))


@pytest.mark.parametrize("m", [1.0, 4.0])
def test_tied_logits_start_at_alpha_out_over_sqrt_m(m):
    """Tied, each logit is alpha_out / m times a sum of D products of the RMS-1 final hidden state and the
    embedding's N(0, 1 / (D / m)) entries: std alpha_out / sqrt(m) at init, O(1) at the base width, shrinking
    with m as muP's logits do. (The embedding's std 1 gave 20 and 5 here.)"""
    cfg = mup_tiny(d_model=128, n_head=8, d_base=int(128 / m), tie_embeddings=True, alpha_out=1.5)
    gpt = params.init_gpt(cfg, jax.random.key(0))
    logits = np.asarray(jax.vmap(gpt)(batch(cfg)[0][0]))
    assert logits.std() == pytest.approx(1.5 / math.sqrt(m), rel=0.1)


@pytest.mark.parametrize("m", [4.0, 0.5])
def test_first_adam_step_sizes_follow_mup(m):
    """One Adam step from init (readout made nonzero, so every parameter has a gradient): each entry
    moves by lr x its multiplier, since Adam's first step is lr * sign(g). Hidden matrices move by lr / m,
    vector-like parameters (embedding, readout, gains) by lr. The expectations are muP's rules, not the table."""
    cfg = mup_tiny(d_model=128, n_head=8, d_base=int(128 / m), norm_gain=True, weight_decay=0.0, learning_rate=1e-3,
                   min_lr=1e-3)
    s = train.setup(cfg, train.make_mesh(cfg))
    unembed = 0.1 * jax.random.normal(jax.random.key(1), s.model.emb.unembed.shape)  # logits O(1): no tiny grads
    gpt = eqx.tree_at(lambda g: g.emb.unembed, s.model, unembed)
    before = [(path, np.asarray(a)) for path, a in jax.tree_util.tree_flatten_with_path(eqx.filter(gpt, eqx.is_array))[0]]
    after, _, _ = s.step(gpt, s.opt_state, *batch(cfg))  # donates gpt's arrays: before holds copies
    hidden = {"blocks.attn.qkv", "blocks.attn.out", "blocks.mlp.up", "blocks.mlp.down"}
    seen = set()
    for (path, old), new in zip(before, arrays_of(after)):
        name = params.param_name(path)
        moved = np.abs(np.asarray(new) - old)
        moved = moved[moved > 0]  # embedding rows of tokens absent from the batch get no gradient
        assert moved.size > 0.1 * np.size(old), name
        expected = 1 / m if name in hidden else 1.0
        assert moved.mean() / cfg.learning_rate == pytest.approx(expected, rel=0.01), name
        seen.add(name)
    assert hidden < seen and len(seen) == 11


def max_abs_slope(table, sizes, steps):
    """The largest |slope| over activations and steps; only the logits at init (all 0) have none."""
    fitted = mup.slopes(sizes, table)
    assert all(fitted[name][t] is not None for name in fitted for t in steps if (name, t) != ("logits", 0))
    return max(abs(fitted[name][t] or 0.0) for name in fitted for t in steps), fitted


def test_coordinate_check_over_width(shakespeare):
    """Widths 64 -> 512, steps 1-4: under muP every activation keeps its size (|slope| <= 0.15 in
    log2 mean|x| against log2 width); the same harness under SP finds one growing (slope >= 0.4)."""
    widths, cfg = [64, 128, 256, 512], mup_tiny(dataset="shakespeare_char")
    worst, fitted = max_abs_slope(mup.coord_check(cfg, "width", widths, steps=4, seeds=2), widths, range(1, 5))
    assert worst <= 0.15, fitted
    sp = mup.coord_check(dataclasses.replace(cfg, param="sp"), "width", widths, steps=4, seeds=2)
    grows, fitted_sp = max_abs_slope(sp, widths, range(1, 5))
    assert grows >= 0.4, fitted_sp
    assert set(fitted) == {"embed", "q", "k", "attn_logits", "attn_out", "mlp_hidden", "mlp_out", "resid.0",
                           "resid.1", "logits"}


def test_coordinate_check_over_depth(shakespeare):
    """Depths 2 -> 16 at width 64, steps 1-4: with CompleteP's residual scale depth_base / L every
    activation keeps its size (|slope| <= 0.15 against log2 depth); without it (SP, which at the base
    width is muP without CompleteP) the residual stream grows. The embedding carries the stream
    (alpha_in = 4; Cerebras-GPT's muP uses 10): at init CompleteP's stream is x0 plus 2L branches
    scaled by depth_base / L, a part that fades like 1 / sqrt(L), which with alpha_in = 1 alone reads
    as a slope of -0.2 over these shallow depths."""
    depths, cfg = [2, 4, 8, 16], mup_tiny(dataset="shakespeare_char", alpha_in=4.0, learning_rate=4e-3, min_lr=4e-3)
    worst, fitted = max_abs_slope(mup.coord_check(cfg, "depth", depths, steps=4, seeds=2), depths, range(1, 5))
    assert worst <= 0.15, fitted
    ends = [depths[0], depths[-1]]  # the control needs only the ends for a slope: fewer compilations
    sp = mup.coord_check(dataclasses.replace(cfg, param="sp"), "depth", ends, steps=4, seeds=2)
    grows, fitted_sp = max_abs_slope(sp, ends, range(1, 5))
    assert grows >= 0.4, fitted_sp


def test_learning_rate_transfers_under_mup_not_sp(shakespeare):
    """Widths 64, 128, 256, six LRs a factor 2 apart, 150 steps of real data: under muP the best LR is
    the same grid point for every width (at most one step apart) and wider is better at it; under SP
    the best LR moves down by at least one step from width 64 (where SP is muP) to 256."""
    cfg = mup_tiny(dataset="shakespeare_char", n_layer=1, depth_base=1, batch_size=8, eval_batches=16, max_steps=150,
                   warmup_steps=0, min_lr=2e-4)
    widths, lrs = [64, 128, 256], [2.0**k for k in range(-10, -4)]
    loss = np.stack([mup.lr_sweep(mup.resize(cfg, "width", w), lrs, 150) for w in widths])
    best = np.nanargmin(loss, axis=1)
    assert np.ptp(best) <= 1, loss
    assert np.all(np.diff(loss[np.arange(len(widths)), best]) < 0), loss
    sp_wide = mup.lr_sweep(mup.resize(dataclasses.replace(cfg, param="sp"), "width", widths[-1]), lrs, 150)
    assert np.nanargmin(sp_wide) <= best[0] - 1, (loss, sp_wide)


@pytest.mark.parametrize("args, error", [(["coord", "--widths=64,abc"], "--widths=64,abc is not a comma-separated list of ints"),
                                         (["coord", "--depths=2,-4"], "--depths=2,-4: every value must be positive and finite"),
                                         (["transfer", "--lrs=1e-3,nan"], "--lrs=1e-3,nan: every value must be positive and finite"),
                                         (["transfer", "--lrs=inf,1e-3"], "--lrs=inf,1e-3: every value must be positive and finite"),
                                         (["coord", "--seeds=0"], "--seeds=0 must be at least 1"),
                                         (["transfer", "--lrs=1e-3,fast"], "--lrs=1e-3,fast is not a comma-separated list of floats"),
                                         (["transfer", "--lrs=1e-3,1e39"], "--lrs=1e-3,1e39: every LR must be finite in float32"),
                                         (["transfer", "--lrs=1e-3,2e-3,1e-3"], "--lrs=1e-3,2e-3,1e-3 repeats a value"),
                                         (["coord", "--widths=64,64"], "--widths=64,64 repeats a value"),
                                         (["coord", "--widths=64"], "--widths=64 needs at least two values to fit a slope"),
                                         (["coord", "--widths=32,64,48"], "width 48 is not a multiple of the head dim 32"),
                                         (["coord", "--widths=64,128", "--depths=2,4"], "--widths and --depths both given"),
                                         (["coord", "--widths="], "--widths= is not a comma-separated list of ints"),
                                         (["transfer", "--depths=2,4", "--lrs=1e-3"], "--depths is for coord"),
                                         (["coord", "--lrs=1e-3"], "--lrs is for transfer"),
                                         (["coord", "--out=TMP/FILE"], "--out=TMP/FILE cannot be written (File exists)"),
                                         (["coord", "--out=TMP/FILE/sub"], "--out=TMP/FILE/sub cannot be written"),
                                         (["coord", "--out=/proc/mugpt"], "--out=/proc/mugpt cannot be written"),
                                         (["coord", "--out="], "--out= cannot be written (empty)"),
                                         (["coord", "--config.n_layers=2"], "unknown config field 'n_layers'; did you mean n_layer"),
                                         (["coord", "--out=TMP/d"], "--out=TMP/d cannot be written (coord_check.json or its .png is a directory)"),
                                         (["transfer", "--lrs=1e-3", "--out=TMP/d"], "--out=TMP/d cannot be written (lr_transfer.json or its .png is a directory)")])
def test_bad_sweep_arguments_are_one_line_errors_before_any_training(tmp_path, monkeypatch, args, error):
    """Each is refused before the first width trains (which takes minutes at the README's sizes)."""
    def train(*_):
        raise AssertionError("trained before the arguments were checked")
    monkeypatch.setattr(mup, "coord_check", train)
    monkeypatch.setattr(mup, "lr_sweep", train)
    (tmp_path / "FILE").write_text("")
    (tmp_path / "d" / "coord_check.json").mkdir(parents=True)
    (tmp_path / "d" / "lr_transfer.png").mkdir()
    args, error = [a.replace("TMP", str(tmp_path)) for a in args], error.replace("TMP", str(tmp_path))
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {error}")):
        mup.main([f"--out={tmp_path}", *args, "--config=shakespeare_char_cpu"])  # a later --out wins


SWEEPS = """import sys, jax, mup
for args in (["coord", "--widths=32,64", "--steps=1", "--seeds=1"], ["transfer", "--widths=32,64", "--lrs=1e-3,2e-3", "--steps=2"]):
    mup.main([*args, "--config=shakespeare_char_cpu", f"--out={sys.argv[1]}"])
print("devices:", jax.device_count())
"""


def test_sweeps_run_on_one_device_of_several(tmp_path, shakespeare):
    """With two devices in the process both commands run (coord's ordered callback is refused by JAX on a
    mesh of two) and write the same numbers, bit for bit, as with one: the same one-device program."""
    results = []
    for n in (1, 2):
        done = run(["-c", SWEEPS, str(tmp_path / str(n))], env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"})
        assert done.returncode == 0 and f"devices: {n}" in done.stdout, done.stderr[-2000:]
        results.append([json.loads((tmp_path / str(n) / f).read_text()) for f in ("coord_check.json", "lr_transfer.json")])
    assert results[0] == results[1]


def fake_sweep(trained, interrupt_at=None):
    """lr_sweep's stand-in: a loss per LR from the width, nan (a diverged run) at the largest; records widths.
    At width interrupt_at it sends the process a Ctrl-C (SIGINT) and waits for it."""
    def sweep(cfg, lrs, steps):
        if cfg.d_model == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        trained.append(cfg.d_model)
        return np.array([cfg.d_model * lr * steps for lr in lrs[:-1]] + [np.nan])
    return sweep


INTERRUPTED = """import sys, mup, test_mup
mup.lr_sweep = test_mup.fake_sweep([], interrupt_at=int(sys.argv[1]))
mup.main(sys.argv[2:])
"""


def test_transfer_resumes_and_keeps_results_of_other_settings(tmp_path, monkeypatch, capsys):
    """Ctrl-C at its second width, transfer says how to continue (one line, no traceback) and its files hold
    the first; the same command then trains only the rest and ends with the files of an uninterrupted run.
    Other settings in that --out, or results mup.py did not record the settings of (docs/'s), are refused
    and left as they were."""
    args = ["transfer", "--config=shakespeare_char_cpu", "--widths=64,32,96", "--lrs=1e-3,2e-3,4e-3", "--steps=3"]
    trained = []
    monkeypatch.setattr(mup, "lr_sweep", fake_sweep(trained))
    mup.main([*args, f"--out={tmp_path / 'whole'}"])
    assert trained == [64, 32, 96]
    whole = json.loads((tmp_path / "whole" / "lr_transfer.json").read_text())
    assert whole["widths"] == [32, 64, 96] and whole["loss"][0][-1] is None and whole["best_lr"]["32"] == 1e-3

    out, trained[:] = tmp_path / "resumed", []
    done = run(["-c", INTERRUPTED, "32", *args, f"--out={out}"], timeout=120)
    assert (done.returncode, done.stderr) == (1, "error: interrupted; rerun the same command to continue\n"), done.stderr
    assert sorted(os.listdir(out)) == ["lr_transfer.json", "lr_transfer.png"]  # no temporary file left
    assert json.loads((out / "lr_transfer.json").read_text())["widths"] == [64]
    capsys.readouterr()
    mup.main([*args, f"--out={out}"])
    assert trained == [32, 96] and "results at width 64: not trained again" in capsys.readouterr().out
    assert json.loads((out / "lr_transfer.json").read_text()) == whole

    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "mup" / "lr_transfer.json", tmp_path / "docs")
    for where, other, error in [(out, ["--lrs=1e-3,2e-3"], "of other settings (lrs differ)"),
                                (out, ["--param=sp", "--steps=4"], "of other settings (steps, config.param differ)"),
                                (tmp_path / "docs", [], "of unrecorded settings (an older mup.py's)")]:
        before = {f: f.read_bytes() for f in where.iterdir()}
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: --out={where} holds lr_transfer.json {error}: pick another")):
            mup.main([*args, *other, f"--out={where}"])
        assert {f: f.read_bytes() for f in where.iterdir()} == before
    assert trained == [32, 96]


def test_coord_makes_again_only_results_of_its_own_settings(tmp_path, monkeypatch):
    """coord_check.json records its settings; a rerun of them writes it again, one of other settings (or into
    docs/'s results, which record none) is refused and leaves the files as they were."""
    table = lambda cfg, axis, sizes, steps, seeds: {"q": np.sqrt(np.outer(sizes, np.arange(1, steps + 2)))}  # slope 1/2
    monkeypatch.setattr(mup, "coord_check", table)
    args = ["coord", "--config=shakespeare_char_cpu", "--steps=2"]
    for _ in range(2):
        mup.main([*args, "--widths=32,64", f"--out={tmp_path / 'out'}"])
        result = json.loads((tmp_path / "out" / "coord_check.json").read_text())
        assert result["slopes"] == {"q": [pytest.approx(0.5)] * 3}
        settings = result["settings"]
        assert (settings["sizes"], settings["seeds"], settings["config.learning_rate"]) == ([32, 64], 3, 4e-3)
    mup.main([*args, "--widths=32,64", "--config.learning_rate=1e-3", f"--out={tmp_path / 'lr'}"])  # as launch.py takes it
    assert json.loads((tmp_path / "lr" / "coord_check.json").read_text())["settings"]["config.learning_rate"] == 1e-3
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "mup" / "coord_check.json", tmp_path / "docs")
    for where, other, error in [("out", ["--widths=32,64", "--steps=3"], "of other settings (steps differ)"),
                                ("out", ["--depths=2,4"], "of other settings (axis, sizes differ)"),
                                ("docs", ["--widths=32,64"], "of unrecorded settings (an older mup.py's)")]:
        before = {f: f.read_bytes() for f in (tmp_path / where).iterdir()}
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: --out={tmp_path / where} holds coord_check.json {error}")):
            mup.main([*args, *other, f"--out={tmp_path / where}"])
        assert {f: f.read_bytes() for f in (tmp_path / where).iterdir()} == before


def test_a_write_stopped_midway_leaves_the_old_file(tmp_path):
    """Results are written beside their file, then renamed over it: a kill leaves the old file or the new one."""
    path = tmp_path / "lr_transfer.json"
    path.write_text("old")

    def half(tmp):
        tmp.write_text("ne")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        mup.write_atomic(path, half)
    assert path.read_text() == "old" and os.listdir(tmp_path) == [path.name]
    mup.write_atomic(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and os.listdir(tmp_path) == [path.name]
