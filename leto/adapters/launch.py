"""``leto launch``: start training with in-place recovery, shaped like ``torchrun``.

::

    leto launch --nproc-per-node 2 train.py --lr 3e-4                    # one node
    leto launch --nnodes 2 --nproc-per-node 2 --node-rank 0 \\
        --rdzv-endpoint 10.0.0.1:29400 train.py                          # on node 0
    leto launch --nnodes 2 --nproc-per-node 2 --node-rank 1 \\
        --rdzv-endpoint 10.0.0.1:29400 train.py                          # on node 1

Each invocation is one node's **agent** (:mod:`leto.backends.gloo.agent`): it
starts one keeper, one trainer and one warm shadow per local rank, and on node 0
the TCPStore of the rendezvous and the recovery coordinator (with ``--rdzv-backend
etcd`` another node's agent takes them over when node 0's is lost). The script sees the
usual variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...) and calls
``leto.wrap(..., config)`` with ``backend = "gloo"``. torchrun's other flags are
accepted, translated to leto's own, or refused in one line giving the reason
(:mod:`leto.adapters.torchrun_flags`, docs/launch.md). Every failure and recovery goes to ``RUN_DIR/events.jsonl``;
``leto report RUN_DIR`` prints the timeline and plots it. Starting the same
command again for a node that was lost brings a replacement (spare) node into the
running job; so does a *spare agent* waiting in the job's pool, without anyone
starting anything::

    leto launch --nnodes 3 --nproc-per-node 1 --node-rank 0 --spares 2 \\
        --rdzv-endpoint 10.0.0.1:29400 train.py                          # + 2 local spares
    leto launch --nnodes 3 --nproc-per-node 1 --spare \\
        --rdzv-endpoint 10.0.0.1:29400 train.py                          # a spare elsewhere

torchrun's elastic ``--nnodes MIN:MAX`` (node 0 with ``--node-rank 0``, the others
without: they are given their ranks as they join, and the job keeps the world it
started with), ``-m module`` and ``--max-restarts N`` (the whole job started again
from its latest checkpoint when in-place recovery cannot continue: docs/gloo.md)::

    leto launch --nnodes 2:4 --nproc-per-node 8 --node-rank 0 \\
        --rdzv-endpoint 10.0.0.1:29400 --max-restarts 3 -m mypkg.train   # node 0
    leto launch --nnodes 2:4 --nproc-per-node 8 \\
        --rdzv-endpoint 10.0.0.1:29400 --max-restarts 3 -m mypkg.train   # any other node

Exit status: 0 when training completed, 1 on a failure leto could not recover
from (the reason is printed and logged), 2 for bad arguments, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from leto.adapters.console import ShownRanks
from leto.adapters.slurm import apply_slurm
from leto.adapters.torchrun_flags import (
    BY_NAME,
    MASTER_ADDR,
    MASTER_PORT,
    RDZV_TIMEOUT,
    add_refused,
    torchrun_environment,
    translate,
)
from leto.argcheck import (
    BadInput,
    Bound,
    check_args,
    dir_to_create,
    file_to_read,
    parse_endpoint,
    positive_int,
    refuse,
    seconds,
    show,
)

__all__ = ["configure", "parse_endpoint", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "The script's own arguments follow its path. Recovery options: the heartbeat "
        "and hang timeout detect hangs; the shadow memory budget makes shadows go cold "
        "while the trainers need the memory; --faults injects real faults (see "
        "leto.backends.gloo.faults) for tests and demos."
    )
    g = parser.add_argument_group("topology (as torchrun)")
    g.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        metavar="N|auto|cpu",
        help="ranks on this node (default 1); auto, cpu: one per CPU this process may run on",
    )
    g.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="nodes; MIN:MAX: the job starts with MAX nodes, or with MIN or more once "
        "--rdzv-timeout has passed, and keeps that many (give --node-rank 0 to node 0 "
        "only: the others are given their ranks as they join; later ones are spares)",
    )
    g.add_argument(
        "--node-rank", "--node_rank", type=int, default=None, metavar="K", help="(default 0)"
    )
    g.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="node 0 serves the rendezvous TCPStore there (default with one node: a free port "
        "on 127.0.0.1); with --rdzv-backend etcd: the etcd members, HOST:PORT,HOST:PORT,...",
    )
    g.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        default="c10d",
        metavar="NAME",
        help="c10d (default: node 0 serves the rendezvous and keeps the commit record) or "
        "etcd (the rendezvous and the commit record in the etcd cluster at --rdzv-endpoint)",
    )
    g.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        default=None,
        metavar="ID",
        help="the job's id, the same on every node: the trainers' TORCHELASTIC_RUN_ID; with "
        "etcd also its keys there (/leto/ID/)",
    )
    g.add_argument(
        "--local-addr",
        "--local_addr",
        default=None,
        metavar="HOST",
        help="with etcd: the address this node's agent serves the TCPStore and the "
        "coordinator on when it runs them (node 0 at the start, any node after a failover; "
        "default: this machine's address towards the first etcd member)",
    )
    g.add_argument("--standalone", action="store_true", help="one node, a free local port")
    g.add_argument(
        "--slurm",
        action="store_true",
        help="run as a task of srun (srun --ntasks-per-node=1 leto launch --slurm ...): the "
        "node count, node rank, rendezvous host (the step's first node, at --master-port), "
        "job id and run directory come from SLURM_* (docs/launch.md)",
    )
    r = parser.add_argument_group("recovery")
    r.add_argument(
        "--run-dir", default=None, help="event log and process logs (default: leto-runs/<time>)"
    )
    r.add_argument(
        "--heartbeat",
        type=float,
        default=0.5,
        metavar="S",
        help="every trainer tells its agent it is alive every S seconds (default %(default)g)",
    )
    r.add_argument(
        "--hang-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a trainer silent this long (no heartbeat, no step) is hung: it is killed and its "
        "rank recovered in place; a node's link to the coordinator that acknowledges nothing "
        "this long (a cut cable, a partition) is closed, and that node (or the coordinator) "
        "is lost (default %(default)g)",
    )
    r.add_argument(
        "--collective-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="the trainers' process-group timeout: a collective that waits longer fails and "
        "its rank is recovered (default %(default)g)",
    )
    r.add_argument(
        "--rdzv-timeout",
        type=float,
        default=None,
        metavar="S",
        help="how long node 0 waits for the other nodes to join, and they for node 0's "
        f"rendezvous (default {RDZV_TIMEOUT:g}; torchrun's --rdzv-conf join_timeout=S)",
    )
    r.add_argument(
        "--spare-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long a lost node waits for a replacement when the spare pool is empty "
        "(default %(default)g)",
    )
    r.add_argument(
        "--recovery-timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="a recovery that has not ended after S seconds gives up: the job stops, or "
        "restarts with --max-restarts (default %(default)g)",
    )
    r.add_argument(
        "--exclude-after",
        type=int,
        default=3,
        metavar="K",
        help="a host whose nodes failed K times within --exclude-window is not taken back: "
        "a replacement started there is refused and a spare from another host takes its "
        "place (0: never; hosts are the agents' addresses, so nodes on one machine's "
        "loopback are never excluded; default %(default)s)",
    )
    r.add_argument(
        "--exclude-window",
        type=float,
        default=600.0,
        metavar="S",
        help="the window of --exclude-after, in seconds (default %(default)g)",
    )
    r.add_argument(
        "--spare",
        action="store_true",
        help="start a spare agent, not a node (no --node-rank): it joins the job's spare "
        "pool, warm, and takes the place of the next node that is lost",
    )
    r.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="N",
        help="node 0: start N spare agents on this machine (as --spare would); they end "
        "with the job (default 0: a lost node waits --spare-timeout for a replacement)",
    )
    r.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        metavar="N",
        help="the last resort, as torchrun's: when in-place recovery cannot continue (a "
        "recovery that gives up, a lost node with no replacement within --spare-timeout), "
        "start the whole job again from the latest checkpoint of the config's "
        "checkpoint_dir, at most N times (default 0: the job stops); give every node the same",
    )
    r.add_argument(
        "--shadow-memory-budget",
        type=float,
        default=None,
        metavar="MB",
        help="shadows go cold while this node's trainers use more (RSS)",
    )
    r.add_argument(
        "--no-shadows", action="store_true", help="no warm shadows (promotion starts cold)"
    )
    r.add_argument("--threads", type=int, default=1, help="torch threads per trainer (default 1)")
    r.add_argument("--faults", default=None, metavar="PLAN", help="fault plan: JSON list or a file")
    r.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="start from this torch.distributed.checkpoint directory (a leto checkpoint_dir, "
        "one step-N of it, or any DCP checkpoint of the same model) with its process state",
    )
    r.add_argument("--quiet", action="store_true", help="no status lines from the agent")
    w = parser.add_argument_group("seeing the job run (node 0)")
    w.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        metavar="S",
        help="a progress line (step, loss, step time, recoveries) at most every S seconds "
        "(default 10)",
    )
    w.add_argument("--no-progress", action="store_true", help="no progress line")
    w.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics there (port 0: a free one); off by default",
    )
    w.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="TensorBoard scalars (loss, step time, recoveries) in DIR; needs tensorboard",
    )
    r.add_argument("--no-echo", action="store_true", help="do not copy the trainers' output here")
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="the script is a module's name, run as `python -m module` (as torchrun's -m)",
    )
    _torchrun_group(parser)
    parser.add_argument("script", help="the training script (with -m: a module's name)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


# torchrun's flags that leto translates, beyond the ones it shares (flag, metavar or
# None for a switch, help)
TRANSLATED_FLAGS: tuple[tuple[str, str | None, str], ...] = (
    (
        "--master-addr",
        "HOST",
        f"the rendezvous host (--rdzv-endpoint HOST:PORT; default {MASTER_ADDR})",
    ),
    (
        "--master-port",
        "PORT",
        f"the rendezvous port (--rdzv-endpoint HOST:PORT; default {MASTER_PORT})",
    ),
    ("--rdzv-conf", "KEY=VALUE,...", "join_timeout=S (--rdzv-timeout S); no other key"),
    ("--log-dir", "DIR", "the same as --run-dir"),
    (
        "--redirects",
        "0|3|LR:V,...",
        "3: the trainers' output (of the local ranks named) only in their logs, not here; "
        "1 and 2 (one stream) are refused: stdout and stderr share one pipe",
    ),
    (
        "--tee",
        "0|3|LR:V,...",
        "3: shown here whatever --redirects says (every process's output is always in its "
        "log in RUN_DIR/logs)",
    ),
    ("--local-ranks-filter", "LR,...", "show only these local ranks' output here"),
    ("--role", "NAME", "the trainers' ROLE_NAME (default 'default')"),
    (
        "--run-path",
        None,
        "accepted: leto always runs the script with runpy in the trainer's Python",
    ),
    ("--start-method", "fork", "fork, what leto does (spawn and forkserver are refused)"),
    ("--event-log-handler", "null", "null only: leto's events are in RUN_DIR/events.jsonl"),
)


def _torchrun_group(parser: argparse.ArgumentParser) -> None:
    """torchrun's other flags: the ones leto translates to its own, then the refused
    ones (:mod:`leto.adapters.torchrun_flags` holds the table)."""
    t = parser.add_argument_group("torchrun's flags, translated (docs/launch.md)")
    for flag, metavar, help_ in TRANSLATED_FLAGS:
        names = BY_NAME[flag].names  # every spelling torchrun takes
        if metavar is None:
            t.add_argument(*names, action="store_true", help=help_)
        else:
            t.add_argument(*names, default=None, metavar=metavar, help=help_)
    add_refused(parser)


# Bounds of the numeric flags (leto.argcheck): every count has a ceiling, every
# duration is positive and finite (nan would switch hang detection off; inf overflows).
BOUNDS: dict[str, Bound] = {
    "nproc_per_node": positive_int(1024, "each local rank runs a keeper, a trainer and a shadow"),
    "nnodes": positive_int(65_536),
    "node_rank": Bound(lo=0, integer=True),
    "heartbeat": seconds(3600.0, "an hour"),
    "hang_timeout": seconds(),
    "collective_timeout": seconds(),
    "rdzv_timeout": seconds(),
    "spare_timeout": seconds(),
    "recovery_timeout": seconds(),
    "exclude_after": Bound(lo=0, hi=1000, integer=True, why_hi="failures of one host"),
    "exclude_window": seconds(),
    "shadow_memory_budget": Bound(lo=0, hi=float(1 << 30), unit="MB", why_hi="a petabyte"),
    "threads": positive_int(1024),
    "progress_every": seconds(),
    "max_restarts": Bound(
        lo=0, hi=1000, integer=True, why_hi="each restart starts every node's processes again"
    ),
    "spares": Bound(
        lo=0, hi=256, integer=True, why_hi="each spare is an agent with torch imported"
    ),
}


def _addresses(host: str, port: int, flag: str = "--rdzv-endpoint") -> list[tuple[Any, Any]]:
    """(family, socket address) for each address ``host`` resolves to; BadInput if none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BadInput(f"{flag}: cannot resolve host {show(host)} ({why})") from None
    return [(family, addr) for family, _, _, _, addr in infos]


