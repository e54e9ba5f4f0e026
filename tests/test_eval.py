"""eval.py against EleutherAI's lm-evaluation-harness scoring the exported model, against values
computed by hand, and on 1 and 4 devices."""
import json
import shutil

import equinox as eqx
import jax
import numpy as np
import pytest
from etils import epath

from inference import tasks as downstream
import export
from run import reading
from conftest import ROOT, TINY_RUN, run

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
TASKS = {"mugpt_mc3": ROOT / "tests/tasks/mc3.jsonl",
         "mugpt_lastword3": ROOT / "tests/tasks/lastword3.jsonl"}


@pytest.fixture(scope="module")
def exported(shakespeare, tmp_path_factory):
    """A tiny run (60 steps, 32-token context: the fixtures' longest choice is 18 characters),
    its JAX model, its export and eval.py's tasks."""
    root = tmp_path_factory.mktemp("eval")
    args = ["--config.block_size=32", "--config.param=sp", "--config.max_steps=60",
            "--config.learning_rate=1e-2", "--config.min_lr=1e-2", "--config.eval_batches=1",
            # eval.py in the loop, at the evaluations of steps 0 and 60
            f"--config.eval_tasks={','.join(map(str, TASKS.values()))}",
            "--config.eval_interval=60", "--config.eval_tasks_interval=60"]
    r = run(["launch.py", *TINY_RUN, *args, f"--rundir={root / 'run'}"])
    assert r.returncode == 0, r.stderr[-2000:]
    rundir = epath.Path(root / "run")
    export.export(rundir, root / "hf")
    cfg = reading.read_config(rundir)
    model, _ = reading.restore_model(rundir, cfg, None)
    meta = reading.read_dataset_record(rundir, cfg)
    tasks = downstream.Tasks([str(p) for p in TASKS.values()], reading.tokenizer(meta)[0],
                             meta["vocab_size"], cfg.block_size)
    return model, root / "hf", tasks, rundir


def with_eval_py(model, tasks) -> dict:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return tasks(model, one, 8)


