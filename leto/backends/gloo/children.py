"""The processes a node agent starts and reaps: one keeper per local rank, and the
trainers and shadows forked by the zygote. A death is seen from the robust mutex the
process's main thread held (:mod:`.deathwatch`), its status then read from ``/proc``,
before the kernel has torn the process's memory down; else on its pidfd, its status
from the zygote. A trainer's death or a keeper's becomes a failure report to the
coordinator, a shadow's a shadow report (and a retry, up to three times). Fencing a generation kills the stale processes
and fences every keeper."""

from __future__ import annotations

import os
import selectors
import signal
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from . import messages as M
from . import procs as P
from .board import StatusBoard
from .deathwatch import DeathWatch, Undecided, quiesced
from .keeper import spawn_keeper
from .node_tables import NodeTables
from .records import LaunchError, Proc, look
from .wire import Conn, WireError

__all__ = ["QUIESCE_WAIT", "Children", "ChildrenHost"]

#: how long the agent waits for a dying process's threads to lose their address space
#: once its main thread died, before it leaves the death to the pidfd
QUIESCE_WAIT = 0.05


class ChildRouting(Protocol):
    """What the node's processes use of the agent's routing."""

    def to_coord(self, msg: M.Message) -> None: ...

    def claim(self, p: Proc) -> None: ...

    def drain_proc(self, p: Proc) -> None: ...

    def drop_conn(self, conn: Conn) -> None: ...


class ChildShadows(Protocol):
    """What the node's processes use of its shadows: a shadow wanted again, or given up."""

    def ensure(self, lr: int, *, force: bool = False) -> None: ...

    def degrade(self, lr: int, rank: int, why: str) -> None: ...


class ChildSupervisor(Protocol):
    """The node's end: checked when a process of it ends."""

    def check_node_finished(self) -> None: ...


class ChildrenHost(NodeTables, Protocol):
    """What the node's processes use of their agent: the job's and node's shape and
    places, its selector, deathwatch and zygote, the tables of its processes (held in
    place), the counters a spawn or fence moves on, and the parts they report to."""

    @property
    def nproc(self) -> int: ...

    @property
    def W(self) -> int: ...

    @property
    def who(self) -> str: ...

    @property
    def job(self) -> str: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def logs(self) -> Path: ...

    @property
    def umask(self) -> int: ...

    @property
    def agent_socket(self) -> str: ...

    @property
    def sel(self) -> selectors.BaseSelector: ...

    @property
    def deathwatch(self) -> DeathWatch: ...

    @property
    def zygote(self) -> Any: ...

    generation: int
    incarnation: int
    recovering: bool
    told_unprotected: bool

    @property
    def by_pid(self) -> dict[int, Proc]: ...

    @property
    def unclaimed_boards(self) -> dict[int, StatusBoard | None]: ...

    @property
    def routing(self) -> ChildRouting: ...

    @property
    def shadows(self) -> ChildShadows: ...

    @property
    def supervisor(self) -> ChildSupervisor: ...


