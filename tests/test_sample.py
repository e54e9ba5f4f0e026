"""sample.py: cached decoding against full recomputation, the sampling rules, the CLI's errors."""
import dataclasses
import json
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data
import model as M
import params
import sample
from inference import decode
import train
from conftest import document_mask_after_end_of_text, run as run_process, tiny
from run.errors import UsageError
from test_model import random_gpt

N_VOCAB = 65  # shakespeare_char's characters; the model pads its vocabulary to 128


@pytest.fixture(scope="module")
def trained(shakespeare):
    """A tiny model trained for 40 steps on shakespeare_char, and its config."""
    cfg = tiny(block_size=32, d_model=64, learning_rate=3e-3, min_lr=3e-3, max_steps=40)
    s = train.setup(cfg, train.make_mesh(cfg))
    tokens = data.load_split(cfg, "train")
    model, opt_state = s.model, s.opt_state
    for step in range(cfg.max_steps):
        x, y = data.get_batch(tokens, cfg.seed, data.TRAIN, step, cfg.batch_size, cfg.block_size)
        model, opt_state, metrics = s.step(model, opt_state, x[None], y[None])
    assert float(metrics["loss"]) < 3.3  # it learnt something (ln 65 = 4.17)
    return model, cfg


def greedy_by_recomputation(model, prompt: list[int], n: int, S: int) -> tuple[list[int], list]:
    """The reference: each token the argmax of the full forward pass over its context, recomputed
    from scratch, the context being the tokens since the window last slid (by S - S // 2 once it
    held S + 1). The context is padded to S tokens, so the forward pass compiles once; being
    causal, the model's logits at the last real token do not see the padding. Returns the tokens
    and the logits each was picked from."""
    forward = jax.jit(model.__call__)
    tokens, first, logits = list(prompt), 0, []
    for _ in range(n):
        if len(tokens) - first > S:
            first += S - S // 2
        context = tokens[first:]
        logits_TV = np.asarray(forward(jnp.asarray(context + [0] * (S - len(context)))))
        logits.append(logits_TV[len(context) - 1])
        tokens.append(int(np.argmax(logits_TV[len(context) - 1, :N_VOCAB])))
    return tokens[len(prompt):], logits


def run(model, cfg, prompt: list[int], seed=0, temperature=1.0, **settings) -> np.ndarray:
    settings = {"num_samples": 2, "max_new_tokens": 60, "n_vocab": N_VOCAB, **settings}
    return np.asarray(decode.generate(model, decode.prompt_window(prompt, cfg.block_size), jax.random.key(seed),
                                      jnp.float32(temperature), **settings))


def test_cached_greedy_equals_greedy_by_recomputation(trained, monkeypatch):
    """60 tokens from a 5-token prompt with a 32-token window: 27 within it, then two slides.
    The tokens, and the logits each was picked from (read out of generate by a callback in
    pick), equal the full forward's: a cache bug that leaves the argmax alone still fails."""
    model, cfg = trained
    prompt = [18, 47, 56, 57, 58]  # "First"
    want, want_logits = greedy_by_recomputation(model, prompt, 60, cfg.block_size)
    seen = []
    pick = decode.pick

    def recording_pick(logits_V, *args, **kwargs):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), logits_V, ordered=False)
        return pick(logits_V, *args, **kwargs)

    monkeypatch.setattr(decode, "pick", recording_pick)
    # three samples: a shape no other test compiles generate for, so it is traced with the patch
    got = run(model, cfg, prompt, temperature=0.0, num_samples=3)
    assert len(set(want)) > 3  # not one token repeated: a real check of the cache
    assert all(row.tolist() == want for row in got)
    # the first pick sees the prefill's logits broadcast to the samples, then one per sample
    assert len(seen) == 60 * 3
    got_logits = np.reshape(seen, (60, 3, -1))
    for i, logits_V in enumerate(want_logits):
        for b in range(3):
            np.testing.assert_allclose(got_logits[i, b], logits_V, rtol=1e-4, atol=1e-4,
                                       err_msg=f"token {i}, sample {b}")


