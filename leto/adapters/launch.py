"""``leto launch``: start training with in-place recovery, shaped like ``torchrun``.

::

    leto launch --nproc-per-node 2 train.py --lr 3e-4                    # one node
    leto launch --nnodes 2 --nproc-per-node 2 --node-rank 0 \\
        --rdzv-endpoint 10.0.0.1:29400 train.py                          # on node 0
    leto launch --nnodes 2 --nproc-per-node 2 --node-rank 1 \\
        --rdzv-endpoint 10.0.0.1:29400 train.py                          # on node 1

Each invocation is one node's **agent** (:mod:`leto.backends.gloo.agent`): it
starts one keeper, one trainer and one warm shadow per local rank, and on node 0
the TCPStore of the rendezvous and the recovery coordinator. The script sees the
usual variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and calls ``leto.wrap(..., config)`` with
``backend = "gloo"``. Every failure and recovery goes to ``RUN_DIR/events.jsonl``;
``leto report RUN_DIR`` prints the timeline and plots it. Starting the same
command again for a node that was lost brings a replacement (spare) node into the
running job.

Exit status: 0 when training completed, 1 on a failure leto could not recover
from (the reason is printed and logged), 2 for bad arguments, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

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
    g.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N")
    g.add_argument("--nnodes", type=int, default=1, metavar="M")
    g.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="K")
    g.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="node 0 serves the rendezvous TCPStore there (default with one node: a free port on 127.0.0.1)",
    )
    g.add_argument("--standalone", action="store_true", help="one node, a free local port")
    r = parser.add_argument_group("recovery")
    r.add_argument(
        "--run-dir", default=None, help="event log and process logs (default: leto-runs/<time>)"
    )
    r.add_argument("--heartbeat", type=float, default=0.5, metavar="S")
    r.add_argument("--hang-timeout", type=float, default=10.0, metavar="S")
    r.add_argument("--collective-timeout", type=float, default=30.0, metavar="S")
    r.add_argument("--rdzv-timeout", type=float, default=60.0, metavar="S")
    r.add_argument(
        "--spare-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long to wait for a replacement of a lost node",
    )
    r.add_argument("--recovery-timeout", type=float, default=180.0, metavar="S")
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
    r.add_argument("--quiet", action="store_true", help="no status lines from the agent")
    r.add_argument("--no-echo", action="store_true", help="do not copy the trainers' output here")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint {text!r} is not HOST:PORT (e.g. 127.0.0.1:29400)")
    return host, int(port)


def _reachable(host: str, port: int, timeout: float) -> bool:
    import socket

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
    print(f"leto launch: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    script = Path(args.script)
    if not script.is_file():
        return _error(f"script {args.script!r} not found")
    if args.nproc_per_node < 1 or args.nnodes < 1:
        return _error("--nproc-per-node and --nnodes must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        return _error(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1}")
    from leto.backends.gloo.procs import free_port

    if args.rdzv_endpoint is None:
        if args.nnodes > 1 and not args.standalone:
            return _error("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
        host, port = "127.0.0.1", free_port()
    else:
        try:
            host, port = parse_endpoint(args.rdzv_endpoint)
        except ValueError as e:
            return _error(str(e))
    for name in ("heartbeat", "hang_timeout", "collective_timeout", "rdzv_timeout"):
        if getattr(args, name) <= 0:
            return _error(f"--{name.replace('_', '-')} must be > 0")
    from leto.backends.gloo.faults import FaultPlanError, load_plan

    try:
        faults = load_plan(args.faults, world_size=args.nnodes * args.nproc_per_node)
    except FaultPlanError as e:
        return _error(f"--faults: {e}")
    # the cheap checks first: nothing is imported or started for a launch that cannot work
    from leto.backends.gloo.procs import port_in_use

    if args.node_rank == 0 and port_in_use(host, port):
        print(
            f"leto launch: error: the rendezvous endpoint {host}:{port} is in use by another "
            "process (pick a free port with --rdzv-endpoint HOST:PORT)",
            file=sys.stderr,
        )
        return 1
    if args.node_rank > 0 and not _reachable(host, port, args.rdzv_timeout):
        print(
            f"leto launch: error: cannot reach the rendezvous endpoint {host}:{port} within "
            f"{args.rdzv_timeout:g} s; is node 0's `leto launch` running there with the same "
            "--rdzv-endpoint?",
            file=sys.stderr,
        )
        return 1
    run_dir = args.run_dir or os.path.join("leto-runs", time.strftime("run-%Y%m%d-%H%M%S"))
    # torch's C++ warnings (store socket timeouts while a peer is gone) are noise here:
    # leto reports failures itself
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from leto.backends.gloo.agent import Agent, AgentOptions

    opts = AgentOptions(
        script=str(script.resolve()),
        script_args=list(args.script_args),
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        node_rank=args.node_rank,
        rdzv_host=host,
        rdzv_port=port,
        run_dir=run_dir,
        hang_timeout=args.hang_timeout,
        heartbeat=args.heartbeat,
        collective_timeout=args.collective_timeout,
        rdzv_timeout=args.rdzv_timeout,
        spare_timeout=args.spare_timeout,
        recovery_timeout=args.recovery_timeout,
        shadow_memory_budget=None
        if args.shadow_memory_budget is None
        else int(args.shadow_memory_budget * (1 << 20)),
        shadows=not args.no_shadows,
        threads=args.threads,
        faults=faults,
        echo=not args.no_echo,
        quiet=args.quiet,
    )
    code = Agent(opts).run()
    events = os.path.join(run_dir, "events.jsonl")
    if args.node_rank == 0 and not args.quiet and os.path.exists(events):
        print(f"leto: events in {events} (leto report {run_dir})")
    return code
