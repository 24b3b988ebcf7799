"""The errors of the retained layer: a layout that does not fit, a chunk operation
illegal in the chunk's status, bytes that fail their checksum."""

from __future__ import annotations

__all__ = ["LayoutError", "ShapeMismatchError", "ChunkStateError", "ChecksumError"]


class LayoutError(ValueError):
    """Bad layout arguments or a retained layout that does not fit."""


class ShapeMismatchError(LayoutError):
    """The model's parameters differ from the retained layout's."""


class ChunkStateError(RuntimeError):
    """An operation is not legal in the chunk's current status."""


class ChecksumError(RuntimeError):
    """Bytes do not match their recorded checksum."""
