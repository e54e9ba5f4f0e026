"""Run by test_train.py in a subprocess with N simulated devices: two train steps of a tiny model
whose parameters are all random, saving the losses, the gradients and their norm, task scores and
the updated parameters to an .npz (conftest.assert_same_step compares two), and asserting that
every FSDP-sharded parameter is split N ways. A 4th argument "kernels": every fast path of
fast_paths.py applies (Pallas in its interpreter, attention by jax's XLA version), as on a GPU;
FIELD=VALUE arguments after it override the config (the variants)."""
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import configs  # noqa: E402
import train  # noqa: E402
from conftest import tiny  # noqa: E402
from test_model import moved  # noqa: E402
from params import Policy, policy_table  # noqa: E402

n, out = int(sys.argv[1]), sys.argv[2]
# Adam's eps large: its update g / (|g| + eps) then moves smoothly with g, where a tiny eps makes
# it a sign that float sums in another order may flip for an entry whose gradient is near 0
cfg = tiny(d_model=64, n_head=4, batch_size=16, adam_eps=1e-3,
           mesh_replica=int(sys.argv[3]) if len(sys.argv) > 3 else 1)
cfg = configs.apply_overrides(cfg, [f"--config.{a}" for a in sys.argv[4:] if "=" in a])
if "kernels" in sys.argv[4:]:
    import dataclasses
    from fused import fast_paths
    from fused import pallas_qk_norm_rope
    pallas_qk_norm_rope.ROWS = 8
    fast_paths.FAST_PATHS = [dataclasses.replace(p, applies=lambda c: True) for p in fast_paths.FAST_PATHS
                          if p.fn is not fast_paths.splash_attend]  # TPU's attention: test_kernels
assert jax.device_count() == n
mesh = train.make_mesh(cfg)
s = train.setup(cfg, mesh)
# Every parameter moved by 0.1 N(0, 1), each on its own sharding: from init the readout is zero,
# so the logits are zero whatever the blocks compute and every block's gradient is 0 on any mesh.
# (0.3 made SharedKV + ALiBi's gradients so ill-conditioned that float32 sums in another order
# differed by 1e-4, past conftest.assert_same_step's tolerance.)
s = s._replace(model=moved(s.model, scale=0.1))
if sys.argv[4:] == ["kernels"]:
    assert s.model.blocks.attn.fast_qk_norm_rope is fast_paths.fused_qk_norm_rope
    assert s.model.blocks.mlp.fast_gelu is fast_paths.recomputing_gelu
    assert s.model.fast_cross_entropy is fast_paths.fused_cross_entropy.cross_entropy
rng = np.random.default_rng(0)
x = rng.integers(0, cfg.vocab_size, (1, 16, cfg.block_size)).astype(np.int32)
y = rng.integers(0, cfg.vocab_size, (1, 16, cfg.block_size)).astype(np.int32)
batch = jax.device_put((x, y), NamedSharding(mesh, train.BATCH_SPEC))
grad_fn = eqx.filter_grad(lambda model, x, y: train.objective(model, x, y, cfg))
with jax.set_mesh(mesh):  # as train.py's step: the kernels run per device (fast_paths.per_device)
    grads = eqx.filter_jit(grad_fn)(s.model, batch[0][0], batch[1][0])
    jaxpr = eqx.filter_make_jaxpr(grad_fn)(s.model, batch[0][0], batch[1][0])[0]


def pallas_calls(jaxpr, per_device=False):
    """Whether each pallas_call in jaxpr (nested ones too) sits in a shard_map over fsdp that
    splits an operand (the batch) over fsdp: each device's own sequences, not a gathered batch."""
    for eqn in jaxpr.eqns:
        splits = any("fsdp" in str(spec) for spec in eqn.params.get("in_specs", ()))
        inner = per_device or "fsdp" in eqn.params.get("newly_manual_axes", ()) and splits
        yield from [per_device] if eqn.primitive.name == "pallas_call" else []
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from pallas_calls(getattr(sub, "jaxpr", sub), inner)


if sys.argv[4:] == ["kernels"]:  # forward and backward, each one per device (never gathered)
    where = list(pallas_calls(jaxpr.jaxpr))
    assert len(where) >= 2 and all(where) == (mesh.shape["fsdp"] > 1), where
# the in-training task scoring (inference/tasks.py) on the same model, its calls recorded
from inference import tasks  # noqa: E402

score, scored = tasks.score, []
tasks.score = lambda *a: scored.append(eqx.filter_make_jaxpr(score)(*a)[0]) or score(*a)
rows = rng.integers(0, cfg.vocab_size, (3, 16, cfg.block_size)).astype(np.int32)
lls, _ = tasks.loglikelihoods(s.model, *rows, cfg.vocab_size,
                              NamedSharding(mesh, jax.P(("replica", "fsdp"))), 16)
if sys.argv[4:] == ["kernels"]:  # each kernel on the device's own rows there too
    where = [w for jaxpr in scored for w in pallas_calls(jaxpr.jaxpr)]
    assert len(where) >= 1 and all(where) == (mesh.shape["fsdp"] > 1), where
fsdp = mesh.shape["fsdp"]
table = jax.tree.leaves(policy_table(s.model, cfg), is_leaf=lambda p: isinstance(p, Policy))
for param, policy in zip(jax.tree.leaves(eqx.filter(s.model, eqx.is_array)), table):
    shard = param.addressable_shards[0].data.shape
    for dim, axis in enumerate(policy.spec):
        if axis == "fsdp":
            assert shard[dim] * fsdp == param.shape[dim], (param.shape, shard)
    if param.size >= 1024:  # every large parameter is split over fsdp
        assert np.prod(shard) * fsdp == param.size, (param.shape, shard)
grads = jax.tree.leaves(grads)
assert all(np.any(np.asarray(g) != 0) for g in grads)  # else the comparison is of zeros
# two steps: the second's update reads Adam's moments, which carry the first gradient's scale
model, opt_state, first = s.step(s.model, s.opt_state, *batch)
model, _, second = s.step(model, opt_state, *batch)
arrays = {f"grad{i}": np.asarray(g) for i, g in enumerate(grads)}
arrays |= {f"param{i}": np.asarray(p) for i, p in enumerate(jax.tree.leaves(eqx.filter(model, eqx.is_array)))}
np.savez(out, loss=np.asarray(first["loss"]), grad_norm=np.asarray(first["grad_norm"]),
         loss2=np.asarray(second["loss"]), task_loglikelihoods=lls, **arrays)
