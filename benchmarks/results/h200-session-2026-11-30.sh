#!/usr/bin/env bash
# One prepared call (2026-11-30): issue 74's unverified CUDA fixes, then where the varlen step's
# time goes beside the defaults', then the long tail with length grouping off.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl && cp -r .gpu/site/* /tmp/site/ \
  && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 3
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error
nvidia-smi -L; python3 -c 'import torch; print(torch.__version__)'
T0=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - T0 )) s"; }
stamp flash-tests
timeout -k 5 120 python3 -m pytest -p no:cacheprovider -q tests/e2e/test_cuda.py -k flash 2>&1 | tail -40 | tee "$OUT/flash-tests.log"
stamp profile-defaults
timeout -k 5 60 python3 -m benchmarks.profile_step --random-init bert-base --batch-size 512 --max-length 128 \
  --warmup 3 --steps 3 --out "$OUT/profile-defaults.json" > "$OUT/profile-defaults.log" 2>&1
tail -25 "$OUT/profile-defaults.log"
stamp profile-packed-flash
timeout -k 5 60 python3 -m benchmarks.profile_step --random-init bert-base --batch-size 512 --max-length 128 \
  --warmup 3 --steps 3 --out "$OUT/profile-packed-flash.json" data.packing=true model.sdpa_backend=flash \
  > "$OUT/profile-packed-flash.log" 2>&1
tail -25 "$OUT/profile-packed-flash.log"
stamp long-tail
left=$(( 330 - ( $(date +%s) - T0 ) ))
[ "$left" -gt 60 ] && python3 -m benchmarks.gpu_check long-tail --budget-s "$left" --out "$OUT/long-tail" 2>&1 | tail -30
stamp done