def _ipv4(host: str, flag: str) -> None:
    """BadInput unless ``host`` has an IPv4 address: the agents' coordinator listens and
    connects over IPv4 only (an IPv6 rendezvous is not supported today)."""
    if not any(family == socket.AF_INET for family, _ in _addresses(host, 0, flag)):
        raise BadInput(
            f"{flag}: {host} has no IPv4 address, and leto launch's rendezvous is IPv4 only "
            "today (the agents' coordinator listens on IPv4); give an IPv4 address or a "
            "host name that has one"
        )


def _can_listen(host: str, port: int, flag: str) -> None:
    """BadInput unless this machine can listen on ``host:port``."""
    why = "no address"
    for family, addr in _addresses(host, port, flag):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind(addr)
                return
            except OSError as e:
                why = e.strerror or str(e)
    raise BadInput(f"{flag}: cannot listen on {host}:{port} ({why})")


def _listen_problem(host: str, port: int) -> tuple[int, str] | None:
    """Why node 0 cannot serve the rendezvous at host:port (an exit status and a line),
    or None: the host must be an address of this machine and the port free there."""
    problem: tuple[int, str] | None = None
    for family, addr in _addresses(host, port):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind(addr)
                return None
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    problem = (
                        1,
                        f"the rendezvous endpoint {host}:{port} is in use by another process "
                        "(pick a free port with --rdzv-endpoint HOST:PORT)",
                    )
                elif problem is None and e.errno == errno.EADDRNOTAVAIL:
                    ip = "" if addr[0] == host else f" ({addr[0]})"
                    problem = (
                        2,
                        f"--rdzv-endpoint: {host}{ip} is not an address of this machine; "
                        "node 0 serves the rendezvous there, so give one of its own",
                    )
                elif problem is None:
                    problem = (2, f"--rdzv-endpoint: cannot listen on {host}:{port}: {e.strerror}")
    return problem


