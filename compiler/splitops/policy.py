"""Forward modes and capture policies: what may sit inside a captured CUDA graph.

A capture policy is part of an op's declaration (see `ops.py`), never an opt-in at a call
site: the split pass reads it to cut the graph, the lints read it to refuse a stateful op
inside a captured piece, and the runtime reads it to choose full, piecewise or eager replay.
"""

from __future__ import annotations

import enum

__all__ = ["Mode", "Capture", "MODES"]


class Mode(str, enum.Enum):
    """How a step's tokens relate to the requests in it."""

    DECODE = "decode"  # one new token per request
    EXTEND = "extend"  # prefill or chunked prefill: many tokens per request
    MIXED = "mixed"  # extend and decode requests in one step
    TARGET_VERIFY = "target_verify"  # speculative decoding: a fixed number of draft tokens per request


MODES: tuple[Mode, ...] = tuple(Mode)


class Capture(str, enum.Enum):
    """What the graph runner may do with an op in one mode."""

    CAPTURABLE = "capturable"  # may be recorded inside a CUDA graph
    EAGER = "eager"  # must run in an eager gap between captured pieces
