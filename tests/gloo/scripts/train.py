"""The real-process tests' training script: a tiny MLP, every RNG seeded.

Environment: TOPO ("NxM", default 1x2; "auto": the launched world), BATCH_PARTS and KEEP_GLOBAL (batch_parts, keep_global_batch = "1"), STEPS (6), CHUNK (64 elements), TIER2
("1"/"0"), OPT (a torch.optim class name, AdamW by default), DEVICE and CHECKSUM (the settings), SHARD ("1": shard = true;
the model's parameters' SHA-256 is then written to RUN_DIR/params-rank<r> at the end, as without it), TIER1_CODE ("parity", the default here, "replica" or "auto"), DIVERGE (each rank's model made different), CKPT (a checkpoint directory; CKPT_EVERY: its interval in steps, or CKPT_MTBF: seconds, Young/Daly's; CKPT_ASYNC "1": checkpoint_async; CKPT_SLOW: seconds each background write waits first; KILL_WRITER "rank:step": that rank SIGKILLs itself in its async write of that step, after its DCP files, before its metadata (once: RUN_DIR/killed-writer); each rank's checkpoint stalls go to RUN_DIR/stalls-rank<r>), STEP_SLEEP (seconds per step), SLOW_BACKWARD ("rank:step:seconds": that rank's backward of
that step waits that long before the model's last layer, so a peer's death finds it inside
its compute; the number of computes each rank ran is written to RUN_DIR/computes-rank<r>, and
the main thread's highest nice value during that backward and at the end to nice-rank<r>),
SLOW_FORWARD ("rank:step:seconds": that rank's step function waits that long first), FLUSH_AFTER_WRAP (subnormal flushing turned on after leto.wrap), BIG_MB (allocate that much while steps
3..6 run, to push the trainers over a shadow memory budget; the math is unchanged).
"""

import hashlib
import json
import os
import random
import threading
import time

import numpy
import torch
import torch.nn.functional as F
from torch import nn

import leto
from leto.retained.process_state import ResumableBatchSampler

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
settings = {
    "backend": "gloo",
    "topology": os.environ.get("TOPO", "1x2"),
    "chunk_size": int(os.environ.get("CHUNK", "64")),
    "tier2_interval": 2,
    "tier2": os.environ.get("TIER2", "1") == "1",
    "tier1_code": os.environ.get("TIER1_CODE", "parity"),
    "tier2_parity": int(os.environ.get("T2_PARITY", "1")),
}
if os.environ.get("SHARD"):
    settings["shard"] = os.environ["SHARD"] == "1"
for key in ("device", "checksum"):  # DEVICE ("cpu", "cuda"), CHECKSUM ("xxh3", "fletcher")
    if os.environ.get(key.upper()):
        settings[key] = os.environ[key.upper()]
if os.environ.get("CKPT"):
    settings["checkpoint_dir"] = os.environ["CKPT"]
    settings["checkpoint_interval"] = int(os.environ.get("CKPT_EVERY", "0"))
    settings["checkpoint_mtbf"] = int(os.environ.get("CKPT_MTBF", "0"))
    settings["checkpoint_async"] = os.environ.get("CKPT_ASYNC") == "1"
if os.environ.get("CKPT_SLOW"):  # seconds each background checkpoint write waits first
    from leto.retained.checkpoint import CheckpointStore

    _write = CheckpointStore.write

    def _slow_write(self, step, state, **kw):
        if threading.current_thread().name == "leto-ckpt-writer":
            time.sleep(float(os.environ["CKPT_SLOW"]))
        return _write(self, step, state, **kw)

    CheckpointStore.write = _slow_write
if os.environ.get("KILL_WRITER"):  # "rank:step": SIGKILLed in its async write of that step
    import signal

    from leto.retained.checkpoint import CheckpointStore

    _meta = CheckpointStore.write_rank_meta

    def _killing_meta(self, step, rank, meta):
        who, at = (int(x) for x in os.environ["KILL_WRITER"].split(":"))
        mark = os.path.join(os.environ["LETO_RUN_DIR"], "killed-writer")
        on_writer = threading.current_thread().name == "leto-ckpt-writer"
        if on_writer and (rank, step) == (who, at) and not os.path.exists(mark):
            # its DCP files written (and DCP's .metadata), its own metadata not yet
            with open(mark, "w") as f:
                f.write(json.dumps({"rank": rank, "step": step, "pid": os.getpid()}))
            os.kill(os.getpid(), signal.SIGKILL)
        return _meta(self, step, rank, meta)

    CheckpointStore.write_rank_meta = _killing_meta
