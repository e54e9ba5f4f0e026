#!/usr/bin/env bash
# Issue 43's measurements on a GPU machine, in one go (GPU time is scarce: run this, not pieces).
#   bash bench_gpu.sh [OUT] [PART ...]   # OUT default runs/bench_gpu-TIMESTAMP; PARTs of
#                                        # mfu time fast trace check multi more optim (default
#                                        # all but "more" and "optim"), in that order: headline first
# The whole call keeps within BUDGET seconds (default 510, so that a 9-minute device call brings
# back every line it measured): each measurement gets the time left (at most 300 s), and one that
# would start with under 20 s left is written as skipped instead.
# It needs data/shakespeare_char's bins (python data.py shakespeare_char; data/ is git-ignored, so a
# session's device tool must carry it): run(carry=["data/shakespeare_char"],
# command='bash bench_gpu.sh "$OUT"', timeout_s=600), then "more" in a later call if time is left.
# tests/test_bench.py rehearses every part on a CPU with tiny models before a GPU is spent on it.
# Writes OUT/bench.jsonl (one bench.py JSON line per measurement, each with its commit, command,
# XLA flags and memory fraction; the "without" lines also name the fast path set aside),
# OUT/check.log (the kernels' self-check on the GPU, against model.py and against an edit of it),
# OUT/stderr.log and OUT/trace (one profile). Copy the lines into BENCHMARKS.md's table with the
# device, the date and the commit.
set -u
cd "$(dirname "$0")" || exit 1
OUT=${1:-runs/bench_gpu-$(date +%Y%m%d-%H%M%S)}
PARTS=" ${*:2} "
[ "$PARTS" = "  " ] && PARTS=" mfu time fast trace check multi "
BUDGET=${BUDGET:-510}
part() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT"
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-../shared/tiktoken_cache}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpus.csv"

left() {  # seconds this measurement may take: what the budget has left, at most 300
  local t=$((BUDGET - SECONDS))
  echo $((t < 300 ? t : 300))
}

measure() {  # CMD...: one JSON line, or a line saying which command failed or was skipped
  echo "+ $* (at ${SECONDS} s)" >> "$OUT/stderr.log"
  if [ "$(left)" -lt 20 ]; then
    echo "{\"skipped\": \"$*\", \"why\": \"the ${BUDGET} s budget is spent\"}" >> "$OUT/bench.jsonl"
  elif ! timeout -k 10 "$(left)" "$@" >> "$OUT/bench.jsonl" 2>> "$OUT/stderr.log"; then
    echo "{\"failed\": \"$*\"}" >> "$OUT/bench.jsonl"
  fi
}

bench() { measure python bench.py "$@"; }

rows() {  # N ARGS...: bench.py ARGS with the Pallas QK-norm + RoPE kernel's blocks of N tokens
  measure python - "$@" <<'PY'
import contextlib, io, json, sys

import bench
from fused import pallas_qk_norm_rope

rows, sys.argv = int(sys.argv[1]), ["bench.py", *sys.argv[2:]]
assert hasattr(pallas_qk_norm_rope, "ROWS"), "the kernel's block size is no longer ROWS"
pallas_qk_norm_rope.ROWS = rows  # checked against model.py at startup, as the default is
with contextlib.redirect_stdout(io.StringIO()) as out:
    bench.main()
print(json.dumps({**json.loads(out.getvalue()), "qk_norm_rope_rows": rows}))
PY
}

without() {  # NAME ARGS...: bench.py ARGS with the fast path of model.NAME set aside
  measure python - "$@" <<'PY'
import contextlib, io, json, sys

import bench
from fused import fast_paths

name, sys.argv = sys.argv[1], ["bench.py", *sys.argv[2:]]
kept = [p for p in fast_paths.FAST_PATHS if p.name != name]
assert len(kept) < len(fast_paths.FAST_PATHS), f"no fast path stands in for model.{name}"
fast_paths.FAST_PATHS = kept
with contextlib.redirect_stdout(io.StringIO()) as out:
    bench.main()
result = json.loads(out.getvalue())
assert name not in result["kernels"], f"model.{name}'s fast path ran though set aside"
print(json.dumps({**result, "without": name}))
PY
}

export CUDA_VISIBLE_DEVICES=0  # all but "multi" on one GPU
# 1. MFU, the headline: openwebtext (124M, 64 sequences) and openwebtext_xl (1.5B) in its default
#    scan and unrolled, with the config's 16-sequence microbatch accumulated over 4 (its 32 is
#    part "more"). The memory fraction is launch.py's 0.9 default.
OWT=(--config=openwebtext --config.batch_size=64 --config.grad_accum=1 --steps=20)
XL=(--config=openwebtext_xl --config.batch_size=64 --config.grad_accum=4 --steps=3)
part mfu && { bench "${OWT[@]}"; bench "${XL[@]}"; bench "${XL[@]}" --config.scan_unroll=48; }

