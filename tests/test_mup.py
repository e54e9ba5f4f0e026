"""muP and CompleteP against their invariants: SP at the base shape, update sizes, coordinate checks
and learning-rate transfer. Each check has an SP control that must fail it, or it would prove nothing."""
import dataclasses
import json
import math
import os
import re
import signal
import time

import equinox as eqx
import jax
import numpy as np
import pytest

import configs
import mup
import params
from tools import plots, sweeps
import train
from conftest import ROOT, run, run_each, tiny


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


def coord_table(cfg, axis, sizes, steps, seeds=2, readout=0.0):
    """Activation name -> mean |x|, shape (sizes, steps + 1), from mup.coord_check at each size."""
    rows = [sweeps.coord_check(mup.resize(cfg, axis, size), steps, seeds, readout)["x"] for size in sizes]
    return {name: np.array([row[name] for row in rows]) for name in rows[0]}


def max_abs_slope(table, sizes, steps):
    """The largest |slope| over activations and steps; only the logits at init (all 0) have none."""
    fitted = plots.slopes(sizes, table)
    assert all(fitted[name][t] is not None for name in fitted for t in steps if (name, t) != ("logits", 0))
    return max(abs(fitted[name][t] or 0.0) for name in fitted for t in steps), fitted


def test_coordinate_check_over_width(shakespeare):
    """Widths 64 -> 512, steps 1-4: under muP every activation keeps its size (|slope| <= 0.15 in
    log2 mean|x| against log2 width); the same harness under SP (mup.variant's, GPT-2's) finds one growing
    (slope >= 0.4)."""
    widths, cfg = [64, 128, 256, 512], mup_tiny(dataset="shakespeare_char")
    worst, fitted = max_abs_slope(coord_table(cfg, "width", widths, steps=4), widths, range(1, 5))
    assert worst <= 0.15, fitted
    sp = coord_table(mup.variant(cfg, "sp"), "width", widths, steps=4, readout=mup.READOUT["sp"])
    grows, fitted_sp = max_abs_slope(sp, widths, range(1, 5))
    assert grows >= 0.4, fitted_sp
    assert set(fitted) == {"embed", "q", "k", "attn_logits", "attn_out", "mlp_hidden", "mlp_out", "resid", "logits"}


def test_coordinate_check_over_depth(shakespeare):
    """Depths 2 -> 16 at width 64, steps 1-4: with CompleteP's residual scale depth_base / L every
    activation keeps its size (|slope| <= 0.15 against log2 depth); without it (depth_base = L at every
    depth) the residual stream grows. The embedding carries the stream (alpha_in = 4; Cerebras-GPT's muP
    uses 10): at init CompleteP's stream is x0 plus 2L branches scaled by depth_base / L, a part that fades
    like 1 / sqrt(L), which with alpha_in = 1 alone reads as a slope of -0.2 over these shallow depths."""
    depths, cfg = [2, 4, 8, 16], mup_tiny(dataset="shakespeare_char", alpha_in=4.0, learning_rate=4e-3, min_lr=4e-3)
    worst, fitted = max_abs_slope(coord_table(cfg, "depth", depths, steps=4), depths, range(1, 5))
    assert worst <= 0.15, fitted
    ends = [depths[0], depths[-1]]  # the control needs only the ends for a slope: fewer compilations
    rows = [sweeps.coord_check(mup.variant(mup.resize(cfg, "depth", L), "nodepth"), 4, 2)["x"] for L in ends]
    grows, fitted_off = max_abs_slope({k: np.array([r[k] for r in rows]) for k in rows[0]}, ends, range(1, 5))
    assert grows >= 0.4, fitted_off