def with_lm_eval(hf_dir, monkeypatch, model=None, tasks=TASKS) -> tuple[dict, dict]:
    """lm-eval's metrics (named as eval.py names them) and its per-request log-likelihoods, of
    the exported directory, or of `model` (a torch model) with its tokenizer."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    monkeypatch.chdir(ROOT)  # the task YAMLs name their files from the repo root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    if model is None:
        lm = HFLM(pretrained=str(hf_dir), trust_remote_code=True, dtype="float32", batch_size=4,
                  device="cpu")
    else:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, device="cpu")
    # bootstrap_iters=0: no standard errors, which lm-eval computes in a pool of forks of this
    # process (see conftest's fork guard) and which no test compares
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), log_samples=True, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(ROOT / "tests/tasks")))
    metrics, lls = {}, {}
    for task, path in tasks.items():
        name = path.stem
        for key, value in out["results"][task].items():
            metric, _, _ = key.partition(",")
            if metric in ("acc", "acc_norm", "perplexity"):
                metrics[f"{name}/{'ppl' if metric == 'perplexity' else metric}"] = value
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        lls[name] = [ll for s in samples for ll, _ in s["filtered_resps"]] if "mc" in name \
            else [s["filtered_resps"][0][0] for s in samples]
    return metrics, lls


def test_lm_eval_agrees_with_eval_py(exported, monkeypatch):
    model, hf_dir, tasks, _ = exported
    ours = with_eval_py(model, tasks)
    theirs, their_lls = with_lm_eval(hf_dir, monkeypatch)
    assert set(ours) == set(theirs) == {"mc3/acc", "mc3/acc_norm", "lastword3/acc",
                                        "lastword3/ppl"}
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
    same_loglikelihoods(model, tasks, their_lls)
    print(json.dumps({"eval.py": ours, "lm_eval": theirs}))


def same_loglikelihoods(model, tasks, their_lls):
    """Every request's log-likelihood, eval.py's against lm-eval's: three examples' metrics
    alone can agree by chance where the tokens scored differ."""
    assert set(tasks.tasks) == set(their_lls)
    for name, (examples, (x, y, m)) in tasks.tasks.items():
        lls, _ = downstream.loglikelihoods(model, x, y, m, tasks.n_vocab,
                                           jax.sharding.SingleDeviceSharding(jax.devices()[0]), 8)
        np.testing.assert_allclose(lls, their_lls[name], atol=1e-3, rtol=1e-5, err_msg=name)


def test_a_uniform_model_scores_as_computed_by_hand(exported, monkeypatch):
    """A zero readout makes every token 1/65 likely: a choice's log-likelihood is -n ln 65 for
    its n characters, so acc picks the shortest (mc3: right in examples 1 and 3, not 2); the
    last words' perplexity is 65 ** (mean characters) = 65 ** (17/3) (" speak", " name",
    " Romeo"); the argmax of equal logits is id 0, a newline, so no word is guessed."""
    model, hf_dir, tasks, _ = exported
    uniform = eqx.tree_at(lambda m: m.emb.unembed, model, replace_fn=lambda u: 0 * u)
    by_hand = {"mc3/acc": 2 / 3, "lastword3/ppl": 65 ** (17 / 3), "lastword3/acc": 0.0}
    ours = with_eval_py(uniform, tasks)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)
    with torch.no_grad():
        hf.unembed.zero_()
    theirs, _ = with_lm_eval(hf_dir, monkeypatch, model=hf)
    for key, value in by_hand.items():
        assert ours[key] == pytest.approx(value, rel=1e-5), key
        assert theirs[key] == pytest.approx(value, rel=1e-5), key


def test_one_and_four_devices_give_the_same_numbers(exported):
    """eval.py on 4 devices (the batch split 4 ways) against 1, and against the hand computation."""
    model, _, tasks, rundir = exported
    ours = with_eval_py(model, tasks)
    r = run(["eval.py", f"--rundir={rundir}", f"--tasks={','.join(map(str, TASKS.values()))}",
             "--batch_size=4"], {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert r.returncode == 0, r.stderr[-2000:]
    four = json.loads(r.stdout.splitlines()[-1])
    assert four.pop("step") == 60
    assert four.keys() == ours.keys()
    for key in ours:
        assert four[key] == pytest.approx(ours[key], rel=1e-6), key
    # and both against the metrics computed by hand (numpy forward, one sequence at a time)
    cfg = reading.read_config(rundir)
    encode = reading.tokenizer(reading.read_dataset_record(rundir, cfg))[0]
    by_hand, _ = scored_by_hand(model, cfg, encode, 65, TASKS.values())
    assert by_hand.keys() == four.keys()
    for key, value in by_hand.items():
        assert four[key] == pytest.approx(value, rel=1e-4), key


def test_bad_task_is_one_line(exported, tmp_path):
    _, _, _, rundir = exported
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no context"}\n')
    for task, why in ((bad, "example 1: needs context, choices and label"),
                      (tmp_path / "none.jsonl", "neither a file nor one of hellaswag")):
        r = run(["eval.py", f"--rundir={rundir}", f"--tasks={task}"])
        assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1
    for flag in ("--batch_size=0", "--limit=0"):  # a division by zero; no metrics at all
        r = run(["eval.py", f"--rundir={rundir}", f"--tasks={bad}", flag])
        assert r.returncode == 1 and r.stderr.strip() == f"error: {flag}: pass a number of 1 or more"
    # offline: one line, not huggingface_hub's retries (nothing listens on port 9)
    r = run(["eval.py", f"--rundir={rundir}", "--tasks=lambada"],
            env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"})
    assert r.returncode == 1 and r.stderr.strip() == (
        "error: task lambada: the Hugging Face Hub cannot be reached for "
        "EleutherAI/lambada_openai: get internet once, or pass a local .jsonl"), r.stderr
    # two files of one name would be scored as one task, one of them dropped
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        shutil.copy(ROOT / "tests/tasks/mc3.jsonl", tmp_path / folder / "mc3.jsonl")
    both = f"{tmp_path}/a/mc3.jsonl,{tmp_path}/b/mc3.jsonl"
    r = run(["eval.py", f"--rundir={rundir}", f"--tasks={both}"])
    assert r.returncode == 1 and r.stderr.strip() == ("error: two tasks are named 'mc3' (the task "
                                                      "files' names without folder and .jsonl): "
                                                      "rename one of them")
    # numpy's (the padded batch) and XLA's out of memory: one line naming --batch_size
    for size in (10**9, 3 * 10**6):
        r = run(["eval.py", f"--rundir={rundir}", f"--tasks={ROOT / 'tests/tasks/mc3.jsonl'}",
                 f"--batch_size={size}"])
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().startswith("error: out of memory (") and r.stderr.strip().endswith(
            f"lower --batch_size={size}"), r.stderr


def test_tasks_in_the_loop_log_eval_py_numbers_to_tensorboard(exported):
    """--config.eval_tasks: the scores at the last step, read by tensorboard's own reader, are
    eval.py's of the final checkpoint."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    model, _, tasks, rundir = exported
    acc = EventAccumulator(str(rundir))
    acc.Reload()
    ours = with_eval_py(model, tasks)
    for key, value in ours.items():
        events = acc.Tensors(f"eval/{key}")
        assert [e.step for e in events] == [0, 60], key
        assert float(events[-1].tensor_proto.float_val[0]) == pytest.approx(value, rel=1e-5), key


# ---------------------------------------------------------------------------------------------
# A tokenizer whose tokens span several characters: acc_norm's divisor (characters, not tokens)
# and the context/continuation split are exercised, as the character-level tokenizer above cannot.
BPE_TASKS = {"mugpt_mc6": ROOT / "tests/tasks/mc6.jsonl",
             "mugpt_mc3_split": ROOT / "tests/tasks/mc3_split.jsonl", **TASKS}


