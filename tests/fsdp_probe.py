"""Run by test_train.py in a subprocess with N simulated devices: one train step of a tiny model,
saving the loss, the gradients and the updated parameters to an .npz, and asserting that every
FSDP-sharded parameter is split N ways. A 4th argument "kernels": every fast path of kernels.py
applies (Pallas in its interpreter, attention by jax's XLA version), as on a GPU; FIELD=VALUE
arguments after it override the config (the variants)."""
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import configs  # noqa: E402
import train  # noqa: E402
from conftest import tiny  # noqa: E402
from params import Policy, policy_table  # noqa: E402

n, out = int(sys.argv[1]), sys.argv[2]
cfg = tiny(d_model=64, n_head=4, batch_size=16, mesh_replica=int(sys.argv[3]) if len(sys.argv) > 3 else 1)
cfg = configs.apply_overrides(cfg, [f"--config.{a}" for a in sys.argv[4:] if "=" in a])
if "kernels" in sys.argv[4:]:
    import dataclasses
    import kernels
    kernels.ROWS = 8
    kernels.FAST_PATHS = [dataclasses.replace(p, applies=lambda c: True) for p in kernels.FAST_PATHS]
    assert set(kernels.select(cfg)) == {"attend", "qk_norm_rope", "gelu"}
assert jax.device_count() == n
mesh = train.make_mesh(cfg)
s = train.setup(cfg, mesh)
rng = np.random.default_rng(0)
x = rng.integers(0, cfg.vocab_size, (1, 16, cfg.block_size)).astype(np.int32)
y = rng.integers(0, cfg.vocab_size, (1, 16, cfg.block_size)).astype(np.int32)
batch = jax.device_put((x, y), NamedSharding(mesh, train.BATCH_SPEC))
grads = eqx.filter_jit(eqx.filter_grad(train.loss_fn))(s.model, batch[0][0], batch[1][0], cfg)
fsdp = mesh.shape["fsdp"]
table = jax.tree.leaves(policy_table(s.model, cfg), is_leaf=lambda p: isinstance(p, Policy))
for param, policy in zip(jax.tree.leaves(eqx.filter(s.model, eqx.is_array)), table):
    shard = param.addressable_shards[0].data.shape
    for dim, axis in enumerate(policy.spec):
        if axis == "fsdp":
            assert shard[dim] * fsdp == param.shape[dim], (param.shape, shard)
    if param.size >= 1024:  # every large parameter is split over fsdp
        assert np.prod(shard) * fsdp == param.size, (param.shape, shard)
model, _, metrics = s.step(s.model, s.opt_state, *batch)
arrays = {f"grad{i}": np.asarray(g) for i, g in enumerate(jax.tree.leaves(grads))}
arrays |= {f"param{i}": np.asarray(p) for i, p in enumerate(jax.tree.leaves(eqx.filter(model, eqx.is_array)))}
np.savez(out, loss=np.asarray(metrics["loss"]), **arrays)