class Children:
    """Spawning, reaping and fencing the node's processes and keepers."""

    def __init__(self, agent: ChildrenHost) -> None:
        self.agent = agent

    def start_keeper(self, lr: int) -> None:
        a = self.agent
        h = spawn_keeper(a.rank(lr), a.job, tag=str(a.run_dir))
        a.routing.to_coord(M.Started(role="keeper", pid=h.pid, rank=a.rank(lr)))
        if a.generation:
            h.fence(a.generation)
        a.keepers[lr] = h
        a.sel.register(h.pidfd, selectors.EVENT_READ, ("keeper_dead", lr))

    def spawn(
        self, lr: int, role: str, promote_gen: int | None = None, *, cold: bool = False
    ) -> None:
        """Fork a trainer or a shadow of ``lr``; a *cold* shadow (one to be promoted at
        once) keeps its parameters instead of building a skeleton."""
        a = self.agent
        cold = role == "shadow" and (cold or promote_gen is not None)
        a.incarnation += 1
        rank = a.rank(lr)
        inc = a.incarnation
        o = a.o
        again = f"-restart{o.restarts}" if o.restarts else ""  # a restart's logs beside
        log_path = str(a.logs / f"node{a.node}-{role}{rank}-{inc}{again}.log")
        rfd, wfd = os.pipe()
        env = {
            "RANK": rank,
            "WORLD_SIZE": a.W,
            "LOCAL_RANK": lr,
            "LOCAL_WORLD_SIZE": a.nproc,
            "GROUP_RANK": a.node,
            "NODE_RANK": a.node,
            "ROLE_RANK": rank,
            "MASTER_ADDR": o.rdzv_host,
            "MASTER_PORT": o.rdzv_port,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": o.threads,
            "LETO_ROLE": role,
            "LETO_INCARNATION": inc,
            "LETO_RUN_DIR": str(a.run_dir),
            "LETO_JOB": a.job,
            # a restart of the job (--max-restarts): the trainers resume from checkpoint_dir
            **({"LETO_RESTART": o.restarts} if o.restarts else {}),
        }
        spec = {
            "role": role,
            "skeleton": not cold,
            "rank": rank,
            "local_rank": lr,
            "node": a.node,
            "nnodes": o.nnodes,
            "nproc": a.nproc,
            "world": a.W,
            "incarnation": inc,
            "env": env,
            "script": o.script,
            "module": o.module,
            "args": o.script_args,
            "cwd": os.getcwd(),
            "agent_socket": a.agent_socket[1:],
            "keeper_socket": a.keepers[lr].socket_name,
            "keeper_pid": a.keepers[lr].pid,
            "agent_pid": os.getpid(),
            "job": a.job,
            "threads": o.threads,
            "heartbeat": o.heartbeat,
            "collective_timeout": o.collective_timeout,
            "umask": a.umask,
            "store_host": o.rdzv_host,
            "store_port": o.rdzv_port,
            "faults": [f for f in o.faults if f["rank"] == rank],
            "generation": a.generation,
        }
        rid = a.zygote.spawn(spec, wfd)
        os.close(wfd)
        os.set_blocking(rfd, False)
        logf = open(log_path, "ab")  # noqa: SIM115 - closed when the pipe closes
        a.spawns[rid] = {
            "lr": lr,
            "role": role,
            "inc": inc,
            "log": log_path,
            "promote_gen": promote_gen,
            "cold": cold,
        }
        a.sel.register(
            rfd, selectors.EVENT_READ, ("log", {"fd": rfd, "file": logf, "rank": rank, "pid": None})
        )
        a.spawns[rid]["logkey"] = rfd
        if role == "shadow":
            a.shadow_state[lr] = "spawning"

    def on_zygote(self) -> None:
        a = self.agent
        alive = a.zygote.conn.feed()
        for msg, fds in a.zygote.conn.messages():
            op = msg.get("op")
            if op == "spawned":
                sp = a.spawns.pop(int(msg["id"]))
                now = time.monotonic()
                p = Proc(
                    pid=int(msg["pid"]),
                    pidfd=fds[0],
                    role=sp["role"],
                    local_rank=sp["lr"],
                    rank=a.rank(sp["lr"]),
                    incarnation=sp["inc"],
                    spawned=now,
                    log_path=sp["log"],
                    hb=now,
                    progress_t=now,
                )
                p.promote_gen = sp["promote_gen"]
                p.cold_start = sp["cold"]
                if p.promote_gen is not None:
                    p.promote_started = now
                    p.promote_warm = False
                a.by_pid[p.pid] = p
                key = a.sel.get_key(sp["logkey"])
                key.data[1]["pid"] = p.pid
                key.data[1]["proc"] = p
                a.sel.register(p.pidfd, selectors.EVENT_READ, ("pidfd", p))
                if p.role == "trainer":
                    a.trainer[p.local_rank] = p
                    self.keeper(p.local_rank, "admit", a.generation, p.pid)
                else:
                    a.shadow[p.local_rank] = p
                a.routing.to_coord(
                    M.Started(role=p.role, pid=p.pid, rank=p.rank, incarnation=p.incarnation)
                )
                a.routing.claim(p)
            elif op == "exited":
                p2 = a.by_pid.get(int(msg["pid"]))
                if p2 is not None:
                    p2.exited = int(msg["code"])
                    if p2.dead_at is not None:
                        self.finalize_exit(p2)
            else:
                for fd in fds:
                    os.close(fd)
        if not alive and not a.stop:
            raise LaunchError("the zygote (fork server) died")

    def unprotected(self, msg: M.Unprotected) -> None:
        """A trainer's script runs without ``leto.wrap`` (:mod:`.unwrapped`): one line on
        this node's console, also with ``--quiet`` (the first rank's), and the event log."""
        a = self.agent
        if not a.told_unprotected:
            a.told_unprotected = True
            print(
                f"leto[{a.who}]: warning: rank {msg.rank}'s script runs without leto.wrap "
                f"({msg.detail}): nothing is protected, a failure ends the job; give your "
                "model, optimizer and data to leto.wrap and train through the session it "
                "returns (docs/loop.md)",
                file=sys.stderr,
                flush=True,
            )
        a.routing.to_coord(msg)

    def on_owner_died(self) -> None:
        """Processes whose main thread died (:mod:`.deathwatch`): each whose threads have
        all lost their address space is dead from here on, its exit status read from
        ``/proc``, before the kernel has torn its memory down and the pidfd says so.
        One that does not get there in :data:`QUIESCE_WAIT` seconds (a main thread that
        exited alone, or a slow exit) is left to its pidfd."""
        for pid in self.agent.deathwatch.pids():
            p = self.agent.by_pid.get(pid)
            # a process the agent killed (fencing, reclaiming, the end) is no news
            if p is None or p.dead_at is not None or p.expected_exit or P.readable(p.pidfd):
                continue
            deadline = time.monotonic() + QUIESCE_WAIT
            try:
                code = quiesced(pid, p.pidfd)
                while code is None and time.monotonic() < deadline:
                    time.sleep(0.0005)
                    code = quiesced(pid, p.pidfd)
            except Undecided:
                continue
            if code is not None:
                self.agent.routing.drain_proc(p)
                p.exited, p.seen_by = code, "deathwatch"
                self.on_pidfd(p)

    def on_pidfd(self, p: Proc) -> None:
        if p.dead_at is not None:  # seen already (deathwatch): its pidfd is closed
            return
        a = self.agent
        a.sel.unregister(p.pidfd)
        p.dead_at = time.monotonic()
        if a.trainer.get(p.local_rank) is p and not p.expected_exit:
            a.recovering = True  # its memory is going away: that is no reason to re-warm
        if p.exited is not None:
            self.finalize_exit(p)

    def finalize_exit(self, p: Proc) -> None:
        a = self.agent
        if p.pid not in a.by_pid:
            return
        del a.by_pid[p.pid]
        look(p, time.monotonic())  # where it was when it died
        if p.board is not None:
            p.board.close()
            p.board = None
        stale = a.unclaimed_boards.pop(p.pid, None)
        if stale is not None:
            stale.close()
        try:
            os.close(p.pidfd)
        except OSError:
            pass
        if p.conn is not None:
            a.routing.drop_conn(p.conn)
        lr = p.local_rank
        code = p.exited
        how = P.describe_status(code)
        if a.trainer.get(lr) is p:
            a.trainer[lr] = None
            if p.expected_exit or a.stop:
                return
            # the job is complete and this trainer said it was done: its end, also when
            # the zygote's status came too late (:meth:`Supervisor.tick`, a busy machine)
            if a.complete and (code == 0 or (code is None and p.phase == "done")):
                p.done = True
                a.supervisor.check_node_finished()
                return
            kind = "exception" if p.error else "crash"
            detected = (
                "exception reported by the trainer" if p.error else f"process exit ({p.seen_by})"
            )
            if code in (0, None) and p.status == "starting":
                # (None: the zygote's status came too late, on a busy machine; the script
                # ended all the same before it called leto.wrap)
                how = (
                    f"the script ended ({how if code is None else 'exit code 0'}) without "
                    "calling leto.wrap with backend='gloo': `leto launch` runs scripts "
                    "wrapped by leto"
                )
            latency = None if p.dead_at is None else round((p.dead_at - p.hb) * 1e3, 1)
            where = {
                "idle": "between steps",
                "startup": "during startup",
                "done": "after its training loop",
            }.get(p.phase, f"in {p.phase} of step {p.step + 1}")
            a.say(f"rank {p.rank} {'raised an exception' if p.error else 'died'} ({how}) {where}")
            a.shadows.ensure(lr)
            a.recovering = True  # (the abort follows) no re-warming on the freed memory
            a.routing.to_coord(
                M.Failure(
                    kind=kind,
                    rank=p.rank,
                    detected_by=detected,
                    detail=how,
                    traceback=p.error,
                    in_phase=p.phase,
                    at_step=p.step,
                    ms_since_heartbeat=latency,
                    pid=p.pid,
                )
            )
        elif a.shadow.get(lr) is p:
            a.shadow[lr] = None
            if p.expected_exit or a.stop:
                return
            a.shadow_failures[lr] += 1
            a.shadow_state[lr] = "failed" if p.error else "none"
            why = _last_line(p.error) or how
            if p.status == "starting" and not p.cold_start and lr not in a.degraded:
                a.shadows.degrade(lr, p.rank, why)  # it died building its skeleton
            reason = f"the shadow of rank {p.rank} exited ({how})"
            if p.error:
                reason += ":\n" + p.error
            a.routing.to_coord(
                M.Shadow(rank=p.rank, state="failed", reason=reason, degraded=a.degraded.get(lr))
            )
            if a.complete:
                return
            # a promotion or the coordinator waits for this rank's replacement
            needed = p.promote_gen is not None or p.cold_start or lr in a.asked
            on_demand = lr in a.degraded or not a.o.shadows
            if a.shadow_failures[lr] < 3 and (needed or not on_demand):
                self.spawn(lr, "shadow", promote_gen=p.promote_gen, cold=on_demand)
            elif needed:
                a.routing.to_coord(
                    M.Fatal(
                        rank=p.rank,
                        error=f"cannot start a replacement process: it exited ({how}): {why}",
                    )
                )

    def kill(self, p: Proc, *, wait: float = 5.0) -> None:
        """SIGKILL ``p`` and wait until it is gone (its handle readable)."""
        p.expected_exit = True
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        import select

        try:
            select.select([p.pidfd], [], [], wait)
        except (OSError, ValueError):
            pass

    def keeper(self, lr: int, op: str, *args: int) -> None:
        """``fence``/``admit`` on the keeper of ``lr``; a keeper found dead is handled now."""
        a = self.agent
        for _ in range(3):
            h = a.keepers[lr]
            try:
                getattr(h, op)(*args)
                return
            except (WireError, TimeoutError, RuntimeError, OSError):
                try:
                    h.proc.wait(2.0)
                except Exception:  # noqa: BLE001
                    raise LaunchError(f"the keeper of rank {a.rank(lr)} does not answer") from None
                self.on_keeper_dead(lr)
        raise LaunchError(f"the keeper of rank {a.rank(lr)} keeps failing")

    def on_keeper_dead(self, lr: int) -> None:
        a = self.agent
        h = a.keepers[lr]
        a.sel.unregister(h.pidfd)
        code = h.proc.wait()
        h.close()
        rank = a.rank(lr)
        if a.stop:
            return
        a.say(
            f"the keeper of rank {rank} died ({P.describe_status(code)}): its retained memory is lost"
        )
        t = a.trainer.get(lr)
        if t is not None:
            self.kill(t)  # the last holder of a mapping: now the memory is really gone
        self.start_keeper(lr)
        a.routing.to_coord(
            M.Failure(
                kind="keeper_lost",
                rank=rank,
                detected_by="keeper process exit (pidfd)",
                detail=P.describe_status(code),
            )
        )

    def discard(self, lr: int, source: int, step: int) -> None:
        """The coordinator found rank ``lr``'s state differs from its replicas' after
        ``step`` (:class:`~.messages.Discard`): its trainer and keeper are killed, so the
        memory is gone as in a keeper's death (the coordinator has told the core:
        ``LoseMemory``); the recovery copies its chunks and its optimizer's and
        scheduler's state from ``source`` (:mod:`.follow`). No failure is reported: the
        coordinator saw it first."""
        a = self.agent
        rank = a.rank(lr)
        a.say(
            f"rank {rank}'s retained state differs from its replicas' after step {step}: "
            f"discarded, to be copied from rank {source}"
        )
        t = a.trainer.get(lr)
        if t is not None:
            self.kill(t)
        h = a.keepers[lr]
        a.sel.unregister(h.pidfd)
        h.stop()  # its memory is freed: nothing of the diverged state is left to map
        self.start_keeper(lr)

    def fence(self, gen: int, kill: list[int]) -> None:
        a = self.agent
        a.generation = gen
        killed = []
        for r in kill:
            lr = r - a.node * a.nproc
            if lr in a.local_ranks:
                p = a.trainer.get(lr)
                if p is not None:
                    self.kill(p)
                    killed.append({"rank": r, "pid": p.pid})
                    a.trainer[lr] = None
        for lr in a.local_ranks:
            self.keeper(lr, "fence", gen)
            p = a.trainer.get(lr)
            if p is not None and p.dead_at is None:
                self.keeper(lr, "admit", gen, p.pid)
        a.routing.to_coord(M.Fenced(node=a.node, gen=gen, killed=killed))


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else ""
