"""eval.py's local task files checked line by line (inference/tasks.py): each malformed file is
one line naming the file and the line, never a traceback or a silent score."""
import json
from pathlib import Path

import numpy as np
import pytest

from inference.tasks import load_task
from run.errors import UsageError

CHOICE = {"context": "The cat sat on the", "choices": [" mat", " moon"], "label": 0}
WORD = {"text": "The cat sat on the mat"}


def lines(*records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


MALFORMED = [
    (b'{"text": "a b"\n', "line 1: not JSON"),
    (lines(CHOICE) + b"[1, 2]\n", "line 2, example 2: not a JSON object"),
    (lines(CHOICE) + '{"text": "caf\xe9 au lait"}\n'.encode("latin-1"), "line 2: not UTF-8"),
    (lines({**CHOICE, "choices": []}), "line 1, example 1: choices must be a list of two"),
    (lines({**CHOICE, "choices": " mat"}), "line 1, example 1: choices must be a list of two"),
    (lines({**CHOICE, "choices": [" mat"], "label": 0}), "choices must be a list of two"),
    (lines({**CHOICE, "choices": [" mat", 3]}), "choices must be a list of two"),
    (lines({**CHOICE, "label": 2}), "line 1, example 1: label must be an integer from 0 to"),
    (lines({**CHOICE, "label": -1}), "line 1, example 1: label must be an integer from 0 to"),
    (lines({**CHOICE, "label": "0"}), "line 1, example 1: label must be an integer from 0 to"),
    (lines({**CHOICE, "label": True}), "line 1, example 1: label must be an integer from 0 to"),
    (lines({**CHOICE, "context": 5}), "line 1, example 1: context must be a string"),
    (lines({"context": "a", "label": 0}), "line 1, example 1: needs context, choices and label"),
    (lines({**CHOICE, "context": ""}), "line 1, example 1: context must be a string that is not empty"),
    (lines({**CHOICE, "context": " "}), "line 1, example 1: context must be a string that is not empty"),
    (lines({"text": "First\tCitizen"}), "line 1, example 1: text must be a string of two words or more, split by a space"),
    (lines(WORD, {"text": "word"}), "line 2, example 2: text must be a string of two"),
    (lines({"text": ""}), "line 1, example 1: text must be a string of two"),
    (lines({"text": ["a", "b"]}), "line 1, example 1: text must be a string of two"),
    (lines(WORD, CHOICE), "line 2, example 2: multiple-choice and last-word lines in one file"),
    (lines(CHOICE, WORD), "line 2, example 2: multiple-choice and last-word lines in one file"),
    (b"", "has no examples"),
    (b"\n  \n", "has no examples"),
]


@pytest.mark.parametrize("content,message", MALFORMED)
def test_a_malformed_task_file_is_one_line_naming_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "task.jsonl"
    path.write_bytes(content)
    with pytest.raises(UsageError) as e:
        load_task(str(path))
    assert str(e.value).startswith(f"task file {path}") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_well_formed_task_files_load_as_written(tmp_path):
    """Blank lines are skipped; limit keeps the first examples."""
    for records in ([CHOICE, {**CHOICE, "label": 1}], [WORD, {"text": "two words"}]):
        path = tmp_path / "task.jsonl"
        path.write_bytes(lines(records[0]) + b"\n" + lines(*records[1:]))
        assert load_task(str(path)) == records
        assert load_task(str(path), limit=1) == records[:1]


def test_an_empty_context_is_refused_not_scored_as_nothing():
    """A continuation with no token before it (an empty context from a Hub task) has no logit to
    score its first token: one line, where every choice would otherwise score 0."""
    from inference.tasks import tokenize
    encode = lambda s: [ord(c) for c in s]  # noqa: E731
    x, y, m = tokenize([("ab", " c")], encode, 8)
    assert m.sum() == 2 and list(y[0][m[0] == 1]) == encode(" c")  # the continuation's tokens
    with pytest.raises(UsageError, match="the context before 'First' is empty"):
        tokenize([("", "First")], encode, 8)


def test_hellaswag_is_read_as_lm_eval_reads_it():
    """Records shaped as Rowan/hellaswag's (a WikiHow one with its [title] and [step] artifacts, an
    ActivityNet one with a lower-case ctx_b) become lm-eval's query and choices, from lm-eval's own
    hellaswag task: eval.py's numbers are then comparable with published ones."""
    datasets = pytest.importorskip("datasets")
    utils = pytest.importorskip("lm_eval.tasks.hellaswag.utils")
    from inference.tasks import HF_TASKS
    records = [
        {"activity_label": "Home and Garden", "ctx_a": "[header] How to grow basil [title] Pick a pot.",
         "ctx_b": "[step] fill it", "ctx": "", "label": "2",
         "endings": ["with sand [substeps]  and water.", " with soil.", "[title] Water it.", "x"]},
        {"activity_label": "Washing face", "ctx_a": "A man is at a sink.", "ctx_b": "he",
         "ctx": "", "label": "0", "endings": ["washes his face.", "runs.", "sits.", "jumps  up."]},
    ]
    convert = HF_TASKS["hellaswag"][2]
    for ours, theirs in zip(map(convert, records),
                            utils.process_docs(datasets.Dataset.from_list(records))):
        assert ours == {"context": theirs["query"] + " ", "choices": theirs["choices"],
                        "label": theirs["gold"]}


def test_hellaswag_is_scored_as_lm_eval_scores_it(tmp_path, monkeypatch):
    """lm-eval's own hellaswag task (its YAML, on these records in a local file): the same
    (context, continuation) requests once trailing spaces move to the continuation (both move
    them), and the same acc and acc_norm from the same log-likelihoods. acc_norm divides by the
    ending's characters without the space before it: counting that space, the second example's
    long ending lost to a short one (-1.35 against -1.351 a character, where lm-eval has -1.5
    against -1.389)."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from inference.tasks import hellaswag_example, metrics, requests
    records = [
        {"activity_label": "Baking", "ctx_a": "She mixes the dough.", "ctx_b": "she",
         "ctx": "", "label": "1", "endings": ["bakes it.", "puts the bowl in the oven and waits.",
                                              "[title] Sing.", "runs"]},
        {"activity_label": "Washing face", "ctx_a": "A man is at a sink.", "ctx_b": "he",
         "ctx": "", "label": "0", "endings": ["washes his face.", "runs.", "sits.", "jumps  up."]},
    ]
    (tmp_path / "hs.jsonl").write_text(lines(*records).decode())
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hs.yaml").write_text(
        f"include: {Path(lm_eval.__file__).parent / 'tasks/hellaswag/hellaswag.yaml'}\n"
        "task: local_hellaswag\ntag: []\ndataset_path: json\ntraining_split: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {tmp_path / 'hs.jsonl'}\n")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = TaskManager(include_path=str(tmp_path / "tasks")).load("local_hellaswag")["tasks"][
        "local_hellaswag"]
    docs = list(task.validation_docs())
    ours = [hellaswag_example(r) for r in records]

    def moved(context, continuation):  # lm-eval's and tokenize's: a context's end spaces move
        spaces = len(context) - len(context.rstrip())
        return context[:len(context) - spaces], context[len(context) - spaces:] + continuation
    theirs = [moved(*r.arguments) for d in docs for r in task.construct_requests(
        d, task.doc_to_text(d))]
    assert [moved(*pair) for pair in requests(ours)] == theirs
    rng = np.random.default_rng(0)
    for lls in [np.array([-13.5, -50.0, -99.0, -99.0, -20.0, -9.0, -9.0, -9.0]),
                *(rng.uniform(-60, -1, 8) for _ in range(20))]:
        want = [task.process_results(d, [(ll, False) for ll in lls[4 * i:4 * i + 4]])
                for i, d in enumerate(docs)]
        got = metrics(ours, lls, np.zeros(8, bool))
        for key in ("acc", "acc_norm"):
            assert got[key] == np.mean([w[key] for w in want]), (key, lls)
