"""``python -m server [serve] [MODEL] [flags]``."""

import sys

from server.cli import main

if __name__ == "__main__":  # tensor-parallel workers are spawned: they re-import this
    sys.exit(main())
