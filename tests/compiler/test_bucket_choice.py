"""Extend buckets chosen from measured costs (compiler/bucket_choice.py): the rule, and a costs
file refused with a line naming the file and field."""

from __future__ import annotations

import json

import pytest

from compiler.bucket_choice import choose_extend_buckets, read_bucket_costs
from compiler.splitops.artifact import ArtifactFormatError, BucketCosts, bucket_costs_doc, parse_bucket_costs


def costs(**by_tokens) -> BucketCosts:
    return BucketCosts("H200", tuple(sorted((int(t[1:]), ms) for t, ms in by_tokens.items())))


def test_a_bucket_is_kept_where_it_saves_a_tenth_over_the_next_kept_one():
    # 16 costs as much as 32 (launch-bound): padding to 32 loses nothing, so it is not captured
    assert choose_extend_buckets(costs(t16=1.9, t32=2.0, t64=2.6, t128=3.9, t256=8.0, t512=9.0)) == (32, 64, 128, 256, 512)
    # 256 saves less than a tenth over 512: dropped, and 128 is then compared with 512
    assert choose_extend_buckets(costs(t128=6.0, t256=8.5, t512=9.0)) == (128, 512)
    assert choose_extend_buckets(costs(t16=5.0, t4096=4.0)) == (4096,), "the largest is always kept"
    assert choose_extend_buckets(costs(t16=1.0, t32=1.0), min_saving=0.0) == (16, 32)


def test_the_costs_document_round_trips_and_bad_fields_are_named(tmp_path):
    c = BucketCosts("NVIDIA H200", ((16, 0.9), (256, 8.0)), ((1, 1.1),))
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(bucket_costs_doc(c, model="qwen3_next bench")))
    assert read_bucket_costs(path) == c
    assert parse_bucket_costs(c.to_json(), "manifest") == c
    for doc, field in (({**c.to_json(), "format": "other"}, "format"),
                       ({"format": "hgc-bucket-costs", "extend_ms": {"16": 1.0}}, "device"),
                       ({"format": "hgc-bucket-costs", "device": "x", "extend_ms": {}}, "extend_ms"),
                       ({"format": "hgc-bucket-costs", "device": "x", "extend_ms": {"16": -1}}, "extend_ms"),
                       ({"format": "hgc-bucket-costs", "device": "x", "extend_ms": {"16": 1}, "decode_ms": []},
                        "decode_ms")):
        path.write_text(json.dumps(doc))
        with pytest.raises(ArtifactFormatError, match=rf"costs.json: field '{field}'"):
            read_bucket_costs(path)
