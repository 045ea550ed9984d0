#!/usr/bin/env bash
# Everything layerswap checks on a GPU, in one go: install, C++ build + ctest (GPU tests included), the Python
# GPU tests, and the foundation benchmark. Made for one call on a GPU machine with no network.
#
#   bench/gpu_run.sh                 # every step
#   bench/gpu_run.sh build pytest    # only some: info install cmake ctest pytest bench (build = install cmake)
#   bench/gpu_run.sh ensure          # install only if the installed package was not built from this tree's sources
#
# Full logs go to $GPU_RUN_LOGS, else $OUT, else /tmp/layerswap-gpu-run: info.log, build.log (pip + CMake),
# ctest.log, pytest.log (+ pytest.xml), bench.log, foundation.json; the console gets each step's tail and a summary
# table. `ensure` alone logs to $GPU_RUN_LOGS or /tmp/layerswap-gpu-run, never to $OUT: on the device machine $OUT
# is the folder whose files come back (at most 8), and a benchmark call that runs `ensure` first needs them for its
# results (session 58 lost one to the two logs). A failed step does not stop the others; the exit status is
# non-zero if any step failed.
#
# Time: the whole run keeps inside GPU_RUN_DEADLINE seconds (default 570, for a 10-minute call): each step
# gets min(its own limit, time left); a step with no time left is reported as skipped. Step limits:
# GPU_RUN_TIMEOUT_{INSTALL,CMAKE,CTEST,PYTEST,BENCH}. PYTHON picks the interpreter (default python3).
# GPU_RUN_PIP_ARGS adds arguments to the install; for perf's symbols an unstripped one:
# GPU_RUN_PIP_ARGS="-C install.strip=false -C cmake.define.CMAKE_STRIP=/bin/true" (pybind11 strips the module itself).
# shellcheck disable=SC2317  # the step functions are called through run_step
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
REPO=$PWD
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=${GPU_RUN_DEADLINE:-570}
JOBS=${GPU_RUN_JOBS:-16}

ALL_STEPS=(info install cmake ctest pytest bench)
ENSURE=
declare -A WANT=()
if [ $# -eq 0 ]; then
  for s in "${ALL_STEPS[@]}"; do WANT[$s]=1; done
else
  WANT[info]=1
  for a in "$@"; do
    case "$a" in
      all) for s in "${ALL_STEPS[@]}"; do WANT[$s]=1; done ;;
      build) WANT[install]=1; WANT[cmake]=1 ;;
      info|install|cmake|ctest|pytest|bench) WANT[$a]=1 ;;
      ensure) WANT[install]=1; ENSURE=1 ;;
      *) echo "gpu_run.sh: unknown step '$a' (steps: ${ALL_STEPS[*]} build ensure all)" >&2; exit 2 ;;
    esac
  done
fi

LOGS_DEFAULT=${TMPDIR:-/tmp}/layerswap-gpu-run
ONLY_ENSURE=$ENSURE
for s in "${ALL_STEPS[@]}"; do
  case "$s" in info|install) ;; *) [ -n "${WANT[$s]:-}" ] && ONLY_ENSURE= ;; esac
done
if [ -n "$ONLY_ENSURE" ]; then
  OUT=${GPU_RUN_LOGS:-$LOGS_DEFAULT}
else
  OUT=${GPU_RUN_LOGS:-${OUT:-$LOGS_DEFAULT}}
fi
mkdir -p "$OUT"

declare -A STATUS=() SECONDS_TAKEN=() LOGS=()
ORDER=()

elapsed() { echo $(( $(date +%s) - START )); }

