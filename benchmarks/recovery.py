"""``leto bench recovery``, runnable from a checkout: ``python benchmarks/recovery.py [options]``."""

import sys

from leto.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "recovery", *sys.argv[1:]]))