def test_coordinate_check_reads_x_t_and_x_t_minus_x_0(shakespeare):
    """mup.coord_check's mean |x_t| and mean |x_t - x_0| (microsoft/mup's two measures) of the logits and
    the embedding, against the model run directly, without taps, from the same initial model and two steps
    on the same batch at m = 2. Its readout (readout=1) starts N(0, 1 / d_base), not zero: step 1 then
    moves the activations inside the model too."""
    import data
    cfg = mup_tiny(dataset="shakespeare_char", d_base=32, learning_rate=8e-3, min_lr=8e-3, warmup_steps=0,
                   max_steps=2)
    got = sweeps.coord_check(cfg, 2, 1, readout=1.0)
    x, y = data.get_batch(data.load_split(cfg, "train"), cfg.seed, data.TRAIN, 0, cfg.batch_size, cfg.block_size)
    gpt = sweeps.init(cfg, jax.random.key(cfg.seed), readout=1.0)
    assert np.std(gpt.emb.unembed) == pytest.approx(1 / math.sqrt(32), rel=0.05)
    s = train.setup(cfg, sweeps.one_device_mesh())
    opt_state = train.make_optimizer(cfg, params.policy_table(gpt, cfg)).init(eqx.filter(gpt, eqx.is_array))
    # placed as the step's outputs are: the step is then traced once
    gpt, opt_state = eqx.filter_shard(gpt, s.model_sharding), eqx.filter_shard(opt_state, s.opt_sharding)
    seen = []
    for t in range(3):
        seen.append((np.asarray(jax.vmap(gpt)(x)), np.asarray(jax.vmap(gpt.embed)(x))))
        if t < 2:  # donates gpt's arrays: seen holds copies
            gpt, opt_state, _ = s.step(gpt, opt_state, x[None], y[None])
    for i, name in enumerate(("logits", "embed")):
        np.testing.assert_allclose(got["x"][name], [np.abs(o[i]).mean() for o in seen], rtol=1e-5)
        np.testing.assert_allclose(got["dx"][name], [np.abs(o[i] - seen[0][i]).mean() for o in seen],
                                   rtol=1e-4, atol=1e-12)
        assert got["dx"][name][2] > 0
    assert got["dx"]["mlp_out"][1] > 0  # not only the readout moved


def lr_sweep(cfg, lrs, steps, readout=0.0):
    """The validation loss after `steps` steps at each LR, from one initial model."""
    return sweeps.train_runs(cfg, lrs, 1, steps, readout=readout)[1][:, 0]


def test_learning_rate_transfers_under_mup_not_sp(shakespeare):
    """Widths 64 and 512 (m = 8), seven LRs a factor 2 apart that bracket every optimum, 150 steps
    of real data. Under muP the best LR, read between grid points (plots.optimum), moves by at
    most one grid step and the wider model is better there; under SP (64 -> 256) it moves down
    by two or more. A wide model must bracket its optimum: with the hidden LR's 1/m removed the
    optimum at 512 falls 1.3 steps (tools/mutate_mup.py), not the 3 of log2 m, as the embedding's
    and readout's LRs pull the other way; muP's rises about half a step at these tiny sizes."""
    cfg = mup_tiny(dataset="shakespeare_char", batch_size=8, eval_batches=16, max_steps=150,
                   warmup_steps=0, min_lr=2e-4)
    lrs = [2.0**k for k in range(-10, -3)]
    loss = np.stack([lr_sweep(mup.resize(cfg, "width", w), lrs, 150) for w in (64, 512)])
    narrow, wide = map(plots.optimum, loss)
    assert 0 < narrow < len(lrs) - 1 and 0 < wide < len(lrs) - 1, loss  # bracketed
    assert abs(wide - narrow) <= 1, (narrow, wide, loss)
    assert np.nanmin(loss[1]) < np.nanmin(loss[0]), loss
    sp = mup.variant(cfg, "sp")
    sp_narrow, sp_wide = (plots.optimum(lr_sweep(mup.resize(sp, "width", w), lrs, 150, mup.READOUT["sp"]))
                          for w in (64, 256))
    assert sp_wide <= sp_narrow - 2, (sp_narrow, sp_wide)


def test_optimum_is_the_vertex_between_grid_points():
    """A loss that is a parabola in log2 LR has its optimum read exactly between grid points; at
    the grid's edge the edge; diverged runs (None, nan) are skipped or give None."""
    assert plots.optimum([(x - 3.3) ** 2 for x in range(8)]) == pytest.approx(3.3)
    assert plots.optimum([None] + [2 * (x - 4.25) ** 2 + 1 for x in range(1, 8)]) == pytest.approx(4.25)
    assert plots.optimum([3.0, 2.0, 1.0]) == 2.0
    assert plots.optimum([None, float("nan")]) is None


