"""nanoGPT's CPU recipe sizes (4 layers, 4 heads, width 128, block 64, batch 12) in float32. muP with
its base at this shape: the same model as SP here, and its LR carries to other widths and depths
(`python mup.py transfer --config=shakespeare_char_cpu ...`). Heads are 32 wide, so attn_tau =
sqrt(32) makes muP's tau / head_dim SP's 1 / sqrt(head_dim). The 4 layers are unrolled in one scan
iteration: at these sizes the XLA:CPU step takes ~20% less time so (bench.py), and compiles as fast.
Schedule: the fewest steps that end at val <= 1.70 with margin over seeds (BENCHMARKS.md): at 1600 steps
learning_rate 4e-3 ended at 1.674 / 1.685 (seeds 0 / 2); 1400 steps at 1.670-1.712 over seeds 0-2;
2e-3, 3e-3 and 6e-3 did worse at 1400 steps."""
from configs import Config

config = Config(dataset="shakespeare_char", vocab_size=65, n_layer=4, n_head=4, d_model=128, block_size=64,
                batch_size=12, compute_dtype="float32", max_steps=1600, learning_rate=4e-3, min_lr=2e-4,
                warmup_steps=100, weight_decay=2e-4, beta2=0.99, eval_interval=400, eval_batches=20,
                param="mup", d_base=128, depth_base=4, attn_tau=32**0.5, scan_unroll=4)
