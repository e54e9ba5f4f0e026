"""The Hugging Face config of a mugpt model exported by export.py (copied next to its weights).

The multipliers of muP and CompleteP are carried here, not folded into the weights: folding
alpha_in into the embedding would untie it from the readout. Names follow transformers' own
(hidden_size, num_hidden_layers, ...) so that its caches and lm-eval read them."""
from transformers import PretrainedConfig


class MuGPTConfig(PretrainedConfig):
    model_type = "mugpt"

    def __init__(self, vocab_size=50257, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=None, intermediate_size=3072,
                 max_position_embeddings=1024, rope_base=10000.0, norm_gain=False,
                 tie_embeddings=False, attn_scale=0.125, branch_mult=1.0, alpha_in=1.0,
                 readout_mult=1.0, attention="mha", position="rope", connections="residual",
                 **kwargs):
        self.vocab_size = vocab_size  # the tokenizer's: the model's padding rows are not exported
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings  # the block_size it was trained on
        self.rope_base = rope_base
        self.norm_gain = norm_gain  # learned RMSNorm gains (model.py's cfg.norm_gain)
        self.tie_embeddings = tie_embeddings  # one matrix for the embedding and the readout
        self.attn_scale = attn_scale  # the attention logit multiplier (cfg.attn_scale)
        self.branch_mult = branch_mult  # CompleteP's residual branch scale (1 / depth_mult)
        self.alpha_in = alpha_in  # the embedding output multiplier
        self.readout_mult = readout_mult  # alpha_out / width_mult
        # the variants of docs/variants.md, model.py's Config fields of the same names
        self.attention = attention  # "mha" or "sharedkv" (the keys are the values)
        self.position = position  # "rope" or "alibi" (then rope_base is not used)
        self.connections = connections  # "residual" or "mudd" (dynamic dense connections)
        # transformers' own tying is not used: the tied model simply has no separate readout
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