# 2. Time to nanoGPT's val loss 1.4697 on shakespeare_char: the recipe (dropout 0.2, 5000 steps),
#    evaluated every 100 steps.
TT=(--config=shakespeare_char --config.eval_interval=100 --time-to=1.4697)
part time && bench "${TT[@]}"

# 3. Each fast path set aside in turn, all of them (kernels=false), then Muon, at 124M in two
#    32-sequence microbatches (64 sequences without cuDNN's attention outgrew an H100's memory:
#    BENCHMARKS.md).
FAST=(--config=openwebtext --config.batch_size=64 --config.grad_accum=2 --steps=10)
if part fast; then
  bench "${FAST[@]}"
  for name in $(python -c "from fused import fast_paths as f
print(*sorted({p.name for p in f.FAST_PATHS}))" 2>> "$OUT/stderr.log"); do
    without "$name" "${FAST[@]}"
  done
  bench "${FAST[@]}" --config.kernels=false
  bench "${FAST[@]}" --config.optimizer=muon  # Muon's cost over the AdamW line above (issue 44)
  # the Pallas kernel's larger blocks (the default: 64 tokens of one head), and XLA's cuBLASLt
  # epilogue fusion: kept only where faster than the first line of this part
  rows 128 "${FAST[@]}"
  rows 256 "${FAST[@]}"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_cublaslt=true" bench "${FAST[@]}"
fi

# 4. One profile of the 124M step (bench.py --trace: the costliest ops on stderr, the trace in
#    OUT/trace for tensorboard's profile tab or ui.perfetto.dev).
part trace && bench "${OWT[@]}" --trace="$OUT/trace"

# 5. Correctness on the GPU: every fast path against model.py (forward and gradient, bf16) at
#    openwebtext's shapes and at grouped-query / SharedKV ones; then with model.rope edited, the
#    Pallas kernel must be set aside; then the GPU branch of the attention test.
if part check; then
  timeout -k 10 "$(left)" python - > "$OUT/check.log" 2>&1 <<'PY'
import dataclasses, configs, model
from fused import fast_paths
base = configs.load("openwebtext")
for over in ({}, {"n_kv_head": 4}, {"attention": "sharedkv", "n_kv_head": 4}):
    print(over, sorted(fast_paths.select(dataclasses.replace(base, **over))), flush=True)
plain = model.rope
model.rope = lambda x, cos, sin: plain(x, cos, -sin)
assert "qk_norm_rope" not in fast_paths.select(base), "an edit of model.rope was not caught"
print("edit caught")
PY
  timeout -k 10 "$(left)" python -m pytest -q tests/test_model.py -k attention_implementations \
    >> "$OUT/check.log" 2>&1
fi

# 6. Several GPUs (only where there are): 124M data-parallel (mesh_replica=N) and under FSDP, 64
#    sequences a device; openwebtext_xl under FSDP, 16 a device, with a profile (the collectives
#    among its top ops).
unset CUDA_VISIBLE_DEVICES
if part multi && [ "$GPUS" -gt 1 ]; then
  M=(--config=openwebtext "--config.batch_size=$((64 * GPUS))" --config.grad_accum=1 --steps=20)
  bench "${M[@]}" "--config.mesh_replica=$GPUS"
  bench "${M[@]}"
  N=(--config=openwebtext_xl "--config.batch_size=$((16 * GPUS))" --config.grad_accum=1 --steps=5)
  bench "${N[@]}"
  bench "${N[@]}" --trace="$OUT/trace_fsdp"
fi

# 7. More, in a later call: the variants, 1.5B without its fast paths (8-sequence microbatches)
#    and as configured (512 sequences in 32 microbatches), a shorter shakespeare_char schedule.
export CUDA_VISIBLE_DEVICES=0
if part more; then
  bench "${OWT[@]}" --config.n_kv_head=4
  bench "${OWT[@]}" --config.attention=sharedkv
  bench --config=openwebtext_xl --config.batch_size=32 --config.grad_accum=4 --steps=3 \
    --config.kernels=false
  bench --config=openwebtext_xl --steps=1
  bench "${TT[@]}" --config.max_steps=3000
fi
# 8. Issue 44's comparison at a GPU size, in its own call (bash bench_gpu.sh OUT optim): AdamW,
#    Lion and Muon on shakespeare_char (nanoGPT's 10.7M model), each at its best LR of an 8-LR
#    sweep, 3 seeds, 500 steps; OUT/optimizers_gpu/README.md, for docs/optimizers.md.
if part optim; then
  timeout -k 10 $((BUDGET - SECONDS)) python -m tools.optimizer_sweep --config=shakespeare_char \
    --steps=500 --out="$OUT/optimizers_gpu" >> "$OUT/stderr.log" 2>&1
fi
echo "done in ${SECONDS} s: $OUT/bench.jsonl" >&2
