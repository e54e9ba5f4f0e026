"""GPT-2 small (124M) on openwebtext: the Config defaults. 512 x 1024 = 0.5M tokens a step,
reached through grad_accum; 20k steps ~ 10B tokens (nanoGPT trains 600k steps of the same batch).
muP with its base here (d_base=768, depth_base=12, the defaults): the same model as SP, and the
base whose learning rate wider and deeper configs (openwebtext_xl) reuse."""
from configs import Config

config = Config(grad_accum=8, param="mup")
