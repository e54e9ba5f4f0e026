"""Breaks one rule of the core at a time in a copy of the repo and lists which of the tests that
should catch it then fail: each mutation must have a test that fails (the table: issue 45's
closing note). The muP rules have their own: tools/mutate_mup.py.

    python tools/mutate.py [MUTATION ...] [-- PYTEST_ARGS]
    python tools/mutate.py --list

MUTATION: the names below (default: all). Each runs only its own tests (a few per mutation, the
heaviest train two or three tiny runs). The copy holds the tracked files and the prepared data;
the working tree is never edited. Each edit must match its file exactly once, or the mutation is
reported as stale (the code moved on) rather than run."""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from mutate_mup import copy_repo  # the same copy of the repo: tracked files and the data

ROOT = Path(__file__).resolve().parents[1]
N_TOKENS = "            global N_TOKENS\n            N_TOKENS = m.sum(1)\n"
ASK_LOGLIK = ("            lls, greedy = loglikelihoods(model, x, y, m, self.n_vocab, sharding, "
              "batch)")
# name: (file, [(the correct text, the broken text), ...], the tests that should catch it)
MUTATIONS = {
    "RoPE base hard-coded (not cfg.rope_base)": (
        "model.py", [("self.rope_base = cfg.rope_base if", "self.rope_base = 10000.0 if")],
        ["tests/test_model.py::test_rope_depends_on_relative_position_only"]),
    "causal mask off by one (sees the next token)": (
        "model.py", [("mask_TS = jnp.tril(jnp.ones((T, S), bool))",
                      "mask_TS = jnp.tril(jnp.ones((T, S), bool), 1)")],
        ["tests/test_model.py::test_causal",
         "tests/test_model.py::test_forward_matches_numpy_reference"]),
    "KV cache: decode steps one position ahead": (
        "inference/decode.py", [("extend_B(model, cache_B, token_B[:, None], pos)",
                                 "extend_B(model, cache_B, token_B[:, None], pos + 1)")],
        ["tests/test_sample.py::test_cached_greedy_equals_greedy_by_recomputation"]),
    "KV cache: a slide keeps one token less": (
        "inference/decode.py", [("window_BS, jnp.int32(keep)", "window_BS, jnp.int32(keep - 1)")],
        ["tests/test_sample.py::test_cached_greedy_equals_greedy_by_recomputation"]),
    "the readout check compares logits with themselves": (
        "fused/agreement.py", [("row_error(gpt.logits(x_TD), want)", "row_error(want, want)")],
        ["tests/test_kernels.py::"
         "test_an_edit_that_reaches_the_logits_but_not_the_loss_is_refused"]),
    "the KV-cache check compares logits with themselves": (
        "inference/decode.py", [("row_error(got_SV, want_SV)", "row_error(want_SV, want_SV)")],
        ["tests/test_sample.py::test_an_edit_decoding_does_not_follow_is_refused"]),
    "the loss note's check compares the loss with itself": (
        "fused/agreement.py", [("row_error(cross_entropy_T, plain_T)",
                                  "row_error(plain_T, plain_T)")],
        ["tests/test_kernels.py::test_a_loss_that_is_not_the_readouts_cross_entropy_is_said"]),
    "optimizer step counts reset at restore": (
        "run/checkpoint.py", [('return model, restored.state["opt_state"], restored.tally',
                               'zero = lambda x: x * 0 if x.ndim == 0 and x.dtype.kind == "i" '
                               'else x\n    return model, jax.tree.map(zero, restored.state['
                               '"opt_state"]), restored.tally')],
        ["tests/test_checkpoint.py::test_stop_and_resume_equals_straight_run"]),
    "gradients divided twice by grad_accum": (
        "train.py", [("v / n for v in loss_fn(model, x, y, cfg, *key)",
                      "v / n / len(x_GBT) for v in loss_fn(model, x, y, cfg, *key)")],
        ["tests/test_train.py::test_accumulation_equals_one_big_batch"]),
    "tokens/s a running average, not each log's own steps": (
        "train.py", [("\n                    t0, t0_step = time.perf_counter(), done  # the rate of "
                      "each log's own steps", "")],
        ["tests/test_train.py::test_each_log_reads_its_own_steps_throughput_and_a_save_is_left_out"]),
    "weight decay on norm gains": (
        "params.py", [("gain = dict(lr_mult=1.0, decay=False,",
                       "gain = dict(lr_mult=1.0, decay=True,")],
        ["tests/test_model.py::test_policy_table_covers_every_parameter",
         "tests/test_train.py::test_weight_decay_is_independent_of_lr_and_only_on_matrices"]),
    "a policy row's sharding the devices do not divide let through": (
        "params.py", [("            if size % parts:", "            if size % parts and False:")],
        ["tests/test_model.py::test_a_policy_row_mistake_stops_launch_before_the_run_directory"]),
    "a launch failed before its first step leaves its new run directory": (
        "run/rundir.py", [("        if not existed:\n            rundir.rmdir()\n", "")],
        ["tests/test_launch.py::test_any_error_before_the_first_step_undoes_the_launch"]),
    "a resume with other code than trained the run is silent": (
        "run/rundir.py", [("    if changes := code_changes(run):", "    if changes := None:")],
        ["tests/test_launch.py::test_a_run_resumed_or_read_with_other_code_says_which_files_changed"]),
    "fused cross-entropy: its gradient without the readout multiplier": (
        "fused/cross_entropy.py", [("dz_TV = (mult * g_T[:, None]", "dz_TV = (g_T[:, None]")],
        ["tests/test_kernels.py::test_the_fused_cross_entropy_is_the_cross_entropy_written_out"]),
    "export: attn.out transposed wrongly (same shape)": (
        "export.py", [('"attn.out.weight": T(a(b.attn.out).reshape(L, -1, D)),',
                       '"attn.out.weight": a(b.attn.out).reshape(L, -1, D),')],
        ["tests/test_export.py::test_variant_pytorch_logits_equal_jax_logits"]),
    "export: the loss of labels= not shifted by one": (
        "hf/modeling_mugpt.py", [("labels[:, 1:].flatten()", "labels[:, :-1].flatten()")],
        ["tests/test_export.py::"
         "test_pytorch_loss_of_labels_is_the_cross_entropy_over_the_tokenizers_ids"]),
    "batch of step s read as step s+1's": (
        "data.py", [("default_rng([seed, stream, step])", "default_rng([seed, stream, step + 1])")],
        ["tests/test_data.py::test_the_batch_of_each_step_is_the_documented_one",
         "tests/test_data.py::test_two_processes_read_the_documented_batches"]),
    "a split's last token never a target (offsets stop one short)": (
        "data.py", [("rng.integers(0, tokens.size - block, size",
                     "rng.integers(0, tokens.size - block - 1, size")],
        ["tests/test_data.py::test_every_token_of_a_split_is_read_the_last_one_as_a_target"]),
    "acc_norm divided by the continuation's tokens": (
        "inference/tasks.py", [(ASK_LOGLIK, N_TOKENS + ASK_LOGLIK),
                               ('chars = np.array([len(c) for c in ex["choices"]], np.float64)',
                                'chars = N_TOKENS[i - len(ex["choices"]):i].astype(np.float64)')],
        ["tests/test_eval.py::test_bpe_metrics_as_computed_by_hand_and_by_lm_eval"]),
    "blocks.mlp.up sharded on F, not D": (
        "params.py", [('"blocks.mlp.up": Policy(1 / math.sqrt(D), spec=("fsdp", None)',
                       '"blocks.mlp.up": Policy(1 / math.sqrt(D), spec=(None, "fsdp")')],
        ["tests/test_sharding.py::test_every_parameter_has_the_tables_spec"]),
    "eval counts the padded vocabulary in the softmax": (
        "inference/tasks.py", [("valid_V = jnp.arange(logits_BTV.shape[-1]) < n_vocab",
                                "valid_V = jnp.arange(logits_BTV.shape[-1]) >= 0")],
        ["tests/test_eval.py::test_one_and_four_devices_give_the_same_numbers"]),
    "loss of the readout's logits without the readout multiplier": (
        "model.py", [("return mult * jnp.einsum(\"TD,VD->TV\"", "return jnp.einsum(\"TD,VD->TV\"")],
        ["tests/test_model.py::test_loss_of_a_random_model_is_numpys_cross_entropy"]),
    "KV cache: a query does not see its own key": (
        "layers/positions.py", [("mask_TS = None if S is None else k_S[None, :] <= q_T[:, None]",
                                 "mask_TS = None if S is None else k_S[None, :] < q_T[:, None]")],
        ["tests/test_sample.py::test_extend_gives_the_full_forward_logits",
         "tests/test_variants.py::test_kv_cache_decoding_equals_the_full_forward"]),
    "ALiBi's bias of the key's distance with the wrong sign": (
        "layers/positions.py", [("* (q_T[:, None] - k_S[None, :])",
                                 "* (k_S[None, :] - q_T[:, None])")],
        ["tests/test_variants.py::test_variant_matches_numpy_reference"]),
    "MUDD's one-hot on the embedding, not the newest state": (
        "layers/mudd.py", [("self.b + jnp.eye(J)[-1]", "self.b + jnp.eye(J)[0]")],
        ["tests/test_variants.py::test_mudd_at_init_is_the_baseline_and_its_weights_matter",
         "tests/test_variants.py::test_variant_matches_numpy_reference"]),
    "attention logits scaled by half (autodiff agrees with itself)": (
        "model.py", [("self.scale, self.kv_heads = cfg.attn_scale, G",
                      "self.scale, self.kv_heads = cfg.attn_scale / 2, G")],
        ["tests/test_model.py::test_the_model_is_differentiable_on_one_unbatched_sequence"]),
}


