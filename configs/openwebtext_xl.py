"""GPT-2 XL shape (1.5B): 48 layers, 25 heads of 64, width 1600; FSDP shards parameters and
optimizer state over every device. Saving the matmuls only keeps activations within one GPU."""
from dataclasses import replace

from configs.openwebtext import config as base

config = replace(base, n_layer=48, n_head=25, d_model=1600, grad_accum=32, remat="save_dots", learning_rate=2e-4,
                 min_lr=2e-5, weight_decay=2e-5)
