"""The network against invariants and an independent numpy reference."""
import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model as M
from conftest import tiny


def numpy_forward(gpt: M.GPT, cfg, tokens: np.ndarray) -> np.ndarray:
    """The GPT written again in plain numpy, with loops and complex-number RoPE."""
    p = jax.tree.map(np.asarray, eqx.filter(gpt, eqx.is_array))
    emb = p.emb.pytree if cfg.tie_embeddings else p.emb
    T, K = len(tokens), cfg.head_dim

    def rms(x):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6)

    def ln(x, g):
        x = x - x.mean(-1, keepdims=True)
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * g

    def rope(x):  # pairs (i, i + K/2) as complex numbers, turned by e^{i * pos * theta_i}
        theta = cfg.rope_base ** (-np.arange(K // 2) / (K // 2))
        z = (x[..., :K // 2] + 1j * x[..., K // 2:]) * np.exp(1j * np.arange(T)[:, None, None] * theta)
        return np.concatenate([z.real, z.imag], axis=-1)

    x = emb.embed[tokens]
    for layer in range(cfg.n_layer):
        b = jax.tree.map(lambda a: a[layer], p.blocks)
        h = rms(x)
        q, k, v = (np.einsum("td,dhk->thk", h, b.attn.qkv[:, i]) for i in range(3))
        q, k = rope(ln(q, b.attn.q_norm)), rope(ln(k, b.attn.k_norm))
        out = np.zeros_like(q)
        for t in range(T):
            for hd in range(cfg.n_head):
                s = np.array([q[t, hd] @ k[u, hd] for u in range(t + 1)]) / math.sqrt(K)
                w = np.exp(s - s.max())
                out[t, hd] = (w / w.sum()) @ v[:t + 1, hd]
        x = x + np.einsum("thk,hkd->td", out, b.attn.out)
        u = rms(x) @ b.mlp.up
        gelu = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
        x = x + gelu @ b.mlp.down.T
    return rms(x) @ (emb.embed if cfg.tie_embeddings else emb.unembed).T


def random_gpt(cfg, seed=0):
    """Every parameter random (the zero readout at init would hide bugs downstream of it)."""
    gpt = M.init_gpt(cfg, jax.random.key(seed))
    params, static = eqx.partition(gpt, eqx.is_array)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
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
    cfg = tiny(d_model=32, n_head=2)
    attn = jax.tree.map(lambda a: a[0], random_gpt(cfg).blocks.attn)
    x = jax.random.normal(jax.random.key(3), (16, cfg.d_model))
    pos = jnp.arange(16)
    q0, k0, _ = attn.project(x, pos)
    q1, k1, _ = attn.project(x, pos + 1000)
    scores = lambda q, k: jnp.einsum("thk,shk->hts", q, k)
    np.testing.assert_allclose(scores(q0, k0), scores(q1, k1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(attn(x, pos), attn(x, pos + 1000), rtol=1e-4, atol=1e-4)
    assert not np.allclose(q0, q1, atol=1e-2)  # absolute positions do change q: the rotation is there


def test_loss_at_init_is_log_vocab():
    import train
    cfg = tiny(n_layer=2, d_model=64, n_head=2)
    gpt = M.init_gpt(cfg, jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (4, 16), 0, cfg.vocab_size)
    assert abs(float(train.loss_fn(gpt, x, x)) - math.log(cfg.model_vocab)) < 0.1


def test_policy_table_covers_every_parameter():
    for norm_gain, tie in [(False, False), (True, True)]:
        cfg = tiny(norm_gain=norm_gain, tie_embeddings=tie)
        gpt = M.init_gpt(cfg, jax.random.key(0))
        table = M.policy_table(gpt, cfg)
        n_params = len(jax.tree.leaves(eqx.filter(gpt, eqx.is_array)))
        assert len(jax.tree.leaves(table, is_leaf=lambda x: isinstance(x, M.Policy))) == n_params


def test_policy_table_rejects_a_parameter_without_a_row(monkeypatch):
    cfg = tiny()
    gpt = M.init_gpt(cfg, jax.random.key(0))
    rows = M.policy_rows(cfg)
    del rows["blocks.mlp.up"]
    monkeypatch.setattr(M, "policy_rows", lambda _: rows)
    with pytest.raises(AssertionError, match="blocks.mlp.up"):
        M.policy_table(gpt, cfg)


def test_tied_embeddings_are_one_array():
    import train
    cfg = tiny(tie_embeddings=True)
    gpt = random_gpt(cfg)
    emb = gpt.embeddings()
    assert emb.embed is emb.unembed
    x = jnp.zeros((2, 16), jnp.int32)
    grads = eqx.filter_grad(train.loss_fn)(gpt, x, x)
    # The readout's gradient reaches the shared array: rows of tokens never input still get one.
    assert float(jnp.abs(grads.emb.pytree.embed[5]).sum()) > 0


@pytest.mark.parametrize("remat", ["none", "full", "save_dots"])
def test_remat_and_unroll_do_not_change_gradients(remat):
    import train
    cfg = tiny(n_layer=4)
    ref = random_gpt(cfg)
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    g0 = eqx.filter_grad(train.loss_fn)(ref, x, x)
    other = random_gpt(dataclasses.replace(cfg, remat=remat, scan_unroll=2))
    g1 = eqx.filter_jit(eqx.filter_grad(train.loss_fn))(other, x, x)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_linear_under_vmap_equals_a_plain_matmul_with_its_gradients():
    """linear() merges the vmapped batch into the rows; values and gradients must be a matmul's."""
    x_BTD = jax.random.normal(jax.random.key(0), (3, 5, 8))
    w_DF = jax.random.normal(jax.random.key(1), (8, 4))
    plain = lambda w, x: jnp.sum(jnp.sin(jnp.einsum("btd,df->btf", x, w)))
    merged = lambda w, x: jnp.sum(jnp.sin(jax.vmap(M.linear, in_axes=(0, None))(x, w)))
    np.testing.assert_allclose(merged(w_DF, x_BTD), plain(w_DF, x_BTD), rtol=1e-5)
    for argnum in (0, 1):
        np.testing.assert_allclose(jax.grad(merged, argnum)(w_DF, x_BTD), jax.grad(plain, argnum)(w_DF, x_BTD),
                                   rtol=1e-5, atol=1e-6)
    ws = jax.random.normal(jax.random.key(2), (3, 8, 4))  # a batch of weights takes the other path
    np.testing.assert_allclose(jax.vmap(M.linear)(x_BTD, ws), jnp.einsum("btd,bdf->btf", x_BTD, ws), rtol=1e-5)


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
    for b in range(2):
        want = naive(q[b], k[b], v[b], causal)
        np.testing.assert_allclose(M.attend(q[b], k[b], v[b], 1 / math.sqrt(8)), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(M.attend(q[b], k[b], v[b], 1 / math.sqrt(8), mask_TS=window),
                                   naive(q[b], k[b], v[b], window), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(jax.nn.dot_product_attention(q[b], k[b], v[b], is_causal=True), want,
                                   rtol=1e-5, atol=1e-5)
        if jax.default_backend() == "gpu":
            bf = lambda a: jnp.asarray(a, jnp.bfloat16)
            out = M.attend(bf(q[b]), bf(k[b]), bf(v[b]), 1 / math.sqrt(8), impl="cudnn")
            np.testing.assert_allclose(out.astype(jnp.float32), want, atol=3e-2)
    assert M.attention_impl(tiny(compute_dtype="float32")) is None  # cuDNN needs bf16: never chosen for fp32


@pytest.mark.parametrize("remat,unroll", [("none", 2), ("save_dots", 1)])
def test_fused_qk_norm_rope_kernel_matches_the_xla_path(monkeypatch, remat, unroll):
    """kernels.qk_norm_rope (the GPU path, here in Pallas's interpreter, 8-token blocks so a sequence
    spans two) in the whole model: the forward against the numpy reference, and every gradient (the
    kernel's is written by hand) against autodiff of model.py's own layer_norm and rope, with the remat
    and scan the XL config uses."""
    import kernels
    import train
    cfg = tiny(n_layer=2, remat=remat, scan_unroll=unroll)
    gpt = random_gpt(cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    y = jnp.roll(tokens, -1, axis=1)
    # not jitted: a jitted function (equinox's cache too) would reuse its first trace, the XLA path's
    loss_grad = lambda: eqx.filter_value_and_grad(train.loss_fn)(gpt, tokens, y)
    want_loss, want = loss_grad()
    monkeypatch.setattr(kernels, "ROWS", 8)
    monkeypatch.setattr(kernels, "applies", lambda T, K: True)
    np.testing.assert_allclose(gpt(np.asarray(tokens[0])), numpy_forward(gpt, cfg, np.asarray(tokens[0])),
                               rtol=1e-4, atol=1e-4)
    got_loss, got = loss_grad()
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    named = lambda g: jax.tree_util.tree_flatten_with_path(eqx.filter(g, eqx.is_array))[0]
    for (path, a), (_, b) in zip(named(want), named(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=M.param_name(path))


def test_gelu_with_recomputing_backward_has_gelus_derivative():
    """kernels.gelu's custom backward against the tanh-form GELU's derivative written out by hand."""
    import kernels
    x = np.linspace(-4, 4, 101)
    c = math.sqrt(2 / math.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))  # in float64; float32's tanh saturates near -5
    want = 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2)
    x = x.astype(np.float32)
    np.testing.assert_allclose(kernels.gelu(x), jax.nn.gelu(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(kernels.gelu(x)))(x), want, rtol=1e-4, atol=1e-5)
