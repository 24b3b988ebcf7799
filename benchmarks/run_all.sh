#!/usr/bin/env bash
# The run behind docs/benchmarks.md: every `leto bench` benchmark with its defaults,
# one after another (they must not share the machine), tables to OUT/*.txt, JSON and
# PNG to OUT/. Takes about an hour on the 2-core development machine.
#
#   benchmarks/run_all.sh [OUT]        # default OUT: bench-results
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results}
mkdir -p "$OUT"
LETO=${LETO:-.venv/bin/leto}
for bench in recovery overhead goodput scaling; do
    echo "== leto bench $bench --out $OUT" | tee "$OUT/$bench.txt"
    start=$(date +%s)
    "$LETO" bench "$bench" --out "$OUT" | tee -a "$OUT/$bench.txt"
    echo "($(( $(date +%s) - start )) s)" | tee -a "$OUT/$bench.txt"
done
