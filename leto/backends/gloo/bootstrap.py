"""What a forked trainer or shadow runs: the user's script, connected to its agent.

The zygote calls :func:`child_main` in the child. It sets the torchrun-style
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ...), connects to the node agent, and runs the script as
``__main__`` (``runpy``; a module's name with ``leto launch -m``). ``leto.wrap`` with ``backend="gloo"`` (which calls
:func:`~.runtime.wrap_gloo`) then finds the connection here (:data:`CHANNEL`) and
returns a :class:`~.runtime.GlooSession`;
in a shadow it returns only once the shadow is promoted. An exception anywhere is
reported to the agent with its traceback before the process exits (a
:class:`~leto.errors.ConfigError` is printed as its one line, not as a traceback).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Callable
from typing import Any

from leto.errors import ConfigError

from . import messages as M
from .channel import AgentChannel, AgentGone
from .procs import steady_heap
from .title import set_title
from .unwrapped import ShadowGroups, Watch

__all__ = ["CHANNEL", "SPEC", "WATCH", "child_main"]

CHANNEL: AgentChannel | None = None
SPEC: dict[str, Any] = {}
WATCH: Watch | ShadowGroups | None = None  # until leto.wrap: see .unwrapped
# run after the script ended without an error (the session registers its completion
# barrier here: this module imports nothing of the runtime)
AT_EXIT: list[Callable[[AgentChannel], None]] = []


def child_main(spec: dict[str, Any]) -> int:
    global CHANNEL, SPEC, WATCH
    SPEC = spec
    set_title(f"{spec['role']} rank {spec['rank']}", str(spec.get("job", "")))
    if "umask" in spec:
        os.umask(int(spec["umask"]))  # the user's: the agent's own files are private
    os.environ.update({k: str(v) for k, v in spec["env"].items()})
    os.chdir(spec["cwd"])
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except AttributeError:  # pragma: no cover
        pass
    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    steady_heap()  # a step's activations stay mapped for the next (procs.steady_heap)
    keys: tuple[str, ...] = ("role", "rank", "local_rank", "node", "incarnation")
    hello: dict[str, Any] = {k: spec[k] for k in keys if k in spec}
    CHANNEL = AgentChannel(
        spec["agent_socket"],
        hello,
        heartbeat=float(spec.get("heartbeat", 0.5)),
        agent_pid=spec.get("agent_pid"),
    )
    script = spec["script"]
    sys.argv = [script, *spec.get("args", [])]
    # as `python -m module` / `python script.py` put the working or the script's directory
    # first on the path (run_module then sets argv[0] to the module's file)
    sys.path.insert(
        0, os.getcwd() if spec.get("module") else os.path.dirname(os.path.abspath(script))
    )
    if spec["role"] == "trainer":
        WATCH = Watch(_teller(CHANNEL, int(spec["rank"])))
        WATCH.start()
    else:  # a shadow: a process group the script forms is a fake one of its own
        WATCH = ShadowGroups(int(spec["rank"]), int(spec["world"]))
        WATCH.start()
    code = 0
    try:
        if spec.get("module"):
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except AgentGone as e:
        sys.stderr.write(f"leto: {e}\n")
        code = 1
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the process ends
        tb = traceback.format_exc()
        # a bad setting (leto.wrap's config): its one line, which names the setting and the
        # file; the agent still gets the traceback, for the event log
        # and bad bytes leto's checksums caught: the rank is replaced and its memory
        # rebuilt (a recovery), one line is what the console needs
        from leto.retained.layout import ChecksumError
        from leto.retained.recovery import IntegrityError

        if isinstance(e, ConfigError):
            sys.stderr.write(f"{e}\n")
        elif isinstance(e, (IntegrityError, ChecksumError)):
            sys.stderr.write(f"leto: rank {spec['rank']}: {e}\n")
        else:
            sys.stderr.write(tb)
        code = 1
        try:
            CHANNEL.send(
                M.Error(traceback=tb[-M.MAX_TEXT :], phase=CHANNEL.phase, step=CHANNEL.step)
            )
        except AgentGone:
            pass
    if code == 0:
        try:
            for at_exit in AT_EXIT:
                at_exit(CHANNEL)
        except AgentGone:
            code = 1
        except BaseException:  # noqa: BLE001
            tb = traceback.format_exc()
            sys.stderr.write(tb)
            code = 1
            try:
                CHANNEL.send(
                    M.Error(traceback=tb[-M.MAX_TEXT :], phase="finish", step=CHANNEL.step)
                )
            except AgentGone:
                pass
    try:
        CHANNEL.send(M.Exit(code=code))
    except AgentGone:
        pass
    return code


def _teller(ch: AgentChannel, rank: int) -> Callable[[str], None]:
    """How a trainer's :class:`.unwrapped.Watch` tells its agent."""

    def tell(how: str) -> None:
        try:
            ch.send(M.Unprotected(rank=rank, detail=how))
        except AgentGone:
            pass

    return tell
