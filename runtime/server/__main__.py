"""`python -m runtime.server ARTIFACT [flags]`: `hgc serve` without the hgc entry point."""

import sys

from runtime.server.cli import main

sys.exit(main())