def test_extend_gives_the_full_forward_logits():
    """Prefill of 5 tokens, then 11 single-token steps: every position's logits equal the full pass's,
    on a model with every parameter random (tied embeddings, norm gains) so that no term hides."""
    cfg = tiny(block_size=16, tie_embeddings=True, norm_gain=True)
    model = random_gpt(cfg)
    tokens_T = jnp.asarray(np.random.default_rng(0).integers(0, N_VOCAB, 16))
    want_TV = np.asarray(model(tokens_T))
    extend = eqx.filter_jit(decode.extend)  # compiled once for the prefill and once for the steps
    x_TD, cache = extend(model, decode.empty_cache(model, 16), tokens_T[:5], 0)
    got = [model.logits(x_TD)]
    for t in range(5, 16):
        x_1D, cache = extend(model, cache, tokens_T[t:t + 1], jnp.int32(t))
        got.append(model.logits(x_1D))
    np.testing.assert_allclose(np.concatenate(got), want_TV, rtol=1e-4, atol=1e-4)


def test_alibi_decodes_past_block_size_as_its_full_forward():
    """An ALiBi model (random weights) decoding with a cache of 3 x block_size positions, past a
    slide: greedy tokens equal those of the full forward over each context (ALiBi's biases depend
    on distances only, so longer contexts are the same model)."""
    cfg = tiny(block_size=8, position="alibi", n_head=4)
    model, S = random_gpt(cfg), 3 * cfg.block_size
    prompt = [18, 47, 56, 57, 58]
    want, _ = greedy_by_recomputation(model, prompt, 40, S)
    got = decode.generate(model, decode.prompt_window(prompt, S), jax.random.key(0),
                          jnp.float32(0.0), num_samples=1, max_new_tokens=40, n_vocab=N_VOCAB)
    assert np.asarray(got)[0].tolist() == want


def test_top_k_1_is_greedy_and_the_seed_fixes_the_samples(trained):
    model, cfg = trained
    prompt = [0]  # a newline
    greedy = run(model, cfg, prompt, temperature=0.0)
    assert (run(model, cfg, prompt, top_k=1, seed=3) == greedy).all()
    assert (run(model, cfg, prompt, top_p=1e-6, seed=3) == greedy).all()  # the nucleus of one token
    a, b, c = (run(model, cfg, prompt, seed=s) for s in (7, 7, 8))
    assert (a == b).all() and not (a == c).all() and not (a[0] == a[1]).all()
    assert not (a == greedy).all()
    # sample 0 does not depend on how many samples are drawn with it
    assert (run(model, cfg, prompt, seed=7, num_samples=1)[0] == a[0]).all()


def test_low_temperature_approaches_greedy(trained):
    """The draw's mass moves onto the argmax as the temperature falls (exactly: e^(l_i/T) / sum_j e^(l_j/T)),
    and at 1e-3 a trained model's samples are its greedy ones."""
    logits_V = jnp.array([2.0, 1.5, 0.0, 1.0])
    keys = jax.random.split(jax.random.key(0), 4000)
    for t in (1.0, 0.3, 0.1):
        top = np.mean(jax.vmap(lambda k: decode.pick(logits_V, k, jnp.float32(t), 4, 0, 1.0))(keys) == 0)
        assert top == pytest.approx(float(jax.nn.softmax(logits_V / t)[0]), abs=0.025)
    model, cfg = trained
    greedy = run(model, cfg, [0], temperature=0.0)
    assert (run(model, cfg, [0], temperature=1e-3, seed=1) == greedy).all()
    assert not (run(model, cfg, [0], temperature=1.0, seed=1) == greedy).all()


