"""The ``leto`` command. Each subcommand lives in its own module, which exposes
``configure(parser)`` and ``run(args) -> int``; modules are imported only when
present, so a subcommand appears as soon as its module lands.

Only the module of the subcommand being run is imported (``leto --help`` imports
none of them), so commands that need no torch (``leto --help``, ``leto spec``,
``leto simulate``, ``leto report``) start without importing it."""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import NoReturn

DESCRIPTION = (
    "leto: in-place failure recovery for PyTorch distributed training (on CPU, with the "
    "gloo backend, today). A trainer that dies or hangs is replaced on the same hardware "
    "from state kept outside it, and the run stays bitwise the one that never failed. "
    "`leto COMMAND --help` gives a command's options."
)

# (name, module, one-line help)
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("spec", "leto.spec.cli", "check the protocol: TLC on spec/, the core's checker, mutants"),
    ("demo", "leto.adapters.demo", "train, inject failures, recover in place, compare bitwise"),
    ("launch", "leto.adapters.launch", "start training with in-place recovery (torchrun-shaped)"),
    ("report", "leto.adapters.report", "print a run's failure/recovery timeline and plot it"),
    ("bench", "leto.bench.cli", "benchmarks against checkpoint-based recovery"),
    ("simulate", "leto.sim.cli", "large-scale goodput simulation"),
)


def _present(module_name: str) -> bool:
    """Whether a subcommand's module exists (found without importing it)."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:  # a parent package is absent
        return False


class Parser(argparse.ArgumentParser):
    """argparse, with a refusal in one line: ``leto CMD: error: argument --FLAG: ...``
    and exit status 2 (argparse's usage block would bury the line that matters; the
    line says where the usage is). Subcommands' parsers are of this class too."""

    commands: dict[str, Parser]

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def unrecognized(self, words: Sequence[str]) -> NoReturn:
        """Refuse words no option of this parser takes, naming the closest flag."""
        flags = [s for a in self._actions for s in a.option_strings]
        first = next((w.split("=", 1)[0] for w in words if w.startswith("-")), "")
        close = difflib.get_close_matches(first, flags, n=1) if first else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        self.error(f"unrecognized arguments: {' '.join(words)}{hint}")


def build_parser(commands: Sequence[str] | None = None) -> Parser:
    """The parser; only the subcommands in ``commands`` (all when None) get their
    options, which imports their modules. The others are listed with their help."""
    parser = Parser(prog="leto", description=DESCRIPTION)
    parser.commands = {}
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_ in SUBCOMMANDS:
        if not _present(module_name):
            continue  # not built yet
        p = sub.add_parser(name, help=help_, description=help_)
        parser.commands[name] = p
        if commands is None or name in commands:
            module = importlib.import_module(module_name)
            module.configure(p)
            p.set_defaults(_run=module.run)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word; the top level has no options
    that take a value)."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = _command(args_list)
    parser = build_parser([] if command is None else [command])
    args, extra = parser.parse_known_args(args_list)
    if extra:  # refused by the subcommand's parser: its --help is the one to read
        parser.commands.get(command or "", parser).unrecognized(extra)
    args._argv = args_list  # what `leto launch` execs itself with at a restart
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    code: int = args._run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
