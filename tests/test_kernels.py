"""fused/fast_paths.py's fast paths against model.py's functions and written-out references: on one
device, sharded over 8 simulated ones (Pallas in its interpreter), and the self-check's fallback."""
import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model as M
from layers.positions import rope_table
import params
from conftest import ROOT, assert_same_step, run, run_each, tiny
from test_model import moved, numpy_forward, random_gpt


def every_kernel(monkeypatch):
    """fast_paths.FAST_PATHS as if on one GPU: the Pallas kernel in its interpreter (8-token blocks, so
    a sequence spans two), attention by jax.nn.dot_product_attention's XLA version."""
    from fused import fast_paths, pallas_qk_norm_rope
    monkeypatch.setattr(pallas_qk_norm_rope, "ROWS", 8)
    paths = [dataclasses.replace(p, applies=lambda cfg: True) for p in fast_paths.FAST_PATHS
             if p.fn is not fast_paths.splash_attend]  # the TPU's attention: its own test
    monkeypatch.setattr(fast_paths, "FAST_PATHS", paths)
    return fast_paths


def layer_norm_rope_written_out(x, gain, base=10000.0):
    """LayerNorm over the head dim (no bias), then RoPE with the pairs (i, i + K/2) as complex
    numbers turned by e^{i pos theta_i}: numpy, x (T, heads, K)."""
    T, _, K = x.shape
    x = x - x.mean(-1, keepdims=True)
    x = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * gain
    theta = base ** (-np.arange(K // 2) / (K // 2))
    z = (x[..., :K // 2] + 1j * x[..., K // 2:]) * np.exp(1j * np.arange(T)[:, None, None] * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("G", [2, 1])  # G = H: the whole-model test below
def test_the_pallas_kernel_is_layer_norm_then_rope(monkeypatch, G):
    """pallas_qk_norm_rope on q (T, H, K) and k (T, G, K), grouped-query and one key head
    included: its forward against numpy, its hand-written backward against autodiff of
    model.qk_norm_rope (gains too), in Pallas's interpreter with two blocks of tokens."""
    from fused import pallas_qk_norm_rope as pallas
    monkeypatch.setattr(pallas, "ROWS", 8)
    T, H, K = 16, 4, 16
    keys = jax.random.split(jax.random.key(0), 6)
    q, k = jax.random.normal(keys[0], (T, H, K)), jax.random.normal(keys[1], (T, G, K))
    q_gain, k_gain = (1 + 0.3 * jax.random.normal(key, (K,)) for key in keys[2:4])
    table = rope_table(jnp.arange(T), K, 10000.0)
    fused = lambda *a: pallas.qk_norm_rope(*a, *table)
    out, pullback = jax.vjp(fused, q, k, q_gain, k_gain)
    for got, x, gain in zip(out, (q, k), (q_gain, k_gain)):
        want = layer_norm_rope_written_out(np.asarray(x), np.asarray(gain))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cotangents = (jax.random.normal(keys[4], (T, H, K)), jax.random.normal(keys[5], (T, G, K)))
    _, autodiff = jax.vjp(lambda *a: M.qk_norm_rope(*a, table, table), q, k, q_gain, k_gain)
    for got, want in zip(pullback(cotangents), autodiff(cotangents), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("G", [4, 2])
def test_splash_attention_matches_model_attend(G):
    """The TPU's attention, splash attention, in Pallas's interpreter on the CPU: causal, all heads
    or grouped-query, outputs and gradients against model.attend's."""
    from fused import fast_paths
    T, H, K = 128, 4, 16
    keys = jax.random.split(jax.random.key(G), 4)
    q = jax.random.normal(keys[0], (T, H, K))
    k, v = (jax.random.normal(key, (T, G, K)) for key in keys[1:3])
    scale = 1 / K  # muP's 1/K: a power of two, so q * scale is exact
    cotangent = jax.random.normal(keys[3], (T, H, K))
    got, got_pullback = jax.vjp(lambda *a: fast_paths.splash_attend(*a, scale), q, k, v)
    want, want_pullback = jax.vjp(lambda *a: M.attend(*a, scale), q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_pullback(cotangent), want_pullback(cotangent), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_splash_attention_applies_on_a_tpu_without_alibi(monkeypatch):
    """ALiBi's bias has no input in splash attention: model.attend runs there."""
    from fused import fast_paths
    monkeypatch.setattr(fast_paths, "on_tpu", lambda: True)
    assert fast_paths.splash_applies(tiny(block_size=256, n_kv_head=1))
    assert not fast_paths.splash_applies(tiny(block_size=256, position="alibi"))
    monkeypatch.setattr(fast_paths, "on_tpu", lambda: False)
    assert not fast_paths.splash_applies(tiny(block_size=256))


SHAREDKV_GQA = dict(attention="sharedkv", n_head=4, n_kv_head=2, d_model=64)


@pytest.mark.parametrize("remat,unroll,variant", [("none", 2, {}), ("save_dots", 1, SHAREDKV_GQA)],
                         ids=["mha-unrolled", "sharedkv-gqa-scan"])
def test_fused_kernels_match_model_py_in_the_whole_model(monkeypatch, capsys, remat, unroll,
                                                         variant):
    """The model with every fast path fast_paths.select accepts: the forward against the numpy
    reference, and every gradient (the Pallas kernel's is written by hand) against autodiff of
    model.py's own functions, with the remat and scan the XL config uses (there with SharedKV keys
    of 2 heads for 4 query heads)."""
    import train
    fast_paths = every_kernel(monkeypatch)
    cfg = tiny(n_layer=2, remat=remat, scan_unroll=unroll, **variant)
    fast = fast_paths.select(cfg)
    assert set(fast) == {"attend", "qk_norm_rope", "gelu", "cross_entropy"}
    assert capsys.readouterr().err.splitlines()[-1] == ALL_FUSED
    plain, fused = random_gpt(cfg), random_gpt(cfg, fast=fast)  # the same arrays
    assert fused.blocks.attn.fast_qk_norm_rope is fast["qk_norm_rope"]
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    y = jnp.roll(tokens, -1, axis=1)
    want_loss, want = eqx.filter_value_and_grad(train.objective)(plain, tokens, y, cfg)
    one = np.asarray(tokens[0])
    assert "pallas_call" in str(jax.make_jaxpr(fused)(one))  # the kernel runs, not model.py's
    np.testing.assert_allclose(fused(one), numpy_forward(plain, cfg, one), rtol=1e-4, atol=1e-4)
    got_loss, got = eqx.filter_value_and_grad(train.objective)(fused, tokens, y, cfg)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    named = lambda g: jax.tree_util.tree_flatten_with_path(eqx.filter(g, eqx.is_array))[0]
    for (path, a), (_, b) in zip(named(want), named(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=params.param_name(path))


ALL_FUSED = ("kernels: fused, each checked where the model calls it: model.attend as cuDNN flash "
             "attention, model.qk_norm_rope as the Pallas QK-norm + RoPE kernel, model.gelu as the "
             "recomputing GELU, model.cross_entropy as the fused readout cross-entropy")


def test_an_edit_to_model_py_sets_its_kernel_aside(monkeypatch, capsys):
    """The self-check against an edited reference: RoPE's rotation turned the other way (a real
    edit a kernel cannot know of) and the attention's logits doubled. Each fast path standing in
    for an edited function is set aside with one line, and the model runs the edit."""
    fast_paths = every_kernel(monkeypatch)
    cfg = tiny()
    tokens = jnp.arange(cfg.block_size) % cfg.vocab_size
    unedited = random_gpt(cfg)(tokens)
    plain_rope, plain_attend = M.rope, M.attend
    monkeypatch.setattr(M, "rope", lambda x, cos, sin: plain_rope(x, cos, -sin))
    assert set(fast_paths.select(cfg)) == {"attend", "gelu", "cross_entropy"}
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith("kernels: the Pallas QK-norm + RoPE kernel set aside, model.qk_norm_rope "
                           "runs instead: its output differs by ")
    monkeypatch.setattr(M, "attend", lambda q, k, v, scale, mask=None, bias=None:
                        plain_attend(q, k, v, 2 * scale, mask, bias))
    assert set(fast_paths.select(cfg)) == {"gelu", "cross_entropy"}
    assert "cuDNN flash attention set aside, model.attend runs instead" in capsys.readouterr().err
    # the model with the fast paths that remain runs both edits: model.py's functions' logits
    edited = random_gpt(cfg, fast=fast_paths.select(cfg))(tokens)
    np.testing.assert_allclose(edited, random_gpt(cfg)(tokens), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(edited - unedited)).max() > 0.1
    capsys.readouterr()
    assert fast_paths.select(dataclasses.replace(cfg, kernels=False)) == {}  # no check, nothing printed
    assert capsys.readouterr().err == ""


def sliding_window(monkeypatch):
    """An edit through the mask: attention to the last 4 positions only (Beltagy et al. 2020's
    sliding window), a mask made in GPT.positions for every forward."""
    plain = M.GPT.positions

    def positions(self, q_T, S=None):
        at = plain(self, q_T, S)
        back_TS = at.q_T[:, None] - at.k_S[None, :]
        return at._replace(mask_TS=(back_TS >= 0) & (back_TS < 4))

    monkeypatch.setattr(M.GPT, "positions", positions)


def soft_capped(monkeypatch):
    """An edit that adds an argument to attend: Gemma 2's logit soft-capping, cap * tanh(l / cap)
    (Gemma Team 2024), passed by Attention.__call__ (here without sample.py's cache)."""
    def attend(q_THK, k_SHK, v_SHK, scale, mask_TS=None, bias_HTS=None, cap=None):  # G = H
        logits_HTS = cap * jnp.tanh(scale * jnp.einsum("THK,SHK->HTS", q_THK, k_SHK) / cap)
        causal_TS = jnp.tril(jnp.ones(logits_HTS.shape[1:], bool))
        probs_HTS = jax.nn.softmax(jnp.where(causal_TS, logits_HTS, -jnp.inf), axis=-1)
        return jnp.einsum("HTS,SHK->THK", probs_HTS, v_SHK)

    def call(self, xs_TD, at, cache=None):
        q_THK, k_TGK, v_TGK = self.project(xs_TD)
        norm_rope = self.fast_qk_norm_rope or M.qk_norm_rope
        q_THK, k_TGK = norm_rope(q_THK, k_TGK, self.q_norm, self.k_norm, at.q_rope, at.k_rope)
        o_THK = (self.fast_attend or M.attend)(q_THK, k_TGK, v_TGK, self.scale, None, None, 30.0)
        return jnp.einsum("THK,HKD->TD", o_THK, self.out.astype(self.dtype)), cache

    monkeypatch.setattr(M, "attend", attend)
    monkeypatch.setattr(M.Attention, "__call__", call)


@pytest.mark.parametrize("edit,line", [
    (sliding_window, "it hands calls with a mask to model.py's function; the model calls "
     "attend(float32[16,2,16], float32[16,2,16], float32[16,2,16], 0.25, bool[16,16], None)"),
    (soft_capped, "it failed: TypeError: cudnn_attend() takes from 4 to 6 positional arguments "
     "but 7 were given; the model calls attend(float32[16,2,16], float32[16,2,16], "
     "float32[16,2,16], 0.25, None, None, 30.0)")], ids=["through-the-mask", "a-new-argument"])
def test_an_attention_edit_sets_the_kernel_aside_where_the_model_calls_it(monkeypatch, capsys,
                                                                          edit, line):
    """Two edits of model.py's attention that a check on a fixed example of attend would pass: a
    mask (cuDNN's path would hand every call to model.attend while the run said it was fused) and
    a new argument (the first step would fail with a TypeError). The self-check sees attend as the
    model calls it, sets cuDNN's attention aside with one line before training, names what runs
    fused, and the train step runs the edit: its loss is that of the run without kernels."""
    import train
    fast_paths = every_kernel(monkeypatch)
    monkeypatch.setattr(fast_paths, "FAST_PATHS", [fast_paths.FAST_PATHS[0],  # cuDNN's, and
                                                   fast_paths.FAST_PATHS[-2]])  # the GELU
    edit(monkeypatch)
    cfg = tiny()
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8, 16)).astype(np.int32)
    y = np.roll(x, -1, axis=-1)
    s = train.setup(cfg, train.make_mesh(cfg))
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kernels:")]
    assert lines == [f"kernels: cuDNN flash attention set aside, model.attend runs instead: {line}",
                     "kernels: fused, each checked where the model calls it: model.gelu as the "
                     "recomputing GELU"]
    assert s.model.blocks.attn.fast_attend is None and s.model.blocks.mlp.fast_gelu is not None
    model = moved(s.model)  # random: from init the zero readout makes every loss ln V
    plain = jax.tree.unflatten(jax.tree.structure(M.GPT(cfg)), jax.tree.leaves(model))
    want = jax.jit(train.objective, static_argnums=3)(plain, x[0], y[0], cfg)  # no fast path
    _, _, metrics = s.step(model, s.opt_state, x, y)
    assert np.isfinite(float(metrics["loss"]))
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)


def capped_logits(cap):
    """model.attend with Gemma 2's soft-cap on the logits, cap * tanh(l / cap), written in place."""
    def attend(q_THK, k_SHK, v_SHK, scale, mask_TS=None, bias_HTS=None):  # G = H
        l_HTS = scale * jnp.einsum("THK,SHK->HTS", q_THK, k_SHK, preferred_element_type=jnp.float32)
        causal_TS = jnp.tril(jnp.ones(l_HTS.shape[1:], bool)) if mask_TS is None else mask_TS
        probs_HTS = jax.nn.softmax(jnp.where(causal_TS, cap * jnp.tanh(l_HTS / cap), -jnp.inf), -1)
        return jnp.einsum("HTS,SHK->THK", probs_HTS.astype(v_SHK.dtype), v_SHK)
    return "attend", attend


def windowed(w):
    """model.attend whose default mask keeps the last w keys only (Beltagy et al. 2020), w just
    under the block: the last positions lose a key or two."""
    plain = M.attend

    def attend(q_THK, k_SHK, v_SHK, scale, mask_TS=None, bias_HTS=None):
        if mask_TS is None:
            back_TS = jnp.arange(q_THK.shape[0])[:, None] - jnp.arange(k_SHK.shape[0])
            mask_TS = (back_TS >= 0) & (back_TS < w)
        return plain(q_THK, k_SHK, v_SHK, scale, mask_TS, bias_HTS)
    return "attend", attend


def norm_eps(eps):
    """model.layer_norm with another epsilon: the Pallas kernel has its own."""
    def layer_norm(x_THK, gain_K):
        x = x_THK.astype(jnp.float32)
        x = x - jnp.mean(x, axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain_K
    return "layer_norm", layer_norm


def ignore_negative():
    """model.cross_entropy with no loss where the target is negative (an ignore index, for
    padding): the check's targets hold -1."""
    plain = M.cross_entropy

    def cross_entropy(h_TD, unembed_VD, mult, y_T):
        return jnp.where(y_T < 0, 0.0, plain(h_TD, unembed_VD, mult, jnp.maximum(y_T, 0)))
    return "cross_entropy", cross_entropy


def z_loss(weight):
    """model.cross_entropy plus PaLM's z-loss, weight * log-sum-exp^2 (Chowdhery et al. 2022)."""
    plain = M.cross_entropy

    def cross_entropy(h_TD, unembed_VD, mult, y_T):
        lse_T = jax.nn.logsumexp(M.readout(h_TD, unembed_VD, mult), axis=-1)
        return plain(h_TD, unembed_VD, mult, y_T) + weight * jnp.square(lse_T)
    return "cross_entropy", cross_entropy


@pytest.mark.parametrize("edit,kernel", [
    (capped_logits(50.0), "cuDNN flash attention"), (windowed(15), "cuDNN flash attention"),
    (norm_eps(1e-3), "the Pallas QK-norm + RoPE kernel"),
    (norm_eps(5e-6), "the Pallas QK-norm + RoPE kernel"),  # at a head dim of 64 (GPT-2's)
    (z_loss(1e-4), "the fused readout cross-entropy"),
    (ignore_negative(), "the fused readout cross-entropy")],
    ids=["soft-cap-50", "window-15-of-16", "layer-norm-eps-1e-3", "layer-norm-eps-5e-6",
         "z-loss-1e-4", "ignore-index-minus-1"])
def test_an_edit_that_bfloat16_rounding_would_hide_sets_its_kernel_aside(monkeypatch, capsys,
                                                                         edit, kernel):
    """In bfloat16, edits whose effect is below the rounding where the inputs are of size 1, at a
    few positions or values only: a soft-cap far above the logits, a window that cuts the oldest
    key of the last position, a QK-norm epsilon of 1e-3 (and of 5e-6, below bfloat16's rounding:
    the check's float32 pass), a z-loss term, no loss at a negative target. The check compares
    outputs position by position at several scales, and sets aside the kernel that would run
    without the edit; the others stay fused."""
    fast_paths = every_kernel(monkeypatch)
    monkeypatch.setattr(M, *edit)
    fast = fast_paths.select(tiny(compute_dtype="bfloat16", d_model=128))
    err = capsys.readouterr().err
    assert f"kernels: {kernel} set aside" in err, err
    assert len(fast) == 3, err


def test_a_fast_path_that_returns_another_dtype_is_not_model_pys():
    """Equal values in another dtype (an edit that drops a cast back to bfloat16 keeps every value
    the check compares) are another function: the next layer computes in that dtype."""
    from fused import fast_paths
    x = jax.random.normal(jax.random.key(0), (4, 8), jnp.bfloat16)
    call = lambda fn, scale, x: fn(x * scale.astype(x.dtype))  # noqa: E731
    same = fast_paths.mismatch(lambda x: x * 1, lambda x: x, (x,), call, 3e-2)
    wider = fast_paths.mismatch(lambda x: x.astype(jnp.float32), lambda x: x, (x,), call, 3e-2)
    assert (same, wider) == (None, "its output has dtype float32, model.py's bfloat16")


@pytest.mark.parametrize("token", ["last", "first"])
def test_a_loss_edit_for_one_token_sets_the_fused_loss_aside(monkeypatch, capsys, token):
    """No loss on one token id (an end-of-text: GPT-2's is the vocabulary's last id, BERT's
    specials the first): the check draws the targets over the whole vocabulary, its edges
    included, so the fused loss, which would train on that token, is set aside (it drew ids
    below 8 only: a GPU run trained on end-of-text with the edit in model.py)."""
    fast_paths = every_kernel(monkeypatch)
    cfg = tiny(compute_dtype="bfloat16")
    skipped = cfg.vocab_size - 1 if token == "last" else 0
    plain = M.cross_entropy
    monkeypatch.setattr(M, "cross_entropy", lambda h_TD, unembed_VD, mult, y_T: jnp.where(
        y_T == skipped, 0.0, plain(h_TD, unembed_VD, mult, y_T)))
    fast = fast_paths.select(cfg)
    err = capsys.readouterr().err
    assert "kernels: the fused readout cross-entropy set aside" in err, err
    assert set(fast) == {"attend", "qk_norm_rope", "gelu"}, err


MID_VOCAB_EOS = 4097  # a tokenizer's end-of-text inside the vocabulary (Llama 3's is 128001)


def focal(h, w, m, y):
    """A focal loss, gamma = 2 (Lin et al. 2017): (1 - p)^2 times the cross-entropy."""
    ce = PLAIN_CROSS_ENTROPY(h, w, m, y)
    return jnp.square(1 - jnp.exp(-ce)) * ce


PLAIN_CROSS_ENTROPY = M.cross_entropy
TARGET_EDITS = {  # a loss edit keyed on targets the check once never drew
    "torch-ignore-index": lambda h, w, m, y: jnp.where(y == -100, 0.0,
                                                       PLAIN_CROSS_ENTROPY(h, w, m, y)),
    "pad-id": lambda h, w, m, y: jnp.where(y >= 8190, 0.0, PLAIN_CROSS_ENTROPY(h, w, m, y)),
    "mid-vocab-end-of-text": lambda h, w, m, y: jnp.where(y == MID_VOCAB_EOS, 0.0,
                                                          PLAIN_CROSS_ENTROPY(h, w, m, y)),
    "focal-loss": focal}


@pytest.mark.parametrize("edit", TARGET_EDITS)
def test_a_loss_edit_keyed_on_the_target_sets_the_fused_loss_aside(monkeypatch, capsys, edit):
    """Loss edits a researcher brings from other code: PyTorch's ignore index -100, no loss on a
    pad id past the tokenizer's (the model's padded rows), none on an end-of-text inside the
    vocabulary (the tokenizer's special id, which train.py hands the check), and a focal loss,
    which weighs each position by its confidence (targets drawn apart from the logits are never
    likely: half the check's are the readout's argmax). The fused loss would train the plain
    cross-entropy: it is set aside."""
    fast_paths = every_kernel(monkeypatch)
    monkeypatch.setattr(fast_paths, "FAST_PATHS",
                        [p for p in fast_paths.FAST_PATHS if p.name == "cross_entropy"])
    # d_model 128: a random target's p is near 0, as in a GPT-2-size model; rows 8190, 8191 padded
    cfg = tiny(compute_dtype="bfloat16", d_model=128, vocab_size=8190)
    monkeypatch.setattr(M, "cross_entropy", TARGET_EDITS[edit])
    fast = fast_paths.select(cfg, special_ids=(MID_VOCAB_EOS,))
    err = capsys.readouterr().err
    assert not fast and "kernels: the fused readout cross-entropy set aside" in err, err


END = "end-of-text"


def loss_edit(name: str, eot: int):
    """model.cross_entropy edited as a researcher might, at GPT-2's end-of-text id (V - 1)."""
    plain = M.cross_entropy
    edits = {
        "unedited": plain,
        f"no loss on {END}": lambda h, w, m, y: jnp.where(y == eot, 0.0, plain(h, w, m, y)),
        f"{END} weighted 0.5": lambda h, w, m, y: jnp.where(y == eot, 0.5, 1.0) * plain(h, w, m, y),
        "label smoothing 0.02": lambda h, w, m, y: (
            0.98 * plain(h, w, m, y) - 0.02 * jax.nn.log_softmax(M.readout(h, w, m)).mean(-1))}
    return edits[name]


@pytest.mark.parametrize("edit,T", [(f"no loss on {END}", 2048), (f"{END} weighted 0.5", 1024),
                                    ("label smoothing 0.02", 256), ("unedited", 1024)])
def test_a_loss_edit_at_gpt2s_sizes_sets_the_fused_loss_aside(monkeypatch, capsys, edit, T):
    """In bfloat16, at a sequence's length as GPT-2 trains it and a vocabulary where end-of-text is
    rare: a loss edit at that id (no loss, or half) changes one position of T (the check's
    tokens hold each edge id once), and label smoothing of 0.02 changes every
    position by less than bfloat16's rounding. The check compares the losses position by position
    and runs the fused loss in float32 too, so each sets it aside (the check kept it, and training
    ran the plain cross-entropy, when it compared a sequence's losses as one row in bfloat16
    alone). Unedited, it stays fused. The fused loss alone is checked: it is the one under test."""
    fast_paths = every_kernel(monkeypatch)
    monkeypatch.setattr(fast_paths, "FAST_PATHS",
                        [p for p in fast_paths.FAST_PATHS if p.name == "cross_entropy"])
    cfg = tiny(compute_dtype="bfloat16", block_size=T, vocab_size=8192)  # end-of-text is rare
    monkeypatch.setattr(M, "cross_entropy", loss_edit(edit, cfg.vocab_size - 1))
    fast = fast_paths.select(cfg)
    err = capsys.readouterr().err
    if edit == "unedited":
        assert set(fast) == {"cross_entropy"}, err
    else:
        assert not fast and "kernels: the fused readout cross-entropy set aside" in err, err


def test_a_sweep_traces_setup_and_runs_model_py(shakespeare, monkeypatch):
    """tools/sweeps.py traces train.setup (the LR a tracer, vmapped over LRs), where the check's
    values would be tracers: it raised ConcretizationTypeError wherever a fast path applied (on a
    GPU, tools/optimizer_sweep.py stopped). A sweep runs model.py's functions."""
    from tools import sweeps
    every_kernel(monkeypatch)
    loss, val = sweeps.train_runs(tiny(compute_dtype="bfloat16"), [1e-3, 2e-3], 1, 2)
    assert loss.shape == (2, 1, 2) and np.isfinite(val).all()


def test_the_fast_paths_take_a_chunked_loss(monkeypatch, capsys):
    """--config.loss_chunks=2 (train.py's advice when memory runs out) with every fast path: the
    self-check traces train.loss_fn on as many sequences as it splits the batch into, all four
    are fused, and a step's loss is that of model.py's functions alone."""
    import train
    every_kernel(monkeypatch)
    cfg = tiny(loss_chunks=2)
    s = train.setup(cfg, train.make_mesh(cfg))
    assert capsys.readouterr().err.splitlines()[-1] == ALL_FUSED
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8, 16)).astype(np.int32)
    y = np.roll(x, -1, axis=-1)
    model = moved(s.model)  # random: from init the zero readout makes every loss ln V
    plain = jax.tree.unflatten(jax.tree.structure(M.GPT(cfg)), jax.tree.leaves(model))
    want = jax.jit(train.objective, static_argnums=3)(plain, x[0], y[0], cfg)
    _, _, metrics = s.step(model, s.opt_state, x, y)
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)


def test_an_edit_that_reaches_the_logits_but_not_the_loss_is_refused(monkeypatch):
    """A final soft-cap written in GPT.logits reaches sampling, eval.py and the export but not
    GPT.loss, which training runs and logs: the run is refused in one line before it starts.
    The same cap in model.readout, which both read, trains; so does a z-loss in
    model.cross_entropy (the loss's own edit)."""
    import train
    from run.errors import UsageError
    cap = lambda x: 30 * jnp.tanh(x / 30)  # noqa: E731
    plain_logits, plain_readout, cfg = M.GPT.logits, M.readout, tiny()
    monkeypatch.setattr(M.GPT, "logits", lambda self, x_TD: cap(plain_logits(self, x_TD)))
    with pytest.raises(UsageError, match=r"^model.GPT.logits is not model.readout, which "
                                         r"training's loss reads \(they differ by .* relative\)"):
        train.setup(cfg, train.make_mesh(cfg))
    monkeypatch.setattr(M.GPT, "logits", plain_logits)
    monkeypatch.setattr(M, "readout", lambda h, w, mult: cap(plain_readout(h, w, mult)))
    train.setup(cfg, train.make_mesh(cfg))
    monkeypatch.setattr(M, "cross_entropy", z_loss(1e-4)[1])
    train.setup(cfg, train.make_mesh(cfg))


def test_the_recomputing_gelu_follows_an_edit_to_model_gelu(monkeypatch, capsys):
    """fast_paths.recomputing_gelu runs model.gelu whatever it says, forward and backward: with GELU
    edited to its exact (erf) form, the check passes and the kernel computes the edit, values and
    derivative against the erf GELU written out in numpy."""
    fast_paths = every_kernel(monkeypatch)
    monkeypatch.setattr(M, "gelu", lambda x: jax.nn.gelu(x, approximate=False))
    assert "gelu" in fast_paths.select(tiny())
    x = np.linspace(-4, 4, 101)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    pdf = np.exp(-x**2 / 2) / math.sqrt(2 * math.pi)
    x32 = x.astype(np.float32)
    np.testing.assert_allclose(fast_paths.recomputing_gelu(x32), x * cdf, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(fast_paths.recomputing_gelu(x)))(x32)
    np.testing.assert_allclose(grad, cdf + x * pdf, rtol=1e-4, atol=1e-5)


def test_a_kernel_whose_batching_mixes_sequences_is_set_aside_on_one_device(monkeypatch, capsys):
    """A kernel right on any one sequence but whose batching under vmap (train.py's over the
    batch) hands each sequence its neighbour's output, as a wrong grid or batch rule would: the
    check runs two sequences per device under the same vmap, so even one device sets it aside."""
    fast_paths = every_kernel(monkeypatch)

    @jax.custom_batching.custom_vmap
    def mixing_gelu(x):
        return M.gelu(x)

    @mixing_gelu.def_vmap
    def batched(axis_size, in_batched, x):
        return jnp.roll(jax.vmap(M.gelu)(x), 1, axis=0), in_batched[0]

    paths = [dataclasses.replace(p, fn=mixing_gelu) for p in fast_paths.FAST_PATHS
             if p.name == "gelu"]
    monkeypatch.setattr(fast_paths, "FAST_PATHS", paths)
    x = jax.random.normal(jax.random.key(0), (3, 5))  # right alone, wrong in a batch
    assert jnp.array_equal(mixing_gelu(x[0]), M.gelu(x[0]))
    assert not jnp.allclose(jax.vmap(mixing_gelu)(x), M.gelu(x))
    assert fast_paths.select(tiny()) == {}
    assert ("kernels: the recomputing GELU set aside, model.gelu runs instead: its output differs "
            "by ") in capsys.readouterr().err


def cross_entropy_written_out(h, w, mult, y):
    """Each position's -log softmax(mult h w^T)[y] and the gradients of their sum with respect to h
    and w (the softmax minus the one-hot target, times mult, through the matmul): numpy, float64,
    h (B, T, D), w (V, D), y (B, T); a negative target counts from the end, as in numpy's indexing."""
    y = np.where(y < 0, y + w.shape[0], y)
    x = mult * h @ w.T
    top = x.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(x - top).sum(-1))
    loss = lse - np.take_along_axis(x, y[..., None], -1)[..., 0]
    dx = mult * (np.exp(x - lse[..., None]) - (np.arange(w.shape[0]) == y[..., None]))
    return loss, dx @ w, np.einsum("btv,btd->vd", dx, h)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_the_fused_cross_entropy_is_the_cross_entropy_written_out(dtype, tolerance):
    """fused/cross_entropy.py on a batch of 3 sequences (train.py's vmap) of a 65-token vocabulary
    (a multiple of nothing): each position's loss and the gradients for the stream and the readout
    against numpy; model.cross_entropy too. In bfloat16 the relative error is the logits' rounding."""
    from fused import cross_entropy as fused
    B, T, D, V, mult = 3, 8, 16, 65, 0.5
    keys = jax.random.split(jax.random.key(0), 3)
    h, w = (jax.random.normal(k, shape, dtype) for k, shape in zip(keys, [(B, T, D), (V, D)]))
    y = jax.random.randint(keys[2], (B, T), 0, V).at[:, 0].set(-1)  # as take_along_axis: V - 1
    want = cross_entropy_written_out(np.asarray(h, np.float64), np.asarray(w, np.float64), mult,
                                     np.asarray(y))
    for fn in (fused.cross_entropy, M.cross_entropy):
        per_token = lambda h, w: jax.vmap(fn, (0, None, None, 0))(h, w, mult, y)
        loss = per_token(h, w)
        grads = jax.grad(lambda h, w: per_token(h, w).sum(), argnums=(0, 1))(h, w)
        assert loss.dtype == jnp.float32 and [g.dtype for g in grads] == [dtype, dtype]
        for got, expected in zip((loss, *grads), want):
            got = np.asarray(got, np.float64)
            assert np.linalg.norm(got - expected) <= tolerance * np.linalg.norm(expected), fn


def test_the_fused_cross_entropy_keeps_no_float32_logits(capsys):
    """In bfloat16, what the fused loss keeps for the backward pass is the bfloat16 logits and a
    float32 log-sum-exp per position; model.cross_entropy's autodiff keeps a float32 (T, V)."""
    from jax.ad_checkpoint import print_saved_residuals
    from fused import cross_entropy as fused
    T, D, V = 16, 8, 65
    h, w = jnp.ones((T, D), jnp.bfloat16), jnp.ones((V, D), jnp.bfloat16)
    y = jnp.zeros(T, jnp.int32)
    kept = {}
    for fn in (fused.cross_entropy, M.cross_entropy):
        print_saved_residuals(lambda h, w: fn(h, w, 0.5, y).sum(), h, w)
        kept[fn] = capsys.readouterr().out
    assert f"bf16[{T},{V}]" in kept[fused.cross_entropy]
    assert f"f32[{T},{V}]" not in kept[fused.cross_entropy]
    assert f"f32[{T},{V}]" in kept[M.cross_entropy]  # the check itself can see one


def test_an_edit_to_the_loss_sets_the_fused_cross_entropy_aside(monkeypatch, capsys):
    """model.cross_entropy edited (label smoothing 0.1): the fused loss is set aside with one line,
    and train.objective of the model built with select's fast paths is the edited loss."""
    import train
    fast_paths = every_kernel(monkeypatch)
    plain = M.cross_entropy

    def smoothed(h, w, mult, y):
        return 0.9 * plain(h, w, mult, y) - 0.1 * jax.nn.log_softmax(M.readout(h, w, mult)).mean(-1)

    monkeypatch.setattr(M, "cross_entropy", smoothed)
    cfg = tiny()
    fast = fast_paths.select(cfg)
    assert "cross_entropy" not in fast and "attend" in fast
    assert ("kernels: the fused readout cross-entropy set aside, model.cross_entropy runs instead: "
            "its output differs by ") in capsys.readouterr().err
    gpt = random_gpt(cfg, fast=fast)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    y = jnp.roll(tokens, -1, axis=1)
    h = jax.vmap(lambda t: gpt.hidden(t)[0])(tokens)
    unembed = gpt.embeddings().unembed
    want = jax.vmap(smoothed, (0, None, None, 0))(jax.vmap(M.rms_norm, (0, None))(h, gpt.final_norm),
                                                  unembed, gpt.readout_mult, y).mean()
    np.testing.assert_allclose(train.objective(gpt, tokens, y, cfg), want, rtol=1e-5)


def capped(logits_TV):  # a soft-cap: other logits, so another model than sampling reads
    return 3.0 * jnp.tanh(logits_TV / 3.0)


def smoothed(logits_TV):  # label smoothing's targets, as a loss of the readout's softmax
    return logits_TV


@pytest.mark.parametrize("edit,smoothing,said", [
    (capped, 0.0, "and reads more of them than their softmax: a change to the logits themselves"),
    (smoothed, 0.1, "; it reads them only through their softmax (label smoothing, say)")])
def test_a_loss_that_is_not_the_readouts_cross_entropy_is_said(monkeypatch, capsys, edit,
                                                               smoothing, said):
    """model.cross_entropy edited is the loss's own, and trains: one line at the start says which
    kind it is. A soft-cap made there trains a model whose logits sampling, eval.py and the export
    do not read (the line names model.readout); label smoothing (optax's) is a loss of the same
    softmax they read. Unedited, nothing is said."""
    import optax
    fast_paths = every_kernel(monkeypatch)
    fast_paths.select(tiny())
    assert "note: model.cross_entropy" not in capsys.readouterr().err

    def cross_entropy(h_TD, unembed_VD, mult, y_T):
        logits_TV = edit(M.readout(h_TD, unembed_VD, mult))
        labels_TV = optax.smooth_labels(jax.nn.one_hot(y_T, logits_TV.shape[-1]), smoothing)
        return optax.softmax_cross_entropy(logits_TV, labels_TV)

    monkeypatch.setattr(M, "cross_entropy", cross_entropy)
    assert "cross_entropy" not in fast_paths.select(tiny())
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(
        "note: model.cross_entropy is not the cross-entropy of model.readout's logits (they "
        "differ by "), notes
    assert said in notes[0], notes


def test_a_loss_edited_in_gpt_loss_is_said(monkeypatch, capsys):
    """A z-loss written in GPT.loss, beside the readout, rather than in train.loss_fn's objective:
    it trains, and is logged as loss/, so one line at the start says that loss/ is not the
    cross-entropy (the check of model.cross_entropy alone passed it). Unedited, nothing is said."""
    fast_paths = every_kernel(monkeypatch)
    fast_paths.select(tiny())
    assert "note: " not in capsys.readouterr().err
    plain = M.GPT.loss

    def loss(self, x_TD, y_T):
        return plain(self, x_TD, y_T) + 1e-2 * jnp.square(jax.nn.logsumexp(self.logits(x_TD), -1))

    monkeypatch.setattr(M.GPT, "loss", loss)
    fast_paths.select(tiny())
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(
        "note: model.GPT.loss is not model.cross_entropy of GPT.readout_inputs"), notes


def test_a_loss_that_takes_the_logits_leaves_the_fused_cross_entropy_unused(monkeypatch, capsys):
    """train.loss_fn edited as the README's z-loss, from model.logits rather than model.loss: the
    self-check traces the loss as edited, says the fused cross-entropy is unused, and fuses the rest."""
    import optax
    import train
    every_kernel(monkeypatch)

    def loss_fn(model, x_BT, y_BT, cfg, keys_B=None):
        logits_BTV = jax.vmap(model)(x_BT)
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, y_BT).mean()
        return cross_entropy + 1e-4 * jnp.square(jax.nn.logsumexp(logits_BTV, -1)).mean(), cross_entropy

    monkeypatch.setattr(train, "loss_fn", loss_fn)
    cfg = tiny()
    s = train.setup(cfg, train.make_mesh(cfg))
    assert s.model.fast_cross_entropy is None and s.model.blocks.mlp.fast_gelu is not None
    assert ("kernels: the fused readout cross-entropy unused: the model never calls "
            "model.cross_entropy through it") in capsys.readouterr().err