# run_step NAME LIMIT LOG TAIL_LINES FUNCTION [PATTERN]: runs FUNCTION with its output appended to LOG, under
# a time limit of min(LIMIT, time left); prints the log's tail (longer when the step failed), then the log's
# lines that match PATTERN (a summary line the tail may miss).
run_step() {
  local name=$1 limit=$2 log=$3 tail_lines=$4 fn=$5 pattern=${6:-}
  ORDER+=("$name")
  LOGS[$name]=$log
  local left=$(( DEADLINE - $(elapsed) ))
  if [ "$left" -lt 20 ]; then
    STATUS[$name]="skipped (no time left)"; SECONDS_TAKEN[$name]=0
    echo "######## $name: skipped, $(elapsed) s of the $DEADLINE s deadline used"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "######## $name (limit ${limit} s, log $log) at +$(elapsed) s"
  echo "######## $name at $(date -u +%FT%TZ), limit ${limit} s" >>"$log"
  local t0 rc
  t0=$(date +%s)
  STEP_LIMIT=$limit "$fn" >>"$log" 2>&1
  rc=$?
  SECONDS_TAKEN[$name]=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 0 ]; then
    STATUS[$name]="ok"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    STATUS[$name]="FAILED (timed out after ${limit} s)"
  else
    STATUS[$name]="FAILED (exit $rc)"
  fi
  [ "$rc" -ne 0 ] && tail_lines=$(( tail_lines > 60 ? tail_lines : 60 ))
  echo "-------- $name: ${STATUS[$name]} in ${SECONDS_TAKEN[$name]} s; last lines of $log:"
  tail -n "$tail_lines" "$log"
  if [ -n "$pattern" ]; then grep -E "$pattern" "$log" | tail -n 5; fi
  echo
}

# ---- steps ------------------------------------------------------------------------------------------------

step_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 || echo "nvidia-smi failed"
  nvidia-smi 2>&1 | head -20
  echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count()); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
  "$PY" -c "import transformers, peft, accelerate; print('transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tail -1
  "$PY" -c "import scikit_build_core, pybind11; print('scikit-build-core', scikit_build_core.__version__, 'pybind11', pybind11.__version__)" 2>&1 | tail -1
  echo "cmake: $(cmake --version 2>&1 | head -1); ninja: $(ninja --version 2>&1 || echo missing); nvcc: $(nvcc --version 2>&1 | tail -1)"
  echo "gtest: $(ls -d /usr/include/gtest /usr/local/include/gtest 2>/dev/null | tr '\n' ' ')"
  nproc; free -g | head -2; df -h "$REPO" | tail -1
  return 0
}

