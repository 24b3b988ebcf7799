"""The ``leto`` command. Each subcommand lives in its own module, which exposes
``configure(parser)`` and ``run(args) -> int``; modules are imported only when
present, so a subcommand appears as soon as its module lands."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (name, module, one-line help)
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("spec", "leto.spec_cli", "check the protocol: TLC on spec/, the core's checker, mutants"),
    ("demo", "leto.adapters.demo", "train, inject failures, recover in place, compare bitwise"),
    ("launch", "leto.adapters.launch", "start training with in-place recovery (torchrun-shaped)"),
    ("report", "leto.adapters.report", "print a run's failure/recovery timeline and plot it"),
    ("bench", "leto.bench.cli", "benchmarks against checkpoint-based recovery"),
    ("simulate", "leto.sim.cli", "large-scale goodput simulation"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leto", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_ in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # not built yet
            raise
        p = sub.add_parser(name, help=help_, description=help_)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    code: int = args._run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
