"""One test per muP/CompleteP rule, each cheap and exact: the expected numbers come from the rules as the
papers state them (TP5 Table 3, CompleteP), computed here, never from model.policy_rows. tools/mutate_mup.py
breaks each rule in a copy of the repo and lists the tests that then fail (docs/mup.md)."""
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tools import sweeps
import optimizers
import params
import train
from test_mup import batch, mup_tiny

HIDDEN = {"blocks.attn.qkv", "blocks.attn.out", "blocks.mlp.up", "blocks.mlp.down"}
OUTSIDE_BLOCKS = {"emb.embed", "emb.unembed", "final_norm"}
# m = 4 (width 128 over base 32), d = 2 (2 layers over base 1): no rule's factor is 1
M4D2 = dict(d_model=128, n_head=8, d_base=32, n_layer=2, depth_base=1, norm_gain=True, grad_clip=0.0,
            learning_rate=1e-3, min_lr=1e-3)


def named(gpt):
    """name -> array, for every parameter of a model."""
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(gpt, eqx.is_array))[0]
    return {params.param_name(path): np.asarray(a) for path, a in flat}


def one_step(cfg, readout_seed=1):
    """Parameters before and after one train step from init (readout made nonzero: every parameter then has a
    gradient), and the gradient of the loss at init, by jax.grad of the loss alone."""
    s = train.setup(cfg, train.make_mesh(cfg))
    unembed = 0.1 * jax.random.normal(jax.random.key(readout_seed), s.model.emb.unembed.shape)
    gpt = eqx.tree_at(lambda g: g.emb.unembed, s.model, unembed)
    x, y = batch(cfg)
    grads = eqx.filter_grad(lambda g: train.objective(g, jnp.asarray(x[0]), jnp.asarray(y[0]), cfg))(gpt)
    before, grads = named(gpt), named(grads)
    after, _, _ = s.step(gpt, s.opt_state, x, y)  # donates gpt's arrays: before holds copies
    return before, grads, named(after)


def test_init_stds_follow_mup():
    """At m = 4: hidden matrices N(0, 1 / fan_in) (the MLP's down projection: fan_in F), the embedding N(0, 1)
    at every width, the readout 0, the gains 1 (TP5 Table 3)."""
    cfg = mup_tiny(**{**M4D2, "d_model": 256, "n_head": 16, "d_base": 64})
    D, F = cfg.d_model, cfg.mlp_width
    expected = {"emb.embed": 1.0, "emb.unembed": 0.0, "blocks.attn.qkv": 1 / math.sqrt(D),
                "blocks.attn.out": 1 / math.sqrt(D), "blocks.mlp.up": 1 / math.sqrt(D),
                "blocks.mlp.down": 1 / math.sqrt(F)}
    for name, a in named(params.init_gpt(cfg, jax.random.key(0))).items():
        if name in expected:
            assert a.mean() == pytest.approx(0, abs=0.02 * max(expected[name], 1e-3)), name
            assert a.std() == pytest.approx(expected[name], rel=0.02, abs=1e-12), name
        else:  # QK-LayerNorm and RMSNorm gains
            np.testing.assert_array_equal(a, 1.0, err_msg=name)


