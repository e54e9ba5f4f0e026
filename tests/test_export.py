"""export.py: the exported PyTorch model (loaded by transformers itself) against the JAX model.
Runs are trained by launch.py in subprocesses (one of them on 4 simulated devices, FSDP-sharded)
and exported here on one CPU device; the architecture variants are random models written by
export.write. Edits of model.py made here (monkeypatched) must make export refuse in one line."""
import dataclasses
import shutil
import string
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

import export
from hf import check
import model as definition
from inference import decode
from run import reading
from conftest import ROOT, TINY_RUN, document_mask_after_end_of_text, run_each, tiny
from run.errors import UsageError
from test_model import random_gpt
from test_variants import VARIANTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak."
# name -> (launch.py arguments beyond TINY_RUN, simulated devices: None for one)
RUNS = {
    # SP, untied; more steps so that greedy decoding is not one repeated character
    "sp": (["--config.param=sp", "--config.max_steps=60", "--config.learning_rate=1e-2",
            "--config.min_lr=1e-2"], None),
    # muP at width_mult 2 and depth_mult 2 (readout 1/2, branches 1/2), tied, norm gains, alpha_in
    "mup_tied": (["--config.param=mup", "--config.d_base=16", "--config.depth_base=1",
                  "--config.tie_embeddings=true", "--config.norm_gain=true",
                  "--config.alpha_in=1.5", "--config.max_steps=10"], None),
    # 4 devices: every matrix sharded 4 ways in the checkpoint
    "fsdp4": (["--config.max_steps=10"], 4),
    # every variant at once, through launch.py's config.json and the checkpoint as export.py reads them
    "variants": (["--config.attention=sharedkv", "--config.n_kv_head=1", "--config.position=alibi",
                  "--config.connections=mudd", "--config.max_steps=10"], None),
}


@pytest.fixture(scope="module")
def runs(shakespeare, tmp_path_factory):
    """Each run's directory and its export."""
    root = tmp_path_factory.mktemp("export")
    done = run_each([["launch.py", *TINY_RUN, "--config.eval_batches=1", f"--rundir={root / name}",
                      *args] for name, (args, _) in RUNS.items()],
                    devices=[n for _, n in RUNS.values()])  # all at once: each compiles alone
    out = {}
    for name, r in zip(RUNS, done):
        assert r.returncode == 0, r.stderr[-2000:]
        export.export(epath.Path(root / name), root / f"{name}_hf")
        out[name] = root / name, root / f"{name}_hf"
    return out