if os.environ.get("BATCH_PARTS"):  # the global batch's parts; KEEP_GLOBAL=1: accumulate
    settings["batch_parts"] = int(os.environ["BATCH_PARTS"])
    settings["keep_global_batch"] = os.environ.get("KEEP_GLOBAL") == "1"
if os.environ.get("TOPO") == "auto":  # the launched world (an elastic job's, shrunk or not)
    del settings["topology"]
    cfg = leto.Config.load(settings)
else:
    cfg = leto.Config.from_dict(settings)
X, Y = torch.randn(64, 8).to(cfg.torch_device), torch.randn(64, 2).to(cfg.torch_device)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 2))
if os.environ.get("DIVERGE"):  # each rank's model its own (not data-parallel training)
    with torch.no_grad():
        model[0].bias.add_(int(os.environ.get("RANK", "0")))
opt = getattr(torch.optim, os.environ.get("OPT", "AdamW"))(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
sampler = ResumableBatchSampler(64, 8, seed=0)
big = int(os.environ.get("BIG_MB", "0")) << 20
calls = {"n": 0, "blob": None, "nice": 0}


def _nice() -> int:
    """This thread's CPU priority (its nice value)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class _Slow(torch.autograd.Function):
    """The identity, whose backward waits ``seconds`` first (the lowest priority the
    thread had meanwhile into ``calls["nice"]``, read by a watcher thread: the lowered
    thread itself may not run at all while it is lowered, on a busy machine)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        end = time.monotonic() + ctx.seconds
        tid = threading.get_native_id()

        def watch():
            while time.monotonic() < end:
                calls["nice"] = max(calls["nice"], os.getpriority(os.PRIO_PROCESS, tid))
                time.sleep(0.002)

        watcher = threading.Thread(target=watch, name="nice-watcher", daemon=True)
        watcher.start()
        while time.monotonic() < end:
            time.sleep(0.02)
        watcher.join()
        return g, None


slow = os.environ.get("SLOW_BACKWARD", "")
slow_fwd = os.environ.get("SLOW_FORWARD", "")


def step_fn(m, idx):
    calls["n"] += 1
    if slow_fwd:
        rank, step, seconds = slow_fwd.split(":")
        if os.environ.get("RANK") == rank and session.step + 1 == int(step):
            time.sleep(float(seconds))
    if slow:
        rank, step, seconds = slow.split(":")
        if os.environ.get("RANK") == rank and session.step + 1 == int(step):
            return F.mse_loss(_Slow.apply(m(X[idx]), float(seconds)), Y[idx])
    if os.environ.get("STEP_SLEEP"):
        time.sleep(float(os.environ["STEP_SLEEP"]))
    if big and 3 <= calls["n"] <= 6:
        if calls["blob"] is None:
            calls["blob"] = torch.ones(big // 4)
        time.sleep(0.3)
    elif calls["n"] > 6:
        calls["blob"] = None
    if os.environ.get("RAISE_AT") and session.step + 1 == int(os.environ["RAISE_AT"]):
        if os.environ.get("RANK") == "1":  # an error of the script, in every incarnation
            raise TypeError("step_fn() got an unexpected keyword argument 'bad'")
    return F.mse_loss(m(X[idx]), Y[idx])


session = leto.wrap(model, opt, sched, sampler, config=cfg)
if os.environ.get("FLUSH_AFTER_WRAP"):  # a floating-point mode changed too late
    torch.set_flush_denormal(True)
session.train(step_fn, int(os.environ.get("STEPS", "6")))
if os.environ.get("SHARD"):  # the model's own parameters, sharded or not
    blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    out = os.path.join(os.environ["LETO_RUN_DIR"], f"params-rank{os.environ['RANK']}")
    with open(out, "w") as f:
        f.write(hashlib.sha256(blob).hexdigest())
if slow:
    out = os.path.join(os.environ["LETO_RUN_DIR"], f"computes-rank{os.environ['RANK']}")
    with open(out, "w") as f:
        f.write(str(calls["n"]))
    out = os.path.join(os.environ["LETO_RUN_DIR"], f"nice-rank{os.environ['RANK']}")
    with open(out, "w") as f:  # the lowest priority during the slow backward, and now
        f.write(f"{calls['nice']} {_nice()}")
if os.environ.get("CKPT"):  # each checkpoint's stall of this rank's loop (its timeline)
    stalls = [e for e in session.timeline if e["event"] == "checkpoint_stall"]
    with open(
        os.path.join(os.environ["LETO_RUN_DIR"], f"stalls-rank{os.environ['RANK']}"), "w"
    ) as f:
        f.write(json.dumps(stalls))
print(f"done at step {session.step}")