@pytest.mark.parametrize("tau", [4.0, 8.0])
def test_attention_logits_are_tau_over_head_dim_as_heads_widen(tau):
    """Two heads at every width, so the head dim grows with it (16 -> 128). With k = q (the alignment training
    brings, TP5 appendix on attention) a token's logit with itself is scale * |LayerNorm(q)|^2 = scale * K:
    attn_tau at every head dim under muP's tau / K; SP's 1 / sqrt(K) would give sqrt(K)."""
    for D in (32, 64, 128, 256):
        cfg = mup_tiny(d_model=D, n_head=2, d_base=32, attn_tau=tau)
        gpt = params.init_gpt(cfg, jax.random.key(0))
        qkv, H = gpt.blocks.attn.qkv, cfg.n_head  # (L, D, heads, K): H query heads, then the keys'
        gpt = eqx.tree_at(lambda g: g.blocks.attn.qkv, gpt, qkv.at[:, :, H:2 * H].set(qkv[:, :, :H]))
        sizes = sweeps.activation_sizes(gpt, np.zeros((1, 1), np.int32))  # one token: only the diagonal
        assert sizes["attn_logits"] == pytest.approx(tau, rel=1e-3), (D, cfg.head_dim)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_first_step_lr_and_adam_eps_follow_mup_and_completep(optimizer):
    """One Adam step at m = 4, d = 2 with eps near the gradients' size: each entry moves by
    lr * lr_mult * g / (|g| + eps * eps_mult) (Adam's first step, bias-corrected), with lr_mult 1 / m for
    hidden matrices and 1 for vector-like parameters (no depth factor: CompleteP's alpha = 1), and eps_mult
    1 / m outside the blocks and 1 / (m d) inside (their gradients carry the readout's 1 / m and the branch
    scale 1 / d; Everett et al. 2024, CompleteP). Under Muon the parameters other than the hidden
    matrices take this Adam, rules and all (the hidden ones: test_optimizers' Muon tests)."""
    cfg = mup_tiny(**M4D2, weight_decay=0.0, optimizer=optimizer)
    m, d = 4, 2
    _, grads, _ = one_step(cfg)
    eps = float(np.median(np.abs(np.concatenate([g.ravel() for g in grads.values()]))))
    cfg = mup_tiny(**M4D2, weight_decay=0.0, adam_eps=eps, optimizer=optimizer)
    before, grads, after = one_step(cfg)
    assert set(before) == HIDDEN | OUTSIDE_BLOCKS | {"blocks.attn.q_norm", "blocks.attn.k_norm",
                                                      "blocks.attn_norm", "blocks.mlp_norm"}
    for name, g in grads.items():
        if optimizer == "muon" and name in HIDDEN:
            continue
        lr_mult = 1 / m if name in HIDDEN else 1.0
        eps_mult = 1 / m if name in OUTSIDE_BLOCKS else 1 / (m * d)
        expected = -cfg.learning_rate * lr_mult * g / (np.abs(g) + eps * eps_mult)
        np.testing.assert_allclose(after[name] - before[name], expected, rtol=2e-3, atol=3e-7, err_msg=name)


@pytest.mark.parametrize("lr", [1e-3, 5e-2])
def test_weight_decay_is_independent_of_lr_and_width(lr):
    """At m = 4, one step with decay minus the same step without: -weight_decay * p for every matrix (hidden,
    embedding, readout), whatever its LR multiplier and the LR; 0 for the gains (Wortsman et al. 2023)."""
    wd = 0.1
    shape = {**M4D2, "learning_rate": lr, "min_lr": lr}
    before, _, no_decay = one_step(mup_tiny(**shape, weight_decay=0.0))
    _, _, decayed = one_step(mup_tiny(**shape, weight_decay=wd))
    for name, p in before.items():
        expected = -wd * p if name in HIDDEN | {"emb.embed", "emb.unembed"} else 0 * p
        np.testing.assert_allclose(decayed[name] - no_decay[name], expected, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("L, depth_base", [(4, 2), (8, 2)])
def test_residual_branches_are_scaled_by_depth_base_over_L(L, depth_base):
    """CompleteP (alpha = 1): each block adds depth_base / L times its attention and MLP outputs. Both are
    linear in their output matrices, so the model equals one without the depth rule (depth_base = L) whose
    attention-out and MLP-down matrices are scaled by depth_base / L."""
    unembed = jax.random.normal(jax.random.key(1), (128, 64))  # nonzero logits
    gpt, plain = (eqx.tree_at(lambda g: g.emb.unembed, params.init_gpt(mup_tiny(n_layer=L, depth_base=b),
                                                                  jax.random.key(0)), unembed)
                  for b in (depth_base, L))  # the same draws: no init std depends on the depth
    r = depth_base / L
    scaled = eqx.tree_at(lambda g: (g.blocks.attn.out, g.blocks.mlp.down), plain,
                         (r * plain.blocks.attn.out, r * plain.blocks.mlp.down))
    x = jnp.asarray(batch(mup_tiny())[0][0, 0])
    np.testing.assert_allclose(gpt(x), scaled(x), rtol=1e-4, atol=1e-4)
    assert not np.allclose(gpt(x), plain(x), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 4])
