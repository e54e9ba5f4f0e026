"""Run by test_checkpoint.py in a subprocess with N simulated devices: restore the checkpoint in
RUNDIR if there is one, checking that it holds exactly the arrays the saving process wrote to
OUT.npz and that they land on this mesh as fresh ones from setup() would, and that restore_model
reads the same model onto one device (as sample.py does); then take two steps (a retrace would trip
the step's assert_max_traces), save them as the next checkpoint and write its arrays to OUT.npz."""
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import numpy as np  # noqa: E402
from etils import epath  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import train  # noqa: E402
from run.checkpoint import (checkpoint_manager, restore_checkpoint, restore_model,  # noqa: E402
                        save_checkpoint)
from conftest import tiny  # noqa: E402
from params import init_gpt  # noqa: E402

n, rundir, out = int(sys.argv[1]), epath.Path(sys.argv[2]), sys.argv[3]
# every kind of parameter: tied embeddings, RMSNorm gains
cfg = tiny(d_model=64, n_head=4, batch_size=16, tie_embeddings=True, norm_gain=True)
mesh = train.make_mesh(cfg)
s = train.setup(cfg, mesh)
# (not eqx.nn.Shared's marker)
arrays = lambda tree: [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
fresh = [(x.shape, x.dtype, x.weak_type, x.sharding) for x in arrays((s.model, s.opt_state))]
mngr = checkpoint_manager(rundir, cfg)
start = mngr.latest_step() or 0
model, opt_state = s.model, s.opt_state
if start:
    model, opt_state, tally = restore_checkpoint(mngr, model, opt_state)
    restored = arrays((model, opt_state))
    assert [(x.shape, x.dtype, x.weak_type, x.sharding) for x in restored] == fresh
    assert max(len(x.sharding.device_set) for x in restored) == n
    saved = np.load(out)
    assert len(saved.files) == len(restored)
    for i, x in enumerate(restored):
        np.testing.assert_array_equal(np.asarray(x), saved[f"a{i}"])
    assert tally == {"since_log": [{"loss": 1.5}], "streak": 0, "skipped": start}
    one = restore_model(mngr, init_gpt(cfg, jax.random.key(1)))  # on jax.devices()[0]
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in arrays(one))
    for x, y in zip(arrays(one), arrays(model), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
rng = np.random.default_rng(start)
for _ in range(2):
    x = rng.integers(0, cfg.vocab_size, (1, 16, cfg.block_size)).astype(np.int32)
    batch = jax.device_put((x, np.roll(x, -1, axis=2)), NamedSharding(mesh, train.BATCH_SPEC))
    model, opt_state, _ = s.step(model, opt_state, *batch)
np.savez(out, **{f"a{i}": np.asarray(x) for i, x in enumerate(arrays((model, opt_state)))})
tally = {"since_log": [{"loss": 1.5}], "streak": 0, "skipped": start + 2}
save_checkpoint(mngr, start + 2, model, opt_state, tally)
mngr.close()
