"""``python -m server [serve] [MODEL] [flags]``."""

import sys

from server.cli import main

sys.exit(main())
