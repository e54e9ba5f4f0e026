"""Parts of the GPT that model.py builds from its config and that an edit of the attention or the
MLP leaves alone: where the tokens sit (positions.py: RoPE's tables, ALiBi's biases, the KV cache's
mask) and MUDD's dense connections between the blocks (mudd.py). model.py holds the math an edit
changes and hands them its functions; these import no module of the repo but configs/."""
