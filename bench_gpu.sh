#!/usr/bin/env bash
# Issue 34's measurements on a GPU machine, in one go (GPU time is scarce: run this, not pieces).
#   bash bench_gpu.sh [OUT] [PART ...]   # OUT default runs/bench_gpu-TIMESTAMP; PARTs of
#                                        # check mfu time more multi (default all five), run in
#                                        # that order: the headline figures first, so a device
#                                        # call cut short by its time limit still brings them back
# It needs data/shakespeare_char's bins (python data.py shakespeare_char; data/ is git-ignored, so a
# session's device tool must carry it): run(carry=["data/shakespeare_char"],
# command='bash bench_gpu.sh "$OUT" check mfu time', timeout_s=...), then "more" if time is left.
# Writes OUT/bench.jsonl (one bench.py JSON line per measurement, each with its commit and command),
# OUT/check.log (the kernels' self-check on the GPU, against model.py and against an edit of it),
# OUT/stderr.log and OUT/trace (one profile, part "more").
# Copy the lines into BENCHMARKS.md's table with the device, the date and the commit.
set -u
cd "$(dirname "$0")" || exit 1
OUT=${1:-runs/bench_gpu-$(date +%Y%m%d-%H%M%S)}
PARTS=" ${*:2} "
[ "$PARTS" = "  " ] && PARTS=" check mfu time more multi "
part() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT"
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-../shared/tiktoken_cache}
GPUS=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpus.csv"

bench() {  # one JSON line, or a line saying which command failed (and the log says why)
  echo "+ python bench.py $*" >> "$OUT/stderr.log"
  timeout 300 python bench.py "$@" >> "$OUT/bench.jsonl" 2>> "$OUT/stderr.log" ||
    echo "{\"failed\": \"python bench.py $*\"}" >> "$OUT/bench.jsonl"
}

export CUDA_VISIBLE_DEVICES=0  # sections 1-3 on one GPU
# 1. Correctness on the GPU: every kernel against model.py (forward and gradient, bf16) at
#    openwebtext's shapes and at grouped-query / SharedKV ones; then with model.rope edited, the
#    Pallas kernel must be set aside. (The GPU branch of the attention test: part "more".)
part check && timeout 240 python - > "$OUT/check.log" 2>&1 <<'PY'
import dataclasses, configs, kernels, model
base = configs.load("openwebtext")
for over in ({}, {"n_kv_head": 4}, {"attention": "sharedkv", "n_kv_head": 4}):
    print(over, sorted(kernels.select(dataclasses.replace(base, **over))), flush=True)
plain = model.rope
model.rope = lambda x, cos, sin: plain(x, cos, -sin)
assert "qk_norm_rope" not in kernels.select(base), "an edit of model.rope was not caught"
print("edit caught")
PY

# 2. MFU on one GPU: openwebtext (124M) and openwebtext_xl (1.5B) in its default scan.
OWT=(--config=openwebtext --config.batch_size=64 --config.grad_accum=1 --steps=20)
XL=(--config=openwebtext_xl --config.batch_size=16 --config.grad_accum=1 --steps=10)
part mfu && { bench "${OWT[@]}"; bench "${XL[@]}"; }

# 3. Time to nanoGPT's val loss 1.4697 on shakespeare_char (its default ended at 1.528, BENCHMARKS.md
#    G5, without dropout): the default and stronger weight decay, evaluated every 25 steps.
TT=(--config=shakespeare_char --config.eval_interval=25 --time-to=1.4697)
part time && { bench "${TT[@]}"; bench "${TT[@]}" --config.weight_decay=3e-3; }

# 4. The rest: the variants through the rewritten Pallas kernel, kernels off as the baseline,
#    openwebtext_xl unrolled, another time-to config, one profile, the GPU branch of the test.
part more && {
bench "${OWT[@]}" --config.n_kv_head=4
bench "${OWT[@]}" --config.attention=sharedkv
bench "${OWT[@]}" --config.kernels=false
bench "${XL[@]}" --config.scan_unroll=48
bench "${TT[@]}" --config.weight_decay=1e-3 --config.max_steps=750 --config.learning_rate=6e-4
bench "${OWT[@]}" --trace="$OUT/trace"
timeout 300 python -m pytest -q tests/test_model.py -k attention_implementations >> "$OUT/check.log" 2>&1
}

# 5. Several GPUs (only where there are): openwebtext_xl under FSDP on all of them against one,
#    tokens/s and the profile's top ops (the collectives among them).
unset CUDA_VISIBLE_DEVICES
if part multi && [ "$GPUS" -gt 1 ]; then
  N=(--config=openwebtext_xl "--config.batch_size=$((16 * GPUS))" --config.grad_accum=1 --steps=10)
  bench "${N[@]}"
  bench "${N[@]}" --trace="$OUT/trace_fsdp"
fi
echo "done: $OUT/bench.jsonl" >&2
