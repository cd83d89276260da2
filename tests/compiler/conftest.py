"""Fixtures the compiler tests share."""

from __future__ import annotations

import pytest

from testkit.traced_glue import program_factory


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """get(family, dtype) -> {program: GraphModule}: the tiny checkpoints compiled for the CPU, each
    once per test module (testkit/traced_glue.py `program_factory`); the glue rewrites' tests take it."""
    return program_factory(tmp_path_factory)
