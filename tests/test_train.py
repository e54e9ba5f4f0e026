"""The train step: FSDP sharding, gradient accumulation, the schedule and the decay."""
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from params import flops_per_token
from model import GPT
import optimizers
import params
from params import init_gpt
import train
from conftest import ROOT, assert_same_step, run_each, tiny
from test_model import moved


MESHES = [(8, 1, ""), (8, 2, ""), (8, 2, "kernels")]  # devices, replicas, every fused kernel


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """fsdp_probe.py's step on one device and on each mesh of MESHES, all at once."""
    runs = [(1, 1, "")] + MESHES
    outs = [tmp_path_factory.mktemp("fsdp") / f"d{n}.npz" for n, _, _ in runs]
    done = run_each([[str(ROOT / "tests/fsdp_probe.py"), str(n), str(out), str(replica), kernels]
                     for (n, replica, kernels), out in zip(runs, outs)])
    for r in done:
        assert r.returncode == 0, r.stderr
    return {key: np.load(out) for key, out in zip(runs, outs)}


@pytest.mark.parametrize("devices,replica,kernels", MESHES)
def test_fsdp_matches_one_device(fsdp_runs, devices, replica, kernels):
    """Loss, gradients and the updated parameters on 8 devices (all FSDP, or 2 replicas x 4, and
    with every fused kernel in its place) equal those on one device of model.py's functions; the
    probe asserts every large parameter really is split over the fsdp axis."""
    assert_same_step(fsdp_runs[devices, replica, kernels], fsdp_runs[1, 1, ""])


def test_accumulation_equals_one_big_batch():
    """One step on 16 sequences in 1 and in 4 microbatches: the same loss, the same gradient norm
    as autodiff's of the whole batch's objective, the same updated parameters. Every parameter
    random (from init the zero readout makes the loss ln V and every block's gradient 0 whatever
    the split); Adam's eps large, so its update is not a sign that float noise may flip."""
    cfg = tiny(batch_size=16, adam_eps=1e-3)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (16, cfg.block_size)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (16, cfg.block_size)).astype(np.int32)
    objective = eqx.filter_value_and_grad(lambda model, x, y: train.objective(model, x, y, cfg))
    results = []
    for g in (1, 4):
        s = train.setup(dataclasses.replace(cfg, grad_accum=g), train.make_mesh(cfg))
        model = moved(s.model)  # the same each time (seeded); the step donates (frees) it
        if g == 1:
            whole, grads = eqx.filter_jit(objective)(model, x, y)
        split = (a.reshape(g, -1, cfg.block_size) for a in (x, y))
        after, _, metrics = s.step(model, s.opt_state, *split)
        assert float(metrics["loss"]) == pytest.approx(float(whole), rel=1e-6), g
        assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)),
                                                            rel=1e-5), g
        results.append(jax.tree.leaves(eqx.filter(after, eqx.is_array)))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("size,grad_clip", [(100.0, 1.0), (0.01, 1.0), (100.0, 0.0)])
def test_first_update_is_clipped_adam_written_out(size, grad_clip):
    """Adam's first step is m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps) of the clipped gradient
    g * min(1, grad_clip / ||g||) (grad_clip=0: no clipping, nanoGPT's convention), times -lr: in
    numpy, for gradients far above grad_clip and below it. A large eps makes the update depend on
    the clipped gradient's size."""
    cfg = tiny(adam_eps=1.0, grad_clip=grad_clip, weight_decay=0.0, warmup_steps=0,
               learning_rate=0.1, min_lr=0.1)
    s = train.setup(cfg, train.make_mesh(cfg))
    arrays, table = eqx.filter(s.model, eqx.is_array), params.policy_table(s.model, cfg)
    opt = train.make_optimizer(cfg, table)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: (size / p.size**0.5 * rng.normal(size=p.shape)).astype(np.float32),
                         arrays)
    norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))
    factor = min(1.0, grad_clip / norm) if grad_clip else 1.0
    updates = opt.update(grads, opt.init(arrays), arrays)[0]
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)):
        gc = np.asarray(g, np.float64) * factor
        np.testing.assert_allclose(u, -0.1 * gc / (np.abs(gc) + 1.0), rtol=1e-4, atol=1e-9)


