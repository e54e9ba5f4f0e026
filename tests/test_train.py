"""The train step: FSDP sharding, gradient accumulation, the schedule and the decay."""
import dataclasses

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from model import flops_per_token, init_gpt
import train
from conftest import ROOT, run, tiny


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "d1.npz"
    r = run([str(ROOT / "tests/fsdp_probe.py"), "1", str(out)])
    assert r.returncode == 0, r.stderr
    return np.load(out)


@pytest.mark.parametrize("devices,replica", [(8, 1), (8, 2)])
def test_fsdp_matches_one_device(one_device, tmp_path, devices, replica):
    """Loss, gradients and the updated parameters on 8 devices (all FSDP, or 2 replicas x 4) equal
    those on one; the probe asserts every large parameter really is split over the fsdp axis."""
    out = tmp_path / "d8.npz"
    r = run([str(ROOT / "tests/fsdp_probe.py"), str(devices), str(out), str(replica)])
    assert r.returncode == 0, r.stderr
    many = np.load(out)
    assert set(many.files) == set(one_device.files)
    for name in one_device.files:
        np.testing.assert_allclose(many[name], one_device[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_accumulation_equals_one_big_batch():
    cfg = tiny(batch_size=16)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (16, cfg.block_size)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (16, cfg.block_size)).astype(np.int32)
    results = []
    for g in (1, 4):
        s = train.setup(dataclasses.replace(cfg, grad_accum=g), train.make_mesh(cfg))
        model, _, metrics = s.step(s.model, s.opt_state, x.reshape(g, -1, cfg.block_size), y.reshape(g, -1, cfg.block_size))
        results.append((float(metrics["loss"]), jax.tree.leaves(eqx.filter(model, eqx.is_array))))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_steps_per_call_equals_one_step_a_call():
    """3 steps in one call (lax.scan over their batches, as the loop runs steps_per_call of them) give the
    losses and parameters of 3 calls of one step each."""
    cfg = tiny()
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 1, 8, cfg.block_size)).astype(np.int32)
    y = np.roll(x, -1, axis=-1)
    one, three = train.setup(cfg, train.make_mesh(cfg)), train.setup(cfg, train.make_mesh(cfg))
    model, opt_state, losses = one.model, one.opt_state, []
    for k in range(3):
        model, opt_state, metrics = one.step(model, opt_state, x[k], y[k])
        losses.append(float(metrics["loss"]))
    model3, _, metrics3 = three.step(three.model, three.opt_state, x, y)
    assert metrics3["loss"].shape == (3,) and len(set(losses)) == 3  # three different steps
    np.testing.assert_allclose(metrics3["loss"], losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)), jax.tree.leaves(eqx.filter(model3, eqx.is_array))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_clip_is_optax_clip_by_global_norm():
    """The optimizer's clip (a scalar multiplier) gives the updates of optax.clip_by_global_norm in its place,
    for gradients far above grad_clip and below it, and keeps its state layout (checkpoints stay readable)."""
    cfg = tiny(adam_eps=1.0)  # a large eps: Adam's first update then depends on the size of the clipped gradients
    s = train.setup(cfg, train.make_mesh(cfg))
    params, table = eqx.filter(s.model, eqx.is_array), train.policy_table(s.model, cfg)
    ours = train.make_optimizer(cfg, table)
    optax_clip = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), train.scale_by_adam(cfg, table), train.scale_by_policy(cfg, table))
    assert jax.tree.structure(ours.init(params)) == jax.tree.structure(optax_clip.init(params))
    rng = np.random.default_rng(0)
    for size in (100.0, 0.01):
        grads = jax.tree.map(lambda p: (size / p.size**0.5 * rng.normal(size=p.shape)).astype(np.float32), params)
        a, b = (opt.update(grads, opt.init(params), params)[0] for opt in (ours, optax_clip))
        # and as the step calls it, with the gradients' norm it has already taken
        c = ours.update(grads, ours.init(params), params, grad_norm=optax.tree.norm(grads))[0]
        for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-9)
            np.testing.assert_allclose(z, y, rtol=1e-5, atol=1e-9)


def test_grad_clip_0_is_no_clipping():
    """nanoGPT's convention: grad_clip=0 turns clipping off (a min(1, 0 / norm) multiplier zeroed every gradient)."""
    cfg = tiny(adam_eps=1.0, grad_clip=0.0)  # a large eps: Adam's first update then depends on the gradients' size
    s = train.setup(cfg, train.make_mesh(cfg))
    params, table = eqx.filter(s.model, eqx.is_array), train.policy_table(s.model, cfg)
    ours, plain = train.make_optimizer(cfg, table), optax.chain(train.scale_by_adam(cfg, table), train.scale_by_policy(cfg, table))
    grads = jax.tree.map(lambda p: np.full(p.shape, 100.0, np.float32), params)
    for x, y in zip(jax.tree.leaves(ours.update(grads, ours.init(params), params)[0]),
                    jax.tree.leaves(plain.update(grads, plain.init(params), params)[0])):
        np.testing.assert_allclose(x, y, rtol=1e-6)
        assert np.abs(x).max() > 0


