"""optimizers.py: Muon against an SVD-based numpy Newton-Schulz, its muP rule over width, Lion
against optax's lion, the schedules against their formulas, WSD's extension on resume, the
options that do not apply, and Muon under FSDP."""
import dataclasses
import json
import math

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import optimizers
import params
import test_checkpoint as ckpt  # its launch helpers (a module attribute: its tests stay its own)
from configs import Config
from conftest import ROOT, assert_same_step, run_each, tiny
from model import GPT
from params import Policy
from run.errors import UsageError

A, B, C = 3.4445, -4.7750, 2.0315  # Jordan's quintic, as his blog post prints them


def ns_reference(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Newton-Schulz from singular values, in float64: X = G / |G|_F = U S V^T, and each step
    X <- a X + b X X^T X + c (X X^T)^2 X maps S to a S + b S^3 + c S^5, U and V kept."""
    u, s, vt = np.linalg.svd(g / (np.linalg.norm(g) + 1e-7), full_matrices=False)
    for _ in range(steps):
        s = A * s + B * s**3 + C * s**5
    return (u * s) @ vt


def matrices(x: np.ndarray, name: str) -> np.ndarray:
    """Each layer's matrix, as the task states Muon's views: qkv (D, N, K) as D x (N K), out
    (H, K, D) as (H K) x D, up and down as stored."""
    L = x.shape[0]
    if name == "blocks.attn.out":
        return x.reshape(L, x.shape[1] * x.shape[2], x.shape[3])
    return x.reshape(L, x.shape[1], -1)


def muon_cfg(**overrides) -> Config:
    """Muon alone shapes the update: no clipping, no decay, a constant LR."""
    base = dict(optimizer="muon", grad_clip=0.0, weight_decay=0.0, schedule="constant",
                warmup_steps=0, learning_rate=0.1, min_lr=0.1, adam_eps=1.0)
    return tiny(**{**base, **overrides})


def table_and_grads(cfg: Config, seed: int = 0, steps: int = 1):
    """The policy table of cfg's model, and `steps` random gradient trees shaped like it."""
    skeleton = eqx.filter(eqx.filter_eval_shape(GPT, cfg), params.is_param)
    rng = np.random.default_rng(seed)
    grads = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), skeleton)
             for _ in range(steps)]
    return params.policy_table(skeleton, cfg), grads


