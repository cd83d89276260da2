"""For every family, small size: the compiled artifact gives exactly the eager model's greedy tokens.

Same check as test_compiler_families.py (which covers tiny, mixed steps and draft programs), at
the `small` size: more layers, wider heads, more experts. Its own file to keep each file short.
"""

from __future__ import annotations

import pytest

from models.families import FAMILY_IDS
from tests.compiler.test_compiler_families import PROMPTS, _compiled, _eager, artifacts  # noqa: F401 (fixtures)

# four compiles of 8-layer models and their greedy runs: about 50 s on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_small_compiled_run_matches_eager_greedy(family, artifacts):
    ckpt, art = artifacts(family, "small")
    prompts = [PROMPTS[0], PROMPTS[1]]
    assert _compiled(art, prompts, 3) == _eager(ckpt, prompts, 3)
