"""Which tree's runtime/ a host benchmark measures: `--code-root DIR` (a baseline commit's code, unpacked
by the benchmark's --baseline-ref run), else this checkout. Read from argv before anything of runtime/
is imported, so the tree it names is first on sys.path."""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def code_root(argv: list[str]) -> Path:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--code-root", default=None)
    known, _ = pre.parse_known_args(argv)
    return Path(known.code_root).resolve() if known.code_root else CHECKOUT


def unpacked(ref: str, folder: Path) -> Path:
    """GITREF's tree (`git archive` of this checkout's repository) in `folder`, unpacked once: the
    code a benchmark's --baseline-ref run measures, passed to it as --code-root."""
    folder = Path(folder)
    if not folder.is_dir():
        archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=CHECKOUT, check=True,
                                 capture_output=True).stdout
        folder.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as t:
            t.extractall(folder)
    return folder
