"""Where a trainer checks for an abort and fires the faults of its plan (:mod:`.faults`).

Every safe point of the step and of a recovery command is also a fault point: the
plan's faults that name this phase, chunk, place and step fire there, each once per
job (claimed through the node's agent first, on the job's TCPStore or in etcd, so a
restarted trainer, or one of a replacement node, does not fire it again).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Protocol

from leto.retained.layout import RetainedLayout
from leto.retained.parity import as_bytes

from . import messages as M
from .channel import AgentChannel
from .collective import Interrupted
from .faults import label as fault_label

__all__ = ["FaultHost", "FaultPoints", "StepProgress"]


class StepProgress(Protocol):
    """What :class:`FaultPoints` reads of the step under way (the step transaction)."""

    @property
    def in_progress(self) -> int: ...
    def claims_recovery(self) -> bool: ...


class FaultHost(Protocol):
    """What :class:`FaultPoints` reads of its rank's session."""

    @property
    def txn(self) -> StepProgress: ...
    @property
    def ch(self) -> AgentChannel: ...
    @property
    def gen(self) -> int: ...
    @property
    def spec(self) -> dict[str, Any]: ...
    @property
    def cfg(self) -> Any: ...
    @property
    def keeper_pid(self) -> int: ...
    @property
    def layout(self) -> RetainedLayout: ...
    def _fatal(self, message: str) -> None: ...


class FaultPoints:
    """One rank's fault plan, fired at its points (see the module docstring)."""

    def __init__(self, session: FaultHost, plan: list[dict[str, Any]]) -> None:
        self.session = session
        self.faults = plan

    def point(
        self, phase: str, chunk: int | None = None, where: str | None = None, *, tear: Any = None
    ) -> None:
        """A safe point (abort check) and a fault point of the plan."""
        session = self.session
        step = session.txn.in_progress
        for f in self.faults:
            if f.get("_fired"):
                continue
            at_chunk = f["chunk"] if phase in ("apply", "parity") else None  # corrupt: its target
            if f["phase"] != phase or (at_chunk is not None and at_chunk != chunk):
                continue
            if f["where"] is not None and f["where"] != where:
                continue
            if phase == "recovery":
                if step < f["step"]:
                    continue
            elif f["step"] != step:
                continue
            f["_fired"] = True
            reply, _ = session.ch.request(M.ClaimFault(fault=str(f["id"])))
            if not reply.get("first"):
                continue  # fired by an earlier incarnation
            self._fire(f, tear)
        if (
            phase != "recovery"
            and session.ch.aborted_since(session.gen)
            and session.txn.claims_recovery()
        ):
            raise Interrupted  # (a recovery beside the compute is waited for at its end)

    def _fire(self, f: dict[str, Any], tear: Any) -> None:
        session = self.session
        what = fault_label(f)
        print(f"leto: injecting fault: {what}", flush=True)
        sys.stdout.flush()
        self._record(f)
        kind = f["kind"]
        if kind == "crash":
            if tear is not None:
                tear()
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "exception":
            raise RuntimeError(f"injected exception: {what}")
        elif kind == "lose_memory":
            os.kill(session.keeper_pid, signal.SIGKILL)
            time.sleep(120)  # the agent kills this process (the last holder of the memory)
        elif kind == "lose_node":
            os.kill(int(session.spec["agent_pid"]), signal.SIGKILL)
            time.sleep(120)  # dies with its agent
        elif kind == "corrupt":
            if not session.cfg.verify_chunks:
                session._fatal(f"fault {what}: needs verify_chunks (PREPARE's checksum pass)")
            c = int(f["chunk"] or 0)
            if not 0 <= c < session.layout.n_chunks:
                session._fatal(
                    f"fault {what}: this rank has chunks 0..{session.layout.n_chunks - 1}"
                )
            first = as_bytes(session.layout.chunk_data(c)[0])
            first[0] ^= 0x10  # and train on: nothing reported a memory error
            return
        time.sleep(120)

    def _record(self, f: dict[str, Any]) -> None:
        """Append the fault's firing, with its ``time`` (``time.time()``, the event log's
        clock), to ``RUN_DIR/faults.jsonl``: what a measurement of the recovery that
        follows needs (its detection starts here), written before the fault acts."""
        run_dir = os.environ.get("LETO_RUN_DIR")
        if not run_dir:
            return
        rec = {k: f.get(k) for k in ("id", "kind", "rank", "step", "phase", "chunk", "where")}
        line = json.dumps({**rec, "time": time.time(), "pid": os.getpid()}) + "\n"
        path = os.path.join(run_dir, "faults.jsonl")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as e:  # the fault is claimed: it acts all the same
            print(f"leto: cannot record the fault in {path}: {e}", file=sys.stderr, flush=True)
