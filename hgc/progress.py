"""Progress bars of the command line: tqdm, on stderr, on a terminal only, never with --quiet.

The modules below the command line (models/, the compiler, runtime/) import no progress library:
the functions with long loops take a `progress` argument, a factory with tqdm's signature
(`progress(iterable, desc=..., total=..., unit=...)`, or `progress(total=...)` and `.update(n)`),
and draw nothing when it is None. `hgc` sets `args.progress = progress_bars(args)` for every
command, which hands it down.

tqdm (a dependency of transformers, tokenizers' hub client and lm-eval already, declared in
pyproject.toml) rather than our own: it handles terminal width, rate and ETA, and turns itself
off on a stream that is not a terminal (`disable=None`), so logs and pipes stay clean.
"""

from __future__ import annotations

import functools
import sys

__all__ = ["progress_bars"]


def progress_bars(args):
    """The tqdm factory for a command's `progress` arguments: None with --quiet."""
    if getattr(args, "quiet", False):
        return None
    from tqdm import tqdm

    # disable=None: off when stderr is not a terminal; leave=False: a finished bar clears its line.
    return functools.partial(tqdm, disable=None, file=sys.stderr, leave=False, dynamic_ncols=True)
