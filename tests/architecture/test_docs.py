"""docs/DESIGN.md stays true to the repo: every test it names as a guard exists, and the repo speaks of
no file outside itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "DESIGN.md"


def test_every_guard_the_design_names_exists():
    """`tests/ROOM/test_x.py::test_y` (or a bare `test_x.py`: test file names are unique across the
    test folders) and the `::test_z` that follow it in the same list name tests of test_x.py."""
    files = {p.name: p for p in (REPO / "tests").rglob("test_*.py")}
    pairs, current = [], None
    for match in re.finditer(r"`(?:tests/(?:[\w/]+/)?)?(test_\w+\.py)(?:::(\w+))?`|`::(\w+)`", DESIGN.read_text()):
        file, test, more = match.groups()
        if file:
            current = file
            assert file in files, f"docs/DESIGN.md names {file}, which is in no folder of tests/"
        if test or more:
            pairs.append((current, test or more))
    assert len(pairs) >= 15, "the failure list names its guards"
    for file, test in pairs:
        assert f"def {test}(" in files[file].read_text(), \
            f"docs/DESIGN.md names {file}::{test}, which does not exist"


def test_the_repo_refers_to_no_file_outside_it():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    # Built from parts, so this test's own text is not itself such a reference: a parent folder's
    # "shared" (the brief beside a checkout), the phrase naming that folder, the workplace root.
    parent, beside = re.escape(".."), "shared"
    outside = re.compile(rf"{parent}/{beside}\b|{beside} folder|DESIGN\.md in the {beside}|/{'work'}/")
    bad = []
    for name in tracked:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".toml", ".sh", ".txt", ".cfg") or name == "tests/architecture/test_docs.py":
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                bad.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not bad, "references to files outside the repo:\n  " + "\n  ".join(bad)