def _check(
    args: argparse.Namespace,
) -> tuple[str, int, Any, tuple[str, int] | None, EtcdArgs | None] | int:
    """Every flag, before anything is imported or started: the rendezvous address and
    the fault plan; or an exit status when a refusal has been printed."""
    apply_slurm(args)
    translate(args, BOUNDS)
    if args.slurm and args.rdzv_backend != "etcd":
        args.endpoint_flag = "--slurm (the first host of the step's node list)"
    if args.module:
        module_to_run(args.script)
    else:
        file_to_read("script", args.script, "script")
    _nnodes(args)
    check_args(args, BOUNDS)
    elastic = args.min_nodes < args.nnodes
    if elastic and args.node_rank is not None and args.node_rank != 0:
        raise BadInput(
            f"--node-rank {args.node_rank} with --nnodes {args.nnodes_text}: node 0 gives "
            "--node-rank 0, every other node none (node 0 gives them their ranks as they join)"
        )
    if elastic and args.node_rank is None and args.rdzv_endpoint and not args.spares:
        args.spare = True  # a node of an elastic job: it waits in the pool for its rank
    if args.spare:
        if args.node_rank is not None:
            raise BadInput(
                "--spare takes no --node-rank: a spare agent is given the rank of the node "
                "whose place it takes"
            )
        if args.spares:
            raise BadInput("--spare and --spares: a spare agent starts no other spares")
    if (args.spare or args.spares) and args.nnodes < 2:
        flag = "--spare" if args.spare else "--spares"
        raise BadInput(
            f"{flag}: a job of one node has no node a spare could replace (node 0, which "
            "serves the rendezvous and the coordinator, is not replaced); use --nnodes 2 or more"
        )
    if args.spare and args.rdzv_endpoint is None:
        raise BadInput("--spare needs --rdzv-endpoint HOST:PORT, where node 0 serves the job")
    if args.node_rank is None:
        args.node_rank = -1 if args.spare else 0
    elif not args.node_rank < args.nnodes:
        raise BadInput(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1}")
    if args.spares and args.node_rank != 0:
        raise BadInput(
            f"--spares: only node 0 starts spare agents (this is node {args.node_rank}); "
            "start one elsewhere with --spare"
        )
    if not args.heartbeat < args.hang_timeout:
        raise BadInput(
            f"--heartbeat {args.heartbeat:g} s must be shorter than --hang-timeout "
            f"{args.hang_timeout:g} s, or every trainer looks hung between heartbeats"
        )
    if args.run_dir is not None:
        dir_to_create("--run-dir", args.run_dir, probe=True)
    else:
        dir_to_create("--run-dir (default: leto-runs/ here)", "leto-runs", probe=True)
    if args.rdzv_backend not in ("c10d", "etcd"):
        raise BadInput(f"--rdzv-backend {show(args.rdzv_backend)} is not one of: c10d, etcd")
    if args.rdzv_backend == "etcd":
        etcd = _check_etcd(args)
    else:
        etcd = None
        if args.local_addr is not None:
            raise BadInput(
                "--local-addr is for --rdzv-backend etcd (this launch uses c10d: node 0 serves "
                "at --rdzv-endpoint)"
            )
    if etcd is not None:
        host, port = etcd.local, 0
    elif args.rdzv_endpoint is None:
        if args.nnodes > 1 and not args.standalone:
            raise BadInput(
                "--rdzv-endpoint HOST:PORT (or --master-addr and --master-port) is required "
                "with --nnodes > 1"
            )
        from leto.backends.gloo.procs import free_port

        host, port = "127.0.0.1", free_port()
    else:
        try:
            host, port = parse_endpoint(args.rdzv_endpoint, args.endpoint_flag)
        except ValueError as e:
            raise BadInput(str(e)) from None
        _ipv4(host, args.endpoint_flag)
    metrics = None
    if args.metrics is not None:
        try:
            metrics = parse_endpoint(args.metrics, "--metrics", free_port=True)
        except ValueError as e:
            raise BadInput(str(e)) from None
        if args.node_rank == 0:  # node 0 serves them
            _can_listen(*metrics, flag="--metrics")
    if args.tensorboard is not None:
        dir_to_create("--tensorboard", args.tensorboard, probe=True)
        if importlib.util.find_spec("tensorboard") is None:
            raise BadInput("--tensorboard needs the tensorboard package (pip install tensorboard)")
    if args.faults is not None and not args.faults.strip():
        raise BadInput("--faults is empty: give a JSON list of faults or a file that holds one")
    from leto.backends.gloo.faults import FaultPlanError, load_plan

    try:
        faults = load_plan(args.faults, world_size=args.nnodes * args.nproc_per_node)
    except FaultPlanError as e:
        raise BadInput(f"--faults: {e}") from None
    if etcd is not None:
        if args.node_rank == 0:
            _can_listen(host, 0, "--local-addr")
    elif args.node_rank == 0:
        problem = _listen_problem(host, port)
        if problem is not None:
            return refuse("launch", problem[1], problem[0])
    else:
        _addresses(host, port)
    return host, port, faults, metrics, etcd


