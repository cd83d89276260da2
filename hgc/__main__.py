"""`python -m hgc ...` is `hgc ...` (the demo runs each step this way)."""

import sys

from hgc import main

sys.exit(main())
