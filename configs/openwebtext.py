"""GPT-2 small (124M) on openwebtext: the Config defaults. 512 x 1024 = 0.5M tokens a step,
reached through grad_accum (64-sequence microbatches fit one H100); 20k steps ~ 10B tokens
(nanoGPT trains 600k steps of the same batch). muP with its base here (d_base=768,
depth_base=12, the defaults): the same model as SP, and the base whose learning rate wider and
deeper configs (openwebtext_xl) reuse.
For speed on a GPU (BENCHMARKS.md) the 12 layers are unrolled: no loop, so no zero-filled
stacked buffers of saved activations, copied in and out, as XLA:GPU's scan keeps; and only the
matmul outputs are saved (the elementwise ops are recomputed: saved, they were float32).
Unrolled, model.gelu may run as fused/fast_paths.py's recomputing GELU on a GPU."""
from configs import Config

config = Config(grad_accum=8, param="mup", remat="save_dots", scan_unroll=12)
