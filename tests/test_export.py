"""export.py: the exported PyTorch model (loaded by transformers itself) against the JAX model.
Runs are trained by launch.py in subprocesses (one of them on 4 simulated devices, FSDP-sharded)
and exported here on one CPU device; the architecture variants are random models written by
export.write."""
import dataclasses
import string
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

import export
from inference import decode
from run import reading
from conftest import TINY_RUN, run, tiny
from run.errors import UsageError
from test_model import random_gpt
from test_variants import VARIANTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak."
# name -> (launch.py arguments beyond TINY_RUN, environment)
RUNS = {
    # SP, untied; more steps so that greedy decoding is not one repeated character
    "sp": (["--config.param=sp", "--config.max_steps=60", "--config.learning_rate=1e-2",
            "--config.min_lr=1e-2"], {}),
    # muP at width_mult 2 and depth_mult 2 (readout 1/2, branches 1/2), tied, norm gains, alpha_in
    "mup_tied": (["--config.param=mup", "--config.d_base=16", "--config.depth_base=1",
                  "--config.tie_embeddings=true", "--config.norm_gain=true",
                  "--config.alpha_in=1.5", "--config.max_steps=10"], {}),
    # 4 devices: every matrix sharded 4 ways in the checkpoint
    "fsdp4": (["--config.max_steps=10"], {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}),
    # every variant at once, through launch.py's config.json and the checkpoint as export.py reads them
    "variants": (["--config.attention=sharedkv", "--config.n_kv_head=1", "--config.position=alibi",
                  "--config.connections=mudd", "--config.max_steps=10"], {}),
}


@pytest.fixture(scope="module")
def runs(shakespeare, tmp_path_factory):
    """Each run's directory and its export."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, (args, env) in RUNS.items():
        rundir = root / name
        r = run(["launch.py", *TINY_RUN, "--config.eval_batches=1", f"--rundir={rundir}", *args],
                env)
        assert r.returncode == 0, r.stderr[-2000:]
        export.export(epath.Path(rundir), root / f"{name}_hf")
        out[name] = rundir, root / f"{name}_hf"
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


def test_greedy_generate_equals_sample_py(runs):
    """transformers' generate (with its KV cache) against sample.generate at temperature 0, within
    the block (sample.py slides its window beyond it, transformers does not)."""
    model, cfg, hf, tokenizer = load(*runs["sp"])
    assert_greedy_generate_equals_sample_py(model, cfg, hf, tokenizer("First")["input_ids"])


def assert_greedy_generate_equals_sample_py(model, cfg, hf, prompt: list[int]) -> None:
    """hf.generate's greedy tokens after prompt, to the end of the block, are sample.py's."""
    n = cfg.block_size - len(prompt)
    want = decode.generate(model, decode.prompt_window(prompt, cfg.block_size), jax.random.key(0),
                           jnp.float32(0.0), num_samples=1, max_new_tokens=n, n_vocab=65)
    want = np.asarray(want)[0].tolist()
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          use_cache=True, attention_mask=torch.ones(1, len(prompt), dtype=int))
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


def test_gpt2_tokenizer_export_encodes_as_tiktoken():
    """The exported GPT-2 tokenizer (built from tiktoken's own ranks) against tiktoken."""
    from text import tokenization

    hf_tok = export.hf_tokenizer({"tokenizer": {"kind": "tiktoken", "encoding": "gpt2"}})
    enc = tokenization.encoding("gpt2")
    text = "Hello world!  It's <|endoftext|> 12345 déjà vu\n\n  spaces"
    assert hf_tok(text)["input_ids"] == enc.encode(text, allowed_special="all")
    assert hf_tok.eos_token_id == enc.eot_token and hf_tok.decode(hf_tok(text)["input_ids"]) == text


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


@pytest.mark.parametrize("name", ["all", "mudd_sharedkv", "gqa"])
def test_variant_greedy_generate_equals_sample_py(name, tmp_path):
    """transformers' generate with its KV cache (rotated keys cached, SharedKV's too) against
    sample.py's greedy decoding with model.py's cache, within the block."""
    model, cfg, hf = exported_variant(name, tmp_path)
    assert_greedy_generate_equals_sample_py(model, cfg, hf, [5, 17, 3, 42])


@pytest.mark.parametrize("name", ["all", "gqa"])
def test_left_padded_batch_generates_as_each_prompt_alone(name, tmp_path):
    """A batch of prompts of two lengths, left-padded as generate pads them: RoPE's positions come
    from position_ids and ALiBi's distances from cache indices, so each row decodes as alone."""
    _, cfg, hf = exported_variant(name, tmp_path)
    prompts, n = [[5, 17, 3, 42], [9, 8]], 8
    with torch.no_grad():
        alone = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, -n:]
                 for p in prompts]
        ids = torch.tensor([prompts[0], [0, 0, *prompts[1]]])
        mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
        batch = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)[:, -n:]
    assert [b.tolist() for b in batch] == [a.tolist() for a in alone]
