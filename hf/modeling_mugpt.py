"""A mugpt model in PyTorch, for transformers (copied by export.py next to the weights): the math
of model.py line by line, so the logits equal the JAX model's. Shapes: B batch, T new positions,
S key positions (cache and new), D width, H heads, K head dim, F mlp width, V vocab.

Loaded by `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`; `generate` keeps
transformers' DynamicCache. RoPE's positions are position_ids where generate passes them
(from the attention mask: left padding shifts them), else they follow the cache.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mugpt import MuGPTConfig

# the output's cache field: "cache" from transformers 5.x, "past_key_values" before
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def rms_norm(x, gain=None):
    """model.rms_norm: float32, eps 1e-6 inside the root; gains only with norm_gain."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return y if gain is None else y * gain


def layer_norm(x, gain):
    """model.layer_norm: QK-LayerNorm over the head dim, no bias, eps 1e-6."""
    x = x.float() - x.float().mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain


def rope(x_BHTK, pos_BT, base):
    """model.rope: rotate-half RoPE, dims i and i + K/2 a pair, angle pos * base^(-2i/K)."""
    K2 = x_BHTK.shape[-1] // 2
    inv_freq = base ** (-torch.arange(K2, dtype=torch.float32, device=x_BHTK.device) / K2)
    angle_BTK2 = pos_BT.float()[..., None] * inv_freq
    cos, sin = angle_BTK2.cos()[:, None], angle_BTK2.sin()[:, None]  # broadcast over H
    x1, x2 = x_BHTK[..., :K2], x_BHTK[..., K2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: MuGPTConfig, layer: int):
        super().__init__()
        D, H, G = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.H, self.G, self.K, self.layer = H, G, D // H, layer
        # queries' H heads, then G key heads, then G value heads (model.py's qkv, flattened)
        self.qkv = nn.Linear(D, (H + 2 * G) * self.K, bias=False)
        self.out = nn.Linear(H * self.K, D, bias=False)
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(self.K)), nn.Parameter(torch.ones(self.K))
        self.scale, self.rope_base = cfg.attn_scale, cfg.rope_base

    def forward(self, x_BTD, pos_BT, mask_BTS, cache):
        B, T, _ = x_BTD.shape
        qkv = self.qkv(x_BTD).view(B, T, self.H + 2 * self.G, self.K).transpose(1, 2)
        q, k, v = qkv.split([self.H, self.G, self.G], dim=1)  # (B, heads, T, K)
        q = rope(layer_norm(q, self.q_norm), pos_BT, self.rope_base)
        k = rope(layer_norm(k, self.k_norm), pos_BT, self.rope_base)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)  # (B, G, S, K): the past and these
        k = k.repeat_interleave(self.H // self.G, dim=1)
        v = v.repeat_interleave(self.H // self.G, dim=1)
        logits_BHTS = self.scale * q @ k.transpose(-1, -2)
        logits_BHTS = logits_BHTS.masked_fill(~mask_BTS[:, None], torch.finfo(torch.float32).min)
        o_BHTK = logits_BHTS.softmax(-1) @ v
        return self.out(o_BHTK.transpose(1, 2).reshape(B, T, self.H * self.K))


class Block(nn.Module):
    def __init__(self, cfg: MuGPTConfig, layer: int):
        super().__init__()
        D, Fw = cfg.hidden_size, cfg.intermediate_size
        gain = (lambda: nn.Parameter(torch.ones(D))) if cfg.norm_gain else (lambda: None)
        self.attn_norm, self.mlp_norm = gain(), gain()
        self.attn = Attention(cfg, layer)
        self.up, self.down = nn.Linear(D, Fw, bias=False), nn.Linear(Fw, D, bias=False)
        self.branch_mult = cfg.branch_mult

    def forward(self, x_BTD, pos_BT, mask_BTS, cache):
        a = self.attn(rms_norm(x_BTD, self.attn_norm), pos_BT, mask_BTS, cache)
        x_BTD = x_BTD + self.branch_mult * a
        m = self.down(F.gelu(self.up(rms_norm(x_BTD, self.mlp_norm)), approximate="tanh"))
        return x_BTD + self.branch_mult * m


class MuGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MuGPTConfig
    base_model_prefix = "mugpt"
    _no_split_modules = ["Block"]

    def __init__(self, cfg: MuGPTConfig):
        super().__init__(cfg)
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.Parameter(torch.ones(D)) if cfg.norm_gain else None
        # tied: the readout is the embedding matrix itself
        self.unembed = None if cfg.tie_embeddings else nn.Parameter(torch.zeros(V, D))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                past_key_values=None, use_cache=None, labels=None, **kwargs):
        """cache (transformers >= 5) or past_key_values (older): the DynamicCache of the keys and
        values so far; position_ids: RoPE's positions (default: those after the cache's)."""
        B, T = input_ids.shape
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        index_T = torch.arange(past, past + T, device=input_ids.device)
        pos_BT = index_T[None].expand(B, T) if position_ids is None else position_ids
        # causal by index in the cache; padded keys (attention_mask 0) are never attended to
        mask_BTS = (torch.arange(past + T, device=input_ids.device) <= index_T[:, None])[None]
        if attention_mask is not None:
            mask_BTS = mask_BTS & attention_mask[:, None, -(past + T):].bool()
        x_BTD = self.config.alpha_in * self.embed(input_ids)
        for block in self.blocks:
            x_BTD = block(x_BTD, pos_BT, mask_BTS, cache)
        unembed = self.embed.weight if self.unembed is None else self.unembed
        logits = self.config.readout_mult * (rms_norm(x_BTD, self.final_norm) @ unembed.T)
        loss = None
        if labels is not None:  # next-token cross-entropy, as train.loss_fn
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits.float(), **{CACHE: cache})