def test_lr_schedule_warmup_then_cosine():
    cfg = tiny(learning_rate=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    lr = train.lr_schedule(cfg)
    assert float(lr(0)) == pytest.approx(0.1)  # (step + 1) / warmup
    assert float(lr(9)) == pytest.approx(1.0)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    assert float(lr(110)) == pytest.approx(0.1) and float(lr(500)) == pytest.approx(0.1)


def test_weight_decay_is_independent_of_lr_and_only_on_matrices():
    """With zero gradients the update is the decay alone: p * (1 - wd * lr_t / lr) on decayed
    parameters, whatever the learning rate; the gains do not move."""
    for lr in (1e-3, 1.0):
        cfg = tiny(norm_gain=True, weight_decay=0.01, learning_rate=lr, min_lr=lr, warmup_steps=0)
        s = train.setup(cfg, train.make_mesh(cfg))
        params = eqx.filter(s.model, eqx.is_array)
        opt = train.make_optimizer(cfg, train.policy_table(s.model, cfg))
        zeros = jax.tree.map(np.zeros_like, params)
        updates, _ = opt.update(zeros, opt.init(params), params)
        np.testing.assert_allclose(updates.blocks.mlp.up, -0.01 * params.blocks.mlp.up, rtol=1e-6)
        assert float(np.abs(updates.blocks.attn_norm).max()) == 0.0
        assert float(np.abs(updates.blocks.attn.q_norm).max()) == 0.0


def test_overfits_one_batch():
    cfg = tiny(n_layer=2, d_model=64, n_head=2, learning_rate=3e-3, min_lr=3e-3, max_steps=150)
    s = train.setup(cfg, train.make_mesh(cfg))
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (1, 8, cfg.block_size)).astype(np.int32)
    model, opt_state = s.model, s.opt_state
    for _ in range(150):
        model, opt_state, metrics = s.step(model, opt_state, x, np.roll(x, -1, axis=2))
    assert float(metrics["loss"]) < 0.1


def test_flops_per_token_counts_gpt2_small():
    """GPT-2 small has 85M non-embedding weights (Kaplan et al. 2020 count 85M); with the 50304 x 768
    readout that is 124M parameters in matmuls, and 6N + 12 L D T at T = 1024."""
    cfg = tiny(n_layer=12, n_head=12, d_model=768, vocab_size=50257, block_size=1024)
    n = 12 * 12 * 768**2 + 50304 * 768
    assert n == pytest.approx(123.6e6, rel=1e-3)
    assert flops_per_token(cfg) == 6 * n + 12 * 12 * 768 * 1024


@pytest.mark.parametrize("overrides, parts", [({}, 1), ({"tie_embeddings": True}, 1), ({"compute_dtype": "bfloat16"}, 1), ({}, 3)])
def test_loss_gradients_match_plain_autodiff(overrides, parts):
    """loss_fn takes the readout's and the loss's gradients in its forward pass (train.head_loss): the loss and
    all gradients equal jax.grad of the loss written plainly, optax's cross-entropy of the model's logits
    divided by parts; in bfloat16 to its rounding, with each gradient in its parameter's dtype."""
    cfg = tiny(**overrides)
    gpt = init_gpt(cfg, jax.random.key(0))
    if not cfg.tie_embeddings:  # the readout starts at zero, where no gradient reaches the blocks
        gpt = eqx.tree_at(lambda m: m.emb.unembed, gpt, jax.random.normal(jax.random.key(1), gpt.emb.unembed.shape))
    x_BT, y_BT = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8, 16))
    plain = lambda m, x, y: optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(x), y).mean() / parts
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x, y: train.loss_fn(m, x, y, 1, parts)))(gpt, x_BT, y_BT)
    want_loss, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(plain))(gpt, x_BT, y_BT)
    tol = 1e-5 if cfg.compute_dtype == "float32" else 2e-2
    np.testing.assert_allclose(loss, want_loss, rtol=tol)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert a.dtype == b.dtype == np.float32
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b) + 1e-12, (np.linalg.norm(a - b), np.linalg.norm(b))


def test_chunked_loss_is_the_same_loss_in_less_memory():
    """loss_chunks=4 gives the whole batch's loss and gradients (to float32 rounding), and the compiled
    loss-and-gradient keeps less temporary memory than without chunks, by at least one whole batch of
    float32 logits (the unchunked one holds the logits and their gradient at once)."""
    cfg = tiny(vocab_size=4096, batch_size=8, block_size=32)
    gpt = init_gpt(cfg, jax.random.key(0))
    x_BT, y_BT = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8, 32))
    logits_bytes = x_BT.size * cfg.model_vocab * 4
    out = {}
    for chunks in (1, 4):
        f = eqx.filter_jit(lambda m, x, y: eqx.filter_value_and_grad(train.loss_fn)(m, x, y, chunks))
        temp = f.lower(gpt, x_BT, y_BT).compile().compiled.memory_analysis().temp_size_in_bytes
        out[chunks] = (*f(gpt, x_BT, y_BT), temp)
    (loss1, grads1, temp1), (loss4, grads4, temp4) = out[1], out[4]
    np.testing.assert_allclose(loss4, loss1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads4), jax.tree.leaves(grads1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert temp4 < temp1 - logits_bytes, (temp1, temp4, logits_bytes)
