"""GPT-2 small (124M) on openwebtext: the Config defaults. 512 x 1024 = 0.5M tokens a step,
reached through grad_accum; 20k steps ~ 10B tokens (nanoGPT trains 600k steps of the same batch).
muP with its base here (d_base=768, depth_base=12, the defaults): the same model as SP, and the
base whose learning rate wider and deeper configs (openwebtext_xl) reuse.
Speed (one H100, BENCHMARKS.md): the 12 layers unrolled (no loop: XLA:GPU's scan kept every saved activation
in a zero-filled stacked buffer, copied in and out: 86 -> 73 ms a 32-sequence microbatch), saving the matmul
outputs only (the elementwise ops are recomputed: they were saved in float32); 39 GB at 64 sequences."""
from configs import Config

config = Config(grad_accum=8, param="mup", remat="save_dots", scan_unroll=12)