def module_to_run(name: str) -> None:
    """``-m NAME``: a dotted name whose top-level package or module is found from the
    working directory or the path (as ``python -m`` would look; nothing is imported)."""
    import importlib.machinery

    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise BadInput(f"-m {show(name)} is not a module name (e.g. pkg.train)")
    if len(parts) > 1 and parts[-1] == "py":
        raise BadInput(f"-m {show(name)} is a file's name: -m takes a module's ({name[:-3]})")
    if importlib.machinery.PathFinder.find_spec(parts[0], [os.getcwd(), *sys.path]) is None:
        raise BadInput(f"-m {show(name)}: no module {parts[0]!r} here or on the Python path")


def _nnodes(args: argparse.Namespace) -> None:
    """``--nnodes N`` or ``MIN:MAX`` (torchrun's elastic form): ``args.nnodes`` becomes
    MAX (bounded as N is), ``args.min_nodes`` MIN, ``args.nnodes_text`` the text."""
    text = str(args.nnodes)
    args.nnodes_text = text
    lo, sep, hi = text.partition(":")
    if not sep:
        lo = hi = text
    if not all(p.isascii() and p.isdecimal() and len(p) <= 18 for p in (lo, hi)):
        raise BadInput(f"--nnodes {show(text)} is not N or MIN:MAX (e.g. 4, or 2:4)")
    args.min_nodes, args.nnodes = int(lo), int(hi)
    if sep and not 1 <= args.min_nodes <= args.nnodes:
        raise BadInput(f"--nnodes {show(text)}: MIN must be in 1..MAX")


