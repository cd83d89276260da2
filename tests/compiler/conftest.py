"""Fixtures the compiler tests share."""

from __future__ import annotations

import pytest

from testkit.traced_glue import program_factory


@pytest.fixture(scope="session")
def programs(tmp_path_factory):
    """get(family, dtype) -> {program: GraphModule}: the tiny checkpoints compiled for the CPU, each
    once per test process (testkit/traced_glue.py `program_factory`); the glue rewrites' tests take it.
    Shared by every module that takes it: its users only read the programs (each rewrite works on
    its own copy of a segment, `segment_module`)."""
    return program_factory(tmp_path_factory)
