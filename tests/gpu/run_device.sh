#!/usr/bin/env bash
# The GPU checks of issue 41, in one run of under 6 minutes (docs/gpu.md).
#
#   bash tests/gpu/run_device.sh          # from the repository root
#
# Uses the machine's python3 (LETO_PYTHON overrides it) with PYTHONPATH=. and installs
# nothing. Prints the device, torch and CUDA; runs the tensor layer's CUDA tests, the
# memory provider contract on CUDA, the retained layout in keeper GPU memory across
# processes and tests/gpu/ (pytest if importable, else tests/gpu/plain_runner.py);
# writes $OUT/gpu_summary.json when OUT is set. Without CUDA every CUDA part skips with
# its reason and the script exits 0; it exits 1 when a part fails.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
PY="${LETO_PYTHON:-python3}"
exec timeout -k 5 355 "$PY" tests/gpu/run_parts.py