def test_pick_draws_only_from_the_top_k_and_the_nucleus():
    logits_V = jnp.log(jnp.array([0.05, 0.5, 0.15, 0.3, 0.0]))  # token 4 is padding: never drawn
    keys = jax.random.split(jax.random.key(0), 2000)

    def draws(**kw):
        kw = {"n_vocab": 4, "top_k": 0, "top_p": 1.0, **kw}
        temperature = kw.pop("temperature", 1.0)
        return np.bincount(jax.vmap(lambda k: decode.pick(logits_V, k, temperature, **kw))(keys), minlength=5) / len(keys)

    assert draws()[[0, 4]].tolist() == pytest.approx([0.05, 0.0], abs=0.02)
    assert draws(top_k=2).tolist() == pytest.approx([0, 0.5 / 0.8, 0, 0.3 / 0.8, 0], abs=0.04)
    assert draws(top_p=0.7).tolist() == pytest.approx([0, 0.5 / 0.8, 0, 0.3 / 0.8, 0], abs=0.04)  # 0.5 < 0.7 <= 0.8
    assert draws(top_p=0.85).tolist() == pytest.approx([0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95, 0], abs=0.04)
    assert draws(temperature=0.0).tolist() == [0, 1, 0, 0, 0]
    # the limits, where logits / T overflows: a huge T draws the 4 real tokens uniformly, a tiny one the argmax
    assert draws(temperature=jnp.float32(jnp.inf)).tolist() == pytest.approx([0.25, 0.25, 0.25, 0.25, 0], abs=0.04)
    assert draws(temperature=1e-38).tolist() == [0, 1, 0, 0, 0]