@pytest.fixture(scope="module")
def bpe(shakespeare, tmp_path_factory):
    """A byte-level BPE of 400 tokens (conftest.small_bpe), a random GPT of that vocabulary (every
    parameter random: no zero readout), its export, and eval.py's tasks tokenized by it."""
    from conftest import small_bpe, tiny
    from test_model import random_gpt
    from text import tokenization

    meta = small_bpe(shakespeare)
    record = meta["tokenizer"]
    cfg = tiny(vocab_size=meta["vocab_size"], block_size=32, d_model=32, n_head=2)
    model = random_gpt(cfg)
    hf_dir = tmp_path_factory.mktemp("bpe") / "hf"
    export.write(model, cfg, meta, hf_dir)
    encode = tokenization.load(record)[0]
    tasks = downstream.Tasks([str(p) for p in BPE_TASKS.values()], encode, meta["vocab_size"],
                             cfg.block_size)
    return model, cfg, encode, meta["vocab_size"], tasks, hf_dir


def scored_by_hand(model, cfg, encode, V: int, paths=BPE_TASKS.values()) -> tuple[dict, dict]:
    """Each task's metrics from test_model.numpy_forward's log-probabilities, one unpadded
    sequence at a time: encode(context), then the continuation's tokens, those of
    encode(context + continuation) after encode(context)'s length, the sequence cut to its last
    block_size + 1 tokens (lm-eval's rule: a BPE merge across the cut stays out of the
    context); acc_norm divides by the continuation's characters. Also returned: the acc_norm that
    divides by its tokens instead, which the tests need to differ."""
    from test_model import numpy_forward

    def loglik(context, continuation):  # (sum of log p, all greedy, tokens)
        assert context == context.rstrip()  # no trailing space to move
        whole, context_ids = encode(context + continuation), encode(context)
        n_cont = len(whole) - len(context_ids)
        # the context's start is cut to fit the model
        whole = (context_ids + whole[len(context_ids):])[-(cfg.block_size + 1):]
        logits = numpy_forward(model, cfg, np.array(whole[:-1]))[:, :V]
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        rows = np.arange(len(whole) - 1 - n_cont, len(whole) - 1)
        targets = np.array(whole[-n_cont:])
        greedy = bool(np.all(logits[rows].argmax(-1) == targets))
        return logp[rows, targets].sum(), greedy, len(targets)

    metrics_, per_token = {}, {}
    for path in paths:
        examples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        name = path.stem
        if "text" in examples[0]:  # the last word, with its space
            words = [ex["text"].rsplit(" ", 1) for ex in examples]
            scored = [loglik(context, " " + word) for context, word in words]
            metrics_[f"{name}/acc"] = float(np.mean([g for _, g, _ in scored]))
            metrics_[f"{name}/ppl"] = float(np.exp(-np.mean([ll for ll, _, _ in scored])))
            continue
        acc, norm, norm_tok = [], [], []
        for ex in examples:
            scored = [loglik(ex["context"], c) for c in ex["choices"]]
            ll = np.array([s[0] for s in scored])
            acc.append(ll.argmax() == ex["label"])
            norm.append((ll / [len(c) for c in ex["choices"]]).argmax() == ex["label"])
            norm_tok.append((ll / [s[2] for s in scored]).argmax() == ex["label"])
            assert max(s[2] for s in scored) > 1  # tokens of several characters
        metrics_ |= {f"{name}/acc": float(np.mean(acc)), f"{name}/acc_norm": float(np.mean(norm))}
        per_token[f"{name}/acc_norm"] = float(np.mean(norm_tok))
    return metrics_, per_token


def test_bpe_metrics_as_computed_by_hand_and_by_lm_eval(bpe, monkeypatch):
    """eval.py's acc, acc_norm and ppl with a BPE tokenizer against the numpy computation, and
    against lm-eval scoring the export with the exported tokenizer, request by request. mc6's
    acc_norm per character (1.0 on this model: its right answers are common words) differs from
    per token (0.0). mc3_split's contexts stop inside a word: the BPE merges across the cut in
    encode(context + choice), and lm-eval keeps encode(context)'s tokens before the choice's."""
    model, cfg, encode, V, tasks, hf_dir = bpe
    ours = with_eval_py(model, tasks)
    by_hand, per_token = scored_by_hand(model, cfg, encode, V)
    assert set(ours) == set(by_hand)
    for key, value in by_hand.items():
        assert ours[key] == pytest.approx(value, rel=1e-4), key
    assert per_token["mc6/acc_norm"] != by_hand["mc6/acc_norm"]
    theirs, their_lls = with_lm_eval(hf_dir, monkeypatch, tasks=BPE_TASKS)
    assert set(theirs) == set(ours)
    for key in ours:
        assert theirs[key] == pytest.approx(ours[key], rel=1e-4), key
    same_loglikelihoods(model, tasks, their_lls)
    print(json.dumps({"eval.py": ours, "by hand": by_hand, "per token": per_token,
                      "lm_eval": theirs}))