@dataclass(frozen=True)
class EtcdArgs:
    endpoints: tuple[tuple[str, int], ...]
    job: str
    local: str  # the address node 0 serves on


MAX_ETCD_MEMBERS = 16


def _check_etcd(args: argparse.Namespace) -> EtcdArgs:
    """--rdzv-backend etcd: its endpoints, the job's id and this node's address."""
    if args.rdzv_endpoint is None:
        raise BadInput(
            "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]: the etcd members"
        )
    parts = args.rdzv_endpoint.split(",")
    if len(parts) > MAX_ETCD_MEMBERS:
        raise BadInput(f"--rdzv-endpoint: {len(parts)} etcd members (at most {MAX_ETCD_MEMBERS})")
    endpoints = []
    for part in parts:
        try:
            endpoints.append(parse_endpoint(part.strip()))
        except ValueError as e:
            raise BadInput(str(e)) from None
    if len(set(endpoints)) != len(endpoints):
        raise BadInput(f"--rdzv-endpoint {show(args.rdzv_endpoint)} names an etcd member twice")
    for host, port in endpoints:
        _addresses(host, port)
    if args.rdzv_id is None:
        raise BadInput(
            "--rdzv-backend etcd needs --rdzv-id ID, the job's id (the same on every node)"
        )
    if importlib.util.find_spec("etcd3gw") is None:
        raise BadInput("--rdzv-backend etcd needs the etcd3gw package (pip install leto[etcd])")
    local = args.local_addr
    if local is None:
        local = _address_towards(*endpoints[0])
    elif not local or len(local) > 253:
        raise BadInput(f"--local-addr {show(local)} is not a host name or an address")
    _ipv4(local, "--local-addr" if args.local_addr else "--rdzv-endpoint (this node's address)")
    return EtcdArgs(tuple(endpoints), args.rdzv_id, local)


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    family, addr = _addresses(host, port)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
        except OSError as e:
            raise BadInput(
                f"--rdzv-endpoint: no route to the etcd member {host}:{port} ({e.strerror}); "
                "give --local-addr"
            ) from None
        return str(s.getsockname()[0])


