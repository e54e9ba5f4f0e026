"""The network against invariants and an independent numpy reference."""
import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model as M
import params
from conftest import tiny


def numpy_forward(gpt: M.GPT, cfg, tokens: np.ndarray) -> np.ndarray:
    """The GPT written again in plain numpy from the papers' equations, with loops and
    complex-number RoPE: grouped-query and SharedKV attention, ALiBi, MUDD connections."""
    p = jax.tree.map(np.asarray, eqx.filter(gpt, eqx.is_array))
    emb = p.emb.pytree if cfg.tie_embeddings else p.emb
    T, K, H = len(tokens), cfg.head_dim, cfg.n_head
    G = cfg.n_kv_head or H
    shared = cfg.attention == "sharedkv"

    def rms(x):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6)

    def ln(x, g):
        x = x - x.mean(-1, keepdims=True)
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * g

    def rope(x):  # pairs (i, i + K/2) as complex numbers, turned by e^{i * pos * theta_i}
        theta = cfg.rope_base ** (-np.arange(K // 2) / (K // 2))
        z = (x[..., :K // 2] + 1j * x[..., K // 2:]) * np.exp(1j * np.arange(T)[:, None, None] * theta)
        return np.concatenate([z.real, z.imag], axis=-1)

    def gelu(u):
        return 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))

    # ALiBi's slopes for a power-of-two H (Press et al. 2022, section 3): 2^(-8/H), 2^(-16/H), ...
    slopes = [2 ** (-8 * (h + 1) / H) for h in range(H)] if cfg.position == "alibi" else [0] * H

    def attention(b, xq, xk, xv):
        w = b.attn.qkv  # (D, heads, K): H query heads, [G key heads,] G value heads
        q = np.einsum("td,dhk->thk", xq, w[:, :H])
        v = np.einsum("td,dhk->thk", xv, w[:, H:] if shared else w[:, H + G:])
        k = v if shared else np.einsum("td,dhk->thk", xk, w[:, H:H + G])  # SharedKV: keys = values
        q, k = ln(q, b.attn.q_norm), ln(k, b.attn.k_norm)
        if cfg.position == "rope":
            q, k = rope(q), rope(k)
        out = np.zeros_like(q)
        for t in range(T):
            for hd in range(H):
                g = hd // (H // G)  # the query head's key/value head
                s = np.array([q[t, hd] @ k[u, g] * cfg.attn_scale - slopes[hd] * (t - u)
                              for u in range(t + 1)])
                w_ = np.exp(s - s.max())
                out[t, hd] = (w_ / w_.sum()) @ v[:t + 1, g]
        return np.einsum("thk,hkd->td", out, b.attn.out)

    x = cfg.alpha_in * emb.embed[tokens]
    states, streams = [x], [x] * (3 if shared else 4)  # MUDD: queries', [keys',] values', residual
    for layer in range(cfg.n_layer):
        b = jax.tree.map(lambda a: a[layer], p.blocks)
        if cfg.connections == "mudd":
            *inputs, x = streams
            xq, xk, xv = (inputs[0], None, inputs[1]) if shared else inputs
        else:
            xq = xk = xv = x
        x = x + attention(b, rms(xq), rms(xk) if xk is not None else None, rms(xv)) / cfg.depth_mult
        x = x + gelu(rms(x) @ b.mlp.up) @ b.mlp.down / cfg.depth_mult
        if cfg.connections == "mudd":  # A = GELU(RMSNorm(X) W1) W2 + b, b one-hot + offset
            c = p.mudd[layer]
            states.append(x)
            C, J = c.b.shape
            a = (gelu(rms(x) @ c.w1) @ c.w2).reshape(T, C, J) + c.b + np.eye(J)[J - 1]
            streams = [sum(a[:, s, j, None] * states[j] for j in range(J)) for s in range(C)]
            x = streams[-1]
    readout = emb.embed if cfg.tie_embeddings else emb.unembed
    return rms(x) @ readout.T * cfg.alpha_out / cfg.width_mult


def random_gpt(cfg, seed=0, fast=None):
    """Every parameter random (the zero readout at init would hide bugs downstream of it)."""
    return moved(params.init_gpt(cfg, jax.random.key(seed), fast), seed + 1)


def moved(gpt, seed=1, scale=0.3):
    """gpt with scale x N(0, 1) added to every array, each on its own sharding: train.setup's
    model made random."""
    arrays, static = eqx.partition(gpt, eqx.is_array)
    leaves, tree = jax.tree.flatten(arrays)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [jax.device_put(x + scale * jax.random.normal(k, x.shape, x.dtype), x.sharding)
              for x, k in zip(leaves, keys)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), static)


@pytest.mark.parametrize("tie", [False, True])
def test_forward_matches_numpy_reference(tie):
    cfg = tiny(n_layer=2, n_head=2, d_model=16, tie_embeddings=tie)
    gpt = random_gpt(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 12)
    np.testing.assert_allclose(np.asarray(gpt(jnp.asarray(tokens))), numpy_forward(gpt, cfg, tokens), rtol=2e-4, atol=2e-4)


def test_causal():
    cfg = tiny()
    gpt = random_gpt(cfg)
    rng = np.random.default_rng(1)
    a = rng.integers(0, cfg.vocab_size, 16)
    for t in (0, 5, 14):
        b = a.copy()
        b[t + 1:] = rng.integers(0, cfg.vocab_size, 15 - t)
        la, lb = gpt(jnp.asarray(a)), gpt(jnp.asarray(b))
        np.testing.assert_allclose(la[:t + 1], lb[:t + 1], atol=1e-5)
        assert not np.allclose(la[t + 1:], lb[t + 1:], atol=1e-3)  # later positions do see the change


def test_rope_depends_on_relative_position_only():
    """Through the model's own tables (GPT.positions, cfg.rope_base, here not the default): they
    are cos and sin of pos * base^(-2i/K) written out, and attention scores and outputs do not
    move when every position shifts by 1000."""
    cfg = tiny(d_model=32, n_head=2, rope_base=500.0)
    gpt = random_gpt(cfg)
    attn = jax.tree.map(lambda a: a[0], gpt.blocks.attn)
    K = cfg.head_dim
    pos = jnp.arange(16)
    angle = np.arange(16)[:, None] * 500.0 ** (-2 * np.arange(K // 2) / K)
    at = gpt.positions(pos)
    np.testing.assert_allclose(at.q_rope[0], np.cos(angle), atol=1e-6)
    np.testing.assert_allclose(at.k_rope[1], np.sin(angle), atol=1e-6)
    x = jax.random.normal(jax.random.key(3), (16, cfg.d_model))
    q, k, _ = attn.project((x,))
    far = gpt.positions(pos + 1000)
    q0, k0 = M.qk_norm_rope(q, k, attn.q_norm, attn.k_norm, at.q_rope, at.k_rope)
    q1, k1 = M.qk_norm_rope(q, k, attn.q_norm, attn.k_norm, far.q_rope, far.k_rope)
    scores = lambda q, k: jnp.einsum("thk,shk->hts", q, k)
    np.testing.assert_allclose(scores(q0, k0), scores(q1, k1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(attn((x,), at)[0], attn((x,), far)[0], rtol=1e-4, atol=1e-4)
    assert not np.allclose(q0, q1, atol=1e-2)  # absolute positions change q: the rotation is there


def test_loss_at_init_is_log_vocab():
    import train
    cfg = tiny(n_layer=2, d_model=64, n_head=2)
    gpt = params.init_gpt(cfg, jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
    assert abs(float(train.objective(gpt, x, x, cfg)) - math.log(cfg.model_vocab)) < 0.1


@pytest.mark.parametrize("loss_chunks", [1, 2])
def test_loss_of_a_random_model_is_numpys_cross_entropy(loss_chunks):
    """Every parameter random (the readout too, and its multiplier 1.5): train.loss_fn's
    cross-entropy (and objective, the same without added terms) is the mean over the batch of
    -log softmax(numpy_forward's logits)[target], padded vocabulary included."""
    import train
    cfg = tiny(n_layer=2, d_model=16, n_head=2, loss_chunks=loss_chunks, alpha_out=1.5)
    gpt = random_gpt(cfg)
    rng = np.random.default_rng(5)
    x, y = (rng.integers(0, cfg.vocab_size, (2, 12)) for _ in range(2))
    want = []
    for xb, yb in zip(x, y):
        logits = numpy_forward(gpt, cfg, xb).astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        want.append(logz - logits[np.arange(12), yb])
    objective, got = map(float, train.loss_fn(gpt, jnp.asarray(x), jnp.asarray(y), cfg))
    assert got == objective == pytest.approx(float(np.mean(want)), rel=1e-4)
    assert abs(got - math.log(cfg.model_vocab)) > 0.5  # not the uniform loss of a zero readout


def expected_policy(cfg) -> dict:
    """params.policy_rows written out again, per kind of parameter: (init mean, init std, LR
    multiplier, weight decay, Adam eps multiplier, spec of one layer's array). m, d: width and
    depth multipliers (Tensor Programs V Table 3; CompleteP)."""
    D, F, m, d = cfg.d_model, cfg.mlp_width, cfg.d_model / cfg.d_base, cfg.n_layer / cfg.depth_base
    embed_std = (D / m) ** -0.5 if cfg.tie_embeddings else 1.0
    hidden = lambda std, spec: (0.0, std, 1 / m, True, 1 / (m * d), spec)
    gain = (1.0, 0.0, 1.0, False, 1 / (m * d), (None,))
    return {"emb.embed": (0.0, embed_std, 1.0, True, 1 / m, (None, "fsdp")),
            "emb.unembed": (0.0, 0.0, 1.0, True, 1 / m, (None, "fsdp")),
            "blocks.attn.qkv": hidden(D ** -0.5, ("fsdp", None, None)),
            "blocks.attn.out": hidden(D ** -0.5, (None, None, "fsdp")),
            "blocks.mlp.up": hidden(D ** -0.5, ("fsdp", None)),
            "blocks.mlp.down": hidden(F ** -0.5, (None, "fsdp")),
            "blocks.attn.q_norm": gain, "blocks.attn.k_norm": gain,
            "blocks.attn_norm": gain, "blocks.mlp_norm": gain,
            "final_norm": (1.0, 0.0, 1.0, False, 1 / m, (None,)),
            "mudd.w1": (0.0, D ** -0.5, 1 / m, True, 1.0, ("fsdp", None)),
            "mudd.w2": (0.0, 0.0, 1.0, True, 1.0, (None, None)),
            "mudd.b": (0.0, 0.0, 1.0, False, 1.0, (None, None))}


@pytest.mark.parametrize("variant", [dict(norm_gain=True, connections="mudd"),
                                     dict(tie_embeddings=True)])
def test_policy_table_covers_every_parameter(variant):
    """Every parameter has a row, and its values are expected_policy's, under muP at width 2x and
    depth 2x the base (so that every multiplier differs from 1)."""
    cfg = tiny(param="mup", d_model=64, d_base=32, n_layer=4, depth_base=2, n_head=4, **variant)
    gpt = params.init_gpt(cfg, jax.random.key(0))
    table = params.policy_table(gpt, cfg)
    is_row = lambda x: isinstance(x, params.Policy)
    rows = jax.tree_util.tree_flatten_with_path(table, is_leaf=is_row)[0]
    assert len(rows) == len(jax.tree.leaves(eqx.filter(gpt, eqx.is_array)))
    want = expected_policy(cfg)
    for path, p in rows:
        name = params.param_name(path)
        mean, std, lr, decay, eps, spec = want[name]
        spec = (None, *spec) if name.startswith("blocks.") else spec  # stacked: L in front
        got = (p.init_mean, p.init_std, p.lr_mult, p.decay, p.eps_mult)
        assert got == pytest.approx((mean, std, lr, decay, eps)), name
        assert tuple(p.spec) == spec, name


def test_policy_table_rejects_a_parameter_without_a_row(monkeypatch):
    cfg = tiny()
    gpt = params.init_gpt(cfg, jax.random.key(0))
    rows = params.policy_rows(cfg)
    del rows["blocks.mlp.up"]
    monkeypatch.setattr(params, "policy_rows", lambda _: rows)
    with pytest.raises(params.UsageError, match="without a row in policy_rows: blocks.mlp.up"):
        params.policy_table(gpt, cfg)


def test_tied_embeddings_are_one_array():
    import train
    cfg = tiny(tie_embeddings=True)
    gpt = random_gpt(cfg)
    emb = gpt.embeddings()
    assert emb.embed is emb.unembed
    x = jnp.zeros((2, 16), jnp.int32)
    grads = eqx.filter_grad(train.objective)(gpt, x, x, cfg)
    # The readout's gradient reaches the shared array: rows of tokens never input still get one.
    assert float(jnp.abs(grads.emb.pytree.embed[5]).sum()) > 0


@pytest.mark.parametrize("remat", ["none", "full", "save_dots"])
def test_remat_and_unroll_do_not_change_gradients(remat):
    import train
    cfg = tiny(n_layer=4)
    ref = random_gpt(cfg)
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    g0 = eqx.filter_grad(train.objective)(ref, x, x, cfg)
    other = random_gpt(dataclasses.replace(cfg, remat=remat, scan_unroll=2))
    g1 = eqx.filter_jit(eqx.filter_grad(train.objective))(other, x, x, cfg)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_model_is_differentiable_on_one_unbatched_sequence():
    """jax.grad of the model alone, no vmap, no train.py, against an independent derivative: the
    directional derivative along a random direction equals the central finite difference of
    numpy_forward (float64, so the difference is exact to ~1e-8)."""
    cfg = tiny(d_model=16, n_head=2)  # numpy_forward has no norm gains
    gpt = random_gpt(cfg)
    tokens = np.arange(16) % cfg.vocab_size
    grads = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(m(jnp.asarray(tokens)))))(gpt)
    params_, static = eqx.partition(gpt, eqx.is_array)
    rng = np.random.default_rng(7)
    d = jax.tree.map(lambda x: rng.normal(size=x.shape), params_)
    f64 = lambda eps: eqx.combine(jax.tree.map(lambda p, v: np.asarray(p, np.float64) + eps * v,
                                               params_, d), static)
    f = lambda eps: np.sum(np.sin(numpy_forward(f64(eps), cfg, tokens)))
    eps = 1e-5
    numeric = (f(eps) - f(-eps)) / (2 * eps)
    analytic = sum(float(jnp.vdot(g, v)) for g, v in
                   zip(jax.tree.leaves(eqx.filter(grads, eqx.is_array)), jax.tree.leaves(d)))
    assert analytic == pytest.approx(numeric, rel=1e-3)


def test_flops_per_token_follow_an_edited_mlp(monkeypatch):
    """A gated (SwiGLU) MLP with three matrices: flops_per_token counts them from the model's arrays,
    against 6N + 12 L H K T written out for that model."""
    class SwiGLU(eqx.Module):
        gate: jax.Array
        up: jax.Array
        down: jax.Array

        def __init__(self, cfg, fast):
            D, F = cfg.d_model, cfg.mlp_width
            self.gate, self.up, self.down = jnp.zeros((D, F)), jnp.zeros((D, F)), jnp.zeros((F, D))

    monkeypatch.setattr(M, "MLP", SwiGLU)
    cfg = tiny(n_layer=3, d_model=32, n_head=4, mlp_ratio=8 / 3, block_size=16)
    L, D, F, V, T = 3, 32, round(32 * 8 / 3), cfg.model_vocab, 16
    gpt = eqx.filter_eval_shape(M.GPT, cfg)
    want = 6 * (L * (3 * D * D + D * D + 3 * D * F) + V * D) + 12 * L * D * T
    assert params.flops_per_token(gpt, T) == want


def test_attention_implementations_match_a_naive_reference():
    """model.attend written out (the CPU path, causal and with sample.py's position mask), jax's XLA
    dot_product_attention and, on a GPU, cuDNN's flash attention, against softmax(q k^T * scale + mask) v
    in plain numpy, one sequence at a time."""
    q, k, v = (np.asarray(jax.random.normal(jax.random.key(i), (2, 16, 4, 8), jnp.float32)) for i in range(3))

    def naive(q, k, v, mask_TS):
        s = np.einsum("thk,shk->hts", q, k) / math.sqrt(8) + np.where(mask_TS, 0, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("hts,shk->thk", p / p.sum(-1, keepdims=True), v)

    causal = np.tril(np.ones((16, 16), bool))
    window = causal & ~np.tril(np.ones((16, 16), bool), -3)  # each query sees itself and 2 before
    # a GPU multiplies float32 in TF32 by default (about 1e-3 relative): the float32 paths are
    # compared at full precision, the bf16 kernel below at bf16's tolerance
    for b in range(2):
        want = naive(q[b], k[b], v[b], causal)
        with jax.default_matmul_precision("highest"):
            np.testing.assert_allclose(M.attend(q[b], k[b], v[b], 1 / math.sqrt(8)), want,
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(M.attend(q[b], k[b], v[b], 1 / math.sqrt(8), mask_TS=window),
                                       naive(q[b], k[b], v[b], window), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(jax.nn.dot_product_attention(q[b], k[b], v[b], is_causal=True),
                                       want, rtol=1e-5, atol=1e-5)
        if jax.default_backend() == "gpu":
            from fused import fast_paths
            bf = lambda a: jnp.asarray(a, jnp.bfloat16)
            out = fast_paths.cudnn_attend(bf(q[b]), bf(k[b]), bf(v[b]), 1 / math.sqrt(8))
            np.testing.assert_allclose(out.astype(jnp.float32), want, atol=3e-2)


ROW_MISTAKES = {  # a policy row's mistake, the launch's devices and config, its one line
    "no row": ("{k: v for k, v in rows(cfg).items() if k != 'blocks.mlp.up'}", 1, [],
               "params.py: parameters without a row in policy_rows: blocks.mlp.up (add each one's "
               "init std, LR multiplier, decay and sharding)"),
    # q_norm's K = 32 / 8 = 4 entries split over 8 devices: XLA's own error, deep inside jax, was
    # a traceback after the run directory was made
    "indivisible sharding": ("{**rows(cfg), 'blocks.attn.q_norm': params.dataclasses.replace("
                             "rows(cfg)['blocks.attn.q_norm'], spec=('fsdp',))}", 8,
                             ["--config.n_head=8"],
                             "params.py: policy_rows shards blocks.attn.q_norm (2, 4) over fsdp's "
                             "8 devices along an axis of 4, which 8 does not divide: give that "
                             "axis None in its spec, or set mesh_replica"),
    # up's (D, F) seen as D x (F and the next layer's D): Muon would orthogonalise a matrix
    # across the layers, silently
    "muon view": ("{**rows(cfg), 'blocks.mlp.up': params.dataclasses.replace("
                  "rows(cfg)['blocks.mlp.up'], muon_view=(1, 2))}", 1, ["--config.optimizer=muon"],
                  "params.py: policy_rows gives blocks.mlp.up the muon_view (1, 2), which does not "
                  "split one layer's 2 axes into rows and columns (Muon would orthogonalise another "
                  "matrix)"),
}


@pytest.mark.parametrize("mistake", ROW_MISTAKES)
def test_a_policy_row_mistake_stops_launch_before_the_run_directory(shakespeare, tmp_path, mistake):
    """The mistakes of adding a parameter (forgetting its row, or sharding an axis the devices
    do not divide) are one line naming it, and nothing is written."""
    from conftest import TINY_RUN, run
    rows, devices, args, line = ROW_MISTAKES[mistake]
    code = ("import sys, params\n"
            "rows = params.policy_rows\n"
            f"params.policy_rows = lambda cfg: {rows}\n"
            "import launch\n"
            "launch.main(sys.argv[1:])\n")
    r = run(["-c", code, *TINY_RUN, *args, f"--rundir={tmp_path / 'run'}"],
            env={"JAX_NUM_CPU_DEVICES": str(devices)})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"error: {line}"
    assert not (tmp_path / "run").exists()
