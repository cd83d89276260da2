"""A step message carries what the other ranks need to run rank 0's step: the journal, each request's
slot, cached count, in-step snapshot (position, id) and pages and tokens, and the logits rows."""

from __future__ import annotations

from runtime.cache.batch import SeqState
from runtime.dist.distributed import decode_step, encode_step


def test_a_step_message_round_trips_every_field_and_the_in_step_snapshots():
    journal = [("zero_slot", 3), ("save", [1, 2], [0, 4]), ("copy_pages", [5], [6])]
    seq_items = [(SeqState(1, [7, 8, 9], 4, snapshot=(8, 2)), [11, 12, 13, 14, 15, 16]),
                 (SeqState(2, [3], 2), [17]),
                 (SeqState(5, [], 0, snapshot=(4, 0)), [1, 2, 3, 4, 5])]
    for rows in (None, [1, 1, 2]):
        assert decode_step(encode_step(journal, seq_items, rows)) == (journal, seq_items, rows)
