"""The baseline that bench.py --torch times: the same model (RMSNorm, QK-LayerNorm, RoPE, GELU
MLP, untied readout) and optimizer (AdamW, clipping), written plainly in eager PyTorch, float32, on
the CPU, as a researcher would without JAX."""
import torch
import torch.nn.functional as F
from torch import nn

from configs import Config
from run.errors import UsageError


# the config fields of a variant this baseline does not implement and that leaves the parameter
# count as it is (those that change it, as SharedKV and MUDD do, are refused by the count)
PLAIN = {"position": "rope", "dropout": 0.0}


def torch_step(cfg: Config, model=None):
    """A function that runs one train step on random tokens, already warmed up. model: the JAX
    model bench.py times; one whose parameters are not these (model.py edited: a SwiGLU gate, say)
    or whose config is another variant is refused, since the two would not be the same model."""
    for field, plain in PLAIN.items():
        if getattr(cfg, field) != plain:
            raise UsageError(f"--torch times tools/bench_torch.py's fixed GPT, which has "
                             f"{field}={plain}, not {getattr(cfg, field)}: drop --torch")
    B, T, D, H, K = cfg.batch_size, cfg.block_size, cfg.d_model, cfg.n_head, cfg.head_dim
    V = cfg.model_vocab
    freq = cfg.rope_base ** (-torch.arange(K // 2) / (K // 2))
    angle = torch.arange(T)[:, None] * freq
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rope(x):
        x1, x2 = x[..., :K // 2], x[..., K // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
            self.q_norm, self.k_norm = nn.LayerNorm(K, bias=False), nn.LayerNorm(K, bias=False)
            self.up = nn.Linear(D, cfg.mlp_width, bias=False)
            self.down = nn.Linear(cfg.mlp_width, D, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(F.rms_norm(x, (D,))).view(B, T, 3, H, K).unbind(2)
            q, k = rope(self.q_norm(q)).transpose(1, 2), rope(self.k_norm(k)).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
            x = x + self.out(o.transpose(1, 2).reshape(B, T, D))
            return x + self.down(F.gelu(self.up(F.rms_norm(x, (D,))), approximate="tanh"))

    embed = nn.Embedding(V, D)
    blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
    unembed = nn.Linear(D, V, bias=False)
    params = [*embed.parameters(), *blocks.parameters(), *unembed.parameters()]
    if model is not None:
        import equinox as eqx
        import jax

        ours = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        theirs = sum(p.numel() for p in params)
        if ours != theirs:
            raise UsageError(f"--torch times tools/bench_torch.py's fixed GPT ({theirs:,} "
                             f"parameters), not this model ({ours:,}): model.py was edited; "
                             "drop --torch or make the same edit there")
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=0.1)
    x, y = torch.randint(0, cfg.vocab_size, (B, T)), torch.randint(0, cfg.vocab_size, (B, T))

    def step():
        h = embed(x)
        for block in blocks:
            h = block(h)
        loss = F.cross_entropy(unembed(F.rms_norm(h, (D,))).view(-1, V), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()

    for _ in range(3):
        step()
    return step