def test_the_depth_rules_are_said_to_cost_loss_where_they_do():
    """Three seeds per depth: with the rules 0.1 worse than without at depth 2, the same at 4, 0.2
    better at 8. The README's comparison says so, each difference with its 95% interval (Welch's
    t, from scipy's t distribution here), and no claim when there is one seed."""
    from scipy import stats
    noise = np.array([-0.01, 0.0, 0.012])
    best = {"lr_depth": {2: 2.4, 4: 2.3, 8: 2.1}, "lr_depth_nodepth": {2: 2.3, 4: 2.3, 8: 2.3}}
    doc = {"results": {part: {str(n): [[b + 1, b + e, b + 0.5] for e in noise] for n, b in by.items()}
                       for part, by in best.items()}}
    text = "\n".join(plots.depth_rules_against_off(doc))
    se = np.sqrt(2 * noise.var(ddof=1) / 3)  # equal spreads: Welch's df is 4
    half = stats.t.ppf(0.975, 4) * se
    assert f"- depth 2: with the rules 2.401 ± 0.011, without 2.301 ± 0.011, difference 0.100 ± {half:.3f}" in text
    assert f"difference -0.200 ± {half:.3f}" in text
    assert "Lower beyond the 95% interval: the rules at depth 8; no rules at depth 2." in text
    one = {"results": {part: {k: v[:1] for k, v in by.items()} for part, by in doc["results"].items()}}
    assert "no claim either way" in "\n".join(plots.depth_rules_against_off(one))


@pytest.mark.parametrize("sp_best,said", [
    ({64: 2.5, 128: 2.3, 256: 2.4}, "muP at widths 64, 256; equal at 128;"),
    ({64: 2.5, 128: 2.3, 256: 2.1}, "model.py's SP at width 256; muP at width 64; equal at 128;")])
def test_the_lower_loss_names_only_the_sides_that_have_a_width(sp_best, said):
    """muP's best loss 2.4, 2.3, 2.2 at widths 64, 128, 256 against model.py's SP's: the line on
    which has the lower mean names each side only where it has a width (never "at widths none")."""
    noise = [-0.01, 0.0, 0.012]
    rows = lambda by: {str(w): [[b + 1, b + e, b + 0.5] for e in noise] for w, b in by.items()}
    doc = {"results": {"lr_width": rows({64: 2.4, 128: 2.3, 256: 2.2}),
                       "lr_width_spmodel": rows(sp_best)}}
    st = {"lr_width": {"config": {"d_model": 128}, "lrs": [1e-3, 2e-3, 4e-3]}}
    line = next(x for x in plots.against_mup(doc, st, "lr_width_spmodel", "model.py's SP", "")
                if x.startswith("The lower mean loss"))
    assert line.startswith(f"The lower mean loss: {said} beyond the 95% interval at: "), line
    assert "none;" not in line


EVIDENCE = sorted(p.parent.relative_to(ROOT) for p in (ROOT / "docs").rglob("evidence.json"))