def named(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {params.param_name(path): np.asarray(x) for path, x in flat}


def updates_of(cfg: Config, table, grads: list):
    """The updates of each step, for the gradients given, on parameters left at zero."""
    opt = optimizers.make_optimizer(cfg, table)
    zeros = jax.tree.map(np.zeros_like, grads[0])
    state, out = opt.init(zeros), []
    for g in grads:
        u, state = opt.update(g, state, zeros)
        out.append(named(u))
    return out


def test_muon_is_newton_schulz_of_nesterov_momentum_per_layer_and_adam_elsewhere():
    """Two steps: each hidden matrix's update is -lr * 0.2 sqrt(max(R, C)) times the SVD-based
    Newton-Schulz of the Nesterov momentum (1 - b) g_t + b m_t, m_t = b m_{t-1} + (1 - b) g_t,
    layer by layer in the views stated; the other parameters take Adam (first step:
    g / (|g| + eps))."""
    cfg = muon_cfg(muon_momentum=0.9)
    table, grads = table_and_grads(cfg, steps=2)
    got = updates_of(cfg, table, grads)
    g1, g2 = named(grads[0]), named(grads[1])
    b = 0.9
    for name in ("blocks.attn.qkv", "blocks.attn.out", "blocks.mlp.up", "blocks.mlp.down"):
        m1 = (1 - b) * g1[name].astype(np.float64)
        m2 = b * m1 + (1 - b) * g2[name]
        for step, nesterov in ((0, b * m1 + (1 - b) * g1[name]), (1, b * m2 + (1 - b) * g2[name])):
            for layer, g_RC in enumerate(matrices(nesterov, name)):
                want = -0.1 * 0.2 * math.sqrt(max(g_RC.shape)) * ns_reference(g_RC)
                have = matrices(got[step][name], name)[layer]
                np.testing.assert_allclose(have, want, atol=2e-4 * np.abs(want).max(),
                                           err_msg=f"{name} layer {layer} step {step}")
    hidden = {"blocks.attn.qkv", "blocks.attn.out", "blocks.mlp.up", "blocks.mlp.down"}
    assert len(set(g1) - hidden) >= 4  # the embeddings and the QK-norm gains
    for name in set(g1) - hidden:
        np.testing.assert_allclose(got[0][name], -0.1 * g1[name] / (np.abs(g1[name]) + 1.0),
                                   rtol=1e-5, err_msg=name)


def test_muon_update_spectral_norm_is_constant_over_width():
    """muP for Muon (the spectral condition, Yang, Simon & Bernstein 2023): at width multipliers
    1, 2, 4 the first update of each hidden matrix is lr / sqrt(m) * 0.2 sqrt(max(R, C)) times
    Newton-Schulz's matrix (computed in numpy), so its spectral norm stays put while its RMS falls
    as 1 / sqrt(m)."""
    norms = {}
    for m in (1, 2, 4):
        cfg = muon_cfg(param="mup", d_base=32, d_model=32 * m, n_head=2 * m)
        table, grads = table_and_grads(cfg, seed=m)
        got, g = updates_of(cfg, table, grads)[0], named(grads[0])
        for name in ("blocks.attn.qkv", "blocks.attn.out", "blocks.mlp.up", "blocks.mlp.down"):
            g_RC, have = matrices(g[name], name)[0], matrices(got[name], name)[0]
            want = -0.1 / math.sqrt(m) * 0.2 * math.sqrt(max(g_RC.shape)) * ns_reference(g_RC)
            np.testing.assert_allclose(have, want, atol=2e-4 * np.abs(want).max(), err_msg=name)
            norms[name, m] = np.linalg.norm(have, ord=2)
            # an orthogonal R x C matrix's RMS is 1 / sqrt(max(R, C)); Newton-Schulz's is near
            assert np.sqrt(np.mean(have**2)) == pytest.approx(0.02 / math.sqrt(m), rel=0.3)
    for name, m in norms:
        assert norms[name, m] / norms[name, 1] == pytest.approx(1, abs=0.15), (name, m, norms)


def test_lion_equals_optax_lion_times_each_lr_multiplier():
    """Three steps on a plain pytree: the update is optax.lion's (weight decay 0) times each
    parameter's lr_mult; Lion's own betas, set away from their defaults, are the ones used."""
    cfg = tiny(optimizer="lion", lion_beta1=0.8, lion_beta2=0.9, grad_clip=0.0,
               weight_decay=0.0, schedule="constant", warmup_steps=0, learning_rate=0.01)
    table = {"w": Policy(1.0, 1.0, decay=False, spec=()), "v": Policy(1.0, 0.5, False, spec=())}
    rng = np.random.default_rng(0)
    zeros = {"w": np.zeros((3, 4), np.float32), "v": np.zeros(5, np.float32)}
    grads = [jax.tree.map(lambda z: rng.normal(size=z.shape).astype(np.float32), zeros)
             for _ in range(3)]
    ours = optimizers.make_optimizer(cfg, table)
    ref = optax.lion(cfg.learning_rate, b1=0.8, b2=0.9, weight_decay=0.0)
    s, r = ours.init(zeros), ref.init(zeros)
    for g in grads:
        u, s = ours.update(g, s, zeros)
        want, r = ref.update(g, r, zeros)
        np.testing.assert_allclose(u["w"], want["w"], rtol=1e-6)
        np.testing.assert_allclose(u["v"], 0.5 * want["v"], rtol=1e-6)


def test_lion_takes_adams_mup_learning_rates():
    """Lion's first update is -lr * lr_mult * sign(g): at width multiplier 2, |update| / lr is
    1/m = 0.5 on the hidden matrices, 1 on the embedding, readout and gains (TP5's Adam rules)."""
    cfg = tiny(optimizer="lion", param="mup", d_base=32, d_model=64, n_head=4, norm_gain=True,
               grad_clip=0.0, weight_decay=0.0, schedule="constant", warmup_steps=0,
               learning_rate=0.01)
    table, grads = table_and_grads(cfg)
    got = updates_of(cfg, table, grads)[0]
    hidden = {"blocks.attn.qkv", "blocks.attn.out", "blocks.mlp.up", "blocks.mlp.down"}
    for name, u in got.items():
        want = 0.5 if name in hidden else 1.0
        np.testing.assert_allclose(np.abs(u) / 0.01, want, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_schedule_is_its_formula(shape):
    """Warmup (step + 1) / warmup * lr, lr until max_steps - round(f * max_steps), then down to
    min_lr at max_steps: linearly, or as 1 - sqrt of the fraction of the decay done."""
    lr, low, warmup, total, f = 1.0, 0.1, 3, 20, 0.3
    cfg = tiny(schedule="wsd", decay_fraction=f, decay_shape=shape, learning_rate=lr,
               min_lr=low, warmup_steps=warmup, max_steps=total)
    start = 14  # 20 - round(6.0)
    for step in range(total + 3):
        if step < warmup:
            want = lr * (step + 1) / warmup
        elif step < start:
            want = lr
        else:
            done = min((step - start) / (total - start), 1.0)
            want = lr - (lr - low) * (done if shape == "linear" else math.sqrt(done))
        assert float(optimizers.lr_schedule(cfg)(step)) == pytest.approx(want, rel=1e-6), step
    constant = tiny(schedule="constant", learning_rate=lr, warmup_steps=warmup, max_steps=total)
    assert [float(optimizers.lr_schedule(constant)(s)) for s in (2, 3, 19, 40)] == [1, 1, 1, 1]


@pytest.mark.parametrize("change", [dict(max_steps=40), dict(decay_fraction=0.5),
                                    dict(decay_shape="1-sqrt")])
def test_a_wsd_run_extends_exactly_while_the_steps_taken_agree(change):
    """Resuming at a checkpoint of step k (steps 0 to k - 1 taken) with another max_steps or
    decay is allowed exactly when the old and the new schedule gave each of those steps the
    same LR."""
    old = tiny(schedule="wsd", learning_rate=1.0, min_lr=0.1, warmup_steps=2, max_steps=20,
               decay_fraction=0.3)
    new = dataclasses.replace(old, **change)
    lrs = [[float(optimizers.lr_schedule(c)(t)) for t in range(21)] for c in (old, new)]
    for k in range(21):
        try:
            optimizers.check_extension(old, new, k)
            allowed = True
        except UsageError:
            allowed = False
        assert allowed == (lrs[0][:k] == lrs[1][:k]), k


def test_an_option_of_another_optimizer_or_schedule_is_refused_in_one_line():
    tiny(optimizer="muon", muon_ns_steps=3).check(1)  # its own options are fine
    cases = [(dict(optimizer="lion", adam_eps=1e-6), "adam_eps=1e-06 does not apply to "
              "optimizer='lion' (only to adamw or muon): leave it at 1e-08"),
             (dict(muon_momentum=0.9), "muon_momentum=0.9 does not apply to optimizer='adamw'"),
             (dict(decay_fraction=0.5), "decay_fraction=0.5 does not apply to schedule='cosine'"),
             (dict(position="alibi", rope_base=500.0),  # ALiBi has no rotation to set
              "rope_base=500.0 does not apply to position='alibi' (only to rope)"),
             # WSD's decay would start inside warmup: at warmup's end the LR would fall at once
             (dict(schedule="wsd", decay_fraction=0.5, warmup_steps=7, max_steps=10),
              "decay_fraction=0.5 starts the WSD decay at step 5, before warmup_steps=7 ends: "
              "use a decay_fraction <= 0.3")]
    for overrides, message in cases:
        with pytest.raises(UsageError) as e:
            tiny(**overrides).check(1)
        assert str(e.value).startswith(message)


WSD = ["--config.schedule=wsd", "--config.min_lr=2e-4"]


def test_wsd_run_extended_in_its_stable_phase_resumes_bitwise(shakespeare, tmp_path, env):
    """8 steps all stable (decay_fraction 0), then resumed to 16 with the last half decaying:
    the logs and final state of a straight 16-step run of the second config, bitwise. Extending
    it again once its decay has begun is refused in one line, and nothing is written: given on the
    command line, or written into config.json (checked against the checkpoint's own record)."""
    straight, rundir = tmp_path / "straight", tmp_path / "run"
    longer = (*WSD, "--config.max_steps=16", "--config.decay_fraction=0.5")
    r = ckpt.run(ckpt.launch_args(straight, *longer), env)
    assert r.returncode == 0, r.stderr
    r = ckpt.run(ckpt.launch_args(rundir, *WSD, "--config.max_steps=8",
                                  "--config.decay_fraction=0"), env)
    assert r.returncode == 0, r.stderr
    r = ckpt.run(ckpt.launch_args(rundir, *longer), env)
    assert r.returncode == 0, r.stderr
    assert "resuming from the checkpoint of step 8" in r.stdout
    assert ckpt.records(rundir) == ckpt.records(straight)
    cfg = ckpt.tiny_config(*longer)
    for a, b in zip(ckpt.final_state(rundir, cfg), ckpt.final_state(straight, cfg), strict=True):
        np.testing.assert_array_equal(a, b)
    before = (rundir / "config.json").read_text()
    r = ckpt.run(ckpt.launch_args(rundir, *longer[:-2], "--config.max_steps=24",
                                  "--config.decay_fraction=0.5"), env)
    ckpt.assert_one_line_error(r, "the checkpoint is at step 16, past the start of the WSD decay "
                                  "(step 8): max_steps=24 (was 16) would change the LR of steps")
    assert (rundir / "config.json").read_text() == before
    edited = json.loads(before) | {"max_steps": 24}
    (rundir / "config.json").write_text(json.dumps(edited))
    metrics = (rundir / "metrics.jsonl").read_bytes()
    r = ckpt.run(["launch.py", f"--rundir={rundir}"], env)
    ckpt.assert_one_line_error(r, "the checkpoint is at step 16, past the start of the WSD decay "
                                  "(step 8): max_steps=24 (was 16) would change the LR of steps")
    assert json.loads((rundir / "config.json").read_text()) == edited
    assert (rundir / "metrics.jsonl").read_bytes() == metrics and ckpt.committed_steps(rundir) == [8, 16]


def test_resume_with_another_optimizer_is_one_line(shakespeare, tmp_path, env):
    """Its state has another structure: the config's comparison refuses it before anything."""
    rundir = tmp_path / "run"
    rundir.mkdir()
    (rundir / "config.json").write_text(json.dumps(dataclasses.asdict(ckpt.tiny_config())))
    r = ckpt.run(ckpt.launch_args(rundir, "--config.optimizer=muon"), env)
    ckpt.assert_one_line_error(r, f"{rundir} holds a run with optimizer='adamw' there, 'muon' "
                                  f"here: resuming may change only max_steps")
    assert sorted(p.name for p in rundir.iterdir()) == ["config.json"]


def test_muon_on_4_fsdp_devices_equals_one_device(tmp_path):
    """fsdp_probe.py's step with Muon: parameters, momentum and the orthogonalised matrices split
    4 ways over fsdp (XLA gathers what Newton-Schulz's matmuls need); the loss, gradients and
    updated parameters equal one device's."""
    out = {n: tmp_path / f"d{n}.npz" for n in (1, 4)}
    for r in run_each([[str(ROOT / "tests/fsdp_probe.py"), str(n), str(out[n]), "1", "optimizer=muon"]
                       for n in (1, 4)]):
        assert r.returncode == 0, r.stderr
    assert_same_step(np.load(out[4]), np.load(out[1]))


def test_the_optimizer_comparison_claims_only_what_its_numbers_allow():
    """tools/optimizer_sweep.readme on made-up sweeps: the best LR is each optimizer's lowest mean
    validation loss, the difference from AdamW's is claimed only when its 95% interval (Welch's t,
    scipy's) excludes 0, a best LR at the grid's edge is said, and the steps to the target (the
    highest final mean train loss) are the first window at or below it."""
    from scipy import stats
    from tools import optimizer_sweep as sweep

    def run(best, vals, train):  # val at every LR: 9 except at the best
        return {"lrs": [1e-3 * 2**k for k in range(4)], "best": best, "train": train,
                "val": [vals if i == best else [9.0] * len(vals) for i in range(4)]}

    doc = {"commit": "c0ffee", "dirty": False, "minutes": 1.0,
           "settings": {"command": "python -m tools.optimizer_sweep --out=X", "config": "cfg",
                        "overrides": [], "steps": 30, "seeds": 3},
           "results": {"adamw": run(1, [2.00, 2.02, 2.04], [[3, 2.5, 2.1]] * 3),
                       "lion": run(3, [2.01, 2.03, 2.05], [[3, 2.8, 2.4]] * 3),
                       "muon": run(2, [1.80, 1.81, 1.82], [[2.4, 2.2, 2.0]] * 3)}}
    text = sweep.readme(doc)
    a, m = np.array([2.00, 2.02, 2.04]), np.array([1.80, 1.81, 1.82])
    se2 = a.var(ddof=1) / 3 + m.var(ddof=1) / 3
    df = se2**2 / ((a.var(ddof=1) / 3) ** 2 / 2 + (m.var(ddof=1) / 3) ** 2 / 2)
    half = stats.t.ppf(0.975, df) * np.sqrt(se2)
    assert f"| muon | 0.004 (2/3) | 1.810 ± 0.010 | {m.mean() - a.mean():.3f} ± {half:.3f} (resolved) |" in text
    assert "- muon: better than AdamW at 30 steps (the 95% interval excludes 0)" in text
    assert "- lion: not distinguishable from AdamW at 30 steps" in text and "grid's edge" in text
    assert "Target train loss: 2.400" in text
    assert sweep.steps_to([[3, 2.5, 2.1], [3, 2.8, 2.4], [2.6, 2.6, 2.6]], 2.4) == [30, 30, None]


@pytest.mark.parametrize("muon,said", [
    ([70, 70, 80], "not resolved (the interval includes 0)"),
    ([30, 40, 30], "fewer steps (the interval excludes 0)")])
def test_steps_to_the_target_are_claimed_only_beyond_welchs_interval(muon, said):
    """The steps to the target, Muon's minus AdamW's (90, 80, 100 steps), against scipy's Welch
    interval, an independent computation: said to be fewer only when it excludes 0; a seed that
    never reaches the target leaves the difference out (Lion's, here)."""
    from scipy import stats
    from tools import optimizer_sweep as sweep

    def run(reached):  # 10 windows of 10 steps; seed i at 2.0 (the target) from step reached[i]
        train = [[3.0] * (k // 10 - 1) + [2.0] * (11 - k // 10) for k in reached]
        return {"lrs": [1e-3, 2e-3, 4e-3], "best": 1, "train": train, "val": [[2.0] * 3] * 3}

    never = run([50, 60, 70])  # one seed ends above the target, 2.0, and the mean below it
    never["train"] = [[3.0] * 9 + [2.5], [3.0] * 5 + [1.5] * 5, [3.0] * 5 + [1.5] * 5]
    doc = {"commit": "c0ffee", "dirty": False, "minutes": 1.0,
           "settings": {"command": "python -m tools.optimizer_sweep --out=X", "config": "cfg",
                        "overrides": [], "steps": 100, "seeds": 3},
           "results": {"adamw": run([90, 80, 100]), "lion": never, "muon": run(muon)}}
    text = sweep.readme(doc)
    ci = stats.ttest_ind(muon, [90, 80, 100], equal_var=False).confidence_interval(0.95)
    d, h = (ci.high + ci.low) / 2, (ci.high - ci.low) / 2
    assert f"- muon, steps to the target: {d:+.1f} ± {h:.1f} against AdamW's (95% interval): " \
        f"{said}" in text
    assert f"| {np.mean(muon):.0f} ± {np.std(muon, ddof=1):.0f} | {d:.1f} ± {h:.1f}" in text
    assert "- lion, steps to the target: no difference computed: a seed never reaches" in text


def test_docs_optimizer_comparison_is_current():
    """docs/optimizers_cpu/README.md is what tools/optimizer_sweep.readme makes from the
    optimizers.json beside it: a change of the generator without the remade README fails here."""
    from tools import optimizer_sweep as sweep
    where = ROOT / "docs" / "optimizers_cpu"
    doc = json.loads((where / "optimizers.json").read_text())
    assert (where / "README.md").read_text() == sweep.readme(doc), (
        "docs/optimizers_cpu/README.md is stale: "
        "python -m tools.optimizer_sweep --out=docs/optimizers_cpu --remake")


@pytest.mark.parametrize("name", ["shakespeare_char_cpu", "shakespeare_char"])
def test_the_comparison_trains_each_optimizer_without_the_others_fields(name):
    """tools/optimizer_sweep's config per optimizer: every config passes Config.check (the
    shipped configs tune Adam's betas: shakespeare_char's beta2 0.99 once stopped its Lion sweep),
    the fields of the optimizers not in use are at Config()'s defaults, the rest is the config's;
    on shakespeare_char_cpu, Lion's is the config of docs/optimizers_cpu's run (beta1 0.9)."""
    import configs
    from tools.optimizer_sweep import OPTIMIZERS, with_optimizer

    cfg, default = configs.load(name), Config()
    unused = {"adamw": {"lion_beta1", "lion_beta2", "muon_momentum", "muon_ns_steps", "muon_rms"},
              "lion": {"beta1", "beta2", "adam_eps", "muon_momentum", "muon_ns_steps", "muon_rms"},
              "muon": {"lion_beta1", "lion_beta2"}}
    for opt in OPTIMIZERS:
        got = with_optimizer(cfg, opt)
        got.check(got.mesh_replica)
        for field in dataclasses.fields(Config):
            want = (opt if field.name == "optimizer" else getattr(default, field.name)
                    if field.name in unused[opt] else getattr(cfg, field.name))
            assert getattr(got, field.name) == want, (opt, field.name)
    if name == "shakespeare_char_cpu":
        assert with_optimizer(cfg, "lion") == configs.apply_overrides(
            cfg, ["--config.optimizer=lion", "--config.beta1=0.9"])
