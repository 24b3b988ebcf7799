"""``leto bench``: leto against checkpoint-based recovery, side by side on this machine.

Importing this package imports no torch (the command line validates its input
first). See ``docs/benchmarks.md``.
"""
