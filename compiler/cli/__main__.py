"""`python -m compiler.cli ...` is `hgc ...` (the demo runs each step this way)."""

import sys

from compiler.cli import main

sys.exit(main())
