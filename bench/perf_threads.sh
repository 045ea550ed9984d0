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
# PERF names the perf binary (default perf); PERF_FREQ the sampling rate in Hz (default 999).
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
  echo "# threads: pid tid name seconds (busiest first; within its process's window when it has one: windowed)"
  "$PERF" script -i "$data" -F pid,tid,comm,time 2>/dev/null |
    awk -v f="$FREQ" -v wf="$PERF_THREADS_WINDOWS" '
      BEGIN { while ((getline line < wf) > 0) { split(line, w, " "); ws[w[1]] = w[2]; we[w[1]] = w[3] } }
      { t = $NF; sub(/:$/, "", t); name = $1; for (i = 2; i < NF - 1; i++) name = name "_" $i;
        split($(NF - 1), p, "/");
        if (p[1] in ws) { if (t + 0 < ws[p[1]] || t + 0 > we[p[1]]) next; name = name " windowed" }
        n[p[1] " " p[2] " " name] += 1 }
      END { for (k in n) { split(k, a, " "); printf "%s %s %s %.3f%s\n", a[1], a[2], a[3], n[k] / f, (a[4] ? " windowed" : "") } }' |
    sort -k4,4 -g -r | tee "$tmp/threads" | head -n 40
  while read -r pid tid name secs _; do
    echo
    window=$(awk -v p="$pid" '$1 == p { print $2 "," $3 }' "$PERF_THREADS_WINDOWS" | head -n 1)
    echo "######## thread $tid ($name) of process $pid: $secs s${window:+ in the window $window}"
    # (perf report --sort dso alone finds no samples for a thread other than a process's first: sum the symbols.)
    "$PERF" report -i "$data" --tid "$tid" ${window:+--time "$window"} --percentage relative --sort dso,sym \
      --stdio 2>/dev/null |
      grep -v '^#' | grep -v '^$' >"$tmp/symbols"
    awk '{ sub(/%/, "", $1); s[$2] += $1 } END { for (d in s) printf "%8.2f%%  %s\n", s[d], d }' "$tmp/symbols" |
      sort -g -r | head -n 12
    echo "--------"
    head -n "$symbols" "$tmp/symbols"
  done < <(head -n "$threads" "$tmp/threads")
} >"$report"
exit "$rc"