@pytest.mark.parametrize("where", EVIDENCE, ids=map(str, EVIDENCE))
def test_docs_mup_evidence_is_current(where):
    """Each evidence.json under docs/ (docs/mup, and a variant's in docs/variants) holds the rules'
    fingerprint (mup.rules: the policy rows, forward multipliers and LR schedule at a reference
    shape) and the settings (full resolved configs, sizes, steps, seeds, LRs) that its recorded
    `python mup.py evidence` command would run now, a result for every size, and the README made
    from them: otherwise the evidence is stale, and this names what differs and the command that
    remakes it. Its coordinate check at the base width, recomputed through the first step, must
    match (mup.drift): a change to the initial draw, the batches or the step changes no rule or
    setting; evidence that does not match must say it is stale in its README (the command, rerun
    on it, records that). Evidence made before seeds (no "seeds" key) is checked against the
    settings that code ran (one seed per sweep, coordinate checks at the training LR from a zero
    readout, seeds sharing batches), and its README must say plainly that it has one seed per LR
    and no spread."""
    doc = json.loads((ROOT / where / "evidence.json").read_text())
    preset = doc.get("preset", "cpu")
    command = " ".join(["python mup.py evidence", f"--out={where}", f"--preset={preset}",
                        f"--config={doc['config_name']}", *doc["overrides"]])
    cfg = mup.evidence_config(doc["config_name"], preset, doc["overrides"])
    # evidence already marked stale (its draws changed) may predate the optimizer's own
    # fingerprint: it then holds the one recorded before it, AdamW's rows, which must still match
    before_per_optimizer = [mup.rules()] if "stale" in doc else []
    assert doc.get("rules") in [mup.rules(cfg.optimizer), *before_per_optimizer], \
        f"{where} is stale (a muP rule changed): {command}"
    # a Config field added after the evidence was made is its default there (as launch.py reads an
    # older run's config.json): a new option, off by default, does not change what was measured
    defaults = json.loads(json.dumps(dataclasses.asdict(configs.Config())))
    for part in doc["settings"].values():
        part["config"] = {**{k: v for k, v in defaults.items() if k not in part["config"]},
                          **part["config"]}
    now = mup.settings(cfg, preset, doc.get("seeds", mup.SEEDS))
    if "seeds" not in doc:  # made before seeds: the settings of that code, its parts
        now = {part: s for part, s in now.items() if part in doc["settings"]}
        for part, s in now.items():
            s.update(seeds={"sweep": 1}.get(s["kind"], 3), lrs=s["lrs"] if s["kind"] != "coord"
                     else [cfg.learning_rate])
            for key in ("batches", "readout", "sequences"):
                s.pop(key, None)
        assert "one seed per LR; no spread" in plots.readme(doc)
    stale = plots.differences(doc["settings"], now)
    assert not stale, f"{where} is stale ({', '.join(stale)} differ): {command}"
    missing = [(p, s) for p, v in now.items() for s in v["sizes"] if str(s) not in doc["results"].get(p, {})]
    assert not missing, f"{where} lacks {missing}: rerun {command} to finish it"
    if "seeds" in doc:  # the rules and settings alone miss a change to the draws or the step
        far = mup.drift(doc)
        assert "stale" in doc or far <= mup.DRIFT, (
            f"{where} is stale (its coordinate check at the base width differs from the current "
            f"code's by {far:.1e}): remake it with {command} in a new folder, or rerun that "
            "command to say so in its README")
        assert "stale" not in doc or far > mup.DRIFT, f"{where} is marked stale but is not: rerun {command}"
    assert (ROOT / where / "README.md").read_text() == plots.readme(doc)


def test_evidence_made_outside_a_git_checkout_says_its_commit_is_unknown():
    """A copy without .git (a downloaded archive) records no commit: its README says so, not
    "commit None", which reads as if a commit named it."""
    doc = json.loads((ROOT / "docs/mup/evidence.json").read_text()) | {"commit": None,
                                                                       "dirty": None}
    made = plots.readme(doc).splitlines()[2]
    assert "commit unknown (not made in a git checkout)" in made and "None" not in made


def test_a_changed_rule_changes_the_fingerprint(monkeypatch):
    """mup.rules sees a rule changed in params.py (the hidden LR's 1/m removed): the staleness
    test's comparison then fails (tools/mutate_mup.py --with_staleness shows it for every rule)."""
    before, muon = mup.rules(), mup.rules("muon")
    rows = params.policy_rows
    monkeypatch.setattr(params, "policy_rows", lambda cfg: {**rows(cfg), "blocks.mlp.up": dataclasses.replace(
        rows(cfg)["blocks.mlp.up"], lr_mult=1.0)})
    assert mup.rules()["rows"]["blocks.mlp.up"] != before["rows"]["blocks.mlp.up"]
    # Muon's hidden rows are its own (1 / sqrt(m)): its evidence's fingerprint sees them
    assert mup.rules("muon")["rows"]["blocks.mlp.up"] != muon["rows"]["blocks.mlp.up"] != \
        before["rows"]["blocks.mlp.up"]
    monkeypatch.undo()
    assert mup.rules() == before and mup.rules("muon") == muon


def test_staleness_names_the_differing_fields():
    """The staleness test's comparison: a changed config field, LR grid and size list are each named."""
    now = mup.settings(configs.load("shakespeare_char_cpu"))
    old = json.loads(json.dumps(now))
    old["lr_width"]["config"]["learning_rate"] = 2e-3
    old["curves"]["sizes"] = old["curves"]["sizes"][:-1]
    del old["coord_depth"]["config"]["rope_base"]
    assert plots.differences(old, json.loads(json.dumps(now))) == [
        "coord_depth.config.rope_base", "lr_width.config.learning_rate", "curves.sizes"]


