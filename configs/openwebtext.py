"""GPT-2 small (124M) on openwebtext: the Config defaults. 512 x 1024 = 0.5M tokens a step,
reached through grad_accum; 20k steps ~ 10B tokens (nanoGPT trains 600k steps of the same batch)."""
from configs import Config

config = Config(grad_accum=8)
