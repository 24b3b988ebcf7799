"""What each process of a job is called in ``ps``: ``leto trainer rank 3 job 1a2b3c4d
(leto launch --nproc-per-node 4 --run-dir runs/gpt train.py)``.

Every trainer and shadow is forked from the zygote, itself forked from the agent
(``leto launch``): left alone, all of them read as the agent's command line. Each names
itself instead: what it is (``agent node 0``, ``zygote node 0``, ``keeper rank 3``,
``trainer rank 3``, ``shadow rank 3``; a promoted shadow becomes ``trainer``), the job
(the first 8 characters of its id, which ``leto report --job`` takes), and in
parentheses the command that started it, shortened (the interpreter's path left out; a
keeper, started by the agent with arguments of its own, shows the run directory).
That command stays so that what finds a job's processes by their command line still
does: ``pgrep -f train.py``, ``pkill -f runs/gpt``, and the tests' tag (a run
directory). The kernel's 15-character name (what ``top`` and ``ps -o comm`` show) becomes
``leto trainer 3``.

The title is written over the command line's own memory (``setproctitle``, the
``torch`` extra), told not to take the environment's as well (``SPT_NOENV``:
``/proc/PID/environ`` stays readable), so a title longer than the command line it
replaces is cut at its end. Without the package only the kernel's name is set
(``prctl(PR_SET_NAME)``). Naming a process never fails: a title is not worth an error.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import types

__all__ = ["set_title", "title"]

_PR_SET_NAME = 15
SHOWN = 8  # the characters of the job's id a title shows

# the environment's memory is not the title's: setproctitle reads this at its first use
_NOENV = "SPT_NOENV" not in os.environ
if _NOENV:
    os.environ["SPT_NOENV"] = "1"
_spt: types.ModuleType | None
try:
    import setproctitle as _spt
except ImportError:  # pragma: no cover - the torch extra brings it
    _spt = None


def title(what: str, job: str = "", context: str | None = None) -> str:
    """The title of a process that is ``what`` (``trainer rank 3``) in job ``job``;
    ``context`` in parentheses (default: the command that started the process)."""
    text = f"leto {what}" + (f" job {job[:SHOWN]}" if job else "")
    shown = _command() if context is None else context
    return f"{text} ({shown})" if shown else text


def set_title(what: str, job: str = "", context: str | None = None) -> None:
    """Name this process ``what`` of job ``job`` (:func:`title`), where it can be."""
    if _spt is not None:
        try:
            _spt.setproctitle(title(what, job, context))
        except Exception:  # noqa: BLE001 - a name is never worth stopping a process
            pass
        if _NOENV:  # read once; the script's environment is its own
            os.environ.pop("SPT_NOENV", None)
    if threading.current_thread() is threading.main_thread():  # the process's own name
        _set_name(f"leto {_short(what)}")


def _short(what: str) -> str:
    """``trainer rank 3`` -> ``trainer 3``: the kernel keeps 15 bytes of a name."""
    return " ".join(w for w in what.split() if w not in ("rank", "node"))


def _set_name(name: str) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _command() -> str:
    """The command line this process (or the process it was forked from) was started
    with, its interpreter's path left out: ``leto launch ...``, ``-m mod ...``."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if argv and os.path.basename(argv[0]).startswith("python"):
        argv = argv[1:]
    if argv[:2] in (["-m", "leto.cli"], ["-m", "leto"]):
        argv = ["leto", *argv[2:]]
    elif argv and os.path.basename(argv[0]) == "leto":
        argv = ["leto", *argv[1:]]
    return " ".join(argv)
