"""Errors every layer may raise about the user's settings (no dependencies but argcheck).

:class:`ConfigError` lives here, below the backends, so that a backend can name a bad
setting (the gloo runtime checks the config against what `leto launch` started)
without importing the adapters that load configs.
"""

from __future__ import annotations

from typing import Any

from leto.argcheck import show

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A bad setting; ``field`` names it."""

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        self.field = field
        self.source = source
        self.message = message
        where = f" ({printable(source)})" if source else ""
        super().__init__(f"leto config{where}: {printable(field)}: {message}")


def printable(name: Any) -> str:
    """A key or a path as it goes into a one-line message."""
    text = str(name)
    return text if text.isprintable() and len(text) <= 200 else show(name, 200)