def resume_problem(path: str) -> str | None:
    """Why ``path`` is not a checkpoint to resume from (read nothing that unpickles:
    the trainers load it, after checking that it is private), or None."""
    from leto.retained.checkpoint import CheckpointError, CheckpointStore

    p = Path(path)
    if not p.is_dir():
        return f"{path} is not a directory" if p.exists() else f"{path} does not exist"
    if (p / ".metadata").is_file():
        return None
    try:
        if CheckpointStore(p).latest() is not None:
            return None
    except CheckpointError as e:
        return str(e)
    return (
        f"{path} is not a torch.distributed.checkpoint directory (no .metadata, no complete "
        "step-<n>/ inside)"
    )


def _reachable(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _error(msg: str) -> int:
    return refuse("launch", msg)


def spare_command(args: argparse.Namespace, host: str, port: int, run_dir: str) -> list[str]:
    """The command line of a spare agent of this job (``--spares``): this launch's
    options, as ``--spare`` instead of a node rank."""
    rdzv = ["--rdzv-endpoint", f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    if args.rdzv_backend == "etcd":  # the etcd members
        rdzv = ["--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-backend", "etcd"]
    if args.rdzv_id is not None:  # the job's id (with etcd, its keys there)
        rdzv += ["--rdzv-id", args.rdzv_id]
    if args.role is not None:
        rdzv += ["--role", args.role]
    if args.shown_ranks and not args.no_echo:
        rdzv += ["--local-ranks-filter", ",".join(map(str, sorted(args.shown_ranks)))]
    cmd = [
        sys.executable, "-m", "leto.cli", "launch", "--spare",
        "--nnodes", args.nnodes_text, "--nproc-per-node", str(args.nproc_per_node),
        *rdzv, "--run-dir", os.path.abspath(run_dir),
        "--heartbeat", repr(args.heartbeat), "--hang-timeout", repr(args.hang_timeout),
        "--collective-timeout", repr(args.collective_timeout),
        "--rdzv-timeout", repr(args.rdzv_timeout), "--spare-timeout", repr(args.spare_timeout),
        "--recovery-timeout", repr(args.recovery_timeout), "--threads", str(args.threads),
        "--exclude-after", str(args.exclude_after), "--exclude-window", repr(args.exclude_window),
    ]  # fmt: skip
    if args.shadow_memory_budget is not None:
        cmd += ["--shadow-memory-budget", repr(args.shadow_memory_budget)]
    if args.faults is not None:  # inline JSON, or a file (by its absolute path)
        plan = args.faults.strip()
        cmd += ["--faults", plan if plan.startswith("[") else os.path.abspath(plan)]
    if args.resume is not None:
        cmd += ["--resume", os.path.abspath(args.resume)]
    if args.max_restarts:
        cmd += ["--max-restarts", str(args.max_restarts)]
    for flag, on in (("--no-shadows", args.no_shadows), ("--quiet", args.quiet),
                     ("--no-echo", args.no_echo)):  # fmt: skip
        if on:
            cmd.append(flag)
    if args.module:
        return [*cmd, "-m", args.script, *args.script_args]
    return [*cmd, os.path.abspath(args.script), *args.script_args]


# a restart (--max-restarts): which one this start is, and the fault plan's entries that
# fired before it; set by the agent that execs itself (restart_launch), read by the next
RESTART_ENV = "LETO_RESTART"
FIRED_ENV = "LETO_FAULTS_FIRED"
NODES_ENV = "LETO_WORLD_NODES"  # --nnodes MIN:MAX: a restart keeps the world it started with


def _restarted() -> tuple[int, tuple[int, ...], int]:
    """(restarts made before this start, fault entries fired, the nodes the job started
    with), from the environment; LETO_RESTART stays there: the trainers resume from
    their checkpoint_dir on it."""
    n = os.environ.get(RESTART_ENV, "0")
    fired = os.environ.pop(FIRED_ENV, "")
    nodes = os.environ.pop(NODES_ENV, "0")
    return (
        int(n) if n.isdecimal() else 0,
        tuple(int(f) for f in fired.split(",") if f.isdecimal()),
        int(nodes) if nodes.isdecimal() else 0,
    )


def restart_launch(agent: Any, argv: list[str]) -> None:
    """The coordinator decided a restart (:mod:`leto.core.restart`), and this agent has
    ended its processes: this ``leto launch`` execs itself with the same arguments, as
    that restart (same pid: whoever started it still holds it), keeping the job's
    secret and id (in the environment, which the next start takes out of it)."""
    from leto.backends.gloo import auth
    from leto.backends.gloo.records import JOB_ENV

    if agent.secret is not None:
        os.environ[auth.ENV] = agent.secret.decode()
    os.environ[JOB_ENV] = agent.job  # the same job: its records and logs go on
    os.umask(agent.umask)  # the user's (the agent keeps its own files private)
    os.environ[RESTART_ENV] = str(agent.restart)
    os.environ[FIRED_ENV] = ",".join(map(str, agent.fired))
    if agent.node == 0:  # the world it starts with: the one it had when it ended
        os.environ[NODES_ENV] = str(agent.o.nnodes)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "leto.cli", *argv])