@pytest.fixture(scope="module")
def run_dir(shakespeare, tmp_path_factory):
    """A run directory as launch.py leaves it: config.json, event files and (with run/checkpoint.py) a
    checkpoint of steps 5 and 10, from 10 steps of a tiny model with evaluations at 0, 5 and 10."""
    cfg = tiny(max_steps=10, eval_interval=5, ckpt_interval=5)
    rundir = tmp_path_factory.mktemp("run")
    (rundir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    train.train(cfg, rundir)
    return rundir


def test_training_writes_a_text_sample_at_each_eval(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert "sample" in acc.Tags()["tensors"]
    events = acc.Tensors("sample")
    assert [e.step for e in events] == [0, 5, 10]
    chars = set(data.read_meta(tiny())["tokenizer"]["chars"])
    for e in events:
        text = e.tensor_proto.string_val[0].decode()
        assert text.startswith("```\n?\n\nGREMI") and text.endswith("\n```")  # the val split's first 8 characters
        body = text[len("```\n"):-len("\n```")]
        assert len(body) == 8 + 128 and set(body) <= chars


def test_cli_prints_samples_and_tokens_per_s(run_dir, capsys):
    sample.main([f"--rundir={run_dir}", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=40", "--seed=1"])
    *samples, speed = capsys.readouterr().out.split("-" * 40 + "\n")  # each sample is followed by a rule
    assert len(samples) == 2 and all(s.startswith("ROMEO:") and len(s) == len("ROMEO:") + 40 + 1 for s in samples)
    assert re.fullmatch(rf"{run_dir} step 10: 80 tokens \(2 x 40\) in .* s: [\d,]+ tokens/s on .*\n", speed), speed
    sample.main([f"--rundir={run_dir}", "--step=5", "--max_new_tokens=10"])
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"{run_dir} step 5: 30 tokens (3 x 10)")


def test_samples_decode_with_the_run_directorys_dataset_record(run_dir, tmp_path, capsys):
    """With dataset.json in the run directory (launch.py writes it) sampling needs no dataset (here one
    that is gone): the same run with every letter's case swapped in its dataset.json samples the same ids,
    so the case-swapped text."""
    def greedy(rundir, start):
        sample.main([f"--rundir={rundir}", f"--start={start}", "--num_samples=1", "--max_new_tokens=30", "--temperature=0"])
        return capsys.readouterr().out.split("-" * 40)[0]

    text = greedy(run_dir, "ROMEO:")
    shutil.copytree(run_dir, tmp_path / "run")
    cfg = json.loads((run_dir / "config.json").read_text())
    (tmp_path / "run" / "config.json").write_text(json.dumps({**cfg, "data_root": str(tmp_path), "dataset": "gone"}))
    assert error_line([f"--rundir={tmp_path / 'run'}"]).startswith(f"error: no dataset at {tmp_path / 'gone'}")
    meta = data.read_meta(tiny())
    meta["tokenizer"]["chars"] = meta["tokenizer"]["chars"].swapcase()
    (tmp_path / "run" / "dataset.json").write_text(json.dumps(meta))
    assert greedy(tmp_path / "run", "romeo:") == text.swapcase() and text.startswith("ROMEO:")
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "run" / "dataset.json").write_text("{not json")  # unreadable: one line naming it
    assert error_line([f"--rundir={tmp_path / 'run'}"]).startswith(f"error: {tmp_path / 'run' / 'dataset.json'} is not JSON")
    (tmp_path / "run" / "dataset.json").unlink()  # none (an older run): the dataset's own meta.json
    assert greedy(tmp_path / "run", "ROMEO:") == text


def error_line(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        sample.main(argv)
    assert isinstance(e.value.code, str) and "\n" not in e.value.code
    return e.value.code


def test_bad_input_is_one_line(run_dir, tmp_path):
    assert error_line([f"--rundir={tmp_path / 'nope'}"]) == f"error: no run directory {tmp_path / 'nope'}"
    assert error_line([f"--rundir={tmp_path}"]) == f"error: {tmp_path} holds no run: it has no config.json"
    assert error_line([f"--rundir={run_dir}", "--start="]).startswith("error: the prompt is empty")
    assert error_line([f"--rundir={run_dir}", "--start=FILE:" + str(tmp_path / "none.txt")]).endswith("no such file")
    assert error_line([f"--rundir={run_dir}", "--start=Zürich"]) == "error: characters 'ü' are not in the dataset's vocabulary"
    assert error_line([f"--rundir={run_dir}", "--top_p=0"]) == "error: --top_p=0.0 must be in (0, 1]"
    assert error_line([f"--rundir={run_dir}", "--temperature=inf"]).startswith("error: --temperature=inf must be finite")
    assert error_line([f"--rundir={run_dir}", "--context=1"]) == "error: --context=1 must be at least 2"
    # XLA aborts the process (no Python error) when it sizes 2**31 samples' buffers
    assert error_line([f"--rundir={run_dir}", f"--num_samples={2**31 - 1}"]).endswith("at most 2**20 a call")
    assert error_line([f"--rundir={run_dir}", f"--seed={2**31}"]) == f"error: --seed={2**31} must be in [0, 2**31)"
    # past block_size is allowed (ALiBi extrapolates): out of memory is one line naming --context
    # (a context of 3M tokens: 9e12 attention scores a head, past any machine)
    assert error_line([f"--rundir={run_dir}", "--context=3000000"]).startswith("error: out of memory (RESOURCE_EXHAUSTED")
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)))
    assert error_line([f"--rundir={run_dir}", f"--start=FILE:{tmp_path / 'binary.txt'}"]).endswith("is not UTF-8 text")
    assert error_line([f"--rundir={run_dir}", "--step=7"]) == f"error: --step=7: {run_dir} has checkpoints of steps 5, 10 only"
    (tmp_path / "config.json").write_text((run_dir / "config.json").read_text())  # a run without a checkpoint
    assert error_line([f"--rundir={tmp_path}"]).startswith(f"error: {tmp_path} has no checkpoint yet")
    (tmp_path / "checkpoints.json").write_text('{"saved": [5, 10]}')  # a run whose checkpoints are gone
    assert error_line([f"--rundir={tmp_path}"]).startswith(
        f"error: {tmp_path} saved checkpoints up to step 10 (checkpoints.json) and none is left")