def load(rundir, hf_dir):
    """The JAX model (float32, on one device) and the exported one as transformers loads it."""
    cfg = dataclasses.replace(reading.read_config(epath.Path(rundir)), compute_dtype="float32")
    model, _ = reading.restore_model(epath.Path(rundir), cfg, None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    return model, cfg, hf.eval(), tokenizer


@pytest.mark.parametrize("name", list(RUNS))
def test_pytorch_logits_equal_jax_logits(runs, name):
    model, cfg, hf, tokenizer = load(*runs[name])
    encode, _ = reading.tokenizer(reading.read_dataset_record(epath.Path(runs[name][0]), cfg))
    ids = encode(TEXT[:cfg.block_size])
    assert tokenizer(TEXT[:cfg.block_size])["input_ids"] == ids  # the same tokenizer
    want_TV = np.asarray(model(jnp.asarray(ids)))
    with torch.no_grad():
        got_TV = hf(torch.tensor([ids])).logits[0].numpy()
    # the padded vocabulary's rows are not exported: generate can never pick one
    assert got_TV.shape == (len(ids), 65) and want_TV.shape == (len(ids), 128)
    diff = np.abs(got_TV - want_TV[:, :65]).max()
    print(f"{name}: max |PyTorch - JAX| logit = {diff:.3g}")
    assert diff <= 1e-4
    assert np.abs(want_TV[:, :65]).max() > 0.1  # a trained readout, not zeros


def test_pytorch_loss_of_labels_is_the_cross_entropy_over_the_tokenizers_ids(runs):
    """transformers' loss (labels=ids: the model shifts them; a Trainer's fine-tuning and a
    perplexity read it) is numpy's cross-entropy of JAX's logits over the tokenizer's 65 ids, as
    eval.py and sample.py read them; a label of -100 is left out of the mean. The logged loss
    (train.loss_fn's) is over the padded 128 (vocab_multiple), so it is higher by the mass left on
    the padding ids: -log(1 - mass), a few 1e-3 after 60 steps (docs/data.md)."""
    import train
    model, cfg, hf, tokenizer = load(*runs["sp"])
    ids = tokenizer(TEXT[:cfg.block_size])["input_ids"]  # a block: T - 1 targets
    logits_TV = np.asarray(model(jnp.asarray(ids)), np.float64)[:-1]

    def cross_entropy(logits_TV, y_T):
        lse_T = np.log(np.exp(logits_TV - logits_TV.max(1, keepdims=True)).sum(1)) + logits_TV.max(1)
        return float(np.mean(lse_T - logits_TV[np.arange(len(y_T)), y_T]))

    y_T = np.array(ids[1:])
    with torch.no_grad():
        got = float(hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
        masked = torch.tensor([ids[:-3] + [-100] * 3])  # the last three targets left out
        got_masked = float(hf(torch.tensor([ids]), labels=masked).loss)
    assert got == pytest.approx(cross_entropy(logits_TV[:, :65], y_T), rel=1e-5)
    assert got_masked == pytest.approx(cross_entropy(logits_TV[:-3, :65], y_T[:-3]), rel=1e-5)
    logged = float(train.loss_fn(model, jnp.asarray([ids[:-1]]), jnp.asarray([ids[1:]]), cfg)[1])
    assert logged == pytest.approx(cross_entropy(logits_TV, y_T), rel=1e-5)
    mass_T = np.exp(logits_TV[:, 65:]).sum(1) / np.exp(logits_TV).sum(1)
    assert logged - got == pytest.approx(-np.log1p(-mass_T).mean(), rel=1e-2, abs=1e-6)
    assert 0 < logged - got < 0.01, (logged, got)


def test_greedy_generate_equals_sample_py(runs):
    """transformers' generate (with its KV cache) against sample.generate at temperature 0, past
    the block: the window slides as sample.py's."""
    model, cfg, hf, tokenizer = load(*runs["sp"])
    assert_greedy_generate_equals_sample_py(model, cfg, hf, tokenizer("First\nA")["input_ids"], 3)
    # a prompt longer than the block: its last block_size tokens, as sample.py keeps them
    assert_greedy_generate_equals_sample_py(model, cfg, hf, tokenizer(TEXT)["input_ids"], 5)


def test_generate_without_the_cache_is_generate_with_it_or_refused(runs):
    """use_cache=False recomputes the whole sequence at each step: within the block the same
    tokens as the cache's; past it the window would slide by one token a step, not as sample.py's
    (by half a block), so it is refused in one line rather than generating other text."""
    model, cfg, hf, tokenizer = load(*runs["sp"])
    prompt = torch.tensor([tokenizer("First\nA")["input_ids"]])
    n = cfg.block_size - prompt.shape[1] + 1  # the last token read from a full block
    with torch.no_grad():
        cached, recomputed = (hf.generate(prompt, max_new_tokens=n, do_sample=False,
                                          use_cache=use) for use in (True, False))
        assert recomputed.tolist() == cached.tolist()
        with pytest.raises(ValueError, match="use_cache=False past max_position_embeddings"):
            hf.generate(prompt, max_new_tokens=n + 1, do_sample=False, use_cache=False)


def test_generated_text_keeps_its_newlines(runs):
    """The character tokenizer's newline is also its bos and pad token (lm-eval and batched
    generate need them, and no id is spare), a special token to transformers, whose decode with
    skip_special_tokens=True (the text-generation pipeline's, lm-eval's) dropped every newline of
    the text: the pipeline's text is sample.py's tokens decoded by text/tokenization.py."""
    model, cfg, hf, tokenizer = load(*runs["sp"])
    encode, decode_ids = reading.tokenizer(reading.read_dataset_record(epath.Path(runs["sp"][0]),
                                                                       cfg))
    prompt = "First\nA"
    n = cfg.block_size - len(encode(prompt))
    want = decode.generate(model, decode.prompt_window(encode(prompt), cfg.block_size),
                           jax.random.key(0), jnp.float32(0.0), num_samples=1, max_new_tokens=n,
                           n_vocab=65)
    want = prompt + decode_ids(np.asarray(want)[0].tolist())  # the pipeline's: prompt and text
    got = transformers.pipeline("text-generation", model=hf, tokenizer=tokenizer)(
        prompt, max_new_tokens=n, do_sample=False)[0]["generated_text"]
    assert got == want and "\n" in want[len(prompt):]  # a newline generated, and kept
    assert tokenizer.batch_decode([encode(TEXT)], skip_special_tokens=True) == [TEXT]


def assert_greedy_generate_equals_sample_py(model, cfg, hf, prompt: list[int],
                                            blocks: int = 1) -> None:
    """hf.generate's greedy tokens after prompt, to the end of the block or through `blocks`
    blocks (the window slides by half each time it is full: 3 blocks slide 4 times), are
    sample.py's, called as a user calls it: without an attention mask (transformers then masks
    every id equal to the model's pad id; a character tokenizer pads with a newline, id 0, which
    the prompts hold)."""
    assert 0 in prompt
    n = blocks * cfg.block_size - len(prompt)
    want = decode.generate(model, decode.prompt_window(prompt, cfg.block_size), jax.random.key(0),
                           jnp.float32(0.0), num_samples=1, max_new_tokens=n, n_vocab=65)
    want = np.asarray(want)[0].tolist()
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          use_cache=True)
    assert len(set(want)) > 2  # not one token repeated
    assert got[0, len(prompt):].tolist() == want


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    rundir, hf_dir = runs["sp"]
    with pytest.raises(UsageError, match="exists and is not empty: pass --force"):
        export.export(epath.Path(rundir), hf_dir)
    with pytest.raises(UsageError, match="--step=7: .* has checkpoints of steps 60 only"):
        export.export(epath.Path(rundir), tmp_path / "a", step=7)
    empty = tmp_path / "no_ckpt"
    empty.mkdir()
    for name in ("config.json", "dataset.json"):
        (empty / name).write_text((rundir / name).read_text())
    with pytest.raises(SystemExit, match="error: .* has no checkpoint yet"):
        export.main([f"--rundir={empty}", f"--out={tmp_path / 'b'}"])
    fork = types.SimpleNamespace(attention="mla", position="rope", connections="residual")
    with pytest.raises(UsageError, match="does not support attention=mla: .* in .'mha', "):
        export.check_exportable(fork)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # --force would replace --out whole: never the run itself, or a folder holding it
    run_files = sorted(p.name for p in rundir.iterdir())
    for out in (rundir, rundir.parent, rundir / "checkpoints", rundir / "new"):
        with pytest.raises(UsageError, match="is, holds or lies in the run directory .*: replacing"):
            export.export(epath.Path(rundir), out, force=True)
    assert sorted(p.name for p in rundir.iterdir()) == run_files
    # nor the repository's hf/, which holds a modeling_mugpt.py as an export does
    source = sorted(p.name for p in export.HF.iterdir())
    for out in (export.HF, ROOT):
        with pytest.raises(UsageError, match="is, holds or lies in the modeling files' source"):
            export.export(epath.Path(rundir), out, force=True)
    assert sorted(p.name for p in export.HF.iterdir()) == source
    (tmp_path / "f").write_text("")  # --out under a file: refused before the checkpoint is read
    with pytest.raises(UsageError, match="f is not a folder this user can write in"):
        export.export(epath.Path(rundir), tmp_path / "f" / "x")


def test_gpt2_tokenizer_export_encodes_as_tiktoken(tmp_path):
    """The exported GPT-2 tokenizer (built from tiktoken's own ranks) against tiktoken, and one
    tokenization of special-token text: "<|endoftext|>" written in a text is the ordinary text
    it is made of for data.py, sample.py and eval.py (text/tokenization.py) and for the export,
    with tiktoken's record and with a tokenizer.json that has it as a special token."""
    from text import tokenization

    record = {"kind": "tiktoken", "encoding": "gpt2"}
    hf_tok = export.hf_tokenizer({"tokenizer": record})
    enc = tokenization.encoding("gpt2")
    text = "Hello world!  It's <|endoftext|> 12345 déjà vu\n\n  spaces"
    ordinary = enc.encode_ordinary(text)
    assert enc.eot_token not in ordinary and ordinary != enc.encode(text, allowed_special="all")
    assert hf_tok(text)["input_ids"] == ordinary == tokenization.load(record)[0](text)
    assert hf_tok.eos_token_id == enc.eot_token and hf_tok.decode(hf_tok(text)["input_ids"]) == text
    hf_tok.save_pretrained(tmp_path / "tiktoken")  # as export writes it and transformers reads it
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "tiktoken")
    assert saved(text)["input_ids"] == ordinary
    # a tokenizers tokenizer.json whose "<|endoftext|>" is a special token (data.py --tokenizer=)
    hf_tok.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    record, _, for_documents = tokenization.for_documents(str(tmp_path / "tokenizer.json"))
    assert for_documents(text) == ordinary + [enc.eot_token]  # the separator: data.py's alone
    assert tokenization.load(record)[0](text) == ordinary
    assert export.hf_tokenizer({"tokenizer": record})(text)["input_ids"] == ordinary


