"""Dropout (--config.dropout): where it drops, that it is a function of (seed, step, sequence)
alone (same run twice, a resume, two devices), and that nothing but the train step drops."""
import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

import train
from conftest import ROOT, run, tiny
from test_model import moved
from inference import decode
from params import init_gpt
from run.checkpoint import checkpoint_manager, restore_checkpoint

# train.loss_fn's objective, jitted: with keys (as the step calls it) or without (evaluation)
objective = eqx.filter_jit(lambda *args: train.loss_fn(*args)[0])

RATE = 0.5


def random_arrays(model, seed=0):
    """Every array of model drawn N(0, 0.3^2): no zero-initialised branch or readout hides a
    mask."""
    params, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return eqx.combine(jax.tree.unflatten(treedef, drawn), static)


def assert_dropped(got, full):
    """got is dropout(full, RATE): each element 0 or full / (1 - RATE), about RATE of them 0."""
    got, full = np.asarray(got, np.float64), np.asarray(full, np.float64)
    zero = got == 0
    assert abs(zero.mean() - RATE) < 0.1, zero.mean()  # 512+ elements: 4.5 standard deviations
    np.testing.assert_allclose(got[~zero], full[~zero] / (1 - RATE), rtol=1e-5)


@pytest.mark.parametrize("branch", ["attn", "mlp"])
def test_a_branch_output_is_dropped_before_the_residual_add(branch):
    """With the other branch zeroed, a block's output minus its input is the branch's output: with a
    key, about half of its elements are zero and the rest twice those without one."""
    cfg = tiny(dropout=RATE)
    model = random_arrays(init_gpt(cfg, jax.random.key(0)))
    other = (lambda b: b.mlp.down) if branch == "attn" else (lambda b: b.attn.out)
    block = jax.tree.map(lambda a: a[0], model.blocks)  # layer 0 of the stacked blocks
    block = eqx.tree_at(other, block, jnp.zeros_like(other(block)))
    x_TD = jax.random.normal(jax.random.key(1), (cfg.block_size, cfg.d_model))
    at = model.positions(jnp.arange(cfg.block_size))
    full = block((x_TD,), at)[0] - x_TD
    got = block((x_TD,), at, key=jax.random.key(2))[0] - x_TD
    assert_dropped(got, full)


def test_the_embedding_output_is_dropped():
    """With every branch zeroed the stream after the blocks is the embedding's output."""
    cfg = tiny(dropout=RATE, block_size=64)
    model = random_arrays(init_gpt(cfg, jax.random.key(0)))
    for where in (lambda m: m.blocks.attn.out, lambda m: m.blocks.mlp.down):
        model = eqx.tree_at(where, model, jnp.zeros_like(where(model)))
    tokens_T = jnp.arange(64) % cfg.vocab_size
    full = model.embed(tokens_T)
    np.testing.assert_array_equal(model.hidden(tokens_T)[0], full)
    assert_dropped(model.hidden(tokens_T, key=jax.random.key(3))[0], full)


def batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab_size, (1, cfg.batch_size, cfg.block_size)).astype(np.int32)
    return x, np.roll(x, -1, axis=-1)


def test_the_same_seed_trains_the_same_run_and_the_step_moves_the_masks():
    """Three dropout steps twice from the same state: bitwise the same losses and parameters;
    the same batches at other step numbers: other losses after the first step (whose zero readout
    gives uniform logits whatever is dropped) and other parameters. The step number reaches the
    step through the dropout keys alone: without dropout the two runs are bitwise the same, so
    every difference is the masks' (the program and its inputs are otherwise the same)."""
    def run_from(s, first):
        state = jax.tree.map(jnp.copy, (s.model, s.opt_state))  # the step donates its inputs
        losses = []
        for i in range(3):
            *state, metrics = s.step(*state, *batch(cfg, i), first + i)
            losses.append(float(metrics["loss"]))
        return losses, jax.tree.leaves(eqx.filter(state[0], eqx.is_array))

    cfg, plain = tiny(dropout=0.2), tiny()
    s = train.setup(cfg, train.make_mesh(cfg))
    a, b, later = run_from(s, 0), run_from(s, 0), run_from(s, 10)
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        np.testing.assert_array_equal(x, y)
    assert a[0][0] == later[0][0] and all(x != y for x, y in zip(a[0][1:], later[0][1:]))
    assert any((x != y).any() for x, y in zip(a[1], later[1], strict=True))
    s = train.setup(plain, train.make_mesh(plain))  # dropout 0: the control
    first, again = run_from(s, 0), run_from(s, 10)
    assert first[0] == again[0]
    for x, y in zip(first[1], again[1], strict=True):
        np.testing.assert_array_equal(x, y)


def test_each_sequence_step_and_seed_has_its_own_mask():
    """The loss of the same batch and parameters moves with the step and the seed; the rows, one
    sequence repeated, have as many losses (each its own mask); without keys, dropout 0's."""
    cfg = tiny(dropout=RATE)
    model = random_arrays(init_gpt(cfg, jax.random.key(0)))
    x = np.repeat(batch(cfg)[0][:, :1], cfg.batch_size, axis=1)  # one sequence in every row
    y = np.roll(x, -1, axis=-1)
    loss = lambda c, step, rows=slice(None): float(objective(
        model, x[0, rows], y[0, rows], c, train.dropout_keys(c, step, x)[0, rows]))
    base = loss(cfg, 3)
    assert base == loss(cfg, 3)
    assert base != loss(cfg, 4) and base != loss(dataclasses.replace(cfg, seed=1), 3)
    assert len({loss(cfg, 3, slice(i, i + 1)) for i in range(cfg.batch_size)}) == cfg.batch_size
    assert float(objective(model, x[0], y[0], cfg)) == float(
        objective(model, x[0], y[0], tiny()))


