"""nanoGPT's GPU recipe for character-level Shakespeare (6 layers, 6 heads, width 384, block 256,
batch 64). No dropout: mugpt has none, so the run is much shorter than nanoGPT's 5000 steps: on an
H100 3000 steps memorised the text and val loss was lowest near step 500, so the run stops there,
the schedule decaying to min_lr by then; nanoGPT, with dropout, ends lower (BENCHMARKS.md).
muP with its base at this shape (the same model as SP here)."""
from configs import Config

config = Config(dataset="shakespeare_char", vocab_size=65, n_layer=6, n_head=6, d_model=384,
                block_size=256, batch_size=64, max_steps=500, learning_rate=1e-3, min_lr=1e-4,
                warmup_steps=100, weight_decay=1e-4, beta2=0.99, eval_interval=250,
                eval_batches=20, param="mup", d_base=384, depth_base=6)