def test_the_character_tokenizer_refuses_a_character_it_lacks(tmp_path):
    """The exported character tokenizer, as transformers loads it, encodes as
    text/tokenization.py does, and refuses a character outside the vocabulary as it does (a BPE
    model with no unknown token dropped it: "7 ab" was encoded as " ab")."""
    from text import tokenization

    record = {"kind": "char", "chars": sorted(set(TEXT))}
    export.hf_tokenizer({"tokenizer": record}).save_pretrained(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    encode = tokenization.load(record)[0]
    assert hf_tok(TEXT)["input_ids"] == encode(TEXT) and hf_tok.decode(encode(TEXT)) == TEXT
    with pytest.raises(UsageError, match="'7'"):
        encode("7 we")
    with pytest.raises(Exception, match=f"outside this model's {len(record['chars'])} characters"):
        hf_tok("7 we")


def test_a_tokenizer_that_adds_its_own_tokens_encodes_one_way_everywhere(tmp_path):
    """A BERT-style tokenizer.json whose post-processor wraps a text in [CLS] ... [SEP]: data.py's
    documents are the words' ids and its separator, sample.py/eval.py's and the export's the
    words' ids alone (they disagreed three ways: [CLS] w [SEP] [SEP], w, [CLS] w [SEP])."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from text import tokenization
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert tok.encode("hello world").ids == [1, 3, 4, 2]  # what it adds by itself
    record, _, for_documents = tokenization.for_documents(str(tmp_path / "tokenizer.json"))
    assert for_documents("hello world") == [3, 4, 2]  # [SEP]: the end-of-text separator
    assert tokenization.load(record)[0]("hello world") == [3, 4]
    assert export.hf_tokenizer({"tokenizer": record})("hello world")["input_ids"] == [3, 4]
    # a dataset prepared before: its record keeps the post-processor; read the same way
    old = {**record, "json": tok.to_str()}
    assert tokenization.load(old)[0]("hello world") == [3, 4]
    assert export.hf_tokenizer({"tokenizer": old})("hello world")["input_ids"] == [3, 4]


# one character per id: the variants' tests feed ids, the tokenizer only has to be writable
CHARS = {"tokenizer": {"kind": "char", "chars": string.printable[:65]}, "vocab_size": 65}


def variant_cfg(name):
    """test_variants' variant under muP with CompleteP's branch scale, an input multiplier and
    norm gains; 6 heads (ALiBi's slopes for a non-power of two; 2 key/value heads: groups of 3),
    3 layers (a MUDD layer between the first and the last); ALiBi's is tied as well."""
    return tiny(n_layer=3, n_head=6, d_model=48, param="mup", d_base=16, depth_base=1,
                alpha_in=1.5, norm_gain=True, tie_embeddings=name == "alibi", **VARIANTS[name])


def exported_variant(name, tmp_path):
    """A random model.py GPT of the variant (MUDD's W2 and b too, so its streams differ) and its
    export as transformers loads it."""
    cfg = variant_cfg(name)
    model = random_gpt(cfg)
    export.write(model, cfg, CHARS, tmp_path / name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True)
    return model, cfg, hf.eval()


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_pytorch_logits_equal_jax_logits(name, tmp_path):
    model, cfg, hf = exported_variant(name, tmp_path)
    ids = np.random.default_rng(0).integers(0, 65, cfg.block_size).tolist()
    want_TV = np.asarray(model(jnp.asarray(ids)))[:, :65]
    with torch.no_grad():
        got_TV = hf(torch.tensor([ids])).logits[0].numpy()
    diff = np.abs(got_TV - want_TV).max()
    print(f"{name}: max |PyTorch - JAX| logit = {diff:.3g} "
          f"(logits up to {np.abs(want_TV).max():.3g})")
    assert diff <= 1e-4
    assert np.abs(want_TV).max() > 0.1
    # on another device (a GPU's user calls .to("cuda")): every tensor the forward makes must be
    # made there; torch's meta device refuses a CPU tensor mixed in as a GPU would, with no GPU
    hf.to("meta")
    with torch.no_grad():
        out = hf(torch.tensor([ids[:5]], device="meta"), use_cache=True)
        step = hf(torch.tensor([ids[5:6]], device="meta"), past_key_values=out.past_key_values)
    assert step.logits.shape == (1, 1, hf.config.vocab_size) and step.logits.device.type == "meta"


@pytest.mark.parametrize("name", ["all", "mudd_sharedkv", "gqa"])
def test_variant_greedy_generate_equals_sample_py(name, tmp_path):
    """transformers' generate with its KV cache (rotated keys cached, SharedKV's too) against
    sample.py's greedy decoding with model.py's cache, past the block (the window slides)."""
    model, cfg, hf = exported_variant(name, tmp_path)
    assert_greedy_generate_equals_sample_py(model, cfg, hf, [5, 0, 17, 0, 3, 42], 3)


@pytest.mark.parametrize("name", ["all", "gqa"])
def test_left_padded_batch_generates_as_each_prompt_alone(name, tmp_path):
    """A batch of prompts of two lengths, left-padded as generate pads them: RoPE's positions come
    from the attention mask and ALiBi's distances from cache indices, so each row decodes as alone
    until the batch's window slides: the cache holds the padding too, so the shorter row slides
    with the longer, two tokens early; the longer row is as alone throughout."""
    _, cfg, hf = exported_variant(name, tmp_path)
    prompts, n = [[5, 17, 3, 42], [9, 8]], 2 * cfg.block_size
    before = cfg.block_size - len(prompts[0]) + 1  # tokens drawn before the batch's first slide
    with torch.no_grad():
        alone = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, -n:]
                 for p in prompts]
        ids = torch.tensor([prompts[0], [0, 0, *prompts[1]]])
        mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
        batch = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)[:, -n:]
    assert batch[0].tolist() == alone[0].tolist()
    assert batch[1, :before].tolist() == alone[1][:before].tolist()


