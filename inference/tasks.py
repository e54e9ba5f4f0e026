"""Downstream tasks: read, tokenized and scored. eval.py's command and train.py's in-loop evals
(cfg.eval_tasks) both use this module.

A task is a local JSONL file (one example a line) or a name in HF_TASKS, downloaded by `datasets`:
- multiple choice (HellaSwag, PIQA, Winogrande style): {"context": str, "choices": [str, ...],
  "label": int}. Each choice is scored by the log-likelihood of its tokens after the context's
  (a choice carries its own leading space, or the context ends with it: lm-eval's
  target_delimiter): acc picks the highest sum, acc_norm the highest sum per character of the
  choice as written (lm-evaluation-harness's acc_norm, which counts no delimiter).
- last word (LAMBADA style): {"text": str}. The continuation is the last space-separated word
  (with its space): acc counts texts whose every word token is the argmax, ppl is
  exp(-mean log-likelihood of the word).
Tokens as lm-evaluation-harness makes them: encode(context), then the continuation's, those of
encode(context + continuation) after encode(context)'s length; the last block_size + 1 are kept.
Scored in jitted batches of fixed shape, split over all devices (the batch axis), so one
compilation serves all.
"""
import json
import math
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import Config
from fused import fast_paths
from run.errors import UsageError
from text import corpus



def hellaswag_text(text: str) -> str:
    """lm-evaluation-harness's HellaSwag cleaning: WikiHow's " [title]" marks become sentence
    ends, its other [bracketed] artifacts go, double spaces become one."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def hellaswag_example(r: dict) -> dict:
    """A Rowan/hellaswag record as lm-eval's hellaswag task scores it (so that its numbers can be
    set beside published ones): the activity, then ctx_a and ctx_b capitalised. The space before
    an ending is its target_delimiter, which acc_norm's per-character length leaves out: it ends
    the context (tokenize moves it to the continuation, as lm-eval does)."""
    context = f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"
    return {"context": hellaswag_text(context) + " ",
            "choices": [hellaswag_text(e) for e in r["endings"]], "label": int(r["label"])}


# name -> (HF dataset id, split, record -> our format), as lm-eval's tasks of those names
HF_TASKS = {
    "hellaswag": ("Rowan/hellaswag", "validation", hellaswag_example),
    "lambada": ("EleutherAI/lambada_openai", "test", lambda r: {"text": r["text"]}),
}


def load_task(name: str, limit: int | None = None) -> list[dict]:
    """A task's examples: a local JSONL file, or an HF_TASKS name (needs internet once)."""
    if name in HF_TASKS:
        import datasets

        source, split, convert = HF_TASKS[name]
        try:
            corpus.hub_reachable(source)  # offline: huggingface_hub's retries, a line each
        except UsageError:
            raise UsageError(f"task {name}: the Hugging Face Hub cannot be reached for {source}: "
                             "get internet once, or pass a local .jsonl") from None
        try:
            records = datasets.load_dataset(source, split=split)
        except Exception as e:  # offline, say
            raise UsageError(f"task {name}: cannot load {source} ({type(e).__name__}); "
                             "get internet once, or pass a local .jsonl") from None
        examples = [convert(r) for r in records.select(range(min(limit or len(records),
                                                                 len(records))))]
    elif Path(name).is_file():
        examples = read_task_file(Path(name))[:limit]
    else:
        raise UsageError(f"task {name!r} is neither a file nor one of {', '.join(HF_TASKS)}")
    return examples


def read_task_file(path: Path) -> list[dict]:
    """A task's JSONL file, each line checked (one line naming the file and the line otherwise):
    all multiple choice or all last word, as the module's docstring says."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise UsageError(f"task file {path}, line {line}: not UTF-8") from None
    examples, kinds = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except ValueError as e:
            raise UsageError(f"task file {path}, line {number}: not JSON ({e})") from None
        if problem := task_problem(ex):
            raise UsageError(f"task file {path}, line {number}, example {len(examples) + 1}: "
                             f"{problem}; see inference/tasks.py's docstring")
        kinds.add("text" in ex)
        if len(kinds) > 1:
            raise UsageError(f"task file {path}, line {number}, example {len(examples) + 1}: "
                             f"multiple-choice and last-word lines in one file; a task is one "
                             f"kind")
        examples.append(ex)
    if not examples:
        raise UsageError(f"task file {path} has no examples")
    return examples


def task_problem(ex) -> str | None:
    """What is wrong with one example, or None: {"context": str, "choices": [str, str, ...],
    "label": int index of choices} or {"text": str of two words or more}."""
    if not isinstance(ex, dict):
        return "not a JSON object"
    if "text" in ex:
        if not isinstance(ex["text"], str) or " " not in ex["text"].strip(" "):
            return ("text must be a string of two words or more, split by a space (the last is "
                    "scored)")
        return None
    if not {"context", "choices", "label"} <= set(ex):
        return "needs context, choices and label (multiple choice) or text (last word)"
    choices, label = ex["choices"], ex["label"]
    if not isinstance(ex["context"], str) or not ex["context"].strip():
        return "context must be a string that is not empty (each choice is scored after it)"
    if not isinstance(choices, list) or len(choices) < 2 or \
            not all(isinstance(c, str) and c for c in choices):
        return "choices must be a list of two or more non-empty strings"
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        return f"label must be an integer from 0 to {len(choices) - 1} (an index of choices)"
    return None


def requests(examples: list[dict]) -> list[tuple[str, str]]:
    """The (context, continuation) pairs to score, example after example, choice after choice."""
    pairs = []
    for ex in examples:
        if "text" in ex:
            context, word = ex["text"].rsplit(" ", 1)
            pairs.append((context, " " + word))
        else:
            pairs += [(ex["context"], choice) for choice in ex["choices"]]
    return pairs


def tokenize(pairs, encode, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs, targets and the continuation's mask, (N, T) each, right-padded: lm-eval's
    encoding, with the context's trailing spaces moved to the continuation as it does."""
    x, y, m = (np.zeros((len(pairs), T), np.int32) for _ in range(3))
    for i, (context, continuation) in enumerate(pairs):
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, context_ids = encode(context + continuation), encode(context)
        n_context = len(context_ids)
        n_cont = len(whole) - n_context
        if not n_context:  # no token before the continuation's first: nothing would score it
            raise UsageError(f"the context before {continuation!r} is empty: a continuation is "
                             "scored after a context of one token or more")
        if not 0 < n_cont <= T:
            raise UsageError(f"{continuation!r} is {n_cont} tokens: a continuation must be 1 to "
                             f"block_size={T} tokens")
        # the context as encoded alone: where a BPE merges across the cut, the merged token
        # would hold the continuation's start, and the model would read part of its answer
        tokens = (context_ids + whole[n_context:])[-(T + 1):]
        n = len(tokens) - 1
        x[i, :n], y[i, :n] = tokens[:-1], tokens[1:]
        m[i, n - n_cont:n] = 1
    return x, y, m


