"""torchrun's flags in ``leto launch``: each one accepted, translated or refused.

One row per flag of ``torchrun`` (``torch.distributed.run``'s parser, every spelling):
*accepted* means what it means to torchrun; *translated* is accepted and turned into
leto's own setting (the row says which); *refused* is answered by one line giving the
reason, before anything starts. ``leto launch`` builds its refusals and the docs'
table (docs/launch.md, ``python -m leto.adapters.torchrun_flags``) from these rows,
and a test runs every flag of the installed torch's parser against them, so neither
can drift from what ``leto launch`` does. :func:`translate` turns the accepted ones
into leto's settings; :func:`torchrun_environment` is what torchrun sets for every
trainer and leto's agent does not.

No torch here: ``leto launch --help`` reads this.
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Mapping

import attrs

from leto.argcheck import BadInput, Bound, parse_endpoint, show
from leto.backends.gloo.etcdstore import valid_job_id

__all__ = [
    "ACCEPTED",
    "FLAGS",
    "REFUSED",
    "TRANSLATED",
    "TorchrunFlag",
    "add_refused",
    "markdown_table",
    "torchrun_environment",
    "translate",
]

ACCEPTED = "accepted"
TRANSLATED = "translated"
REFUSED = "refused"

CPU_ONLY = "leto trains on CPU only today (gloo; no NCCL backend is built)"


@attrs.frozen
class TorchrunFlag:
    """A torchrun flag: its spellings (the first is the table's), what leto does with
    it (or, refused, why not), and an example of it (the words after the flag)."""

    names: tuple[str, ...]
    verdict: str = attrs.field(validator=attrs.validators.in_((ACCEPTED, TRANSLATED, REFUSED)))
    leto: str
    example: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def takes_value(self) -> bool:
        return bool(self.example)

    def refusal(self) -> str:
        """The one line a refused flag is answered with."""
        return f"{self.flag}: {self.leto}"


FLAGS: tuple[TorchrunFlag, ...] = (
    TorchrunFlag(
        ("--nnodes",),
        ACCEPTED,
        "N, or MIN:MAX (elastic: the job keeps the world it started with)",
        ("2:4",),
    ),
    TorchrunFlag(
        ("--nproc-per-node", "--nproc_per_node"),
        TRANSLATED,
        f"N; `auto` and `cpu`: one rank per CPU this process may run on; `gpu` and `xpu` "
        f"refused: {CPU_ONLY}",
        ("auto",),
    ),
    TorchrunFlag(
        ("--rdzv-backend", "--rdzv_backend"),
        TRANSLATED,
        "`c10d` (node 0 serves the TCPStore and the coordinator), `etcd` (an etcd v3 "
        "cluster; the coordinator fails over); `static`: `c10d` at --master-addr:--master-port; "
        "`etcd-v2`: refused (leto's etcd rendezvous speaks etcd's v3 API: give `etcd`)",
        ("static",),
    ),
    TorchrunFlag(
        ("--rdzv-endpoint", "--rdzv_endpoint"),
        ACCEPTED,
        "HOST:PORT (IPv4: an IPv6 address is refused, leto's coordinator listens on IPv4)",
        ("127.0.0.1:29400",),
    ),
    TorchrunFlag(
        ("--rdzv-id", "--rdzv_id"),
        ACCEPTED,
        "the job's id: the trainers' `TORCHELASTIC_RUN_ID` (not given: as torchrun, a fresh "
        "uuid on one node, `none` on more); with etcd also the job's keys there",
        ("job-7",),
    ),
    TorchrunFlag(
        ("--rdzv-conf", "--rdzv_conf"),
        TRANSLATED,
        "`join_timeout=S`: --rdzv-timeout S; any other key refused, naming it (leto's "
        "rendezvous has no other setting)",
        ("join_timeout=90",),
    ),
    TorchrunFlag(("--standalone",), ACCEPTED, "one node, a free local port"),
    TorchrunFlag(
        ("--max-restarts", "--max_restarts"),
        ACCEPTED,
        "whole-job restarts from the latest checkpoint, when in-place recovery cannot "
        "continue (`TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS` set)",
        ("2",),
    ),
    TorchrunFlag(
        ("--monitor-interval", "--monitor_interval"),
        REFUSED,
        "leto's agent polls nothing: it learns of a process's end at once (pidfds) and of "
        "a hang from heartbeats (--heartbeat, --hang-timeout)",
        ("1",),
    ),
    TorchrunFlag(
        ("--start-method", "--start_method"),
        TRANSLATED,
        "`fork`: what leto does (every trainer and warm shadow is forked from a Python that "
        "imported torch); `spawn`, `forkserver`: refused (a spawned trainer would start cold)",
        ("fork",),
    ),
    TorchrunFlag(
        ("--event-log-handler", "--event_log_handler"),
        TRANSLATED,
        "`null` (torchrun's default: no handler); any other refused: leto writes its "
        "events to RUN_DIR/events.jsonl (`leto report RUN_DIR`)",
        ("null",),
    ),
    TorchrunFlag(
        ("--role",),
        TRANSLATED,
        "the trainers' `ROLE_NAME` (1-64 letters, digits, `_ . -`)",
        ("trainer",),
    ),
    TorchrunFlag(("-m", "--module"), ACCEPTED, "the script is a module's name (`python -m`)"),
    TorchrunFlag(
        ("--no-python", "--no_python"),
        REFUSED,
        "leto forks every trainer and warm shadow from a Python process that has imported "
        "torch, and the script must call leto.wrap; give a Python script (or -m module)",
    ),
    TorchrunFlag(
        ("--run-path", "--run_path"),
        ACCEPTED,
        "what leto always does: the script runs with runpy in the trainer's Python",
    ),
    TorchrunFlag(
        ("--log-dir", "--log_dir"),
        TRANSLATED,
        "--run-dir: each process's output in its logs/, the event log beside",
        ("logs",),
    ),
    TorchrunFlag(
        ("-r", "--redirects"),
        TRANSLATED,
        "`3` (or `0:3,1:3`, per local rank): that rank's output only in its log, not on the "
        "console; `0`: the console too; `1`, `2` refused (a trainer's stdout and stderr "
        "share one pipe and one log)",
        ("3",),
    ),
    TorchrunFlag(
        ("-t", "--tee"),
        TRANSLATED,
        "leto always writes each process's output to its log; `3` (per local rank too) "
        "shows it on the console whatever --redirects says; `1`, `2` beside a redirect "
        "of the other stream refused (one pipe)",
        ("3",),
    ),
    TorchrunFlag(
        ("--local-ranks-filter", "--local_ranks_filter"),
        TRANSLATED,
        "the console shows only these local ranks' output (every rank's is in its log)",
        ("0",),
    ),
    TorchrunFlag(
        ("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
        REFUSED,
        "leto writes each process's output to its own log in RUN_DIR/logs: grep there",
        ("loss",),
    ),
    TorchrunFlag(
        ("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
        REFUSED,
        "leto writes each process's output to its own log in RUN_DIR/logs: grep there",
        ("Error",),
    ),
    TorchrunFlag(("--node-rank", "--node_rank"), ACCEPTED, "K (default 0)", ("0",)),
    TorchrunFlag(
        ("--master-addr", "--master_addr"),
        TRANSLATED,
        "the rendezvous endpoint's host (--rdzv-endpoint; port --master-port, default 29500)",
        ("127.0.0.1",),
    ),
    TorchrunFlag(
        ("--master-port", "--master_port"),
        TRANSLATED,
        "the rendezvous endpoint's port (--rdzv-endpoint; host --master-addr, default 127.0.0.1)",
        ("29500",),
    ),
    TorchrunFlag(
        ("--local-addr", "--local_addr"),
        ACCEPTED,
        "with etcd: the address this node serves on; with c10d refused (node 0 serves at "
        "--rdzv-endpoint)",
        ("127.0.0.1",),
    ),
    TorchrunFlag(
        ("--logs-specs", "--logs_specs"),
        REFUSED,
        "a torchrun logging plug-in; leto writes each process's output to RUN_DIR/logs",
        ("default",),
    ),
    TorchrunFlag(
        ("--numa-binding", "--numa_binding"),
        REFUSED,
        f"it binds ranks to the CPUs near their GPUs; {CPU_ONLY}",
        ("node",),
    ),
    TorchrunFlag(
        ("--signals-to-handle", "--signals_to_handle"),
        REFUSED,
        "leto's agent handles SIGINT and SIGTERM itself (it ends the job and every process "
        "it started) and forwards no signal to the trainers",
        ("SIGUSR1",),
    ),
    TorchrunFlag(
        ("--shutdown-timeout", "--shutdown_timeout"),
        REFUSED,
        "leto's agent ends its processes at once (SIGKILL): their state is in the keepers",
        ("30",),
    ),
    TorchrunFlag(
        ("--virtual-local-rank", "--virtual_local_rank"),
        REFUSED,
        f"it maps each rank's GPU to device 0; {CPU_ONLY}",
    ),
)

BY_NAME: dict[str, TorchrunFlag] = {name: f for f in FLAGS for name in f.names}


RDZV_TIMEOUT = 60.0  # --rdzv-timeout's default (torchrun's join_timeout is 600 s)
MASTER_ADDR, MASTER_PORT = "127.0.0.1", 29500  # torchrun's defaults
_STD = {"0": frozenset(), "1": frozenset({"out"}), "2": frozenset({"err"})}
_STD["3"] = _STD["1"] | _STD["2"]


def add_refused(parser: argparse.ArgumentParser) -> None:
    """torchrun's flags that leto refuses, each with its reason as its help (they are
    parsed, then refused by :func:`translate` in one line)."""
    g = parser.add_argument_group("torchrun's flags that leto refuses (docs/launch.md)")
    for f in FLAGS:
        if f.verdict != REFUSED:
            continue
        if f.takes_value:
            g.add_argument(*f.names, dest=f.dest, default=None, metavar="X", help=f.leto)
        else:
            g.add_argument(*f.names, dest=f.dest, action="store_true", help=f.leto)


def translate(args: argparse.Namespace, bounds: Mapping[str, Bound]) -> None:
    """torchrun's flags into leto's own, in ``args`` (BadInput for a refused one):
    ``nproc_per_node`` becomes an int, ``rdzv_backend`` c10d or etcd,
    ``rdzv_endpoint`` takes --master-addr/--master-port, ``rdzv_timeout``
    --rdzv-conf's join_timeout (checked against ``bounds``), ``run_dir`` --log-dir,
    and ``shown_ranks`` the local ranks whose output the console shows (None: every
    one; empty: none, and ``no_echo``)."""
    for f in FLAGS:
        if f.verdict == REFUSED and getattr(args, f.dest, None) not in (None, False):
            raise BadInput(f.refusal())
    args.nproc_per_node = _nproc(args.nproc_per_node)
    bound = bounds.get("nproc_per_node")
    problem = None if bound is None else bound.problem(args.nproc_per_node)
    if problem is not None:  # before anything is made per local rank
        raise BadInput(f"--nproc-per-node {problem}")
    if args.rdzv_backend == "static":  # torchrun's default: node 0's store at the endpoint
        args.rdzv_backend = "c10d"
    elif args.rdzv_backend == "etcd-v2":
        raise BadInput(
            "--rdzv-backend etcd-v2: leto's etcd rendezvous speaks etcd's v3 API; give "
            "--rdzv-backend etcd (the same etcd cluster serves both)"
        )
    _master(args)
    _rdzv_conf(args, bounds["rdzv_timeout"])
    if args.log_dir is not None:
        if args.run_dir is not None and os.path.abspath(args.run_dir) != os.path.abspath(
            args.log_dir
        ):
            raise BadInput(
                "--log-dir and --run-dir name two directories: --log-dir is torchrun's name "
                "for leto's run directory, give one of them"
            )
        args.run_dir = args.log_dir
    for flag, value in (("--role", args.role), ("--rdzv-id", args.rdzv_id)):
        if value is not None and not valid_job_id(value):
            raise BadInput(
                f"{flag} {show(value)} is not 1-64 letters, digits, '_', '.', '-' "
                "(starting with a letter or a digit)"
            )
    if args.start_method not in (None, "fork"):
        why = {"spawn": "spawned", "forkserver": "forkserver-started"}.get(args.start_method)
        if why is None:
            raise BadInput(
                f"--start-method {show(args.start_method)} is not one of fork, spawn, forkserver"
            )
        raise BadInput(
            f"--start-method {args.start_method}: leto forks every trainer and warm shadow "
            f"from a Python that has imported torch (fork); a {why} trainer would start cold"
        )
    if args.event_log_handler not in (None, "null"):
        raise BadInput(
            f"--event-log-handler {show(args.event_log_handler)}: leto calls no torchrun "
            "event handler; its events are in RUN_DIR/events.jsonl (leto report RUN_DIR)"
        )
    args.shown_ranks = _shown_ranks(args)
    if args.shown_ranks is not None and not args.shown_ranks:
        args.no_echo = True


def _nproc(text: str) -> int:
    """--nproc-per-node: N, or torchrun's auto / cpu (the CPUs this process may run on)."""
    word = str(text).strip()
    if word in ("auto", "cpu"):
        return (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
    if word in ("gpu", "xpu"):
        raise BadInput(
            f"--nproc-per-node {word}: {CPU_ONLY}, so it starts no rank per {word.upper()}; "
            "give a number, or auto / cpu for one rank per CPU"
        )
    if word.isascii() and word.isdecimal() and len(word) <= 18:
        return int(word)
    raise BadInput(f"--nproc-per-node {show(text)} is not a number of ranks, auto or cpu")


def _master(args: argparse.Namespace) -> None:
    """--master-addr / --master-port (torchrun's static rendezvous): the endpoint, and
    ``endpoint_flag`` the flags a refusal of it names."""
    args.endpoint_flag = "--rdzv-endpoint"
    if args.master_addr is None and args.master_port is None:
        return
    flags = " and ".join(
        f for f, v in (("--master-addr", args.master_addr), ("--master-port", args.master_port))
        if v is not None
    )  # fmt: skip
    if args.rdzv_backend == "etcd":
        raise BadInput(
            f"{flags}: torchrun's static rendezvous; with --rdzv-backend etcd give the etcd "
            "members as --rdzv-endpoint"
        )
    if args.rdzv_endpoint is not None:
        raise BadInput(f"{flags} and --rdzv-endpoint both name the rendezvous: give one")
    port = str(MASTER_PORT) if args.master_port is None else args.master_port.strip()
    if not (port.isascii() and port.isdecimal() and len(port) <= 5 and 0 < int(port) < 65536):
        raise BadInput(f"--master-port {show(args.master_port)} is not a port in 1..65535")
    host = MASTER_ADDR if args.master_addr is None else args.master_addr
    text = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        parse_endpoint(text, "--master-addr")
    except ValueError:
        raise BadInput(f"--master-addr {show(host)} is not a host name or an address") from None
    args.rdzv_endpoint, args.endpoint_flag = text, flags


def _rdzv_conf(args: argparse.Namespace, bound: Bound) -> None:
    """--rdzv-conf KEY=VALUE,...: join_timeout is --rdzv-timeout; no other key."""
    conf: dict[str, str] = {}
    for item in (args.rdzv_conf or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise BadInput(
                f"--rdzv-conf {show(args.rdzv_conf)} is not KEY=VALUE,... (e.g. join_timeout=90)"
            )
        if key != "join_timeout":
            raise BadInput(
                f"--rdzv-conf {show(key)}: leto's rendezvous reads join_timeout only (the "
                "same as --rdzv-timeout); it has no other setting"
            )
        conf[key] = value
    if "join_timeout" in conf:
        try:
            seconds = float(conf["join_timeout"])
        except ValueError:
            seconds = float("nan")
        bound.check("--rdzv-conf join_timeout", seconds)
        if args.rdzv_timeout is not None and args.rdzv_timeout != seconds:
            raise BadInput(
                f"--rdzv-conf join_timeout={conf['join_timeout']} and --rdzv-timeout "
                f"{show(args.rdzv_timeout)} disagree: give one"
            )
        args.rdzv_timeout = seconds
    if args.rdzv_timeout is None:
        args.rdzv_timeout = RDZV_TIMEOUT


def _streams(flag: str, text: str | None, nproc: int) -> dict[int, frozenset[str]]:
    """torchrun's --redirects / --tee value (``3``, or ``0:3,1:0``): per local rank, the
    streams it names."""
    if text is None:
        return dict.fromkeys(range(nproc), frozenset())
    text = text.strip()
    if text in _STD:
        return dict.fromkeys(range(nproc), _STD[text])
    out = dict.fromkeys(range(nproc), frozenset[str]())
    for item in text.split(","):
        rank, sep, value = item.strip().partition(":")
        if not sep or value not in _STD or not (rank.isascii() and rank.isdecimal()):
            raise BadInput(
                f"{flag} {show(text)} is not 0-3, or LOCAL_RANK:0-3,... (e.g. 3, or 0:3,1:0)"
            )
        if int(rank) >= nproc:
            raise BadInput(f"{flag} {show(text)}: local rank {rank} is not in 0..{nproc - 1}")
        out[int(rank)] = _STD[value]
    return out


def _shown_ranks(args: argparse.Namespace) -> frozenset[int] | None:
    """The local ranks whose output the console shows (None: all of them), from
    torchrun's --redirects, --tee and --local-ranks-filter. A trainer's stdout and
    stderr share one pipe: a rank shows both or neither."""
    nproc = args.nproc_per_node
    redirected = _streams("--redirects", args.redirects, nproc)
    teed = _streams("--tee", args.tee, nproc)
    shown = set(range(nproc))
    for lr in range(nproc):
        console = (_STD["3"] - redirected[lr]) | teed[lr]
        if console == _STD["3"]:
            continue
        if not console:
            shown.discard(lr)
            continue
        raise BadInput(
            f"--redirects {show(args.redirects or '0')} with --tee {show(args.tee or '0')} "
            f"shows only the {'stdout' if 'out' in console else 'stderr'} of local rank {lr} "
            "on the console, but a trainer's stdout and stderr share one pipe: redirect (3) "
            "or show (0) both"
        )
    if args.local_ranks_filter is not None:
        wanted = set()
        for item in args.local_ranks_filter.split(","):
            word = item.strip()
            if not (word.isascii() and word.isdecimal()) or int(word) >= nproc:
                raise BadInput(
                    f"--local-ranks-filter {show(args.local_ranks_filter)} is not a list of "
                    f"local ranks in 0..{nproc - 1} (e.g. 0 or 0,1)"
                )
            wanted.add(int(word))
        shown &= wanted
    return None if shown == set(range(nproc)) else frozenset(shown)


def torchrun_environment(
    args: argparse.Namespace, restarts: int, environ: Mapping[str, str]
) -> dict[str, str]:
    """What torchrun sets for every trainer of the job and leto's agent does not:
    ``TORCHELASTIC_RUN_ID`` (--rdzv-id; else, as torchrun, a fresh uuid for one node
    and ``none`` for more, kept across --max-restarts), ``TORCHELASTIC_RESTART_COUNT``,
    ``TORCHELASTIC_MAX_RESTARTS`` and ``ROLE_NAME`` (--role)."""
    run_id = args.rdzv_id
    if run_id is None:
        kept = environ.get("TORCHELASTIC_RUN_ID") if restarts else None
        run_id = kept or (str(uuid.uuid4()) if args.nnodes == 1 else "none")
    return {
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
        "ROLE_NAME": args.role or "default",
    }


def markdown_table() -> str:
    """The docs' table, one row per flag (docs/launch.md holds exactly this)."""
    rows = ["| torchrun flag | in `leto launch` | what leto does (refused: why) |"]
    rows.append("|---|---|---|")
    for f in FLAGS:
        names = ", ".join(f"`{n}`" for n in f.names)
        rows.append(f"| {names} | {f.verdict} | {f.leto} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