# A hash of the library's sources (what the install builds), so that an install says which tree it came from: the
# install step writes it into the package (SOURCE_HASH), `ensure` compares, and bench/swap.py records it per side. A
# warm machine keeps the last call's install, which may be of another tree (session 43 ran a benchmark on one).
source_hash() {
  find allocator profiler runtime bindings cmake CMakeLists.txt pyproject.toml -type f -print0 2>/dev/null |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

installed_hash() {
  (cd / && "$PY" -c "import layerswap, os; print(open(os.path.join(os.path.dirname(layerswap.__file__), 'SOURCE_HASH')).read().strip())" 2>/dev/null)
}

step_install() {
  local pip=("$PY" -m pip) rc want
  want=$(source_hash)
  if [ -n "$ENSURE" ] && [ "$(installed_hash)" = "$want" ]; then
    echo "installed package built from these sources ($want): not reinstalled"
    return 0
  fi
  "$PY" -m pip --version >/dev/null 2>&1 || pip=(pip)
  # shellcheck disable=SC2086 # GPU_RUN_PIP_ARGS is a list of words
  timeout "$STEP_LIMIT" "${pip[@]}" install --no-build-isolation --no-deps -q ${GPU_RUN_PIP_ARGS:-} . && rc=0 || rc=$?
  if [ "$rc" -ne 0 ] && grep -q "externally-managed-environment" "$OUT/build.log" 2>/dev/null; then
    echo "pip refused an externally managed environment: retrying with --break-system-packages"
    # shellcheck disable=SC2086 # GPU_RUN_PIP_ARGS is a list of words
    timeout "$STEP_LIMIT" "${pip[@]}" install --no-build-isolation --no-deps -q --break-system-packages ${GPU_RUN_PIP_ARGS:-} . && rc=0 || rc=$?
  fi
  [ "$rc" -ne 0 ] && return "$rc"
  # The installed package, seen from outside the source tree, stamped with the sources it was built from.
  (cd / && GPU_RUN_SOURCE_HASH="$want" "$PY" -c "import torch, layerswap, layerswap._C as C, os; d=os.path.dirname(layerswap.__file__); open(os.path.join(d, 'SOURCE_HASH'), 'w').write(os.environ['GPU_RUN_SOURCE_HASH'] + '\n'); print('installed:', d, sorted(f for f in os.listdir(d) if f.endswith('.so')), 'sources', os.environ['GPU_RUN_SOURCE_HASH']); print('gpu_available:', C.gpu_available())")
}

step_cmake() {
  local gen=()
  if [ -f build/CMakeCache.txt ]; then
    echo "reusing build/ ($(grep '^CMAKE_GENERATOR:' build/CMakeCache.txt))"  # its generator cannot change
  elif command -v ninja >/dev/null 2>&1; then
    gen=(-G Ninja)
  else
    echo "ninja not found: using the default generator"
  fi
  # The Python extension is built and installed by the install step; the CMake tree builds the C++ tests.
  timeout "$STEP_LIMIT" cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DLAYERSWAP_BUILD_PYTHON=OFF &&
    timeout "$STEP_LIMIT" cmake --build build -j"$JOBS"
}

# The GPU tests first and one at a time (they share the device, and some fill its memory on purpose); then the unit
# tests, which need no GPU, in parallel. One after the other they took over 150 s on the H100 (session 34).
step_ctest() {
  local end=$(( $(date +%s) + STEP_LIMIT )) rc=0
  timeout "$STEP_LIMIT" ctest --test-dir build --output-on-failure --timeout 120 -L gpu || rc=$?
  local left=$(( end - $(date +%s) ))
  [ "$left" -gt 0 ] || return 124
  timeout "$left" ctest --test-dir build --output-on-failure --timeout 120 -L unit --parallel "$JOBS" || rc=$?
  return "$rc"
}

step_pytest() {
  timeout "$STEP_LIMIT" "$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=15 \
    --junitxml="$OUT/pytest.xml" tests/python
}

step_bench() {
  rm -f bench/results/foundation.json
  timeout "$STEP_LIMIT" "$PY" bench/foundation.py
  local rc=$?
  if [ -f bench/results/foundation.json ]; then cp bench/results/foundation.json "$OUT/foundation.json"; fi
  return "$rc"
}

# ---- run --------------------------------------------------------------------------------------------------

echo "gpu_run.sh: steps: $(for s in "${ALL_STEPS[@]}"; do [ -n "${WANT[$s]:-}" ] && printf '%s ' "$s"; done); logs in $OUT"
[ -n "${WANT[info]:-}" ]    && run_step info    60                                  "$OUT/info.log"   40 step_info
[ -n "${WANT[install]:-}" ] && run_step install "${GPU_RUN_TIMEOUT_INSTALL:-300}"  "$OUT/build.log"  5  step_install
[ -n "${WANT[cmake]:-}" ]   && run_step cmake   "${GPU_RUN_TIMEOUT_CMAKE:-240}"    "$OUT/build.log"  3  step_cmake
[ -n "${WANT[ctest]:-}" ]   && run_step ctest   "${GPU_RUN_TIMEOUT_CTEST:-150}"    "$OUT/ctest.log"  12 step_ctest "tests passed|tests failed"
[ -n "${WANT[pytest]:-}" ]  && run_step pytest  "${GPU_RUN_TIMEOUT_PYTEST:-330}"   "$OUT/pytest.log" 40 step_pytest
[ -n "${WANT[bench]:-}" ]   && run_step bench   "${GPU_RUN_TIMEOUT_BENCH:-300}"    "$OUT/bench.log"  32 step_bench

echo "======== summary ($(elapsed) s in all; logs in $OUT)"
printf '%-8s %-34s %8s  %s\n' step status seconds log
failed=0
for s in "${ORDER[@]}"; do
  printf '%-8s %-34s %8s  %s\n' "$s" "${STATUS[$s]}" "${SECONDS_TAKEN[$s]}" "${LOGS[$s]}"
  case "${STATUS[$s]}" in ok) ;; *) failed=1 ;; esac
done
exit "$failed"
