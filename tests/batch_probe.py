"""Run by test_multihost.py as process I of two, each with 2 CPU devices (jax.distributed on
ADDRESS): data.global_batch's rows on this process's devices, for steps 0..4 on a 1 x 4 and a
2 x 2 mesh, are test_data.documented_batch's (the documented offsets written out)."""
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import data  # noqa: E402
import train  # noqa: E402
from conftest import tiny  # noqa: E402
from test_data import documented_batch  # noqa: E402

N, G, B, T = 5000, 2, 8, 16
tokens = np.arange(N, dtype=np.uint16)
for replica in (1, 2):
    sharding = NamedSharding(train.make_mesh(tiny(mesh_replica=replica)), train.BATCH_SPEC)
    for step in range(5):
        got = data.global_batch(tokens, 3, data.TRAIN, step, sharding, (G, B, T))
        for array, want in zip(got, documented_batch(3, data.TRAIN, step, G, B, T, N)):
            assert len(array.addressable_shards) == 2
            for shard in array.addressable_shards:
                np.testing.assert_array_equal(shard.data, want[shard.index])
print(f"process {jax.process_index()}: ok")
