#!/usr/bin/env bash
# One-command GPU validation, for a machine with a GPU, a CUDA torch and no network:
#   bash bench/gpu_check.sh [--quick] [RESULTS_DIR]
# 1. builds the extension against the local torch (PATHKERNELS_CUDA=ON);
# 2. runs the whole test suite (tests run on every device the machine has);
# 3. runs compute-sanitizer memcheck and racecheck on small cases of every CUDA kernel;
# 4. runs the GPU benchmarks;
# 5. writes a summary and the logs into RESULTS_DIR (default bench/results/gpu-<card>-<date>).
# --quick (about 8 minutes): the build for this card's architecture alone; the CUDA cases of the
# leaf-kernel, engine, norm, statistics and readout-engine tests, with the CPU GEMM's and the
# hostile-input tests, the Triton leaf kernel's tests compiled for the GPU (no interpreter) and the
# all-heads CUDA leaf kernel's, the Triton norm kernels', the Triton statistics fold's and the CUDA
# graphs' (PATHKERNELS_CUDA_GRAPHS=1) tests;
# memcheck of every kernel and racecheck of the leaf and engine kernels; bench_gpu_leaves.py
# --quick (its whole-leaf-level section times the Triton kernel, autotuned over its quick space,
# against cuBLAS and the CUDA kernels, and writes its JSON after every case); bench_gpu_heads_leaf.py
# --quick (the all-heads CUDA leaf kernel's variants against cuBLAS and the per-head kernels); the engine's profile
# (every leaf kernel, the engine's all-heads candidates "heads" and "heads_128" among them, each
# call's residuals against the SIMT kernel's, and the CUDA graphs); bench_engine_choices.py --quick (every
# leaf kernel with and without graphs against float64, the statistics folds and the level modes:
# the defaults table's entries for this card, engine_defaults.json); bench_norms.py --quick, and its Triton section (the Triton norm kernels, autotuned, against the CUDA
# kernel, torch.compile, x.sum() and a copy); bench_gpu_statistics.py (each leaf kernel with the torch and the
# Triton fold at 10^7 paths, the folds' statistics compared, a resumed 10^8-path checkpoint);
# bench_gpu_readout.py (the readout engine, CUDA against CPU).
# Each step is stopped after STEP_TIMEOUT seconds (default 600), so one hang cannot eat the lease.
set -uo pipefail
quick=false
if [ "${1:-}" = "--quick" ]; then
  quick=true
  shift
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
card=$($PYTHON -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))" 2>/dev/null || echo unknown)
out=${1:-bench/results/gpu-${card}-$(date +%Y%m%d)}
mkdir -p "$out"
summary="$out/summary.md"
status=0
step() {  # step NAME COMMAND...: run, log to $out/NAME.log, record pass/fail
  local name=$1; shift
  local start=$SECONDS
  if timeout "$STEP_TIMEOUT" "$@" > "$out/$name.log" 2>&1; then result=pass
  else result="FAIL (exit $?)"; status=1; fi
  echo "| $name | $result | $((SECONDS - start)) s | \`$*\` |" >> "$summary"
  echo "$name: $result ($((SECONDS - start)) s)"
}

{
  echo "# pathkernels GPU check$($quick && echo " (--quick)") on $card, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  $PYTHON -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}')"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  echo
  echo "| step | result | time | command |"
  echo "|---|---|---|---|"
} > "$summary"