# ---------------------------------------------------------------------------------------------
# The self-check: research edits of model.py that hf/modeling_mugpt.py does not follow


def parallel_block(self, xs_TD, at, cache=None, key=None):
    """GPT-J's parallel block: attention and MLP read the same input (a block computed
    differently)."""
    (x_TD,) = xs_TD
    attn_TD, cache = self.attn((definition.rms_norm(x_TD, self.attn_norm),), at, cache)
    mlp_TD = self.mlp(definition.rms_norm(x_TD, self.mlp_norm))
    return x_TD + self.branch_mult * (attn_TD + mlp_TD), cache


def local_attend(q_THK, k_SGK, v_SGK, scale, mask_TS=None, bias_HTS=None, attend=definition.attend):
    """A sliding window of 4 keys (a changed attention mask)."""
    T, S = q_THK.shape[0], k_SGK.shape[0]
    i, j = jnp.arange(T)[:, None] + S - T, jnp.arange(S)[None]
    return attend(q_THK, k_SGK, v_SGK, scale, (j <= i) & (j > i - 4), bias_HTS)


class BiasMLP(definition.MLP):
    """The MLP with an output bias (a new parameter)."""
    bias: jax.Array

    def __init__(self, cfg, fast):
        super().__init__(cfg, fast)
        self.bias = jnp.zeros(cfg.d_model)

    def __call__(self, x_TD):
        return super().__call__(x_TD) + self.bias


