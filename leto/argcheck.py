"""Bounds on what a user hands a command: flags, config keys, environment variables.

Every command checks its input with the same :class:`Bound` before it imports or
starts anything, so every refusal reads the same way: one line that names the
flag (or key, or variable), says what is wrong and what would be right, and a
non-zero exit. Numbers are always finite (``nan`` and ``inf`` parse as floats, and
would otherwise switch a timeout off or overflow far from where they came in);
every count has an upper bound that says why it is there.

Paths are checked for what the command will do with them (read a file, create a
directory, write a file) without creating anything: a refused command leaves
nothing behind.

No torch, no numpy: ``leto --help`` imports this.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "BadInput",
    "Bound",
    "check_args",
    "dir_to_create",
    "file_to_read",
    "file_to_write",
    "one_line",
    "parse_endpoint",
    "refuse",
    "show",
]

WEEK_S = 7 * 86400.0


class BadInput(ValueError):
    """Input a command refuses; ``str()`` is one line that starts with the name."""


def show(value: Any, width: int = 60) -> str:
    """``value`` for a message: a number as written, anything else as its repr, cut
    to ``width`` characters (a refusal stays one short line)."""
    if isinstance(value, float):  # 4096.0 stays a float: "must be an integer, got 4096.0"
        text = f"{value:g}"
        return text if any(c in text for c in ".enia") else text + ".0"
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > 128:
            return f"an integer of {value.bit_length()} bits"
        return str(value)
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def parse_endpoint(
    text: str, flag: str = "--rdzv-endpoint", *, free_port: bool = False
) -> tuple[str, int]:
    """HOST:PORT (``[v6]:PORT`` too); port 0 (any free one) only with ``free_port``."""
    lowest = 0 if free_port else 1
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [::1]:29400
        host = host[1:-1]
    if (
        not sep
        or not host
        or not (port.isascii() and port.isdecimal())
        or len(port) > 5
        or not lowest <= int(port) < 65536
    ):
        raise ValueError(
            f"{flag} {show(text)} is not HOST:PORT with a port in {lowest}..65535 "
            "(e.g. 127.0.0.1:29400)"
        )
    return host, int(port)


def _limit(value: float) -> str:
    if float(value).is_integer() and abs(value) >= 10_000:
        return f"{int(value):,}"
    return show(value)


def one_line(text: object) -> str:
    """``text`` with every unprintable character escaped: a newline in a path or a value
    the user gave cannot split a refusal into two lines."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def refuse(command: str, error: object, status: int = 2) -> int:
    """Print ``leto COMMAND: error: ...`` (one line) to stderr; the exit status."""
    print(f"leto {command}: error: {one_line(error)}", file=sys.stderr)
    return status


@attrs.frozen
class Bound:
    """The values one setting accepts: an integer or a finite number in ``[lo, hi]``
    (``(lo, hi]`` with ``lo_open``); ``why_hi`` says what the upper bound protects."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False
    unit: str = ""
    why_hi: str = ""

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` ("must be ..., got ..."), or None."""
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"must be an integer, got {show(value)}"
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {show(value)}"
        elif not math.isfinite(value):
            return f"must be a finite number, got {show(value)}"
        unit = f" {self.unit}" if self.unit else ""
        if self.lo is not None:
            if self.lo_open and not value > self.lo:
                if self.lo == 0:
                    return f"must be positive, got {show(value)}"
                return f"must be more than {_limit(self.lo)}{unit}, got {show(value)}"
            if not self.lo_open and value < self.lo:
                return f"must be at least {_limit(self.lo)}{unit}, got {show(value)}"
        if self.hi is not None and value > self.hi:
            why = f" ({self.why_hi})" if self.why_hi else ""
            return f"must be at most {_limit(self.hi)}{unit}{why}, got {show(value)}"
        return None

    def check(self, name: str, value: Any) -> None:
        """Raise :class:`BadInput` ``"NAME must be ..."`` unless ``value`` is in bounds."""
        problem = self.problem(value)
        if problem is not None:
            raise BadInput(f"{name} {problem}")


def positive_int(hi: int, why_hi: str = "", unit: str = "") -> Bound:
    return Bound(lo=1, hi=hi, integer=True, unit=unit, why_hi=why_hi)


