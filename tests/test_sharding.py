"""FSDP pinned: each parameter's PartitionSpec against a table written here, and the compiled
train step's communication on 4 simulated devices against the FSDP volume of the parameters."""
import json
import math

import equinox as eqx
import jax
import pytest

import params
from conftest import run, tiny

# name: (its axes, by model.py's legend; its spec). FSDP splits every matrix along D, the model
# width; vectors (gains) and the connections' small MUDD matrices stay whole. Written out here,
# not read from params.py, so that a changed spec fails a test.
EXPECTED = {
    "emb.embed": ("V D", (None, "fsdp")),
    "emb.unembed": ("V D", (None, "fsdp")),
    "blocks.attn_norm": ("L D", (None, None)),
    "blocks.attn.qkv": ("L D N K", (None, "fsdp", None, None)),  # N: H + 2G heads
    "blocks.attn.out": ("L H K D", (None, None, None, "fsdp")),
    "blocks.attn.q_norm": ("L K", (None, None)),
    "blocks.attn.k_norm": ("L K", (None, None)),
    "blocks.mlp_norm": ("L D", (None, None)),
    "blocks.mlp.up": ("L D F", (None, "fsdp", None)),
    "blocks.mlp.down": ("L F D", (None, None, "fsdp")),
    "final_norm": ("D", (None,)),
    "mudd.w1": ("D M", ("fsdp", None)),  # M: C J, the connections' weights
    "mudd.w2": ("M M", (None, None)),
    "mudd.b": ("C J", (None, None)),
}
# tests/sharding_probe.py's model: every axis a different size, so a shape names its axes
SIZES = dict(V=128, D=64, L=2, N=12, K=16, H=4, F=256)


def test_the_table_is_fsdp_over_d():
    """The table itself: "fsdp" sits on D in every matrix of more than D entries."""
    for name, (axes, spec) in EXPECTED.items():
        axes = axes.split()
        matrix = len(axes) - axes.count("L") >= 2 and "D" in axes
        assert [a == "fsdp" for a in spec] == [matrix and a == "D" for a in axes], name


@pytest.mark.parametrize("variant", [{}, {"norm_gain": True, "tie_embeddings": True},
                                     {"norm_gain": True, "connections": "mudd"}])
def test_every_parameter_has_the_tables_spec(variant):
    cfg = tiny(d_model=64, n_head=4, n_layer=2, **variant)
    gpt = eqx.filter_eval_shape(params.init_gpt, cfg, jax.random.key(0))
    table = params.policy_table(gpt, cfg)
    leaves = jax.tree_util.tree_flatten_with_path(params.partition_specs(table))[0]
    assert leaves
    for path, spec in leaves:
        name = params.param_name(path)
        assert tuple(spec) == EXPECTED[name][1], name


@pytest.fixture(scope="module")
def compiled() -> dict:
    """tests/sharding_probe.py's compilation of the train step on 4 devices."""
    r = run(["tests/sharding_probe.py"], timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_initial_model_is_drawn_onto_its_shardings(compiled):
    """train.setup draws each parameter on its own sharding, each device computing its share: a
    device holds less than the whole model while the model is drawn (drawn on one device, then
    sharded, it held several times the model: BENCHMARKS.md). The values are those drawn on one
    device: FSDP's run starts from the same model."""
    init = compiled["init"]
    assert init["equal"]
    assert init["device_bytes"] < init["model_bytes"], init


def check_fsdp(out: dict) -> None:
    """The arrays on 4 devices carry the table's specs; the step all-gathers each sharded
    parameter along D, one layer at a time, and its communication is the FSDP volume: the
    sharded parameters gathered once forward and once backward (2x their bytes; 1x to 3x
    allowed) and their gradients reduced (1x), activations never (at 4096 tokens per step the
    blocks' activations are 30x the parameters)."""
    sharded = 0
    want_gathers = set()
    for name, shape in out["shapes"].items():
        axes, spec = EXPECTED[name]
        assert tuple(shape) == tuple(SIZES[a] for a in axes.split()), name
        assert tuple(out["specs"][name]) == spec, name
        if "fsdp" in spec:
            sharded += 4 * math.prod(shape)
            one = [n for a, n in zip(axes.split(), shape) if a != "L"]  # one layer's array
            want_gathers.add((",".join(map(str, one)), axes.replace("L ", "").split().index("D")))
    gathers = [c for c in out["collectives"] if c["kind"] == "all-gather"]
    got = {(c["shapes"][0], c["dim"]) for c in gathers}
    assert want_gathers <= got, sorted(want_gathers - got)
    gathered = sum(c["bytes"] * c["runs"] for c in gathers)
    total = sum(c["bytes"] * c["runs"] for c in out["collectives"])
    print(f"sharded parameters {sharded:,} B; all-gathers {gathered:,} B, all collectives "
          f"{total:,} B per step")
    assert sharded <= gathered <= 3 * sharded
    assert total <= 5 * sharded


def test_the_train_step_communicates_as_fsdp(compiled):
    """Without model.batch_split on the embedding's output, XLA's partitioner carried the table's
    D split into the activations: (B, T, F) all-reduces in every layer, many times the parameters'
    bytes of collectives a step (BENCHMARKS.md)."""
    check_fsdp(compiled)
