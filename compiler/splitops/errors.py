"""CompileError: the error a user can act on, for every stage that refuses a checkpoint at compile time.

It sits on the ground floor so that everything above it (the frontend, the passes, the lints, the
artifact writer, the command line) raises and catches the same class without importing one another.
The message says what, where (pass, node, layer, file) and how to fix it; docs/DESIGN.md lists the
failure classes and the tests that guard them.
"""

from __future__ import annotations

__all__ = ["CompileError"]


class CompileError(Exception):
    """An error the user can act on: the message says what, where, and how to fix it."""
