"""A mugpt model in PyTorch, for transformers (copied by export.py next to the weights): the math
of model.py line by line, so the logits equal the JAX model's, with every variant of
docs/variants.md (grouped-query and SharedKV attention, ALiBi, MUDD connections) in any
combination. Shapes: B batch, T new positions, S key positions (cache and new), D width, H heads,
G key/value heads, K head dim, F mlp width, V vocab; MUDD: C streams, J states.

Loaded by `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`; `generate` keeps
transformers' DynamicCache of the keys after QK-norm and RoPE, and the values. SharedKV caches its
rotated keys as well as its values: twice the memory of model.py's cache (which keeps the values
alone and recomputes the keys each step), the price of using transformers' cache unchanged.
RoPE's positions are position_ids where passed (generate's count them from the attention mask
over the cache's window: left padding shifts them), else they follow the cache. ALiBi's distances
are those of cache indices, which equal the positions' differences between unpadded tokens
(padding is on the left only). Past max_position_embeddings (the block_size it was trained on)
generate slides its window as sample.py does (prepare_inputs_for_generation), with use_cache=True
(its default) only: without the cache it refuses to go past it.
"""
import math

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
    """model.rms_norm: in float32, eps 1e-6 inside the root, gains only with norm_gain; returned
    in x's dtype (bfloat16 and float16 exports run their matmuls in it)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (y if gain is None else y * gain).to(x.dtype)


def layer_norm(x, gain):
    """model.layer_norm: QK-LayerNorm (Dehghani et al. 2023) over the head dim, no bias."""
    x = x.float() - x.float().mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain


def rope(x_BHTK, pos_BT, base):
    """model.rope: rotate-half RoPE (Su et al. 2021), dims i and i + K/2 a pair, angle
    pos * base^(-2i/K)."""
    K2 = x_BHTK.shape[-1] // 2
    inv_freq = base ** (-torch.arange(K2, dtype=torch.float32, device=x_BHTK.device) / K2)
    angle_BTK2 = pos_BT.float()[..., None] * inv_freq
    cos, sin = angle_BTK2.cos()[:, None], angle_BTK2.sin()[:, None]  # broadcast over H
    x1, x2 = x_BHTK[..., :K2], x_BHTK[..., K2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def alibi_slopes(H):
    """ALiBi's (Press et al. 2022, arXiv 2108.12409) slopes: 2^(-8/H), 2^(-16/H), ... for H a
    power of two; else those of the power of two below H, then every other one of twice that
    power (the paper's code), as layers.positions.alibi_bias."""
    powers = lambda n: [2 ** (-8 * (i + 1) / n) for i in range(n)]  # noqa: E731
    below = 2 ** math.floor(math.log2(H))
    return torch.tensor(powers(below) + powers(2 * below)[0::2][:H - below])


class Attention(nn.Module):
    def __init__(self, cfg: MuGPTConfig, layer: int):
        super().__init__()
        D, H, G = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.H, self.G, self.K, self.layer = H, G, D // H, layer
        self.shared_kv = cfg.attention == "sharedkv"
        # queries' H heads, then G key heads (none with SharedKV: its keys are the values), then
        # G value heads (model.py's qkv, flattened)
        self.heads = [H, G] if self.shared_kv else [H, G, G]
        self.qkv = nn.Linear(D, sum(self.heads) * self.K, bias=False)
        self.out = nn.Linear(H * self.K, D, bias=False)
        self.q_norm = nn.Parameter(torch.ones(self.K))
        self.k_norm = nn.Parameter(torch.ones(self.K))
        self.scale = cfg.attn_scale
        self.rope_base = cfg.rope_base if cfg.position == "rope" else None  # None: ALiBi

    def project(self, xs_BTD):
        """model.Attention.project: [q, k, v] (B, heads, T, K) (SharedKV: [q, v, v]) from one
        input, or from MUDD's one input per projection (queries', keys', values' streams)."""
        B, T, _ = xs_BTD[0].shape
        heads_BNTK = lambda y, n: y.view(B, T, n, self.K).transpose(1, 2)  # noqa: E731
        if len(xs_BTD) == 1:  # one matmul for all heads
            parts = heads_BNTK(self.qkv(xs_BTD[0]), sum(self.heads)).split(self.heads, dim=1)
        else:  # each stream through its own heads' rows of the projection
            rows = self.qkv.weight.split([n * self.K for n in self.heads])
            parts = [heads_BNTK(x @ w.T, n) for x, w, n in zip(xs_BTD, rows, self.heads)]
        return [parts[0], parts[1], parts[1]] if self.shared_kv else list(parts)

    def forward(self, xs_BTD, pos_BT, index_T, mask_BTS, cache):
        B, T, _ = xs_BTD[0].shape
        q, k, v = self.project(xs_BTD)  # (B, heads, T, K)
        # SharedKV's keys are its values QK-LayerNormed and rotated; the values stay unnormalized
        q, k = layer_norm(q, self.q_norm), layer_norm(k, self.k_norm)
        if self.rope_base is not None:
            q, k = rope(q, pos_BT, self.rope_base), rope(k, pos_BT, self.rope_base)
        q, k = q.to(v.dtype), k.to(v.dtype)  # model.qk_norm_rope: float32 inside, out as the input
        if cache is not None:
            k, v = cache.update(k, v, self.layer)  # (B, G, S, K): the past and these
        # grouped-query attention (Ainslie et al. 2023): query head h reads head h // (H / G)
        k = k.repeat_interleave(self.H // self.G, dim=1)
        v = v.repeat_interleave(self.H // self.G, dim=1)
        # model.attend: the logits in float32 (its einsum's preferred_element_type)
        logits_BHTS = self.scale * (q.float() @ k.float().transpose(-1, -2))
        if self.rope_base is None:  # ALiBi: -m_h (i - j), after the logit scale as model.py
            index_S = torch.arange(k.shape[2], device=k.device)
            slopes_H = alibi_slopes(self.H).to(k.device)
            bias_HTS = -slopes_H[:, None, None] * (index_T[:, None] - index_S[None, :])
            logits_BHTS = logits_BHTS + bias_HTS
        logits_BHTS = logits_BHTS.masked_fill(~mask_BTS[:, None], torch.finfo(torch.float32).min)
        o_BHTK = logits_BHTS.softmax(-1).to(v.dtype) @ v
        return self.out(o_BHTK.transpose(1, 2).reshape(B, T, self.H * self.K))


class Block(nn.Module):
    def __init__(self, cfg: MuGPTConfig, layer: int):
        super().__init__()
        D, Fw = cfg.hidden_size, cfg.intermediate_size
        gain = (lambda: nn.Parameter(torch.ones(D))) if cfg.norm_gain else (lambda: None)
        self.attn_norm, self.mlp_norm = gain(), gain()
        self.attn = Attention(cfg, layer)
        self.up, self.down = nn.Linear(D, Fw, bias=False), nn.Linear(Fw, D, bias=False)
        # CompleteP: residual branches scaled by depth_base / L (Dey et al. 2025)
        self.branch_mult = cfg.branch_mult

    def forward(self, xs_BTD, pos_BT, index_T, mask_BTS, cache):
        """xs_BTD: the residual stream (x,), or MUDD's streams for the queries, (keys,) values
        and the residual; the attention inputs share one RMSNorm gain. Returns the new residual."""
        *streams, x_BTD = xs_BTD
        normed = [rms_norm(s, self.attn_norm) for s in streams or [x_BTD]]
        x_BTD = x_BTD + self.branch_mult * self.attn(normed, pos_BT, index_T, mask_BTS, cache)
        m = self.down(F.gelu(self.up(rms_norm(x_BTD, self.mlp_norm)), approximate="tanh"))
        return x_BTD + self.branch_mult * m


class Connections(nn.Module):
    """layers.mudd.Connections: MUDD's dynamic dense connections after block i (Xiao et al. 2025,
    arXiv 2502.12170): per token, A (C, J) = GELU(RMSNorm(X_i+1) W1) W2 + b + one-hot(J - 1)
    weighs the J = i + 2 states so far (embedding, each block's output) into C streams."""

    def __init__(self, cfg: MuGPTConfig, layer: int):
        super().__init__()
        last = layer == cfg.num_hidden_layers - 1
        self.C, self.J = 1 if last else (3 if cfg.attention == "sharedkv" else 4), layer + 2
        self.w1 = nn.Linear(cfg.hidden_size, self.C * self.J, bias=False)
        self.w2 = nn.Linear(self.C * self.J, self.C * self.J, bias=False)
        self.b = nn.Parameter(torch.zeros(self.C, self.J))  # stored minus the one-hot

    def forward(self, states):
        B, T, _ = states[-1].shape
        h = F.gelu(self.w1(rms_norm(states[-1])), approximate="tanh")
        # layers.mudd's: b and the one-hot added in float32, then back to the streams' dtype
        a_BTCJ = self.w2(h).view(B, T, self.C, self.J).float() + self.b.float()
        one_hot = F.one_hot(torch.tensor(self.J - 1, device=a_BTCJ.device), self.J)
        a_BTCJ = (a_BTCJ + one_hot).to(h.dtype)
        return [sum(a_BTCJ[..., c, j, None] * x for j, x in enumerate(states))
                for c in range(self.C)]


class MuGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MuGPTConfig
    base_model_prefix = "mugpt"
    _no_split_modules = ["Block"]

    def __init__(self, cfg: MuGPTConfig):
        super().__init__(cfg)
        V, D, L = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(L))
        self.mudd = None
        if cfg.connections == "mudd":
            self.mudd = nn.ModuleList(Connections(cfg, i) for i in range(L))
        self.final_norm = nn.Parameter(torch.ones(D)) if cfg.norm_gain else None
        # tied: the readout is the embedding matrix itself
        self.unembed = None if cfg.tie_embeddings else nn.Parameter(torch.zeros(V, D))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """generate's inputs, windowed as sample.py's (inference/decode.py): the model was trained
        on S = max_position_embeddings positions, so a longer prompt keeps its last S tokens, and
        when the cache is full it is emptied and the last S // 2 tokens run again from position 0
        with the new one: every new token sees S // 2 to S tokens, never a position it was not
        trained on. RoPE's positions are counted from the attention mask over the cache's window."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        cache = inputs.get("cache", inputs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        S, T = self.config.max_position_embeddings, inputs["input_ids"].shape[1]
        if inputs.get("use_cache") is False and T > S:
            # Without a cache generate passes the whole sequence at each step and not where its
            # prompt ended, which sets where sample.py's window slides (a prompt longer than S is
            # cut to its last S tokens, and the slides count from there): refused, not guessed
            raise ValueError(f"generate with use_cache=False past max_position_embeddings ({S} "
                             f"tokens, here {T}): only the cache slides the window as sample.py "
                             "does; pass use_cache=True")
        if past + T > S:  # the window slides
            n = min(S, S // 2 + T) if past else S
            if past:  # a negative crop: that many tokens removed (transformers 4.x and 5.x)
                cache.crop(-past)
            past, T, inputs["input_ids"] = 0, n, input_ids[:, -n:].contiguous()
        mask = inputs.get("attention_mask")
        inputs.pop("position_ids", None)  # generate's count from the first token, past any slide
        if mask is not None and mask.ndim == 2:
            window = mask[:, -(past + T):].long()
            inputs["position_ids"] = (window.cumsum(-1) - 1).masked_fill(window == 0, 0)[:, -T:]
        return inputs

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
        # model.GPT.hidden: with MUDD each block reads the streams its Connections made of every
        # earlier state; block 0 reads the embedding alone
        states, xs_BTD = [x_BTD], [x_BTD]
        for i, block in enumerate(self.blocks):
            x_BTD = block(xs_BTD, pos_BT, index_T, mask_BTS, cache)
            if self.mudd is None:
                xs_BTD = [x_BTD]
            else:
                states.append(x_BTD)
                xs_BTD = self.mudd[i](states)
        unembed = self.embed.weight if self.unembed is None else self.unembed
        # model.GPT.logits: the readout's matmul in the weights' dtype, the multiplier in float32
        h_BTD = rms_norm(xs_BTD[0], self.final_norm)
        logits = self.config.readout_mult * (h_BTD @ unembed.T).float()
        loss = None
        if labels is not None:  # next-token cross-entropy, as train.loss_fn
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE: cache})
