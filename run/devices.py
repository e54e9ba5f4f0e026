"""Settings of the accelerator that must be made before JAX starts its backends (launch.py and
bench.py call them first thing): so this module imports no JAX."""
import os

# JAX preallocates 75% of a GPU's memory, and the 1.5B unrolled step ran out of it on an 80 GiB
# H100 (BENCHMARKS.md; whether 0.9 is enough is still to be measured there). 0.9 leaves the rest
# to the CUDA context and cuDNN/cuBLAS workspaces outside XLA's pool. Only a GPU's allocator reads
# it; a value the user set wins.
GPU_MEMORY_FRACTION = "0.9"


def default_memory_fraction() -> None:
    """Before jax's GPU backend starts (it reads the variable then)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