def run(args: argparse.Namespace) -> int:
    from leto.backends.gloo.procs import die_with_starter

    die_with_starter()  # started by another leto command (the demo): nothing outlives it
    # the cheap checks first: nothing is imported or started for a launch that cannot work
    try:
        checked = _check(args)
    except BadInput as e:
        return _error(str(e))
    if isinstance(checked, int):
        return checked
    host, port, faults, metrics, etcd = checked
    if args.resume is not None:
        problem = resume_problem(args.resume)
        if problem is not None:
            return _error(f"--resume: {problem}")
        # every trainer's config takes it (leto.wrap), whatever the script's own config
        os.environ["LETO_RESUME"] = os.path.abspath(args.resume)
    if etcd is not None:
        if not any(
            _reachable(h, p, args.rdzv_timeout / len(etcd.endpoints)) for h, p in etcd.endpoints
        ):
            print(
                f"leto launch: error: cannot reach any etcd member at {args.rdzv_endpoint} "
                f"within {args.rdzv_timeout:g} s; is etcd running there?",
                file=sys.stderr,
            )
            return 1
    elif args.node_rank != 0 and not _reachable(host, port, args.rdzv_timeout):
        print(
            f"leto launch: error: cannot reach the rendezvous endpoint {host}:{port} within "
            f"{args.rdzv_timeout:g} s; is node 0's `leto launch` running there with the same "
            "--rdzv-endpoint?",
            file=sys.stderr,
        )
        return 1
    script = Path(args.script)
    restarts, fired, world_nodes = _restarted()
    run_dir = args.run_dir or os.path.join("leto-runs", time.strftime("run-%Y%m%d-%H%M%S"))
    # torch's C++ warnings (store socket timeouts while a peer is gone) are noise here:
    # leto reports failures itself
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # the trainers inherit them (forked from this process): torchrun's job variables
    os.environ.update(torchrun_environment(args, restarts, os.environ))
    from leto.backends.gloo.agent import Agent, AgentOptions

    opts = AgentOptions(
        script=args.script if args.module else str(script.resolve()),
        module=args.module,
        script_args=list(args.script_args),
        nnodes=args.nnodes,
        min_nodes=args.min_nodes,
        world_nodes=world_nodes if args.min_nodes < args.nnodes else 0,
        nproc_per_node=args.nproc_per_node,
        node_rank=args.node_rank,
        rdzv_host=host,
        rdzv_port=port,
        run_dir=run_dir,
        hang_timeout=args.hang_timeout,
        heartbeat=args.heartbeat,
        collective_timeout=args.collective_timeout,
        rdzv_timeout=args.rdzv_timeout,
        etcd=etcd.endpoints if etcd is not None else (),
        rdzv_id=etcd.job if etcd is not None else "",
        spare_timeout=args.spare_timeout,
        recovery_timeout=args.recovery_timeout,
        exclude_after=args.exclude_after,
        exclude_window=args.exclude_window,
        shadow_memory_budget=None
        if args.shadow_memory_budget is None
        else int(args.shadow_memory_budget * (1 << 20)),
        shadows=not args.no_shadows,
        threads=args.threads,
        faults=faults,
        spare=args.spare,
        spares=args.spares,
        spare_command=spare_command(args, host, port, run_dir) if args.spares else [],
        echo=not args.no_echo,
        quiet=args.quiet,
        progress_every=None if args.no_progress else args.progress_every,
        metrics=metrics,
        tensorboard=args.tensorboard,
        preload=("leto.adapters.api",),
        max_restarts=args.max_restarts,
        restarts=restarts,
        fired_faults=fired,
    )
    agent = Agent(opts)
    stdout = sys.stdout
    if args.shown_ranks and not args.no_echo:  # --redirects, --tee, --local-ranks-filter
        sys.stdout = cast(TextIO, ShownRanks(stdout, args.shown_ranks, args.nproc_per_node))
    try:
        code = agent.run()
    finally:
        sys.stdout = stdout
    if agent.restart:
        restart_launch(agent, getattr(args, "_argv", sys.argv[1:]))  # does not return
    events = os.path.join(run_dir, "events.jsonl")
    if args.node_rank == 0 and not args.quiet and os.path.exists(events):
        try:
            print(f"leto: events in {events} (leto report {run_dir})", flush=True)
        except OSError:  # the console's reader went away: the job's status stands
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code
