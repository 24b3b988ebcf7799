"""leto: in-place failure recovery for PyTorch distributed training.

Importing ``leto`` is cheap and never imports torch; the torch-facing parts
(``leto.adapters``, ``leto.backends``) are imported on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Config": "leto.adapters.config",
    "wrap": "leto.adapters.api",
    "ResumableBatchSampler": "leto.retained.process_state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'leto' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