def fake_measure(done, interrupt_at=None):
    """mup.measure's stand-in: results from the size; records (part, size). At interrupt_at it sends the
    process a Ctrl-C (SIGINT) and waits for it."""
    def measure(s, size, *_):
        if (s["kind"], size) == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        done.append((s["kind"], size))
        if s["kind"] == "coord":
            return {k: {"q": [float(size) ** 0.5 * (t + 1) for t in range(s["steps"] + 1)]} for k in ("x", "dx")}
        if s["kind"] == "sweep":  # None: a diverged run
            return [[size * lr * (1 + i / 100) for lr in s["lrs"][:-1]] + [None] for i in range(s["seeds"])]
        return {"train": [[3 - size / 1000 - t / 100 + i / 1e4 for t in range(s["steps"] // mup.EVERY)]
                          for i in range(s["seeds"])],
                "val": [3.0] * s["seeds"]}
    return measure


INTERRUPTED = """import sys, mup, test_mup
mup.measure = test_mup.fake_measure([], interrupt_at=("sweep", 256))
mup.main(sys.argv[1:])
"""


def test_evidence_resumes_and_keeps_results_of_other_settings(tmp_path, monkeypatch, capsys):
    """Ctrl-C midway, evidence says how to continue (one line, no traceback) and its files hold what was done;
    the same command then measures only the rest and ends with the files of an uninterrupted run. Other
    settings in that --out, or a JSON without recorded settings, are refused and left as they were."""
    args = ["evidence", "--config=shakespeare_char_cpu"]
    done = []
    monkeypatch.setattr(mup, "measure", fake_measure(done))
    mup.main([*args, f"--out={tmp_path / 'whole'}"])
    n = sum(len(s["sizes"]) for s in mup.settings(configs.load("shakespeare_char_cpu")).values())
    assert len(done) == n + 1  # and the draws, once (mup.draws)
    whole = json.loads((tmp_path / "whole" / "evidence.json").read_text())
    assert whole["results"]["lr_width"]["64"][0][-1] is None
    readme = (tmp_path / "whole" / "README.md").read_text()
    assert "| 64 | 0.00 ± 0.00 (0.00025), loss 0.016 ± 0.000 | 0.00 ± 0.00 (0.00025), loss 0.016 ± 0.000 |" in readme
    assert "Wider is never worse beyond 1 sd at any logged step after warmup; better beyond 1 sd at every" in readme
    assert "Tuned at the base width 128 and trained at width 256 with the LR best at 128" in readme

    out, done[:] = tmp_path / "resumed", []
    result = run(["-c", INTERRUPTED, *args, f"--out={out}"], timeout=300)
    assert (result.returncode, result.stderr) == (1, "\nerror: interrupted (SIGINT); rerun the same command to continue\n")
    assert not [f for f in os.listdir(out) if f.startswith(".")]  # no temporary file left
    partial = json.loads((out / "evidence.json").read_text())["results"]
    assert "lr_width" in partial and "256" not in partial["lr_width"]
    capsys.readouterr()
    mup.main([*args, f"--out={out}"])
    left = n - sum(map(len, partial.values()))  # and the draws, checked (mup.drift)
    assert len(done) == left + 1 and "sizes left" in capsys.readouterr().out
    again = json.loads((out / "evidence.json").read_text())
    assert again["results"] == whole["results"] and again["settings"] == whole["settings"]

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "evidence.json").write_text(json.dumps({"results": {}}))  # no settings
    for where, other, error in [(out, ["--config.learning_rate=1e-3"], "of other settings (coord_width.lrs, "
                                 "coord_width.config.learning_rate, coord_width_sp.lrs, coord_width_sp.config."
                                 "learning_rate ... differ)"),
                                (tmp_path / "old", [], "of unrecorded settings")]:
        before = {f: f.read_bytes() for f in where.iterdir()}
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: --out={where} holds evidence.json {error}: pick")):
            mup.main([*args, *other, f"--out={where}"])
        assert {f: f.read_bytes() for f in where.iterdir()} == before


def test_evidence_refuses_a_folder_of_other_files(tmp_path, monkeypatch):
    """An --out of someone's files but no evidence.json (their notes; --out=. in the repo, its
    README.md) is not taken for evidence's own, whose README.md would overwrite theirs: refused in
    one line before any training, its files as they were. A new or empty folder is evidence's."""
    def measure(*_):
        raise AssertionError("trained")
    monkeypatch.setattr(mup, "measure", measure)
    args = ["evidence", "--preset=tiny", "--seeds=1", "--parts=coord_width"]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("my notes\n")
    monkeypatch.chdir(notes)
    for out in (str(notes), "."):
        with pytest.raises(SystemExit, match="^" + re.escape(
                f"error: --out={out} holds files but no evidence.json: pick an empty or new "
                "folder, or one that mup.py evidence wrote")):
            mup.main([*args, f"--out={out}"])
        assert os.listdir(notes) == ["README.md"]
        assert (notes / "README.md").read_text() == "my notes\n"
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new"):
        with pytest.raises(AssertionError, match="trained"):  # taken: it trains
            mup.main([*args, f"--out={out}"])


def test_parts_measures_those_now_and_the_same_command_the_rest_later(tmp_path, monkeypatch, capsys):
    """--parts=lr_width,lr_depth (a slow optimizer's sweeps first, say): their sizes only, a line saying
    what is left; the same command without --parts then measures only the others."""
    args, done = ["evidence", "--config=shakespeare_char_cpu", f"--out={tmp_path}"], []
    monkeypatch.setattr(mup, "measure", fake_measure(done))
    sizes = {p: len(s["sizes"]) for p, s in mup.settings(configs.load("shakespeare_char_cpu")).items()}
    mup.main([*args, "--parts=lr_width,lr_depth"])
    results = json.loads((tmp_path / "evidence.json").read_text())["results"]
    parted = sizes["lr_width"] + sizes["lr_depth"]
    assert sorted(results) == ["lr_depth", "lr_width"] and len(done) == parted + 1  # and the draws
    left = sum(sizes.values()) - parted
    assert f"{left} sizes of other parts left (rerun without --parts)" in capsys.readouterr().out
    mup.main(args)
    # every size once, and the draws twice: recorded by the first run, checked by the second
    assert len(done) == sum(sizes.values()) + 2 and "all parts done" in capsys.readouterr().out
    assert sorted(json.loads((tmp_path / "evidence.json").read_text())["results"]) == sorted(mup.PARTS)


def test_the_tiny_preset_runs_the_whole_command_on_the_cpu(shakespeare, tmp_path, monkeypatch):
    """`python mup.py evidence --preset=tiny`, its muP LR sweep over width (the real training at toy
    sizes, 3 seeds, LRs and seeds vmapped in programs of 2 LRs as --preset=gpu's): the CPU dry run of what
    the GPU ladder runs, through the same code (the coordinate check's: the test above). Its files hold
    every size, LR and seed, and the README their means and spreads."""
    monkeypatch.setattr(mup, "PARTS", {"lr_width": mup.PARTS["lr_width"]})
    start = time.time()
    mup.main(["evidence", "--preset=tiny", f"--out={tmp_path}"])
    print(f"tiny preset, LR sweeps over width: {time.time() - start:.0f} s")
    doc = json.loads((tmp_path / "evidence.json").read_text())
    assert doc["seeds"] == 3 and doc["preset"] == "tiny" and doc["rules"] == mup.rules()
    assert all(len(seeds) == 3 and len(seeds[0]) == 3 for seeds in doc["results"]["lr_width"].values())
    readme = (tmp_path / "README.md").read_text()
    assert "--preset=tiny" in readme and "| 32 | " in readme and "| 64 | " in readme
    assert readme == plots.readme(doc) and "one seed per LR" not in readme


def test_evidence_of_other_draws_is_refused_a_resume_and_said_stale_once_complete(tmp_path, monkeypatch):
    """A change to the initial draw or the step changes no rule or setting: an --out whose draws
    (its first run's coordinate check at the base width through step 1, whatever --parts) this
    code does not reproduce beyond float rounding is refused a resume, which would mix two codes'
    results, and left as it was; its parts done, the same command says in the README that it is
    stale, and takes that back once the code matches."""
    monkeypatch.setattr(mup, "measure", fake_measure([]))
    args, path = ["evidence", f"--out={tmp_path}"], tmp_path / "evidence.json"
    mup.main([*args, "--parts=lr_width"])
    doc = json.loads(path.read_text())
    made = doc["draws"]["x"]["q"][1]
    doc["draws"]["x"]["q"][1] = made * 1.01  # the code that made it stepped otherwise
    path.write_text(json.dumps(doc))
    before = {f: f.read_bytes() for f in tmp_path.iterdir()}
    with pytest.raises(SystemExit, match="^" + re.escape(
            f"error: --out={tmp_path} was made by other code: its coordinate check at the base width "
            "differs from this code's by 9.9e-03 (the initial models, the batches or the step changed): pick")):
        mup.main(args)
    assert {f: f.read_bytes() for f in tmp_path.iterdir()} == before
    mup.main([*args, "--parts=lr_width"])  # nothing left to measure: the check alone
    marked = json.loads(path.read_text())
    assert marked["stale"]["drift"] == pytest.approx(0.01 / 1.01)
    assert "**Stale: the code at commit " in (tmp_path / "README.md").read_text()
    marked["draws"]["x"]["q"][1] = made * (1 + mup.DRIFT / 10)  # rounding
    path.write_text(json.dumps(marked))
    mup.main([*args, "--parts=lr_width"])
    assert "stale" not in json.loads(path.read_text())
    assert "Stale" not in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize("args, error", [(["--config.n_layers=2"], "unknown config field 'n_layers'; did you mean n_layer"),
                                         (["--config.n_head=3"], "width 64 is not a multiple of the head dim"),
                                         (["--out=TMP/FILE"], "--out=TMP/FILE cannot be written (File exists)"),
                                         (["--out=TMP/FILE/sub"], "--out=TMP/FILE/sub cannot be written"),
                                         (["--out=/proc/mugpt"], "--out=/proc/mugpt cannot be written"),
                                         (["--out="], "--out= cannot be written (empty)"),
                                         (["--out=TMP/d"], "--out=TMP/d cannot be written (evidence.json is a directory)"),
                                         (["--seeds=0"], "--seeds=0: at least 1"),
                                         (["--parts=lr_widht"], "--parts: no part 'lr_widht'; the parts: coord_width,")])
def test_bad_evidence_arguments_are_one_line_errors_before_any_training(tmp_path, monkeypatch, args, error):
    """Each is refused before the first part trains (the whole takes most of an hour)."""
    def measure(*_):
        raise AssertionError("trained before the arguments were checked")
    monkeypatch.setattr(mup, "measure", measure)
    (tmp_path / "FILE").write_text("")
    (tmp_path / "d" / "evidence.json").mkdir(parents=True)
    args, error = [a.replace("TMP", str(tmp_path)) for a in args], error.replace("TMP", str(tmp_path))
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {error}")):
        mup.main(["evidence", f"--out={tmp_path}", *args])  # a later --out wins


SWEEPS = """import dataclasses, json, sys, jax, configs
from tools import sweeps
cfg = dataclasses.replace(configs.load("shakespeare_char_cpu"), d_model=32, n_head=1, kernels=False)
print(json.dumps([sweeps.coord_check(cfg, 1, 1), sweeps.train_runs(cfg, [1e-3, 2e-3], 1, 2)[1].tolist()]))
print("devices:", jax.device_count())
"""


def test_sweeps_run_on_one_device_of_several(shakespeare):
    """With two devices in the process both measurements run (coord's ordered callback is refused by JAX on a
    mesh of two) and give the same numbers, bit for bit, as with one: the same one-device program."""
    results = []
    for n, done in zip((1, 2), run_each([["-c", SWEEPS]] * 2, devices=[1, 2])):
        assert done.returncode == 0 and f"devices: {n}" in done.stdout, done.stderr[-2000:]
        results.append(done.stdout.splitlines()[0])
    assert results[0] == results[1]


def test_a_write_stopped_midway_leaves_the_old_file(tmp_path):
    """Results are written beside their file, then renamed over it: a kill leaves the old file or the new one."""
    path = tmp_path / "evidence.json"
    path.write_text("old")

    def half(tmp):
        tmp.write_text("ne")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        plots.write_atomic(path, half)
    assert path.read_text() == "old" and os.listdir(tmp_path) == [path.name]
    plots.write_atomic(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and os.listdir(tmp_path) == [path.name]
