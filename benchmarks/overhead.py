"""``leto bench overhead``, runnable from a checkout: ``python benchmarks/overhead.py [options]``."""

import sys

from leto.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "overhead", *sys.argv[1:]]))
