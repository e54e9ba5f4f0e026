"""Run by test_multihost.py as process I of two, each with 2 CPU devices (jax.distributed on ADDRESS):
make_mesh puts the replica axis across the processes and fsdp within them, and global_batch gives this
process exactly its devices' rows of get_batch's batch, reading no other row from the tokens."""
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import data  # noqa: E402
import train  # noqa: E402
from run.errors import UsageError  # noqa: E402
from conftest import tiny  # noqa: E402

me = jax.process_index()
# mesh_replica -> the process of each device, row by row (a row is one replica)
for replica, processes in [(1, [[0, 0, 1, 1]]), (2, [[0, 0], [1, 1]]), (4, [[0], [0], [1], [1]])]:
    mesh = train.make_mesh(tiny(mesh_replica=replica))
    assert [[d.process_index for d in row] for row in mesh.devices] == processes, (replica, mesh.devices)
with pytest.raises(UsageError, match="mesh_replica=3 is neither a multiple nor a divisor of the 2 processes"):
    train.make_mesh(tiny(mesh_replica=3))


class Tokens:
    """A token array that records where it is read."""

    def __init__(self, tokens):
        self.tokens, self.size, self.read = tokens, tokens.size, []

    def __getitem__(self, index):
        self.read.append(index.start)
        return self.tokens[index]


tokens = np.arange(1000, dtype=np.uint16)
G, B, T = 2, 8, 16
everything = [a.reshape(G, B, T) for a in data.get_batch(tokens, 0, data.TRAIN, 3, G * B, T)]  # every row, read here
for replica in (1, 2):
    sharding = NamedSharding(train.make_mesh(tiny(mesh_replica=replica)), train.BATCH_SPEC)
    recorded = Tokens(tokens)
    x, y = data.global_batch(recorded, 0, data.TRAIN, 3, sharding, (G, B, T))
    assert x.shape == y.shape == (G, B, T) and x.sharding == sharding
    mine = slice(me * B // 2, (me + 1) * B // 2)  # the processes' devices are contiguous: one block each
    assert sorted(recorded.read) == sorted(everything[0][:, mine, 0].ravel().tolist())  # its rows and no other
    for got, want in ((x, everything[0]), (y, everything[1])):
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(shard.data, want[shard.index])
print(f"process {me}: ok")