def seconds(hi: float = WEEK_S, why_hi: str = "a week") -> Bound:
    """A positive, finite duration."""
    return Bound(lo=0, lo_open=True, hi=hi, unit="s", why_hi=why_hi)


def check_args(args: argparse.Namespace, bounds: Mapping[str, Bound]) -> None:
    """Check ``args.<dest>`` against ``bounds[dest]`` for every dest that is set; the
    flag is named as ``--dest-with-dashes``."""
    for dest, bound in bounds.items():
        value = getattr(args, dest, None)
        if value is not None:
            bound.check("--" + dest.replace("_", "-"), value)


# ------------------------------------------------------------------------------ paths


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _path(name: str, path: str | os.PathLike[str]) -> tuple[Path, str]:
    """The path and how a message shows it; BadInput for an empty one or a NUL."""
    text = str(os.fspath(path))
    if not text:
        raise BadInput(f"{name} is empty: give a path")
    if "\0" in text:
        raise BadInput(f"{name} {show(text)} is not a path (it holds a NUL)")
    return Path(text), show(text, 200)


def _os_error(name: str, shown: str, e: OSError) -> BadInput:
    return BadInput(f"{name} {shown}: {e.strerror or e}")


def file_to_read(name: str, path: str | os.PathLike[str], what: str = "file") -> Path:
    """An existing, readable regular file."""
    p, shown = _path(name, path)
    try:
        if p.is_dir():
            raise BadInput(f"{name} {shown} is a directory, not a {what}")
        if not p.exists():
            raise BadInput(f"{name} {shown} not found")
        if not p.is_file():
            raise BadInput(f"{name} {shown} is not a regular file")
        if not os.access(p, os.R_OK):
            raise BadInput(f"{name} {shown} is not readable")
    except OSError as e:  # a name too long, a loop of links
        raise _os_error(name, shown, e) from None
    return p


def dir_to_create(name: str, path: str | os.PathLike[str], *, probe: bool = False) -> Path:
    """A directory that is there (writable) or can be created (its nearest existing
    ancestor is a writable directory). Nothing is created here, but with ``probe``
    (for a directory the command is about to create) an empty directory is made in
    that ancestor and removed: ``os.access`` says yes to root in ``/proc``."""
    p, shown = _path(name, path)
    try:
        if p.exists() and not p.is_dir():
            raise BadInput(f"{name} {shown} exists and is not a directory")
        base = _nearest_existing(p)
        if not base.is_dir():
            raise BadInput(f"{name} {shown}: {show(str(base), 200)} is not a directory")
        if not os.access(base, os.W_OK | os.X_OK):
            where = "is not writable" if base == p.absolute() else "cannot be created there"
            raise BadInput(f"{name} {shown} {where}")
        if any(len(part.encode()) > 255 for part in p.parts):
            raise BadInput(f"{name} {shown}: a name in it is longer than 255 bytes")
    except OSError as e:
        raise _os_error(name, shown, e) from None
    if probe:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".leto-probe-", dir=base))
        except OSError as e:
            why = e.strerror or str(e)
            if base == p.absolute():
                raise BadInput(f"{name} {shown} is not writable ({why})") from None
            where = show(str(base), 200)
            raise BadInput(f"{name} {shown} cannot be created in {where} ({why})") from None
    return p


def file_to_write(name: str, path: str | os.PathLike[str]) -> Path:
    """A file the command will write: not a directory, in an existing, writable one."""
    p, shown = _path(name, path)
    try:
        if p.is_dir():
            raise BadInput(f"{name} {shown} is a directory")
        parent = p.absolute().parent
        if not parent.is_dir():
            why = "does not exist" if not parent.exists() else "is not a directory"
            raise BadInput(f"{name} {shown}: the directory {show(str(parent), 200)} {why}")
        if p.exists() and not os.access(p, os.W_OK):
            raise BadInput(f"{name} {shown} is not writable")
        if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
            raise BadInput(f"{name} {shown}: the directory is not writable")
        if len(p.name.encode()) > 255:
            raise BadInput(f"{name} {shown}: the file name is longer than 255 bytes")
    except OSError as e:
        raise _os_error(name, shown, e) from None
    return p