def assert_refused(message: str, out, *names: str) -> None:
    """export's refusal: one line naming the logit difference, the file to edit and names."""
    assert message.startswith("error: ") and "\n" not in message, message
    for part in ("max |PyTorch - JAX| logit", "edit hf/modeling_mugpt.py", *names):
        assert part in message, message
    assert not out.exists() and list(out.parent.iterdir()) == []  # no temporary folder either


@pytest.mark.parametrize("edit", ["block", "mask", "document-mask"])
def test_edited_trained_model_is_refused_in_one_line(runs, edit, tmp_path, monkeypatch):
    """document-mask: one keyed on the end-of-text id, which the check's tokens now hold."""
    if edit == "block":
        monkeypatch.setattr(definition.Block, "__call__", parallel_block)
    elif edit == "mask":
        monkeypatch.setattr(definition, "attend", local_attend)
    else:
        document_mask_after_end_of_text(monkeypatch, tiny().vocab_size - 1)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        export.main([f"--rundir={runs['sp'][0]}", f"--out={out}"])
    print(f"\n{edit}: {e.value.code}")
    assert_refused(e.value.code, out)


def test_a_document_mask_after_an_end_of_text_inside_the_vocabulary_is_refused(
        shakespeare, tmp_path, monkeypatch):
    """A tokenizer whose end-of-text is inside the vocabulary (Llama 3's 128001), and model.py
    edited to keep attention within documents closed by it: the unedited modeling file attends
    across them. The self-check's tokens hold the exported config's eos_token_id, so the export
    is refused; its random tokens never held that id."""
    from conftest import small_bpe
    from fused.agreement import tokens
    meta = small_bpe(shakespeare)
    V = meta["vocab_size"]
    cfg = tiny(vocab_size=V, block_size=32)
    mid = next(i for i in range(3, V - 2)
               if i not in tokens(32, V, seed=32) and i not in tokens(8, V, seed=8))
    meta["tokenizer"]["eos"] = mid
    document_mask_after_end_of_text(monkeypatch, mid)
    with pytest.raises(UsageError, match="does not follow model.py"):
        export.write(random_gpt(cfg), cfg, meta, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def edited_modeling_file(tmp_path, monkeypatch, code: str) -> None:
    """export.py's modeling files from a copy of hf/ whose modeling_mugpt.py ends with code: the
    edit is in the file the export writes and loads, as a researcher's would be."""
    hf = tmp_path.parent / f"{tmp_path.name}-hf"  # beside tmp_path: the test's out is in it
    shutil.copytree(export.HF, hf, dirs_exist_ok=True)
    (hf / "modeling_mugpt.py").write_text((export.HF / "modeling_mugpt.py").read_text() + code)
    monkeypatch.setattr(export, "HF", hf)


CACHED_STEP_AT_0 = """
_plain_forward = MuGPTForCausalLM.forward


def _forward(self, input_ids, *args, past_key_values=None, **kwargs):
    if past_key_values is not None and past_key_values.get_seq_length():
        kwargs["position_ids"] = torch.zeros_like(input_ids)
    return _plain_forward(self, input_ids, *args, past_key_values=past_key_values, **kwargs)


MuGPTForCausalLM.forward = _forward
"""
# A buffer made in __init__ and not saved (persistent=False, as Hugging Face's RoPE keeps its
# inv_freq): from_pretrained builds the model without running that __init__'s arithmetic
UNSAVED_BUFFER = """
_plain_init, _plain_forward = MuGPTForCausalLM.__init__, MuGPTForCausalLM.forward


def _init(self, config):
    _plain_init(self, config)
    self.register_buffer("logit_gain", torch.full((), 1.0), persistent=False)


def _forward(self, *args, **kwargs):
    out = _plain_forward(self, *args, **kwargs)
    out.logits = out.logits * self.logit_gain
    return out


MuGPTForCausalLM.__init__, MuGPTForCausalLM.forward = _init, _forward
"""


# Position interpolation (RoPE's positions halved) followed where the forward makes its default
# positions only: generate and lm-eval pass position_ids made from the attention mask
HALF_DEFAULT_POSITIONS = """
_plain_forward = MuGPTForCausalLM.forward


def _forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
             past_key_values=None, **kwargs):
    known = cache if cache is not None else past_key_values
    past = known.get_seq_length() if known is not None else 0
    if position_ids is None:
        B, T = input_ids.shape
        position_ids = (torch.arange(past, past + T) * 0.5)[None].expand(B, T)
    return _plain_forward(self, input_ids, attention_mask, position_ids, cache, past_key_values,
                          **kwargs)


MuGPTForCausalLM.forward = _forward
"""


@pytest.mark.parametrize("code", [CACHED_STEP_AT_0, UNSAVED_BUFFER, HALF_DEFAULT_POSITIONS],
                         ids=["cached-step-at-0", "unsaved-buffer", "half-default-positions"])
def test_an_edited_modeling_file_that_differs_is_refused(code, tmp_path, monkeypatch):
    """hf/modeling_mugpt.py edited apart from model.py, the export refused and nothing written: its
    KV-cache path (generate's) rotating each cached step as position 0 (its one-pass logits still
    model.py's; the self-check also decodes the last token by the cache); a gain on the logits
    kept in a buffer that is not saved, right in the class as built (a check of the class passed
    it) and not as from_pretrained loads it (the self-check loads the folder written); and
    model.py's RoPE positions halved, followed by the modeling file for default positions only
    (the self-check also runs generate's inputs, a left-padded row beside a full one)."""
    if code is HALF_DEFAULT_POSITIONS:
        from layers import positions
        plain_table = positions.rope_table
        monkeypatch.setattr(positions, "rope_table",
                            lambda pos_T, K, base: plain_table(pos_T * 0.5, K, base))
    edited_modeling_file(tmp_path, monkeypatch, code)
    cfg = tiny()
    leaves, tree = jax.tree.flatten(definition.GPT(cfg))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    gpt = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                    for x, k in zip(leaves, keys)])
    out = tmp_path / "out"
    with pytest.raises(UsageError) as e:
        export.write(gpt, cfg, CHARS, out)
    assert_refused(f"error: {e.value}", out)


