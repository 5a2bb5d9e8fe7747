#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md, repeatable with one command on a host with one
# CUDA GPU and this project installed (`make install`, or the image), offline:
#
#   benchmarks/gpu.sh [all | cuda | sweep | compare | profile | ablations | demo | cpu-scaling ...]
#   benchmarks/gpu.sh check [--dry-run] [variants packing long-tail saves profile profile-flash cuda cuda-flash scoring]
#
# check is issue 58's prepared check, one call of at most 8 minutes with no internet
# (benchmarks/gpu_check.py, docs/gpus.md): on bert-base at batch 512 the loss check,
# model.sdpa_backend and train.compile on and off, interleaved, an FSDP save with
# checkpoint.async_save on and off, a profile, the CUDA tests, and `score` against
# transformers' pipeline (issue 73); check.json, check.md and check.log land in
# $OUT (benchmarks/results where unset). --dry-run (or DRY_RUN=1): the same on CPU, tiny.
#
# all (the default) runs every part in this order, about 25 minutes on an H100:
#   cuda         tests/e2e/test_cuda.py (the CUDA path's guarantees) and the determinism check
#   sweep        bert-base at per-GPU batch 32..512: samples/s, MFU, memory (find the knee)
#   compare      this trainer against transformers.Trainer at the knee, interleaved, 3 reps
#   profile      torch.profiler over 5 steps at the knee: where the step time goes
#   ablations    each speed feature on and off at the knee, and the checkpoint cost
#   demo         configs/demo.yaml on one NCCL rank, then final/ loaded by plain transformers
#   cpu-scaling  CPU DDP at 2, 4 and 8 ranks on MiniLM, threads split evenly, with the
#                independent-runs ceiling
# Results land in benchmarks/results/<gpu>-*.json (override the prefix with PREFIX=...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
if [ "${1:-}" = check ]; then
  shift
  exec $PY -m benchmarks.gpu_check "$@"
fi
PREFIX=${PREFIX:-$($PY -c 'import torch; print(torch.cuda.get_device_name(0).split()[1].lower())')}
RESULTS=benchmarks/results
BERT=(--random-init bert-base --nproc 1 --epoch-steps 20 --keep-going)

knee() {  # the smallest batch within 3% of the sweep's best samples/s (256 before a sweep)
  $PY - "$RESULTS/$PREFIX-bert-base-batch-sweep.json" <<'EOF' 2>/dev/null || echo 256
import json, sys
medians = json.load(open(sys.argv[1]))["medians"]
by_batch = {int(name.rsplit(" ", 1)[1]): rate for name, rate in medians.items()}
best = max(by_batch.values())
print(min(b for b, rate in by_batch.items() if rate >= 0.97 * best))
EOF
}

part_cuda() {
  $PY -m pytest -p no:cacheprovider -q tests/e2e/test_cuda.py
  $PY tests/support/determinism_check.py --modes off
}

part_sweep() {
  $PY -m benchmarks "${BERT[@]}" --reps 1 --sweep-batch 32 64 128 256 512 --name "$PREFIX-bert-base-batch-sweep"
}

part_compare() {
  $PY -m benchmarks "${BERT[@]}" --batch-size "$(knee)" --reps 3 \
    --only "trainer DDP bf16" "HF Trainer best bf16" --name "$PREFIX-bert-base"
}

part_profile() {
  $PY -m benchmarks.profile_step --batch-size "$(knee)" --out "$RESULTS/$PREFIX-bert-base-profile.json"
}

part_ablations() {
  $PY -m benchmarks "${BERT[@]}" --batch-size "$(knee)" --reps 1 --ablations --name "$PREFIX-bert-base-ablations"
}

part_demo() {
  local out=runs/gpu-demo
  [ -f data/reviews/train.jsonl ] || $PY -m trainer.data.demo data/reviews
  rm -rf "$out"
  # One rank with the CPU demo's global batch (2 ranks x 16): the same global batches.
  torchrun --standalone --nproc-per-node=1 -m trainer train -c configs/demo.yaml train.batch_size=32 \
    wandb.mode=disabled "output_dir=$out" 2>&1 | tee "$out.log"
  $PY benchmarks/load_final.py "$out" data/reviews/test.jsonl --out "$RESULTS/$PREFIX-demo.json"
}

part_cpu-scaling() {
  local cores n
  cores=$($PY -c 'import os; print(len(os.sched_getaffinity(0)))')
  for n in 2 4 8; do
    $PY -m benchmarks --cpu --nproc "$n" --threads-per-rank $((cores / n)) --reps 1 --keep-going \
      --only "trainer DDP bf16" "trainer 1 rank bf16" "nproc x trainer 1 rank bf16 at once (no DDP)" \
      --name "$PREFIX-host-cpu-scaling-$n-ranks"
  done
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] || [ "${parts[0]}" = all ] && parts=(cuda sweep compare profile ablations demo cpu-scaling)
failed=()
set +e
for part in "${parts[@]}"; do
  echo "=== $part ($(date +%T))"
  (set -e; "part_$part") || failed+=("$part")  # the other parts still run
done
[ ${#failed[@]} -eq 0 ] || { echo "=== failed: ${failed[*]}"; exit 1; }
