"""Run by test_sharding.py in a subprocess with 4 simulated devices (a 1 x 4 mesh, all FSDP):
prints one JSON line: each parameter's sharding spec as placed by train.setup, and every collective of the compiled train step (kind,
array shapes, gathered dimension, and how many times a step runs it: the trip counts of the while
loops around it); the initial model's values and the memory a device takes to draw
it. ARGS: FIELD=VALUE config overrides."""
import inspect
import json
import math
import re
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import configs  # noqa: E402
import params  # noqa: E402
import train  # noqa: E402
from conftest import tiny  # noqa: E402

cfg = tiny(d_model=64, n_head=4, batch_size=64, block_size=64, norm_gain=True)
cfg = configs.apply_overrides(cfg, [f"--config.{a}" for a in sys.argv[1:] if "=" in a])
mesh = train.make_mesh(cfg)


CALLS, INIT_GPT = [], train.init_gpt
train.init_gpt = lambda *args: CALLS.append(args) or INIT_GPT(*args)  # what setup asks for


def compiled_step() -> tuple[dict, dict, str, object]:
    """The placed parameters' specs and shapes, the train step's optimized HLO, the model."""
    s = train.setup(cfg, mesh)
    arrays = eqx.filter(s.model, eqx.is_array)
    leaves = jax.tree_util.tree_flatten_with_path(arrays)[0]
    specs = {params.param_name(path): [a if a is None else str(a) for a in x.sharding.spec]
             for path, x in leaves}
    shapes = {params.param_name(path): x.shape for path, x in leaves}
    x = np.zeros((cfg.grad_accum, cfg.batch_size // cfg.grad_accum, cfg.block_size), np.int32)
    batch = jax.device_put((x, x), NamedSharding(mesh, train.BATCH_SPEC))
    jitted = inspect.getclosurevars(s.step).nonlocals["jitted"]  # the jax.jit inside the step
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as the step traces it
        return (specs, shapes, jitted.lower(arrays, s.opt_state, *batch, 0).compile().as_text(),
                s.model)


def collectives(hlo: str) -> list[dict]:
    """Every collective: kind, result shapes, bytes, gathered dimension, and runs per step. Each
    computation runs as often as its caller (ENTRY: once) times, for a while loop's body and
    condition, the loop's known trip count; called and branch computations: once per call."""
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        if head := re.match(r"(ENTRY )?%(\S+) .*\{$", line):
            entry, name = entry or (head.group(1) and head.group(2)), head.group(2)
            comps[name] = []
        elif name and line.startswith("  "):
            comps[name].append(line)
    runs, order = {entry: 1}, [entry]
    for comp in order:  # a computation has one caller in XLA's optimized HLO
        for line in comps[comp]:
            trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            times = int(trip.group(1)) if trip and " while(" in line else 1
            for callee in re.findall(r"%([\w.\-]+)", line.split("(", 1)[-1]):
                if callee in comps and callee not in runs:
                    runs[callee] = runs[comp] * times
                    order.append(callee)
    size = {"f32": 4, "s32": 4, "bf16": 2, "u32": 4, "pred": 1}
    found = []
    for comp, lines in comps.items():
        for line in lines:
            op = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) (all-gather|reduce-scatter|all-reduce|"
                          r"all-to-all|collective-permute)(?:-start)?\(", line)
            if op:
                arrays = re.findall(r"(\w+)\[([\d,]*)\]", op.group(1))
                dim = re.search(r"dimensions=\{(\d+)\}", line)
                found.append({"kind": op.group(2), "runs": runs.get(comp, 1),
                              "shapes": [dims for _, dims in arrays],
                              "bytes": sum(size[t] * math.prod(int(d) for d in dims.split(",")
                                                               if d) for t, dims in arrays),
                              "dim": int(dim.group(1)) if dim else None})
    return found


def initial_model(model) -> dict:
    """train.setup's initial model against params.init_gpt's on one device (equal: bitwise), and
    the bytes a device holds while train.setup's call of init_gpt draws it (the compiled draw's
    output and temporaries) against the whole model's."""
    one = INIT_GPT(cfg, jax.random.key(cfg.seed))
    pairs = zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                jax.tree.leaves(eqx.filter(one, eqx.is_array)), strict=True)
    _, key, *rest = CALLS[-1]
    draw = jax.jit(lambda key: eqx.filter(INIT_GPT(cfg, key, *rest), eqx.is_array))
    memory = draw.lower(key).compile().memory_analysis()
    return {"equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
            "device_bytes": memory.output_size_in_bytes + memory.temp_size_in_bytes,
            "model_bytes": sum(x.nbytes for x in jax.tree.leaves(eqx.filter(one, eqx.is_array)))}


specs, shapes, hlo, model = compiled_step()
print(json.dumps({"specs": specs, "shapes": shapes, "collectives": collectives(hlo),
                  "init": initial_model(model)}, default=int))
