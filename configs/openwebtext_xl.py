"""GPT-2 XL shape (1.5B): 48 layers, 25 heads of 64, width 1600; FSDP shards parameters and
optimizer state over every device. Saving the matmuls only keeps activations within one GPU; the
48 layers stay one scan, which fits an H100 at 16 sequences a microbatch (unrolled, even 12
sequences ran out of memory). On an H200, with more memory, add --config.scan_unroll=48: no loop,
no zero-filled stacked buffers, and a higher MFU (BENCHMARKS.md).
openwebtext's learning rate and decay, carried over by muP (width 768 -> 1600: hidden LRs / 2.08)
and CompleteP (12 -> 48 layers: residual branches x 1/4)."""
from dataclasses import replace

from configs.openwebtext import config as base

config = replace(base, n_layer=48, n_head=25, d_model=1600, grad_accum=32, scan_unroll=1)
