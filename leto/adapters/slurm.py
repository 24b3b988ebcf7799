"""``leto launch --slurm``: a node's place in the job taken from the variables ``srun``
sets, so that one line starts every node of a Slurm allocation::

    srun --ntasks-per-node=1 leto launch --slurm --nproc-per-node 8 train.py

``srun`` starts one task per node: each is that node's agent (``leto launch`` starts the
node's ranks itself). From the step's variables:

- ``--nnodes``: ``SLURM_STEP_NUM_NODES`` (the step's nodes; else ``SLURM_JOB_NUM_NODES``,
  ``SLURM_NNODES``);
- ``--node-rank``: ``SLURM_NODEID`` (the node's index in the step, 0 first);
- the rendezvous: the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``),
  node 0, at ``--master-port`` (default torchrun's 29500); with ``--rdzv-backend etcd``
  the etcd members stay ``--rdzv-endpoint``;
- ``--rdzv-id``: ``slurm-JOBID`` unless given;
- ``--run-dir``: ``leto-runs/slurm-JOBID`` unless given: the same directory on every
  node, where the nodes find the job's secret when they share a file system (else export
  ``LETO_JOB_SECRET`` in the batch script: docs/security.md).

A flag that would say the same thing twice (``--nnodes``, ``--node-rank``,
``--master-addr``, ``--rdzv-endpoint`` with c10d, ``--spare``) is refused in one line, as
is a step that started other than one task per node. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping

from leto.argcheck import BadInput, show

__all__ = ["apply_slurm", "first_host"]

_RANGE = re.compile(r"\[([^\[\]]*)\]")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (``tux[01-04,07],gpu5`` -> ``tux01``,
    ``rack[1-2]-n[3,5]`` -> ``rack1-n3``): its first name, each bracket replaced by the
    low end of its first range, as written (zero padding kept). ValueError names what
    is wrong with a list this cannot read."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, ch in enumerate(text):  # the first name ends at the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            break
        if ch == "," and depth == 0:
            end = i
            break
    name = text[:end]

    def low(m: re.Match[str]) -> str:
        first = m.group(1).split(",")[0].split("-")[0]
        if not (first.isascii() and first.isdecimal()):
            raise ValueError(f"{show(nodelist)}: {show(m.group(0))} is not a range of numbers")
        return first

    host = _RANGE.sub(low, name)
    if not host or any(c in host for c in "[],") or not host.isascii() or " " in host:
        raise ValueError(f"{show(nodelist)} is not a Slurm host list (e.g. node[01-04],gpu5)")
    return host


def _int(env: Mapping[str, str], *names: str) -> tuple[str, int] | None:
    """The first of ``names`` set in ``env``, and its value as a count (BadInput if it is
    not one)."""
    for name in names:
        text = env.get(name)
        if text is None:
            continue
        if not (text.isascii() and text.isdecimal() and len(text) <= 9):
            raise BadInput(f"--slurm: {name}={show(text)} is not a number")
        return name, int(text)
    return None


def apply_slurm(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> None:
    """With ``--slurm``: the node count, node rank, rendezvous host, job id and run
    directory from ``env`` (default ``os.environ``) into ``args``, before torchrun's flags
    are translated (the rendezvous host becomes ``--master-addr``). BadInput names the
    variable missing or wrong, or the flag given twice."""
    if not args.slurm:
        return
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        raise BadInput(
            "--slurm: SLURM_JOB_ID is not set: start leto launch --slurm with srun inside a "
            "Slurm allocation (sbatch or salloc)"
        )
    etcd = args.rdzv_backend == "etcd"
    given = [
        flag
        for flag, value in (
            ("--nnodes", args.nnodes if str(args.nnodes) != "1" else None),
            ("--node-rank", args.node_rank),
            ("--master-addr", args.master_addr),
            ("--rdzv-endpoint", None if etcd else args.rdzv_endpoint),
            ("--standalone", args.standalone or None),
            ("--spare", args.spare or None),
        )
        if value is not None
    ]
    if given:
        raise BadInput(
            f"--slurm and {given[0]}: with --slurm the node count, node rank and rendezvous "
            "host come from srun's SLURM_* variables; drop " + given[0]
        )
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    node = _int(env, "SLURM_NODEID")
    if nodes is None or node is None:
        missing = "SLURM_STEP_NUM_NODES" if nodes is None else "SLURM_NODEID"
        raise BadInput(
            f"--slurm: {missing} is not set: run leto launch --slurm as a task of srun "
            "(srun --ntasks-per-node=1 leto launch --slurm ...), not in the batch script itself"
        )
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if tasks is not None and tasks[1] != nodes[1]:
        raise BadInput(
            f"--slurm: srun started {tasks[1]} tasks on {nodes[1]} node(s) ({tasks[0]}); leto "
            "launch is one agent per node and starts the node's ranks itself: give srun "
            "--ntasks-per-node=1"
        )
    if not 0 <= node[1] < nodes[1]:
        raise BadInput(f"--slurm: SLURM_NODEID={node[1]} is not in 0..{nodes[1] - 1}")
    args.nnodes, args.node_rank = str(nodes[1]), node[1]
    if not etcd:
        key = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        nodelist = env.get(key) or env.get("SLURM_NODELIST")
        if not nodelist:
            raise BadInput("--slurm: neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set")
        try:
            args.master_addr = first_host(nodelist)
        except ValueError as e:
            raise BadInput(f"--slurm: {key} {e}") from None
    if args.rdzv_id is None:
        args.rdzv_id = f"slurm-{job}"
    if args.run_dir is None and args.log_dir is None:
        args.run_dir = os.path.join("leto-runs", f"slurm-{job}")
