"""``python -m leto``: the ``leto`` command."""

import sys

from leto.cli import main

sys.exit(main())
