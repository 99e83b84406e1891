#!/usr/bin/env bash
# One lease of a GPU machine (python3 with a CUDA build of torch and Triton, nvcc):
# build the extensions in place, run the GPU tests, time the kernels and the engine.
# Logs go to $OUT (the lender's output folder) or /tmp/fastdp-gpu.
#   bash bench/gpu_session.sh [tests|kernels|engine|ghost|ghost-engine|noise|profile ...]   (default: the first three)
# CONFIGS=a,b, METHODS=m,n and MIN_TIME=s narrow the engine benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/fastdp-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then  # peers carried as wheels (e.g. opacus)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
make -s cuda-lib >>"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
steps=${*:-tests kernels engine}
for step in $steps; do
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
    kernels) python3 bench/kernels_table.py --cuda 2>&1 | tee "$OUT/kernels.txt" ;;
    engine) python3 -m fastdp bench --device cuda --min-time "${MIN_TIME:-1.0}" --budget 20 ${CONFIGS:+--configs $CONFIGS} \
              --methods ${METHODS:-fastdp-auto,fastdp-native,opacus-hooks,opacus-ghost,bf16-nonprivate,bf16-fastdp} \
              --markdown "$OUT/bench.md" --json "$OUT/bench.json" 2>&1 | tee "$OUT/engine.log" | tail -70 ;;
    ghost) python3 bench/gpu_profile.py ghost 2>&1 | tee "$OUT/ghost.txt" ;;
    noise) python3 bench/gpu_profile.py noise 2>&1 | tee "$OUT/noise.txt" ;;
    ghost-engine) python3 bench/gpu_profile.py ghost-engine 2>&1 | tee "$OUT/ghost_engine.txt" ;;
    profile) python3 bench/gpu_profile.py step mlp cifar-cnn-gn transformer 2>&1 | tee "$OUT/profile.txt" | grep "^==" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
