"""What the replica check (``replica_check``, docs/loop.md "Replicas agree") costs a
trainer per checked step, against the optimizer step every trainer runs anyway.

In one process, on the benchmark workload's model (``--params``, AdamW, the chunk size
``leto bench`` uses), alternating: the retained AdamW step of one rank (begin, every
chunk applied and sealed, end) and the digest a rank sends with its FINISH
(:func:`leto.retained.agreement.replica_digest`: the stored checksums, the optimizer's
process state, a LambdaLR's state). Medians of CPU time (``time.thread_time``) and
their ratio. ``leto bench overhead --configs plain,leto,leto-no-replica-check``
measures the same in whole jobs. Run:
python benchmarks/replica_check.py [--params 1M] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from leto.bench.workload import Workload, parse_count
from leto.retained import RetainedLayout
from leto.retained.agreement import replica_digest
from leto.retained.optim import required_states, to_retained
from leto.retained.process_state import scheduler_state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="1M", help="model size in parameters (default 1M)")
    ap.add_argument("--steps", type=int, default=30, help="steps measured (default 30)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    wl = Workload.for_params(parse_count(args.params))
    model = wl.build_model()
    opt = wl.build_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    lay = RetainedLayout.create(model, chunk_numel=wl.chunk_numel, states=required_states(opt))
    ropt = to_retained(opt, lay)
    torch.manual_seed(0)
    step_ms, digest_ms = [], []
    digests = set()
    for v in range(1, args.steps + 1):
        lay.grad_buffer.copy_(torch.randn(lay.numel, dtype=lay.dtype))
        lay.seal_grads(v, [True] * len(lay.params))
        t = time.thread_time()
        ropt.begin(v)
        for c in range(lay.n_chunks):
            ropt.save_undo(c)
            ropt.apply_chunk(c, seal=False)
            lay.seal_chunk(c, v)
            ropt.finish_chunk(c)
        ropt.end()
        step_ms.append(1e3 * (time.thread_time() - t))
        with warnings.catch_warnings():  # the retained optimizer stepped, not opt.step()
            warnings.simplefilter("ignore", UserWarning)
            sched.step()
        t = time.thread_time()
        digests.add(replica_digest(lay, ropt.process_state(), scheduler_state(sched)))
        digest_ms.append(1e3 * (time.thread_time() - t))
    out = {
        "params": lay.numel,
        "chunks": lay.n_chunks,
        "steps": args.steps,
        "step_ms_median": statistics.median(step_ms),
        "digest_ms_median": statistics.median(digest_ms),
        "digest_over_step_pct": 100.0 * statistics.median(digest_ms) / statistics.median(step_ms),
        "distinct_digests": len(digests),  # every step's state differs: one digest each
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"replica check on {out['params']:,} parameters in {out['chunks']} chunks, "
        f"{out['steps']} steps: the retained AdamW step {out['step_ms_median']:.3f} ms CPU, "
        f"the digest {out['digest_ms_median']:.3f} ms CPU "
        f"({out['digest_over_step_pct']:.2f}% of the step)"
    )


if __name__ == "__main__":
    main()