@eqx.filter_jit
def score(model, x_BT, y_BT, m_BT, n_vocab):
    """Each row's summed log-likelihood of its masked targets, and whether all are the argmax.
    The model's padded vocabulary is left out of the softmax (no tokenizer id is there)."""
    logits_BTV = jax.vmap(model, spmd_axis_name=fast_paths.batch_axes())(x_BT)  # as the step's
    valid_V = jnp.arange(logits_BTV.shape[-1]) < n_vocab
    logp_BTV = jax.nn.log_softmax(jnp.where(valid_V, logits_BTV, -jnp.inf), axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, y_BT[..., None], axis=-1)[..., 0]
    greedy_BT = jnp.argmax(logp_BTV, axis=-1) == y_BT
    return (logp_BT * m_BT).sum(-1), jnp.all(greedy_BT | (m_BT == 0), axis=-1)


def loglikelihoods(model, x, y, m, n_vocab: int, sharding, batch: int):
    """score over all rows, `batch` at a time, the batch split as `sharding` says."""
    rows = len(x)
    pad = -rows % batch
    x, y, m = (np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)]) for a in (x, y, m))
    lls, greedy = [], []
    # a training model's kernels run on each device's own rows (fast_paths.per_device reads the
    # mesh), not on the batch gathered on every device
    mesh = sharding.mesh.abstract_mesh if isinstance(sharding, NamedSharding) else \
        jax.sharding.AbstractMesh((), ())  # one device (eval.py's tests)
    with jax.sharding.use_abstract_mesh(mesh):
        for i in range(0, len(x), batch):
            part = x[i:i + batch], y[i:i + batch], m[i:i + batch]
            ll, g = score(model, *jax.device_put(part, sharding), n_vocab)
            lls.append(ll), greedy.append(g)
    # a multi-host run's rows sit on other processes' devices too, which device_get cannot read
    lls, greedy = multihost_utils.process_allgather((lls, greedy), tiled=True)
    return np.concatenate(lls)[:rows].astype(np.float64), np.concatenate(greedy)[:rows]


def metrics(examples: list[dict], lls: np.ndarray, greedy: np.ndarray) -> dict[str, float]:
    """acc and acc_norm (multiple choice), or acc and ppl (last word), from requests' order."""
    if "text" in examples[0]:
        return {"acc": float(greedy.mean()), "ppl": math.exp(-lls.mean())}
    acc, acc_norm, i = [], [], 0
    for ex in examples:
        ll = lls[i:i + len(ex["choices"])]
        i += len(ex["choices"])
        acc.append(np.argmax(ll) == ex["label"])
        chars = np.array([len(c) for c in ex["choices"]], np.float64)
        acc_norm.append(np.argmax(ll / chars) == ex["label"])
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(acc_norm))}


class Tasks:
    """The tasks tokenized once (a run evaluates them at every interval)."""

    def __init__(self, names: list[str], encode, n_vocab: int, T: int, limit: int | None = None):
        self.n_vocab = n_vocab
        self.tasks = {}
        for name in names:
            examples = load_task(name, limit)
            if examples:
                task = Path(name).stem if name not in HF_TASKS else name
                if task in self.tasks:  # their scores would be logged as one
                    raise UsageError(f"two tasks are named {task!r} (the task files' names "
                                     f"without folder and .jsonl): rename one of them")
                self.tasks[task] = examples, tokenize(requests(examples), encode, T)

    def __call__(self, model, sharding, batch: int) -> dict[str, float]:
        """{"TASK/acc": ..., ...} of the model, its batch sharded as `sharding` says."""
        out = {}
        for task, (examples, (x, y, m)) in self.tasks.items():
            lls, greedy = loglikelihoods(model, x, y, m, self.n_vocab, sharding, batch)
            out |= {f"{task}/{k}": v for k, v in metrics(examples, lls, greedy).items()}
        return out


def log_in_training(tasks: Tasks | None, model, cfg: Config, step: int, mesh, logger) -> None:
    """train.py's hook at each evaluation: cfg.eval_tasks (tokenized once, by train.py) scored and
    logged (tensorboard's eval/TASK/METRIC) when the step is a multiple of eval_tasks_interval, or
    the last."""
    if tasks is None or (step % cfg.eval_tasks_interval and step != cfg.max_steps):
        return
    sharding = NamedSharding(mesh, P(("replica", "fsdp")))  # the batch over all devices
    scores = tasks(model, sharding, cfg.microbatch_size)
    logger.log(step, scores, {k: f"eval/{k}" for k in scores})