def test_lr_schedule_warmup_then_cosine():
    cfg = tiny(learning_rate=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    lr = optimizers.lr_schedule(cfg)
    assert float(lr(0)) == pytest.approx(0.1)  # (step + 1) / warmup
    assert float(lr(9)) == pytest.approx(1.0)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    assert float(lr(110)) == pytest.approx(0.1) and float(lr(500)) == pytest.approx(0.1)


def test_weight_decay_is_independent_of_lr_and_only_on_matrices():
    """With zero gradients the update is the decay alone: p * (1 - wd * lr_t / lr) on every matrix
    (the embedding, the readout, each block's four), whatever the learning rate, at the first
    step of a 4-step warmup (lr_t / lr = 1 / 4); the gains (vectors) do not move."""
    for lr in (1e-3, 1.0):
        cfg = tiny(norm_gain=True, weight_decay=0.01, learning_rate=lr, min_lr=lr, warmup_steps=4)
        s = train.setup(cfg, train.make_mesh(cfg))
        arrays = eqx.filter(s.model, eqx.is_array)
        opt = train.make_optimizer(cfg, params.policy_table(s.model, cfg))
        zeros = jax.tree.map(np.zeros_like, arrays)
        updates, _ = opt.update(zeros, opt.init(arrays), arrays)
        named = jax.tree_util.tree_flatten_with_path(arrays)[0]
        stacked = {id(x) for x in jax.tree.leaves(arrays.blocks)}  # one more axis: the layers
        matrices = 0
        for (path, p), u in zip(named, jax.tree.leaves(updates), strict=True):
            if p.ndim - (id(p) in stacked) >= 2:
                np.testing.assert_allclose(u, -0.01 / 4 * p, rtol=1e-6, err_msg=str(path))
                matrices += 1
            else:
                assert float(np.abs(u).max()) == 0.0, path
        assert matrices == 6


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
    assert flops_per_token(eqx.filter_eval_shape(GPT, cfg), 1024) == 6 * n + 12 * 12 * 768 * 1024


def test_loss_is_cross_entropy_written_out():
    """The loss against numpy's log-softmax of the model's own logits at the targets."""
    cfg = tiny()
    gpt = init_gpt(cfg, jax.random.key(0))
    gpt = eqx.tree_at(lambda m: m.emb.unembed, gpt,
                      jax.random.normal(jax.random.key(1), gpt.emb.unembed.shape))
    x_BT, y_BT = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8, 16))
    logits = np.asarray(jax.vmap(gpt)(x_BT), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, y_BT[..., None], -1).mean()
    for chunks in (1, 2):
        got = train.objective(gpt, x_BT, y_BT, dataclasses.replace(cfg, loss_chunks=chunks))
        assert float(got) == pytest.approx(want, rel=1e-5)


def z_loss(monkeypatch, weight=0.1):
    """A z-loss (PaLM's log(Z)^2 term, large here so it shows) added to the objective in
    train.loss_fn as the README shows; returns the objective, its gradient taken here by jax.grad."""
    plain = train.loss_fn

    def loss_fn(model, x_BT, y_BT, cfg):
        log_z_BT = jax.nn.logsumexp(jax.vmap(model)(x_BT), axis=-1)
        objective, cross_entropy = plain(model, x_BT, y_BT, cfg)
        return objective + weight * jnp.mean(log_z_BT**2), cross_entropy

    monkeypatch.setattr(train, "loss_fn", loss_fn)
    return eqx.filter_value_and_grad(lambda m, x, y, cfg: loss_fn(m, x, y, cfg)[0])


def test_an_edit_to_the_loss_reaches_the_gradient(monkeypatch):
    """A z-loss added to the objective: the train step's objective and gradient norm are those of
    the edited objective, its gradient taken by jax.grad, and differ from the plain loss's; the
    step's loss stays the cross-entropy."""
    cfg = tiny()
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8, 16)).astype(np.int32)
    y = np.roll(x, -1, axis=-1)
    s = train.setup(cfg, train.make_mesh(cfg))
    model = moved(s.model)  # random: from init the zero readout makes the loss ln V for any model
    want_ce = train.objective(model, x[0], y[0], cfg)
    _, _, before = s.step(model, s.opt_state, x, y)
    grad_fn = z_loss(monkeypatch)
    s = train.setup(cfg, train.make_mesh(cfg))
    model = moved(s.model)  # the same parameters (the step donated the first copy)
    want_objective, want_grads = grad_fn(model, x[0], y[0], cfg)
    _, _, after = s.step(model, s.opt_state, x, y)
    assert float(after["objective"]) == pytest.approx(float(want_objective), rel=1e-5)
    assert float(after["loss"]) == pytest.approx(float(want_ce), rel=1e-5) == float(before["loss"])
    assert float(after["objective"]) > float(after["loss"]) + 0.1
    assert float(after["grad_norm"]) == pytest.approx(float(optax.tree.norm(want_grads)), rel=1e-4)
    assert float(after["grad_norm"]) != pytest.approx(float(before["grad_norm"]), rel=1e-2)


