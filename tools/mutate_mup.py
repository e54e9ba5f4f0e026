"""Breaks one muP/CompleteP rule at a time in a copy of the repo and lists the muP tests that then
fail: each rule must have a test that catches it (the table: issue 33's closing note).

    python tools/mutate_mup.py [RULE ...] [--with_staleness] [-- PYTEST_ARGS]

RULE: the names in MUTATIONS (default: all; --help lists them). --with_staleness keeps
tests/test_mup.py's staleness test, which compares the rules' fingerprint with docs' evidence.
The copy holds the tracked files and the prepared data; the working tree is never edited. Each
mutation must change its file exactly once, or it is reported as stale (the code moved on) rather
than run."""
import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_mup_rules.py", "tests/test_mup.py",
         "tests/test_optimizers.py::test_muon_update_spectral_norm_is_constant_over_width",
         "tests/test_optimizers.py::test_lion_takes_adams_mup_learning_rates"]
READOUT_EPS = 'spec=(None, "fsdp"), eps_mult=1 / m),\n        # hidden'  # the readout's row
# rule: (file, the correct text, the broken text)
MUTATIONS = {
    "hidden LR 1/m": ("params.py", "hidden = dict(lr_mult=1 / m,", "hidden = dict(lr_mult=1.0,"),
    "hidden LR no depth factor": ("params.py", "hidden = dict(lr_mult=1 / m,",
                                  "hidden = dict(lr_mult=1 / (m * d),"),
    "embedding LR 1": ("params.py", "Policy(embed_std, 1.0,", "Policy(embed_std, 1 / m,"),
    "readout multiplier alpha_out/m": ("model.py", "cfg.alpha_out / cfg.width_mult",
                                       "cfg.alpha_out"),
    "hidden init 1/sqrt(fan_in)": ("params.py", '"blocks.mlp.up": Policy(1 / math.sqrt(D)',
                                   '"blocks.mlp.up": Policy(1 / math.sqrt(cfg.d_base)'),
    "down init 1/sqrt(F)": ("params.py", "Policy(1 / math.sqrt(F)", "Policy(1 / math.sqrt(D)"),
    "embedding init 1": ("params.py", "if cfg.tie_embeddings else 1.0",
                         "if cfg.tie_embeddings else D**-0.5"),
    "readout init 0": ("params.py", '"emb.unembed": Policy(0.0,', '"emb.unembed": Policy(D**-0.5,'),
    "attention tau/head_dim": ("configs/__init__.py", "return self.attn_tau / self.head_dim",
                               "return self.attn_tau / math.sqrt(self.head_dim)"),
    "Adam eps 1/(m d) in blocks": ("params.py", "decay=True, eps_mult=1 / (m * d))",
                                   "decay=True, eps_mult=1.0)"),
    "Adam eps 1/m outside blocks (readout)": ("params.py", READOUT_EPS,
                                              READOUT_EPS.replace("1 / m", "1.0")),
    "weight decay independent of lr_mult": ("optimizers.py", "(decay * p if policy.decay",
                                            "(decay * policy.lr_mult * p if policy.decay"),
    "weight decay independent of lr": ("optimizers.py",
                                       "decay = cfg.weight_decay * lr / cfg.learning_rate",
                                       "decay = cfg.weight_decay * lr"),
    "CompleteP branch 1/d": ("model.py", "self.dropout_rate = 1 / cfg.depth_mult,",
                             "self.dropout_rate = 1.0,"),
    "MUDD w1 LR 1/m": ("params.py", '"mudd.w1": Policy(1 / math.sqrt(D), 1 / m,',
                       '"mudd.w1": Policy(1 / math.sqrt(D), 1.0,'),
    "embedding multiplier alpha_in": ("model.py", "= cfg.alpha_in, cfg.alpha_out",
                                      "= cfg.alpha_in * cfg.width_mult, cfg.alpha_out"),
    "warmup independent of width": ("optimizers.py", "(step + 1) / max(cfg.warmup_steps, 1)",
                                    "(step + 1) / max(cfg.warmup_steps * cfg.width_mult, 1)"),
    # Muon's rules (docs/optimizers.md): hidden LR 1/sqrt(m), the update's RMS matched by sqrt(max)
    "Muon hidden LR 1/sqrt(m)": ("params.py", 'hidden["lr_mult"] = 1 / math.sqrt(m)',
                                 'hidden["lr_mult"] = 1 / m'),
    "Muon update RMS sqrt(max(R, C))": ("optimizers.py", "math.sqrt(max(R, C))",
                                        "math.sqrt(min(R, C))"),
}


def copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / "data").mkdir(exist_ok=True)
    (dest / "data" / "shakespeare_char").symlink_to(ROOT / "data" / "shakespeare_char")


def failing(dest: Path, pytest_args: list[str], staleness: bool) -> list[str]:
    # the staleness test compares the rules with docs' evidence: kept only when asked, so that the
    # table shows which rule's own test catches each mutation
    skip = [] if staleness else ["--deselect=tests/test_mup.py::test_docs_mup_evidence_is_current"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS,
                           *skip, *pytest_args], cwd=dest, capture_output=True, text=True)
    return sorted(set(re.findall(r"^FAILED \S+::(\S+)", done.stdout, re.M)))


def main(argv: list[str]) -> None:
    argv, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="rules: " + "; ".join(MUTATIONS))
    ap.add_argument("rules", nargs="*", metavar="RULE", help="a rule's name (default: all)")
    ap.add_argument("--with_staleness", action="store_true",
                    help="keep the staleness test of docs' evidence")
    args = ap.parse_args(argv)
    if unknown := [r for r in args.rules if r not in MUTATIONS]:
        sys.exit(f"error: unknown rule {unknown[0]!r}; the rules: {'; '.join(MUTATIONS)}")
    for rule in args.rules or MUTATIONS:
        path, good, bad = MUTATIONS[rule]
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp)
            copy_repo(dest)
            text = (dest / path).read_text()
            if text.count(good) != 1:
                print(f"| {rule} | stale: {path} holds {good!r} {text.count(good)} times |",
                      flush=True)
                continue
            (dest / path).write_text(text.replace(good, bad))
            caught = failing(dest, pytest_args, args.with_staleness)
            print(f"| {rule} | {', '.join(caught) or 'NONE: no test fails'} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
