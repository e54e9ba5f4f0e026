"""The one config dataclass. Defaults describe GPT-2 small on openwebtext; each module in configs/
overrides only what differs (`config = replace(base, n_layer=48, ...)`) and launch.py overrides
single fields from the command line (`--config.learning_rate=3e-4`)."""
import dataclasses
import difflib
import importlib
import math
import pkgutil
import typing
from typing import Literal

from run.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Config:
    # data: <data_root>/<dataset>/{train,val}.bin and meta.json, written by
    # `python data.py <dataset>`
    dataset: str = "openwebtext"
    data_root: str = "data"  # relative paths are relative to the repo
    vocab_size: int = 50257  # the tokenizer's; the model pads it to a multiple of vocab_multiple
    vocab_multiple: int = 128  # padded vocab -> matmul shapes the tensor cores like (GPT-2: 50304)

    # model
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    mlp_ratio: float = 4.0  # F = round(mlp_ratio * D): 4 for GELU, 8/3 keeps a gated MLP's size
    block_size: int = 1024
    tie_embeddings: bool = False
    # learned RMSNorm gains; off by default: they break muP transfer (Lingle 2024)
    norm_gain: bool = False
    rope_base: float = 10000.0
    # The seeds' variants (docs/variants.md). "sharedkv": no key projection, the keys are the
    # values QK-normed and rotated (clankur/mugpt, sharedkv.md): half the KV cache.
    attention: Literal["mha", "sharedkv"] = "mha"
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    # "alibi": no RoPE; logits biased by -m_h (i - j) (Press et al. 2022), for longer contexts
    position: Literal["rope", "alibi"] = "rope"
    # "mudd": each block reads every earlier state through MUDD's dynamic dense connections
    # (Xiao et al. 2025, Caiyun-AI/MUDDFormer) instead of the residual stream alone
    connections: Literal["residual", "mudd"] = "residual"
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"  # parameters always stay float32
    remat: Literal["none", "full", "save_dots"] = "none"  # what the backward pass recomputes
    scan_unroll: int = 1  # layers per scan iteration; >1 trades compile time for speed
    # dropout on the embedding's and each residual branch's output in training (model.dropout),
    # keyed by (seed, step, sequence); evaluation, sampling and export run without
    dropout: float = 0.0
    # groups of sequences the readout and loss take one at a time (train.loss_fn): >1 keeps the
    # float32 (B, T, V) logits from existing whole, for one more readout matmul forward
    loss_chunks: int = 1
    # fast paths on a GPU (cuDNN attention, fused/'s QK-norm + RoPE and fused cross-entropy, a
    # recomputing GELU where the layers are unrolled) or a TPU (splash attention): each is checked against model.py's own function when a run
    # starts and set aside, with a printed line, if they differ.
    # false: model.py's functions alone, everywhere
    kernels: bool = True

    # parametrization: "mup" is the Maximal Update Parametrization (Tensor Programs V, Yang et al.
    # 2022, arXiv 2203.03466) with CompleteP's depth rules (Dey et al. 2025, arXiv 2505.01618):
    # LRs tuned at d_model = d_base and n_layer = depth_base transfer to other widths and depths;
    # there muP equals SP. The rules are rows of params.policy_rows and static fields set in
    # model.GPT.
    param: Literal["sp", "mup"] = "sp"
    d_base: int = 768  # the width at which muP equals SP (width_mult = d_model / d_base)
    # the depth at which CompleteP's residual branch scale depth_base / n_layer is 1
    depth_base: int = 12
    alpha_in: float = 1.0  # embedding output multiplier (tunable at the base shape, transfers)
    alpha_out: float = 1.0  # readout multiplier; muP divides it by width_mult
    # muP's attention logits are attn_tau / head_dim (TP5: q and k become correlated in training);
    # 8 = sqrt(64) equals SP's 1 / sqrt(head_dim) for 64-dim heads. head_dim stays fixed as width
    # grows.
    attn_tau: float = 8.0

    # optimisation: by default AdamW, linear warmup then cosine decay to min_lr at max_steps
    batch_size: int = 512  # sequences per step, global (over all devices and microbatches)
    grad_accum: int = 1  # microbatches per step, accumulated in one jitted lax.scan
    max_steps: int = 20000
    learning_rate: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 700
    # Independent weight decay: every step p -= weight_decay * (lr_t / learning_rate) * p, for
    # matrices only, whatever each parameter's LR multiplier. AdamW's lr * wd: 6e-4 * 0.1 = 6e-5.
    weight_decay: float = 6e-5
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global gradient norm; 0: no clipping (nanoGPT's convention)
    # The optimizer and schedule (optimizers.py, docs/optimizers.md). "adamw" above; "lion" (Chen
    # et al. 2023) for every parameter; "muon" (Jordan 2024) for the hidden matrices, AdamW for
    # the rest. Each's muP LR rules are the policy table's (params.policy_rows).
    optimizer: Literal["adamw", "lion", "muon"] = "adamw"
    lion_beta1: float = 0.9  # Lion's interpolation of momentum and gradient (Chen et al.'s)
    lion_beta2: float = 0.99  # Lion's momentum decay (Chen et al.'s)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum (Jordan's)
    muon_ns_steps: int = 5  # Newton-Schulz iterations (Jordan's)
    # Muon's update RMS: 0.2 matches AdamW's, so learning_rate and weight_decay carry over
    # (Liu et al. 2025, arXiv 2502.16982)
    muon_rms: float = 0.2
    # "cosine" above; "wsd": warmup, learning_rate, then a decay to min_lr over the last
    # decay_fraction of max_steps, "linear" or "1-sqrt" (decay_shape): while in its stable phase
    # a run may be extended by raising max_steps; "constant": learning_rate after warmup
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2
    decay_shape: Literal["linear", "1-sqrt"] = "linear"

    # evaluation and logging
    eval_interval: int = 500  # steps between evaluations (and the last step)
    eval_batches: int = 20  # fixed microbatches of train and of val data per evaluation
    log_interval: int = 10  # steps between host syncs for the progress bar and tensorboard
    # downstream tasks (eval.py: names or .jsonl files, comma-separated) scored at the evaluations
    # whose step is a multiple of eval_tasks_interval (a multiple of eval_interval), and the last
    eval_tasks: str = ""
    eval_tasks_interval: int = 1000
    wandb_project: str = ""  # also log to this Weights & Biases project (tensorboard always)
    seed: int = 0

    # mesh ("replica", "fsdp"): parameters are sharded over fsdp, the batch over both axes;
    # replicas run across hosts (or TPU slices) first, fsdp within them (train.make_mesh)
    mesh_replica: int = 1  # devices on the replica axis; the rest go to fsdp

    # checkpoints in RUNDIR/checkpoints (orbax); launching again with the same --rundir resumes
    # steps between checkpoints; one is also written at the end and on SIGTERM/SIGINT
    ckpt_interval: int = 1000
    ckpt_keep: int = 3  # the latest checkpoints kept on disk; older ones are deleted
    # A step with a non-finite loss, gradient or update is skipped (the state stays as it was);
    # this many in a row stop the run: the model has diverged and skipping will not bring it back.
    max_nonfinite: int = 10

    def __post_init__(self):
        """Each field's type, as a config module may set any value: param="muP" or
        tie_embeddings="false" would otherwise train another model than config.json says, and
        "fp16" fail deep inside JAX."""
        for name, kind in typing.get_type_hints(Config).items():
            value, allowed = getattr(self, name), typing.get_args(kind)
            if typing.get_origin(kind) is Literal and value not in allowed:
                names = ", ".join(map(repr, allowed))
                raise UsageError(f"{name}={value!r}: allowed values are {names}")
            # float is checked loosely, as what converts to one: mup.py passes tracers (a list
            # of numbers in config.json was a TypeError deep in check)
            wrong = {bool: not isinstance(value, bool), str: not isinstance(value, str),
                     int: isinstance(value, bool) or not hasattr(value, "__index__"),
                     float: isinstance(value, bool) or not hasattr(value, "__float__")}
            # a field of another type (a user's float | None, say) is the user's to check
            if wrong.get(kind, False):
                needs = {bool: "true or false", str: "a string", int: "an integer"}
                raise UsageError(f"{name}={value!r} must be {needs.get(kind, 'a number')}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_width(self) -> int:
        return round(self.mlp_ratio * self.d_model)

    @property
    def model_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    @property
    def decay_start(self) -> int:
        """The step where WSD's decay starts: the last decay_fraction of max_steps decays."""
        return self.max_steps - round(self.decay_fraction * self.max_steps)

    @property
    def width_mult(self) -> float:
        """m = d_model / d_base under muP, 1 under SP: hidden-matrix LRs are lr / m, the readout
        alpha_out / m."""
        return self.d_model / self.d_base if self.param == "mup" else 1.0

    @property
    def depth_mult(self) -> float:
        """n_layer / depth_base under muP (CompleteP), 1 under SP: residual branches are scaled by
        its inverse."""
        return self.n_layer / self.depth_base if self.param == "mup" else 1.0

    @property
    def attn_scale(self) -> float:
        """The attention logit multiplier: attn_tau / head_dim under muP, 1 / sqrt(head_dim)
        under SP."""
        if self.param == "mup":
            return self.attn_tau / self.head_dim
        return 1 / math.sqrt(self.head_dim)

    def mesh_shape(self, n_devices: int) -> dict[str, int]:
        """The sizes of train.make_mesh's axes on n_devices: mesh_replica, and fsdp the rest."""
        return {"replica": self.mesh_replica, "fsdp": max(n_devices // self.mesh_replica, 1)}

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.grad_accum

    def check(self, n_devices: int) -> None:
        """Raise UsageError for a config that cannot run on n_devices, naming the field."""
        positive = ("n_layer", "n_head", "d_model", "block_size", "batch_size", "grad_accum",
                    "max_steps", "eval_interval", "eval_batches", "log_interval", "vocab_size",
                    "vocab_multiple", "scan_unroll", "ckpt_interval", "ckpt_keep", "max_nonfinite",
                    "d_base", "depth_base", "loss_chunks", "mesh_replica", "eval_tasks_interval",
                    "muon_ns_steps")
        for name in positive:  # first: the checks below divide by some of them
            if getattr(self, name) < 1:
                raise UsageError(f"{name}={getattr(self, name)} must be at least 1")
        fsdp = self.mesh_shape(n_devices)["fsdp"]  # mesh_replica > n_devices is reported below
        finite = ("rope_base", "alpha_in", "alpha_out", "attn_tau", "mlp_ratio")
        # the largest decay_fraction (to 3 decimals) whose decay starts after warmup
        most_decay = (self.max_steps - self.warmup_steps) * 1000 // self.max_steps / 1e3
        problems = [
            (self.d_model % self.n_head,
             f"d_model={self.d_model} is not divisible by n_head={self.n_head}"),
            (not (self.n_kv_head is None or isinstance(self.n_kv_head, int)
                  and 1 <= self.n_kv_head and self.n_head % self.n_kv_head == 0),
             f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} "
             f"(or be none: as many as n_head)"),
            (self.head_dim % 2,
             f"head_dim={self.head_dim} (d_model/n_head) is odd; "
             f"RoPE rotates pairs, so pick an even one"),
            (n_devices % self.mesh_replica,
             f"mesh_replica={self.mesh_replica} does not divide the {n_devices} devices "
             f"(on a CPU, JAX_NUM_CPU_DEVICES=N splits it into N devices)"),
            (self.batch_size % (n_devices * self.grad_accum),
             f"batch_size={self.batch_size} is not divisible by devices x grad_accum = "
             f"{n_devices} x {self.grad_accum}"),
            (self.d_model % fsdp,
             f"d_model={self.d_model} is not divisible by the fsdp axis size {fsdp}; "
             f"set mesh_replica"),
            # each replica takes its loss over its own share of the microbatch (shard_map)
            ((self.microbatch_size // self.mesh_replica) % self.loss_chunks,
             f"loss_chunks={self.loss_chunks} does not divide the "
             f"{self.microbatch_size // self.mesh_replica} sequences of a microbatch on each "
             f"replica ({self.microbatch_size} / mesh_replica={self.mesh_replica})"),
            # the train step skips non-finite losses and gradients only: an update must be finite
            # when they are
            (not (0 < self.learning_rate < 3e38 and 0 <= self.min_lr < 3e38),
             f"learning_rate={self.learning_rate} and min_lr={self.min_lr} must be finite in "
             f"float32, learning_rate > 0"),
            (not 0 <= self.weight_decay < 3e38,
             f"weight_decay={self.weight_decay} must be finite and >= 0"),
            (not 0 < self.adam_eps < 3e38,
             f"adam_eps={self.adam_eps} must be > 0 and finite in float32: Adam divides by "
             f"sqrt(v) + eps"),
            (not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1),
             f"beta1={self.beta1} and beta2={self.beta2} must be in [0, 1)"),
            (not (0 <= self.lion_beta1 < 1 and 0 <= self.lion_beta2 < 1
                  and 0 <= self.muon_momentum < 1),
             f"lion_beta1={self.lion_beta1}, lion_beta2={self.lion_beta2} and muon_momentum="
             f"{self.muon_momentum} must be in [0, 1)"),
            (not 0 < self.muon_rms < math.inf, f"muon_rms={self.muon_rms} must be > 0 and finite"),
            (not 0 <= self.decay_fraction <= 1,
             f"decay_fraction={self.decay_fraction} must be in [0, 1]"),
            (self.min_lr > self.learning_rate,
             f"min_lr={self.min_lr} is above learning_rate={self.learning_rate}: "
             f"the cosine decays to it"),
            # above max_steps is allowed: a smoke run
            (self.warmup_steps < 0, f"warmup_steps={self.warmup_steps} must be >= 0"),
            # the LR would fall at warmup's end from learning_rate to the decay's LR of that step
            (self.schedule == "wsd" and self.decay_start < self.warmup_steps <= self.max_steps,
             f"decay_fraction={self.decay_fraction} starts the WSD decay at step "
             f"{self.decay_start}, before warmup_steps={self.warmup_steps} ends: use a "
             f"decay_fraction <= {most_decay}"),
            (not 0 <= self.grad_clip < 3e38,
             f"grad_clip={self.grad_clip} must be finite and >= 0 (0: no clipping)"),
            # finite as a Python float: 1e39 (inf in float32) is how a test makes every loss
            # non-finite
            *((not 0 < getattr(self, f) < math.inf,
               f"{f}={getattr(self, f)} must be > 0 and finite") for f in finite),
            (0 < self.mlp_ratio < math.inf and self.mlp_width < 1,
             f"mlp_ratio={self.mlp_ratio} x d_model={self.d_model} rounds to an MLP width of 0"),
            (not 0 <= self.dropout < 1, f"dropout={self.dropout} must be in [0, 1)"),
            (not 0 <= self.seed < 2**31, f"seed={self.seed} must be in [0, 2**31)"),
            # the step is an int32 in the schedule's jitted math
            *((getattr(self, f) >= 2**31, f"{f}={getattr(self, f)} must be below 2**31")
              for f in ("max_steps", "warmup_steps")),
            # padding past that buys the matmuls nothing and costs a vocabulary's rows of memory
            (self.vocab_multiple > 4096,
             f"vocab_multiple={self.vocab_multiple} must be at most 4096 (the padded vocabulary "
             f"is a multiple of it: GPT-2's 128 makes 50304)"),
            (self.eval_tasks and self.eval_tasks_interval % self.eval_interval,
             f"eval_tasks_interval={self.eval_tasks_interval} is not a multiple of "
             f"eval_interval={self.eval_interval}: tasks are scored at evaluations"),
            (not self.dataset,
             f"dataset is empty: name a folder of {self.data_root}/ "
             f"(`python data.py NAME` makes one)"),
        ]
        for bad, message in problems:
            if bad:
                raise UsageError(message)
        default = Config()
        for name, (choice, users) in ONLY_FOR.items():  # else silently unused
            if getattr(self, choice) not in users and getattr(self, name) != getattr(default, name):
                raise UsageError(f"{name}={getattr(self, name)!r} does not apply to {choice}="
                                 f"{getattr(self, choice)!r} (only to {' or '.join(users)}): "
                                 f"leave it at {getattr(default, name)!r}")


# The fields that only some optimizers, schedules or positions read: field -> (what chooses, the
# users)
ONLY_FOR = {"beta1": ("optimizer", ("adamw", "muon")), "beta2": ("optimizer", ("adamw", "muon")),
            "adam_eps": ("optimizer", ("adamw", "muon")), "lion_beta1": ("optimizer", ("lion",)),
            "lion_beta2": ("optimizer", ("lion",)), "muon_momentum": ("optimizer", ("muon",)),
            "muon_ns_steps": ("optimizer", ("muon",)), "muon_rms": ("optimizer", ("muon",)),
            "decay_fraction": ("schedule", ("wsd",)), "decay_shape": ("schedule", ("wsd",)),
            "rope_base": ("position", ("rope",))}


# The fields a resumed run may change (launch.py compares every other one with the run's
# config.json): how long it goes on, what it logs and evaluates, how it checkpoints, where the data
# lives and how the same step is laid out and computed (a run resumed on fewer devices may need
# more microbatches to fit; grad_accum also sizes evaluation's batches). Anything else would make
# the checkpoint another run's. A WSD run's max_steps and decay may change only while it is in its
# stable phase (optimizers.check_extension): there the old and new schedules agree on every step
# taken.
RESUMABLE = ("max_steps", "eval_interval", "eval_batches", "eval_tasks", "eval_tasks_interval",
             "wandb_project", "log_interval", "ckpt_interval", "ckpt_keep", "max_nonfinite",
             "mesh_replica", "remat", "scan_unroll", "grad_accum", "loss_chunks", "data_root",
             "kernels", "decay_fraction", "decay_shape")


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__))


def load(name: str) -> Config:
    """The `config` of configs/<name>.py; a module that fails is one line naming the file."""
    if name not in available():
        # a path (configs/x.py) or a near miss: name the spelling that works
        stem = name.removeprefix("./").removeprefix("configs/").removesuffix(".py")
        near = [stem] if stem in available() else difflib.get_close_matches(stem, available(), 3)
        if near:
            hint = f"did you mean {' or '.join(f'--config={n}' for n in near)}?"
        else:
            hint = f"available: {', '.join(available())}"
        raise UsageError(f"unknown config {name!r}; {hint}")
    try:
        config = importlib.import_module(f"configs.{name}").config
    except Exception as e:
        # a syntax error, an unknown field, a bad value: the user's module, not mugpt
        why = e if isinstance(e, UsageError) else f"{type(e).__name__}: {e}"
        raise UsageError(f"configs/{name}.py: {why}") from None
    if not isinstance(config, Config):
        kind = type(config).__name__
        raise UsageError(f"configs/{name}.py: `config` is a {kind}, not a Config: "
                         f"write config = Config(...)")
    return config


def parse_value(name: str, kind, text: str):
    """text as the field's type: int, float, bool, str, or one of a Literal's values."""
    if type(None) in typing.get_args(kind):  # an optional field: "none" unsets it
        if text.lower() == "none":
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        if text not in typing.get_args(kind):
            allowed = ", ".join(typing.get_args(kind))
            raise UsageError(f"--config.{name}={text!r}: allowed values are {allowed}")
        return text
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise UsageError(f"--config.{name}={text!r}: expected true or false")
        return text.lower() in ("true", "1")
    if kind not in (int, float, str):
        raise UsageError(f"--config.{name}: a field of type {kind} is set in a config module, "
                         f"not on the command line")
    try:
        return kind(text)
    except ValueError:
        raise UsageError(f"--config.{name}={text!r}: expected {kind.__name__}") from None


def override_field(arg: str) -> str:
    """The field that "--config.FIELD=VALUE" sets; a malformed argument or an unknown field (a
    near miss named) is a UsageError."""
    if not arg.startswith("--config.") or "=" not in arg:
        raise UsageError(f"unrecognised argument {arg!r} (see --help); "
                         f"overrides look like --config.FIELD=VALUE")
    name = arg[len("--config."):].split("=", 1)[0]
    if name not in Config.__dataclass_fields__:
        near = difflib.get_close_matches(name, Config.__dataclass_fields__, n=3)
        if near:
            hint = f"; did you mean {' or '.join(near)}?"
        else:
            hint = "; the fields are in configs/__init__.py"
        raise UsageError(f"unknown config field {name!r}" + hint)
    return name


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply ["--config.FIELD=VALUE", ...]; an unknown field or a badly typed value is a
    UsageError."""
    types = typing.get_type_hints(Config)
    changes = {}
    for arg in overrides:
        name = override_field(arg)
        changes[name] = parse_value(name, types[name], arg.split("=", 1)[1])
    return dataclasses.replace(cfg, **changes)