# A norm that halves its output in float16 and bfloat16 only: float32 exports are untouched
NORM_IN_HALF = """
_plain_rms_norm = rms_norm


def rms_norm(x, gain=None):
    y = _plain_rms_norm(x, gain)
    return y if x.dtype == torch.float32 else 0.5 * y
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_modeling_file_that_computes_otherwise_in_half_precision_is_refused(dtype, tmp_path,
                                                                              monkeypatch):
    """The float32 self-check cannot see a path the modeling file takes only in float16 or
    bfloat16: its logits are finite but not float32's (here a norm that halves its output), and
    such an export is refused in one line, nothing written; float32's is written."""
    edited_modeling_file(tmp_path, monkeypatch, NORM_IN_HALF)
    cfg = tiny()
    gpt = random_gpt(cfg)
    export.write(gpt, cfg, CHARS, tmp_path / "float32")
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=f"^in {dtype} the exported model computes other logits "
                                         "than in float32 .*nothing was written$") as e:
        export.write(gpt, cfg, CHARS, out, dtype)
    print(f"\n{dtype}: error: {e.value}")
    assert "\n" not in str(e.value) and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float32"]  # no temporary folder


@pytest.mark.parametrize("readout", [1.0, 0.01])
def test_an_exact_gelu_is_refused_whatever_the_size_of_the_logits(readout, tmp_path, monkeypatch):
    """model.py's GELU made exact (erf) while the modeling file keeps GPT-2's tanh form: the
    logits differ by ~2e-4 of the largest, above the bound, in a random model and in the same
    model with its readout scaled by 0.01, as early in training (logits below 1). The bound was
    relative to the largest logit but at least 1, and let the small-logit model through."""
    monkeypatch.setattr(definition, "gelu", lambda x: jax.nn.gelu(x, approximate=False))
    cfg = tiny()
    gpt = random_gpt(cfg)
    gpt = eqx.tree_at(lambda g: g.emb.unembed, gpt, gpt.emb.unembed * readout)
    out = tmp_path / "out"
    with pytest.raises(UsageError) as e:
        export.write(gpt, cfg, CHARS, out)
    print(f"\nreadout x {readout}: error: {e.value}")
    assert_refused(f"error: {e.value}", out)


