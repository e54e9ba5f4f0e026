"""nanoGPT's GPU recipe for character-level Shakespeare (config/train_shakespeare_char.py): 6
layers, 6 heads, width 384, block 256, batch 64, dropout 0.2, 5000 steps, learning rate 1e-3
warmed up over 100 steps and decayed to 1e-4, beta2 0.99, AdamW decay 0.1 x lr (here independent:
1e-4). nanoGPT ends at val 1.4697. Without dropout mugpt overfit early and stopped short of it
(BENCHMARKS.md); this recipe with dropout has not been run on a GPU yet
(bench_gpu.sh's "time" part measures the time to 1.4697).
muP with its base at this shape (the same model as SP here)."""
from configs import Config

config = Config(dataset="shakespeare_char", vocab_size=65, n_layer=6, n_head=6, d_model=384,
                block_size=256, batch_size=64, dropout=0.2, max_steps=5000, learning_rate=1e-3,
                min_lr=1e-4, warmup_steps=100, weight_decay=1e-4, beta2=0.99, eval_interval=250,
                eval_batches=20, param="mup", d_base=384, depth_base=6)
