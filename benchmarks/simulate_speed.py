"""How fast `leto simulate` runs, against the issue's targets (5 s for a 30-day job on
131,072 GPUs, command start-up included; 60 s for a 20-point sweep). Prints each time
and its ratio to the target. Run: python benchmarks/simulate_speed.py"""

from __future__ import annotations

import subprocess
import sys
import time

from leto.sim import sweep
from leto.sim.params import SimParams


def main() -> None:
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "leto.cli",
            "simulate",
            "--gpus",
            "131072",
            "--days",
            "30",
            "--json",
        ],
        check=True,
        capture_output=True,
    )
    one = time.perf_counter() - start
    start = time.perf_counter()
    sweep.run_sweep(SimParams(), "gpus", progress=False)
    twenty = time.perf_counter() - start
    print(f"simulate 131072 GPUs x 30 days: {one:.2f} s  ({one / 5.0:.2f} of the 5 s target)")
    print(
        f"20-point gpus sweep:            {twenty:.1f} s  ({twenty / 60.0:.2f} of the 60 s target)"
    )


if __name__ == "__main__":
    main()