def test_a_prompt_of_no_tokens_is_refused(run_dir, monkeypatch):
    """A tokenizer that splits on whitespace (tokenizers' WordLevel) encodes sample.py's default
    prompt, a newline, to no token: generate then started after the padding id 0 as if it were
    the prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = Tokenizer(models.WordLevel({"ROMEO": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    assert words.encode("\n").ids == [] and words.encode("ROMEO\n").ids == [0]
    monkeypatch.setattr(sample, "tokenizer", lambda meta: (lambda t: words.encode(t).ids, str))
    assert error_line([f"--rundir={run_dir}"]) == (
        "error: --start='\\n' is no token in this run's tokenizer (it drops what the prompt "
        "holds): pass a prompt it keeps")


def test_a_missing_step_is_one_line_on_stderr_without_orbax_warnings(run_dir):
    r = run_process(["sample.py", f"--rundir={run_dir}", "--step=7"])
    assert r.returncode == 1 and r.stderr == f"error: --step=7: {run_dir} has checkpoints of steps 5, 10 only\n", r.stderr


def window_in_the_default_mask(monkeypatch):
    """A sliding window (the last 12 keys) written where model.attend makes its causal mask: the
    full forward takes it, decoding passes its own mask and would not."""
    plain = M.attend

    def attend(q_THK, k_SGK, v_SGK, scale, mask_TS=None, bias_HTS=None):
        if mask_TS is None:
            back_TS = jnp.arange(q_THK.shape[0])[:, None] - jnp.arange(k_SGK.shape[0])
            mask_TS = (back_TS >= 0) & (back_TS < 12)
        return plain(q_THK, k_SGK, v_SGK, scale, mask_TS, bias_HTS)
    monkeypatch.setattr(M, "attend", attend)


def positions_without_start(monkeypatch):
    """Learned absolute positions added in GPT.embed, which knows no start: each decoding step's
    token would get position 0's vector."""
    plain = M.GPT.embed
    table_TD = jax.random.normal(jax.random.key(3), (16, 32))
    monkeypatch.setattr(M.GPT, "embed", lambda self, tokens_T: plain(self, tokens_T)
                        + table_TD[:tokens_T.shape[0]])


def mask_aligned_to_the_last_key(monkeypatch):
    """model.attend's causal mask for T queries over S keys aligned to the last key (as
    FlashAttention 2.1 and is_causal may align it), the mask passed in ignored: right for the full
    forward (T = S) and for a step at the cache's last position, wrong for a step before it,
    which then reads the padding after its own position."""
    plain = M.attend

    def attend(q_THK, k_SGK, v_SGK, scale, mask_TS=None, bias_HTS=None):
        T, S = q_THK.shape[0], k_SGK.shape[0]
        return plain(q_THK, k_SGK, v_SGK, scale, jnp.tril(jnp.ones((T, S), bool), S - T), bias_HTS)
    monkeypatch.setattr(M, "attend", attend)


def document_mask_at_the_last_id(monkeypatch):
    document_mask_after_end_of_text(monkeypatch, N_VOCAB - 1)


@pytest.mark.parametrize("edit", [window_in_the_default_mask, positions_without_start,
                                  document_mask_at_the_last_id, mask_aligned_to_the_last_key],
                         ids=["window-in-attend", "positions-in-embed", "document-mask",
                              "mask-aligned-to-the-last-key"])
def test_an_edit_decoding_does_not_follow_is_refused(run_dir, monkeypatch, capsys, edit):
    """Edits of model.py that training and the full forward take and KV-cache decoding does
    not: sample.py refuses in one line (it sampled another model than the trained one, silently);
    training's preview writes the reason instead of a sample, and training goes on."""
    edit(monkeypatch)
    jax.clear_caches()  # compiled before the edit (filter_jit's key is the model's structure)
    line = error_line([f"--rundir={run_dir}", "--max_new_tokens=10"])
    assert line.startswith("error: decoding with a KV cache does not give the model's own logits "
                           "(they differ by "), line
    assert capsys.readouterr().out == ""
    model = random_gpt(tiny())
    text = decode.preview(model, tiny(), [1, 2, 3], lambda t: "".join(map(str, t)), N_VOCAB)
    assert text.startswith("(no sample: decoding with a KV cache does not give"), text


@pytest.mark.parametrize("param", ["sp", "mup"])
def test_the_cache_check_sees_an_edit_at_step_0(monkeypatch, param):
    """At init the readout is zero (the loss starts at ln V), every logit 0 in both paths: the
    check at a run's first evaluation would compare zeros and pass any edit. It checks with a
    drawn readout instead; the model as initialised, with an edit decoding does not follow, is
    refused."""
    window_in_the_default_mask(monkeypatch)
    cfg = tiny(param=param, n_layer=3)  # another shape than the other tests': jit's cache
    model = params.init_gpt(cfg, jax.random.key(0))
    assert not jnp.any(model.embeddings().unembed)
    with pytest.raises(UsageError, match="decoding with a KV cache does not give"):
        decode.check_cache(model, cfg, cfg.block_size)


