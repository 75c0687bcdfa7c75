"""``python -m distlm.export``: the command line of distlm/export/cli.py."""

import sys

from distlm.export.cli import main

sys.exit(main())