def test_evaluation_sampling_and_the_model_call_do_not_drop(shakespeare):
    """train.evaluate twice gives the same losses, those of the same parameters with dropout 0;
    decoding (sample.py's extend) and the model's call (eval.py's tasks, export's check) too."""
    import data

    cfg = tiny(dropout=RATE)
    model = random_arrays(init_gpt(cfg, jax.random.key(0)))
    plain = random_arrays(init_gpt(dataclasses.replace(cfg, dropout=0.0), jax.random.key(0)))
    assert model.dropout_rate == RATE and plain.dropout_rate == 0
    mesh = train.make_mesh(cfg)
    tokens = data.load_split(cfg, "train"), data.load_split(cfg, "val")
    first = train.evaluate(model, cfg, *tokens, mesh)
    assert first == train.evaluate(model, cfg, *tokens, mesh)
    assert first == train.evaluate(plain, dataclasses.replace(cfg, dropout=0.0), *tokens, mesh)
    x = jnp.asarray(batch(cfg)[0][0, 0])
    np.testing.assert_array_equal(model(x), plain(x))
    cache = decode.empty_cache(model, cfg.block_size)
    for a, b in zip(jax.tree.leaves(decode.extend(model, cache, x, 0)),
                    jax.tree.leaves(decode.extend(plain, cache, x, 0)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_two_devices_draw_the_masks_of_one(tmp_path):
    """Two steps with dropout on 2 devices as 2 replicas in 2 microbatches: the losses and
    parameters of one device in one microbatch (to float rounding: the masks are those of the
    sequences, wherever they run)."""
    out = tmp_path / "d2.npz"
    r = run([str(ROOT / "tests/dropout_probe.py"), str(out)])
    assert r.returncode == 0, r.stderr
    two = np.load(out)
    cfg = tiny(dropout=0.5, batch_size=8, adam_eps=1e-3)  # as the probe's
    s = train.setup(cfg, train.make_mesh(cfg))
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (2, 8, cfg.block_size)).astype(np.int32)
    model, opt_state, losses = moved(s.model, scale=0.1), s.opt_state, []
    for i, step in enumerate((5, 6)):
        model, opt_state, metrics = s.step(model, opt_state, x[i][None],
                                           np.roll(x[i], -1, -1)[None], step)
        losses.append(float(metrics["loss"]))
    params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for name in ("replicas",):
        np.testing.assert_allclose(two[f"{name}_loss"], losses, rtol=1e-5, err_msg=name)
        for i, p in enumerate(params):
            np.testing.assert_allclose(two[f"{name}_param{i}"], p, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name} {i}")


def final_arrays(rundir, cfg) -> list[np.ndarray]:
    s = train.setup(cfg, train.make_mesh(cfg))
    mngr = checkpoint_manager(epath.Path(rundir), cfg, read_only=True)
    return [np.asarray(a) for a in jax.tree.leaves(restore_checkpoint(mngr, s.model,
                                                                      s.opt_state)[:2])]


def test_a_resumed_run_is_bitwise_the_straight_one(shakespeare, tmp_path):
    """6 steps straight, against 3 and then the same run resumed to 6: the same metrics.jsonl
    (losses, evaluations) and bitwise the same parameters and optimizer state."""
    cfg = tiny(dropout=0.2, max_steps=6, eval_interval=3, ckpt_interval=3, log_interval=1,
               eval_batches=1, learning_rate=1e-2, min_lr=1e-2)
    train.train(cfg, epath.Path(tmp_path / "straight"))
    train.train(dataclasses.replace(cfg, max_steps=3), epath.Path(tmp_path / "resumed"))
    train.train(cfg, epath.Path(tmp_path / "resumed"))
    lines = {}
    for name in ("straight", "resumed"):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        lines[name] = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")}
                       for r in records]
    assert len(lines["straight"]) == 9 and lines["resumed"] == lines["straight"]
    for a, b in zip(final_arrays(tmp_path / "resumed", cfg),
                    final_arrays(tmp_path / "straight", cfg), strict=True):
        np.testing.assert_array_equal(a, b)


def test_recomputed_blocks_draw_the_same_masks():
    """remat=full recomputes each block in the backward pass, masks included: the loss and
    gradients of dropout with it (and the layers unrolled) and without it agree."""
    x, y = batch(tiny())
    out = []
    for remat, unroll in (("none", 1), ("full", 2)):
        cfg = tiny(dropout=RATE, remat=remat, scan_unroll=unroll)
        model = random_arrays(init_gpt(cfg, jax.random.key(0)))
        keys_B = train.dropout_keys(cfg, 7, x)[0]
        f = eqx.filter_jit(eqx.filter_value_and_grad(lambda *args: train.loss_fn(*args)[0]))
        out.append(f(model, x[0], y[0], cfg, keys_B))
    for loss, grads in out[1:]:
        np.testing.assert_allclose(loss, out[0][0], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(out[0][1]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