def failing(dest: Path, tests: list[str], pytest_args: list[str]) -> list[str]:
    """The named tests that fail (an error in a fixture counts: the mutation broke the run)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *tests, *pytest_args], cwd=dest, capture_output=True, text=True)
    return sorted(set(re.findall(r"^(?:FAILED|ERROR) \S+::(\S+)", done.stdout, re.M)))


def main(argv: list[str]) -> None:
    argv, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mutations", nargs="*", metavar="MUTATION",
                    help="names from --list (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutations and their tests")
    args = ap.parse_args(argv)
    if unknown := [m for m in args.mutations if m not in MUTATIONS]:
        sys.exit(f"error: unknown mutation {unknown[0]!r}; python tools/mutate.py --list")
    if args.list:
        for name, (path, _, tests) in MUTATIONS.items():
            print(f"{name}  [{path}]: {' '.join(tests)}")
        return
    print("| mutation | file | tests that fail |\n|---|---|---|", flush=True)
    for name in args.mutations or MUTATIONS:
        path, edits, tests = MUTATIONS[name]
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp)
            copy_repo(dest)
            text = (dest / path).read_text()
            if stale := [good for good, _ in edits if text.count(good) != 1]:
                print(f"| {name} | {path} | stale: {stale[0]!r} is not there once |", flush=True)
                continue
            for good, bad in edits:
                text = text.replace(good, bad)
            (dest / path).write_text(text)
            caught = failing(dest, tests, pytest_args)
            print(f"| {name} | {path} | {', '.join(caught) or 'NONE: no test fails'} |",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