@pytest.mark.parametrize("edit", ["exact-gelu", "soft-cap-50", "rms-norm-eps-1e-5",
                                  "qk-norm-eps-1e-5"])
def test_an_edit_an_early_checkpoint_hides_is_refused(runs, edit, tmp_path, monkeypatch):
    """A checkpoint 10 steps in (muP's readout still near its zero start): an exact GELU or a
    soft-cap of the attention logits at 50 moves its logits by less than the bound on its own
    weights, and it was exported, the PyTorch file computing the old math. The check on a model
    drawn as training starts (check.drawn) sees both: refused. An epsilon of 1e-5 for 1e-6 in
    RMSNorm or the QK-norm (LLaMA's value) hides on the drawn model too; the drawn model with its
    arrays but the gains at 1/64 shows it."""
    from test_kernels import capped_logits, norm_eps
    if edit == "exact-gelu":
        monkeypatch.setattr(definition, "gelu", lambda x: jax.nn.gelu(x, approximate=False))
    elif edit == "soft-cap-50":
        monkeypatch.setattr(definition, *capped_logits(50.0))
    elif edit == "qk-norm-eps-1e-5":
        monkeypatch.setattr(definition, *norm_eps(1e-5))
    else:
        def rms_norm(x_TD, gain_D):
            x = x_TD.astype(jnp.float32)
            y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
            return (y if gain_D is None else y * gain_D).astype(x_TD.dtype)
        monkeypatch.setattr(definition, "rms_norm", rms_norm)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        export.main([f"--rundir={runs['fsdp4'][0]}", f"--out={out}"])
    print(f"\n{edit}: {e.value.code}")
    assert_refused(e.value.code, out, "on a drawn model")


def test_a_drawn_model_has_no_zero_array_and_no_two_alike():
    """check.drawn, the model the check above runs on: every array nonzero (a zero one, as MUDD's
    w2 starts, hides what it multiplies) and each a draw of its own: no two drawn arrays share
    their leading values (one key for every zero array gave the readout and each layer's MUDD
    w2 and b the same ones, whatever their shapes). The norms' gains, all ones, are not drawn."""
    gpt = check.drawn(tiny(**VARIANTS["all"], n_layer=3))
    flat = [np.asarray(x).ravel() for x in jax.tree.leaves(eqx.filter(gpt, eqx.is_array))]
    assert all(x.any() for x in flat)
    drawn = [x for x in flat if np.ptp(x) > 0]
    assert len(drawn) == 15 and not [(i, j) for i, x in enumerate(drawn) for j, y in
                                     enumerate(drawn[:i]) if np.array_equal(x[:4], y[:4])]


@pytest.mark.parametrize("bias", ["random", "zero"])
def test_new_parameter_is_refused_and_named(bias, tmp_path, monkeypatch):
    """A bias that export.py does not convert: named, even while it is zero (logits equal)."""
    import params
    monkeypatch.setattr(definition, "MLP", BiasMLP)
    rows = params.policy_rows  # its row, as a run of it has (export draws a model as params does)
    monkeypatch.setattr(params, "policy_rows", lambda c: {
        **rows(c), "blocks.mlp.bias": params.Policy(0.0, 1.0, False, (None,))})
    cfg = tiny()
    gpt = definition.GPT(cfg)
    leaves, tree = jax.tree.flatten(gpt)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    gpt = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                    for x, k in zip(leaves, keys)])
    if bias == "zero":
        gpt = eqx.tree_at(lambda g: g.blocks.mlp.bias, gpt, jnp.zeros_like(gpt.blocks.mlp.bias))
    out = tmp_path / "out"
    with pytest.raises(UsageError) as e:
        export.write(gpt, cfg, CHARS, out)
    print(f"\n{bias} bias: error: {e.value}")
    assert_refused(f"error: {e.value}", out, "carries: blocks.mlp.bias;")