def test_the_cache_check_draws_the_tokenizers_end_of_text(monkeypatch):
    """A document mask after an end-of-text inside the vocabulary (Llama 3's is 128001, no edge
    id): the check's tokens hold the tokenizer's special ids (sample.py and the preview pass
    them), so decoding's difference shows. Without them no token of the check is that id, and
    the edit passes unseen."""
    from fused.agreement import tokens
    cfg = tiny(n_layer=3)  # another shape than the other tests': jit's cache
    S = cfg.block_size
    mid = next(i for i in range(3, cfg.vocab_size - 2) if i not in tokens(S, cfg.vocab_size))
    document_mask_after_end_of_text(monkeypatch, mid)
    jax.clear_caches()
    model = random_gpt(cfg)
    decode.check_cache(model, cfg, S)
    with pytest.raises(UsageError, match="decoding with a KV cache does not give"):
        decode.check_cache(model, cfg, S, (mid,))


def test_the_cache_check_passes_an_unedited_model_in_bfloat16():
    """check_cache runs the model's arrays in float32, then in bfloat16 at its tolerance: a
    bfloat16 model (random, 4 layers, every gain random) that decodes as it trains is not refused
    for its rounding."""
    cfg = tiny(compute_dtype="bfloat16", n_layer=4, norm_gain=True)
    decode.check_cache(random_gpt(cfg), cfg, cfg.block_size)


def test_the_cache_check_allows_a_deep_models_own_rounding(monkeypatch):
    """Decoding's honest bfloat16 error grows with depth (1.79e-2 against the 3e-2 tolerance at
    1.5B parameters, BENCHMARKS.md): past the tolerance it is allowed up to twice the dtype's own
    rounding of the logits against float32's. Here the fixed tolerance is set near zero, as a
    deep model's rounding would exceed it: an unedited model passes by its rounding's size, and
    the bfloat16-only edit below (its error far above its rounding) is still refused."""
    monkeypatch.setitem(decode.TOLERANCE, "bfloat16", 1e-12)
    cfg = tiny(compute_dtype="bfloat16", n_layer=4, norm_gain=True)
    decode.check_cache(random_gpt(cfg), cfg, cfg.block_size)
    monkeypatch.setattr(M, "attend", bfloat16_shortcut(M.attend))
    cfg = dataclasses.replace(cfg, n_layer=3)  # another shape: jit's cache holds the unedited
    with pytest.raises(UsageError, match=r"in bfloat16, \S+ allowed\)"):
        decode.check_cache(random_gpt(cfg), cfg, cfg.block_size)


def bfloat16_shortcut(plain):
    """model.attend taking a shortcut in bfloat16: jax.nn.dot_product_attention, causal from
    position 0, the mask passed in dropped."""
    def attend(q_THK, k_SGK, v_SGK, scale, mask_TS=None, bias_HTS=None):
        if q_THK.dtype == jnp.bfloat16:
            return jax.nn.dot_product_attention(q_THK, k_SGK, v_SGK, scale=scale, is_causal=True)
        return plain(q_THK, k_SGK, v_SGK, scale, mask_TS, bias_HTS)
    return attend


def test_an_edit_for_bfloat16_alone_is_refused_in_a_bfloat16_run(monkeypatch):
    """model.attend taking a shortcut in bfloat16 (jax.nn.dot_product_attention, causal from
    position 0, the mask passed in dropped): the float32 check cannot see it; the run's own dtype
    does, and the refusal says so."""
    monkeypatch.setattr(M, "attend", bfloat16_shortcut(M.attend))
    cfg = tiny(compute_dtype="bfloat16")
    with pytest.raises(UsageError, match=r"differ by \S+ relative over 16 tokens in bfloat16, "
                                         r"\S+ allowed\)"):
        decode.check_cache(random_gpt(cfg), cfg, cfg.block_size)
