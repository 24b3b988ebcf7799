"""Where the TLA+ spec lives: inside the package (``leto/spec/files``: in a source
checkout a link to the repository's ``spec/``, in a wheel the files themselves)."""

from __future__ import annotations

from pathlib import Path

SPEC_DIR = Path(__file__).resolve().parent / "files"
"""The directory of ``Leto.tla``, its ``MCLeto*.cfg`` files and ``PROTOCOL.md``."""