# ---------------------------------------------------------------------------------------------
# Writing: atomic, --force replaces whole; half precision


def test_out_is_replaced_whole_and_never_half_written(runs, tmp_path, monkeypatch):
    rundir, hf_dir = runs["sp"]
    (tmp_path / "file").write_text("mine")
    with pytest.raises(UsageError, match="--out=.*file is a file: export writes a folder"):
        export.export(epath.Path(rundir), tmp_path / "file", force=True)
    assert (tmp_path / "file").read_text() == "mine"
    (tmp_path / "notes" / "sub").mkdir(parents=True)  # not an export: --force does not delete it
    (tmp_path / "notes" / "sub" / "results.csv").write_text("mine")
    with pytest.raises(UsageError, match="notes is not a folder export.py wrote .*: --force "):
        export.export(epath.Path(rundir), tmp_path / "notes", force=True)
    assert (tmp_path / "notes" / "sub" / "results.csv").read_text() == "mine"
    shutil.rmtree(tmp_path / "notes")
    out = tmp_path / "out"
    shutil.copytree(hf_dir, out)
    (out / "stale.txt").write_text("an older export's")
    names = lambda d: sorted(p.name for p in d.iterdir()) if d.exists() else None  # noqa: E731
    # an export that dies after writing its weights (as kill -9 would) leaves --out as it was
    with monkeypatch.context() as m:
        m.setattr(export.shutil, "copy", lambda *a: (_ for _ in ()).throw(OSError("killed")))
        for target, force in ((tmp_path / "new", False), (out, True)):
            before = names(target)
            kept = "the old export is as it was" if force else "nothing was written"
            with pytest.raises(UsageError, match=f"writing .* failed \\(killed\\); {kept}"):
                export.export(epath.Path(rundir), target, force=force)
            assert names(target) == before
    export.export(epath.Path(rundir), out, force=True)
    assert names(out) == names(hf_dir)  # the stale file went with the old export
    assert names(tmp_path) == ["file", "out"]  # and no temporary folder stays


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_export_that_overflows_is_refused(dtype, tmp_path):
    """Embeddings past float16's largest number (65504; a muP run's can grow so): the float32
    self-check passes, the float16 model's logits are not finite, and a float16 export is refused
    in one line, nothing written; bfloat16's range holds them, and it is written."""
    cfg = variant_cfg("gqa")
    model = eqx.tree_at(lambda m: m.emb.embed, random_gpt(cfg), replace_fn=lambda x: 1e5 * x)
    if dtype == "float16":
        with pytest.raises(UsageError, match="^in float16 the exported model's logits are not "
                                             "finite .*nothing was written$"):
            export.write(model, cfg, CHARS, tmp_path / dtype, dtype)
        assert not (tmp_path / dtype).exists()
    else:
        export.write(model, cfg, CHARS, tmp_path / dtype, dtype)
        assert (tmp_path / dtype / "model.safetensors").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_export_loads_and_generates_as_jax(runs, dtype, tmp_path):
    """Weights saved in dtype, loaded by transformers in it (config.json's dtype): logits within
    the dtype's rounding of the float32 JAX model's, greedy tokens equal on the trained model."""
    rundir, _ = runs["sp"]
    export.export(epath.Path(rundir), tmp_path / dtype, dtype=dtype)
    model, cfg, hf, tokenizer = load(rundir, tmp_path / dtype)
    assert {p.dtype for p in hf.parameters()} == {getattr(torch, dtype)}
    ids = tokenizer(TEXT[:cfg.block_size])["input_ids"]
    want_TV = np.asarray(model(jnp.asarray(ids)))[:, :65]
    with torch.no_grad():
        got_TV = hf(torch.tensor([ids])).logits[0].numpy()
    diff, scale = np.abs(got_TV - want_TV).max(), np.abs(want_TV).max()
    print(f"\n{dtype}: max |PyTorch - JAX| logit = {diff:.3g} (logits up to {scale:.3g})")
    # a few roundings of the dtype's precision (bfloat16 8 bits, float16 11) of the logits' scale
    assert diff <= 2 * scale * float(torch.finfo(getattr(torch, dtype)).eps)
    assert_greedy_generate_equals_sample_py(model, cfg, hf, tokenizer("First\nA")["input_ids"])