def test_forward_multipliers_are_alpha_in_and_alpha_out_over_m(m):
    """At width 128 over a base of 128 / m: the embedding's output is alpha_in times its rows at every
    width (the input layer's multiplier is constant, TP5 Table 3), and the logits are alpha_out / m times
    the RMS-normalised final state against the readout (written out here)."""
    cfg = mup_tiny(d_model=128, n_head=8, d_base=128 // m, alpha_in=1.5, alpha_out=2.0)
    gpt = params.init_gpt(cfg, jax.random.key(0))
    unembed = jax.random.normal(jax.random.key(1), gpt.emb.unembed.shape)
    gpt = eqx.tree_at(lambda g: g.emb.unembed, gpt, unembed)
    tokens = jnp.asarray(batch(cfg)[0][0, 0])
    np.testing.assert_allclose(gpt.embed(tokens), 1.5 * np.asarray(gpt.emb.embed)[tokens], rtol=1e-6)
    h = np.asarray(gpt.hidden(tokens)[0], np.float64)
    normed = h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + 1e-6)
    want = 2.0 / m * normed @ np.asarray(unembed, np.float64).T
    np.testing.assert_allclose(gpt.logits(jnp.asarray(h, jnp.float32)), want, rtol=1e-4, atol=1e-5)


def adam_first_moves(before, after, lr):
    """Each parameter's mean |step| / lr over the entries that moved (Adam's first step is
    lr * lr_mult * sign(g) where |g| >> eps)."""
    out = {}
    for name, old in before.items():
        moved = np.abs(after[name] - old)
        out[name] = moved[moved > 0].mean() / lr
    return out


def test_mudd_w1_lr_is_one_over_m():
    """MUDD's connections at m = 4: W1 (fan-in D grows, fan-out fixed: readout-like) moves by lr / m on
    Adam's first step, W2 and b (finite in both dimensions: vector-like) by lr (params.py, TP5 Table 3).
    W2 is made nonzero first: at init (W2 = 0) W1 has no gradient."""
    cfg = mup_tiny(**M4D2, weight_decay=0.0, adam_eps=1e-20, connections="mudd")
    s = train.setup(cfg, train.make_mesh(cfg))
    gpt = eqx.tree_at(lambda g: g.emb.unembed, s.model,
                      0.1 * jax.random.normal(jax.random.key(1), s.model.emb.unembed.shape))
    w2 = [0.1 * jax.random.normal(jax.random.key(2 + i), c.w2.shape) for i, c in enumerate(gpt.mudd)]
    gpt = eqx.tree_at(lambda g: [c.w2 for c in g.mudd], gpt, w2)
    conns = lambda g: {f"{i}.{k}": np.asarray(getattr(c, k)) for i, c in enumerate(g.mudd)
                       for k in ("w1", "w2", "b")}
    before = conns(gpt)
    after, _, _ = s.step(gpt, s.opt_state, *batch(cfg))  # donates gpt's arrays: before holds copies
    for name, moved in adam_first_moves(before, conns(after), cfg.learning_rate).items():
        assert moved == pytest.approx(1 / 4 if name.endswith("w1") else 1.0, rel=0.01), name


def test_warmup_and_schedule_do_not_depend_on_width():
    """warmup_steps = 4: at widths 32 and 128 (m = 1 and 4) the LR at step t is lr (t + 1) / 4 during
    warmup, then the cosine to min_lr (written out here): muP puts the width in lr_mult alone. Through
    the real train step, the first update of the embedding (lr_mult 1) is lr / 4 at both widths."""
    lr, low = 1e-2, 1e-3
    for D in (32, 128):
        cfg = mup_tiny(d_model=D, n_head=D // 16, d_base=32, warmup_steps=4, max_steps=12,
                       learning_rate=lr, min_lr=low, weight_decay=0.0, adam_eps=1e-20)
        schedule = optimizers.lr_schedule(cfg)
        for t in range(12):
            want = lr * (t + 1) / 4 if t < 4 else low + 0.5 * (lr - low) * (1 + math.cos(math.pi * (t - 4) / 8))
            assert float(schedule(t)) == pytest.approx(want, rel=1e-5), (D, t)
        before, _, after = one_step(cfg)
        moved = adam_first_moves({"emb.embed": before["emb.embed"]}, after, lr)["emb.embed"]
        assert moved == pytest.approx(1 / 4, rel=0.01), D
