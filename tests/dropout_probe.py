"""Run by test_dropout.py with 2 CPU devices: two dropout train steps (steps 5 and 6) of a tiny
model as two data-parallel replicas in two microbatches, saving each loss and the final
parameters to OUT (.npz) for comparison with one device in one microbatch."""
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)

import dataclasses  # noqa: E402

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import train  # noqa: E402
from conftest import tiny  # noqa: E402
from test_model import moved  # noqa: E402

# Every parameter random (from init the zero readout makes every block's gradient 0, so the
# first step could not tell the masks apart); Adam's eps large, so its update is no sign that
# float sums in another order may flip
cfg = tiny(dropout=0.5, batch_size=8, adam_eps=1e-3)
rng = np.random.default_rng(0)
x = rng.integers(0, cfg.vocab_size, (2, 8, cfg.block_size)).astype(np.int32)  # two steps' batches
arrays = {}
for name, replica, accum in (("replicas", 2, 2),):
    c = dataclasses.replace(cfg, mesh_replica=replica, grad_accum=accum)
    mesh = train.make_mesh(c)
    s = train.setup(c, mesh)
    model, opt_state, losses = moved(s.model, scale=0.1), s.opt_state, []
    for i, step in enumerate((5, 6)):
        batch = (a.reshape(accum, -1, cfg.block_size) for a in (x[i], np.roll(x[i], -1, -1)))
        batch = jax.device_put(tuple(batch), NamedSharding(mesh, train.BATCH_SPEC))
        model, opt_state, metrics = s.step(model, opt_state, *batch, step)
        losses.append(float(metrics["loss"]))
    arrays[f"{name}_loss"] = np.array(losses)
    for i, p in enumerate(jax.tree.leaves(eqx.filter(model, eqx.is_array))):
        arrays[f"{name}_param{i}"] = np.asarray(p)
np.savez(sys.argv[1], **arrays)