def test_each_log_reads_its_own_steps_throughput_and_a_save_is_left_out(tmp_path, monkeypatch):
    """tokens_per_s is the rate of the steps since the last log, and a checkpoint save is left out
    of it, as an evaluation is. Logs every 3 steps, saves at 6 and 12, each save and the batch of
    step 7 made 3 s long: the log of step 9 shows the slow step, those of steps 12 and 15 the
    steps' rate again. With the save counted in, the log after it read 3 s more (the rate fell
    after every save); with a running average, step 7's 3 s stayed in every log to the next
    evaluation or save. The bound is loose (1/50) for a noisy 2-core machine: 3 s against a few
    tiny steps is thousands of times slower."""
    import json
    import time
    cfg = tiny(max_steps=15, eval_interval=100, log_interval=3, ckpt_interval=6)
    saving, batch = train.save_checkpoint, train.data.global_batch
    monkeypatch.setattr(train, "save_checkpoint", lambda *a: time.sleep(3.0) or saving(*a))
    monkeypatch.setattr(train.data, "global_batch",
                        lambda *a: (a[2] == train.data.TRAIN and a[3] == 6 and time.sleep(3.0))
                        or batch(*a))
    rundir = tmp_path / "run"
    rundir.mkdir()
    (rundir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    train.train(cfg, rundir)
    rate = {r["step"]: r["tokens_per_s"] for r in map(json.loads, (rundir / "metrics.jsonl").open())
            if r.get("tokens_per_s") and "val_loss" not in r}
    assert rate[9] < rate[6] / 50, rate  # the slow step's own log
    assert rate[12] > rate[6] / 50 and rate[15] > rate[6] / 50, rate  # after it, after a save


def test_logged_losses_are_the_cross_entropy_whatever_the_objective(monkeypatch, shakespeare,
                                                                    tmp_path):
    """Two runs of 2 steps from the same parameters, one with a z-loss added to the objective:
    metrics.jsonl's losses (the step-0 evaluation's train and val, the first step's batch loss)
    are the same cross-entropy in both, and only the z-loss run logs an objective, larger by the
    z-loss."""
    import json
    cfg = tiny(max_steps=2, eval_interval=2, log_interval=1, eval_batches=1)

    def logged(rundir):
        rundir.mkdir()
        (rundir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        train.train(cfg, rundir)
        return {r["step"]: r for r in map(json.loads, (rundir / "metrics.jsonl").open())
                if "val_loss" in r or r["step"] == 1}

    plain = logged(tmp_path / "plain")
    z_loss(monkeypatch)
    with_z = logged(tmp_path / "z")
    for key in ("train_loss", "val_loss"):
        assert with_z[0][key] == pytest.approx(plain[0][key], rel=1e-6)
        assert with_z[0][key.replace("loss", "objective")] > with_z[0][key] + 0.1
    assert with_z[1]["loss"] == pytest.approx(plain[1]["loss"], rel=1e-6)
    assert with_z[1]["objective"] > with_z[1]["loss"] + 0.1
    assert not {"train_objective", "val_objective", "objective"} & {*plain[0], *plain[1]}
    assert with_z[2]["val_loss"] != pytest.approx(plain[2]["val_loss"], rel=1e-6)  # it trained


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
        c = dataclasses.replace(cfg, loss_chunks=chunks)
        f = eqx.filter_jit(lambda m, x, y: eqx.filter_value_and_grad(train.objective)(m, x, y, c))
        temp = f.lower(gpt, x_BT, y_BT).compile().compiled.memory_analysis().temp_size_in_bytes
        out[chunks] = (*f(gpt, x_BT, y_BT), temp)
    (loss1, grads1, temp1), (loss4, grads4, temp4) = out[1], out[4]
    np.testing.assert_allclose(loss4, loss1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads4), jax.tree.leaves(grads1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert temp4 < temp1 - logits_bytes, (temp1, temp4, logits_bytes)


def test_evaluation_is_the_mean_cross_entropy_of_its_microbatches(shakespeare):
    """train.evaluate's train_loss and val_loss against numpy: test_model.numpy_forward's
    cross-entropy (over the padded vocabulary, as training's), averaged over each split's
    eval_batches microbatches, microbatch i being the batch_size / grad_accum sequences that
    data.get_batch draws from (seed, the split's stream, i) (docs/data.md). Each microbatch counts
    once: evaluating the first every time, or dropping one, would differ."""
    import data
    from test_model import numpy_forward, random_gpt

    cfg = tiny(grad_accum=2, eval_batches=3)
    model = random_gpt(cfg)
    splits = {"train": (data.load_split(cfg, "train"), data.EVAL_TRAIN),
              "val": (data.load_split(cfg, "val"), data.EVAL_VAL)}
    got = train.evaluate(model, cfg, splits["train"][0], splits["val"][0], train.make_mesh(cfg))
    for name, (tokens, stream) in splits.items():
        per_batch = []
        for i in range(cfg.eval_batches):
            x, y = data.get_batch(tokens, cfg.seed, stream, i, cfg.batch_size // cfg.grad_accum,
                                  cfg.block_size)
            losses = []
            for x_T, y_T in zip(x, y):
                logits = numpy_forward(model, cfg, x_T).astype(np.float64)
                top = logits.max(-1)
                lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
                losses.append(lse - logits[np.arange(len(y_T)), y_T])
            per_batch.append(np.mean(losses))
        assert len(set(per_batch)) == cfg.eval_batches  # distinct microbatches: each one counts
        assert got[f"{name}_loss"] == pytest.approx(np.mean(per_batch), rel=1e-5), name