def test_sharded_kernels_match_one_device(tmp_path):
    """8 simulated devices, all FSDP, every kernel per device (Pallas in its interpreter): the
    probe asserts each pallas_call runs in a shard_map on the device's own sequences, and the loss,
    gradients and updated parameters equal one device's of model.py's functions."""
    outputs = {devices: tmp_path / f"d{devices}.npz" for devices in (1, 8)}
    probe = lambda devices, *extra: [str(ROOT / "tests/fsdp_probe.py"), str(devices),  # noqa: E731
                                     str(outputs[devices]), *extra]
    for r in run_each([probe(1), probe(8, "1", "kernels")]):
        assert r.returncode == 0, r.stderr
    assert_same_step(np.load(outputs[8]), np.load(outputs[1]))


# Run with 8 simulated devices: the self-check on train.py's mesh, against edits of model.py
SHARDED_CHECK = """
import dataclasses, jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import model, train
from fused import fast_paths, pallas_qk_norm_rope
from conftest import tiny
pallas_qk_norm_rope.ROWS = 8
fast_paths.FAST_PATHS = [dataclasses.replace(p, applies=lambda c: True) for p in fast_paths.FAST_PATHS
                      if p.name != "attend"]  # attention's paths: the tests above
cfg = tiny(n_head=4, d_model=64, n_kv_head=2)
mesh = train.make_mesh(cfg)
assert set(fast_paths.select(cfg, mesh)) == {"qk_norm_rope", "gelu", "cross_entropy"}
plain_rope = model.rope
model.rope = lambda x, cos, sin: plain_rope(x, cos, -sin)
assert set(fast_paths.select(cfg, mesh)) == {"gelu", "cross_entropy"}
model.rope = plain_rope

def first_device_only(x):  # right on the first device's sequences, wrong on the others'
    axes = fast_paths.batch_axes()
    if axes is None:  # one device
        return model.gelu(x)
    return fast_paths.per_device(lambda x: model.gelu(x) * (1 + jax.lax.axis_index(axes)), x)

fast_paths.FAST_PATHS = [dataclasses.replace(p, fn=first_device_only) if p.name == "gelu" else p
                         for p in fast_paths.FAST_PATHS]
assert "gelu" in fast_paths.select(cfg)  # on one device: no mesh, no shard_map, right
assert set(fast_paths.select(cfg, mesh)) == {"qk_norm_rope", "cross_entropy"}
"""


def test_the_self_check_sets_a_sharded_kernel_aside(tmp_path):
    """On 8 simulated devices the check runs each kernel as training does, split over the mesh:
    an edit to model.rope sets the Pallas kernel aside, and so does a kernel right on one device
    but wrong on the others' sequences (which a check on one device would pass)."""
    r = run(["-c", SHARDED_CHECK])
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    all_fused = ("kernels: fused, each checked where the model calls it: model.qk_norm_rope as "
                 "the Pallas QK-norm + RoPE kernel, model.gelu as the recomputing GELU, "
                 "model.cross_entropy as the fused readout cross-entropy")
    assert lines[0] == all_fused
    assert lines[1].startswith("kernels: the Pallas QK-norm + RoPE kernel set aside, "
                               "model.qk_norm_rope runs instead: its output differs by ")
    assert lines[-2].startswith("kernels: the recomputing GELU set aside, model.gelu runs instead: "
                                "its output differs by ")