# --quick builds for this card alone (TORCH_CUDA_ARCH_LIST), on every core.
arch=$($PYTHON -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || true)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if $quick && [ -n "$arch" ]; then export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}; fi
step build env PATHKERNELS_CUDA=ON $PYTHON -m pip install --no-build-isolation --no-deps -v -e .
# With pytest-xdist a crashing test takes down one worker, not the rest of the suite.
parallel=$($PYTHON -c "import xdist" 2>/dev/null && echo "-n 8" || true)
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if $quick; then
  step tests env PATHKERNELS_TEST_DEVICES=cuda $PYTHON -m pytest -q -rs --durations=5 $parallel \
    tests/test_fused_leaf.py tests/test_engine.py tests/test_norms.py tests/test_statistics.py \
    tests/test_engine_gemm.py tests/test_hostile_inputs.py tests/test_readout_engine.py tests/test_triton_leaf.py \
    tests/test_heads_leaf.py tests/test_triton_norms.py tests/test_triton_statistics.py tests/test_chunk_graphs.py \
    -k "not compile"
  # 2026-11-27 this test crashed (SIGSEGV) in the op under the machine's GCC 13 build: a native
  # backtrace, from cuda-gdb (which also debugs host code; the image has no gdb).
  step crash-backtrace cuda-gdb -batch -ex run -ex bt -ex quit --args $PYTHON -m pytest -q -p no:cacheprovider \
    tests/test_hostile_inputs.py -k statistics_fold_refuses
  step sanitizer-memcheck "$SANITIZER" --tool memcheck --error-exitcode 1 $PYTHON bench/sanitizer_cases.py
  step sanitizer-racecheck "$SANITIZER" --tool racecheck --error-exitcode 1 $PYTHON bench/sanitizer_cases.py leaves engine
  step bench-gpu-leaves $PYTHON bench/bench_gpu_leaves.py --quick --limit 60 --out "$out/gpu_leaves.json"
  step bench-gpu-heads-leaf $PYTHON bench/bench_gpu_heads_leaf.py --quick --out "$out/gpu_heads_leaf.json"
  # The Triton leaf kernel in the engine autotunes over its quick space here (four configs).
  step profile-engine env PATHKERNELS_TRITON_CONFIGS=quick $PYTHON bench/profile_gpu_engine.py --out "$out/gpu_profile.json"
  # The defaults table's entries for this card (copy them into pathkernels/core/engine_defaults.json).
  step bench-engine-choices env PATHKERNELS_TRITON_CONFIGS=quick $PYTHON bench/bench_engine_choices.py --quick \
    --out "$out/engine_defaults.json"
  step bench-norms $PYTHON bench/bench_norms.py --device cuda --quick --out "$out/norms.json"
  step bench-norms-triton $PYTHON bench/bench_norms.py --device cuda --only triton --quick --out "$out/norms_triton.json"
  step bench-gpu-statistics env PATHKERNELS_TRITON_CONFIGS=quick $PYTHON bench/bench_gpu_statistics.py --out "$out/gpu_statistics.json"
  step bench-gpu-readout $PYTHON bench/bench_gpu_readout.py --out "$out/gpu_readout.json"
  logs="tests crash-backtrace bench-gpu-leaves bench-gpu-heads-leaf profile-engine bench-engine-choices bench-norms bench-norms-triton bench-gpu-statistics bench-gpu-readout"
else
  step tests $PYTHON -m pytest -q -rs --durations=5 $parallel tests
  for tool in memcheck racecheck; do
    step "sanitizer-$tool" "$SANITIZER" --tool "$tool" --error-exitcode 1 $PYTHON bench/sanitizer_cases.py
  done
  # The leaf kernels and the engine first: a lease that runs out should lose the older benchmarks.
  step bench-gpu-leaves $PYTHON bench/bench_gpu_leaves.py --limit 100 --out "$out/gpu_leaves.json"
  step bench-gpu-heads-leaf $PYTHON bench/bench_gpu_heads_leaf.py --out "$out/gpu_heads_leaf.json"
  step profile-engine $PYTHON bench/profile_gpu_engine.py --out "$out/gpu_profile.json"
  step bench-engine-choices $PYTHON bench/bench_engine_choices.py --out "$out/engine_defaults.json"
  step bench-norms $PYTHON bench/bench_norms.py --device cuda --out "$out/norms.json"
  step bench-norms-triton $PYTHON bench/bench_norms.py --device cuda --only triton --out "$out/norms_triton.json"
  step bench-gpu-statistics $PYTHON bench/bench_gpu_statistics.py --full --out "$out/gpu_statistics.json"
  step bench-paths $PYTHON bench/bench_paths.py --device cuda --quick --out "$out/paths.json"
  step bench-gpu-readout $PYTHON bench/bench_gpu_readout.py --out "$out/gpu_readout.json"
  logs="tests bench-gpu-leaves bench-gpu-heads-leaf profile-engine bench-engine-choices bench-norms bench-norms-triton bench-gpu-statistics bench-paths bench-gpu-readout"
fi
for log in $logs; do
  { echo; echo "$log:"; tail -n 30 "$out/$log.log" | sed 's/^/    /'; } >> "$summary"
done
echo "results in $out"
exit $status
