#!/usr/bin/env bash
# Where each busy thread's CPU goes, by library and symbol: runs a command under `perf record` (cpu-clock
# samples, every process it starts included) and writes one text report.
#
#   bench/perf_threads.sh REPORT [--threads N] [--symbols N] -- command args...
#
# REPORT gets, first, every thread with samples (process id, thread id, name, CPU seconds), busiest first; then
# for the N busiest (default 8) the shares of its samples by library, and its top symbols (default 30). The
# perf data stays in a temporary directory: it is large, and only the report is worth keeping.
# A process that writes "pid start end" (CLOCK_MONOTONIC seconds) to the file $PERF_THREADS_WINDOWS is reported
# over that window alone (bench/swap.py's workers write their timed steps' window), so start-up does not dilute
# what the steps cost.
# PERF names the perf binary (default perf); PERF_FREQ the sampling rate in Hz (default 999). PERF_THREADS_JSON, if
# set, also gets every thread's samples by library and symbol (bench/perf_report.py), which bench/perf_sides.py
# tables per side of an interleaved bench/swap.py run.
# Symbols of layerswap's own libraries need an unstripped install: pybind11 strips the module itself, so
# pip install -C install.strip=false -C cmake.define.CMAKE_STRIP=/bin/true .
set -u -o pipefail

usage() { echo "usage: bench/perf_threads.sh REPORT [--threads N] [--symbols N] -- command args..." >&2; exit 2; }
[ $# -ge 3 ] || usage
report=$1; shift
threads=8 symbols=30
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case "$1" in
    --threads) threads=${2:?}; shift 2 ;;
    --symbols) symbols=${2:?}; shift 2 ;;
    *) usage ;;
  esac
done
[ "${1:-}" = -- ] || usage
shift
[ $# -gt 0 ] || usage

PERF=${PERF:-perf}
FREQ=${PERF_FREQ:-999}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
data=$tmp/perf.data

export PERF_THREADS_WINDOWS=$tmp/windows
: >"$PERF_THREADS_WINDOWS"
"$PERF" record -q -k CLOCK_MONOTONIC -F "$FREQ" -e cpu-clock -o "$data" -- "$@"
rc=$?

{
  echo "# perf_threads: $*"
  echo "# exit status $rc; cpu-clock samples at $FREQ Hz: seconds = samples / $FREQ"
  echo
  echo "# timed windows (pid start end):"
  sed 's/^/#   /' "$PERF_THREADS_WINDOWS"
  # One pass over the samples (bench/perf_report.py); PERF_THREADS_JSON, if set, also gets every thread's counts.
  "$PERF" script -i "$data" -F pid,tid,comm,time,ip,sym,dso 2>/dev/null |
    python3 "$(dirname "${BASH_SOURCE[0]}")/perf_report.py" --freq "$FREQ" --windows "$PERF_THREADS_WINDOWS" \
      --threads "$threads" --symbols "$symbols" ${PERF_THREADS_JSON:+--json "$PERF_THREADS_JSON"}
} >"$report"
exit "$rc"
