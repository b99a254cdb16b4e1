#!/usr/bin/env bash
# The GPU checks and measurements of issue 25, as one device call (docs/gpu.md says how to run it):
#
#   bash benchmarks/gpu_checks.sh checks [SECONDS]   # the demo, doctor, GPU tests, bench_train
#   bash benchmarks/gpu_checks.sh sweep [SECONDS]    # the demo sweep, 4 trials sharing the GPU; a ZeRO-3 epoch
#   bash benchmarks/gpu_checks.sh losses [SECONDS]   # bench_losses (rerun when platform/pairsim/losses changes)
#   bash benchmarks/gpu_checks.sh profile [SECONDS]  # where the step goes: each precision and clipping path
#                                                    # profiled against a plain PyTorch loop; start-up by
#                                                    # phase; tests/test_gpu.py
#
# Run from the project root on the GPU machine, with the dependency bundle carried in .gpu/
# (../shared/tools/gpu-bundle). pydantic's typing_inspection was missing there on 2026-11-26 though
# gpu-bundle counts it as present: carry it in .gpu/extra/ (cp -r .venv/lib/python3.*/site-packages/
# typing_inspection .gpu/extra/). Set BENCH_COMMIT to the commit sent: the results files record it. Every step has its own time limit inside the call's SECONDS
# (default 560), so a slow step costs the steps after it their time, not the results before it.
# What each step prints goes to $OUT/log.txt ($OUT/demo.txt for the demo, which runs beside the
# checks that time nothing); the benchmarks write their results files to $OUT.
set -u
mode=${1:?checks or sweep}
budget=${2:-560}
OUT=${OUT:-bench_out/gpu}
mkdir -p "$OUT" /tmp/site
started=$SECONDS
logfile=$OUT/log.txt
log() { echo "=== $(date -u +%T) (+$((SECONDS - started)) s) $*" | tee -a "$logfile"; }
step() {  # step LIMIT_SECONDS COMMAND...: run within the limit and what is left of the budget
  local limit=$1; shift
  local left=$((budget - (SECONDS - started) - 20))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then log "skipped (no time left): $*"; return; fi
  log "$* (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$logfile" | tail -n 60
  log "exit ${PIPESTATUS[0]}: $1"
}

[ -f /tmp/site/.ok ] || { tar -xJf .gpu/site.tar.xz -C /tmp/site && touch /tmp/site/.ok; }
export PYTHONPATH=/tmp/site:$PWD/.gpu/extra:$PWD/platform:$PWD/tests PYTHONUNBUFFERED=1
log "bundle unpacked; commit ${BENCH_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/log.txt"
echo "compilers: $(command -v gcc cc nvcc | tr '\n' ' ')" | tee -a "$OUT/log.txt"

case $mode in
checks)
  # the demo on one GPU worker in the default precision (amp_bf16; ZeRO-2, as the demo), ${DEMO_EPOCHS:-3} epochs,
  # its data made with more CPUs; beside it the checks that time nothing, then the benchmarks alone on the GPU
  (logfile=$OUT/demo.txt; step 220 python3 benchmarks/bench_demo.py --set train.use_gpu=true \
    --set train.num_workers=1 --set ray.data_cpus=12 \
    --set train.epochs="${DEMO_EPOCHS:-3}" --out /tmp/bench_demo --results "$OUT") >/dev/null &
  demo=$!
  step 60 python3 -m pairsim.cli doctor --set train.use_gpu=true --set train.num_workers=1
  step 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
  wait $demo
  # the default precision, amp_bf16, throughout: once an engine has used torch_autocast, DeepSpeed flags the whole
  # process as autocast-initialised (the profile mode takes bf16 first)
  step 400 python3 benchmarks/bench_train.py --device cuda --model ViT-B-32 --image-size 224 --precision amp_bf16 \
    --batch-size 256 --images 12800 --threads 6 --data-workers 6 --repeats 2 --synthetic \
    --variants optim.grad_clip=0 train.zero_stage=3 train.compile=true \
    --out /tmp/bench_train --results "$OUT"
  ;;
sweep)
  step 400 python3 -m pairsim.cli demo --sweep --set train.use_gpu=true --set train.num_workers=1 \
    --set train.gpus_per_worker=0.25 --set sweep.num_samples=4 --set sweep.max_concurrent_trials=4
  # an epoch under ZeRO-3 in the default precision (amp_bf16) through Ray Train, on the sweep's dataset
  step 150 python3 -m pairsim.cli train --config platform/pairsim/configs/demo.yaml --set data.path=data/shapes-sweep \
    --set data.test_split=null --set train.use_gpu=true --set train.num_workers=1 \
    --set train.zero_stage=3 --set train.epochs=1 --set ray.run_name=zero3-amp-bf16
  ;;
profile)
  # the real runs (open_clip_train; pairsim in bf16 and amp_bf16, with their start-up phases), then pairsim's step
  # on device tensors in each precision, with and without clipping, against the same model and objective in a
  # plain PyTorch loop, each profiled for 5 steps; then tests/test_gpu.py
  step 450 python3 benchmarks/bench_train.py --device cuda --model ViT-B-32 --image-size 224 --precision bf16 \
    --batch-size 256 --images 12800 --threads 6 --data-workers 6 --real-variants train.precision=amp_bf16 \
    --synthetic --plain --profile-steps 5 \
    --variants optim.grad_clip=0 train.precision=amp_bf16 train.precision=amp_bf16,optim.grad_clip=0 \
    --out /tmp/bench_train --results "$OUT"
  step 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
  ;;
losses)
  step 120 python3 benchmarks/bench_losses.py --sizes 1024 4096 --repeats 21 --results "$OUT"
  ;;
esac
log "done"
