"""Memory planner arithmetic on published layouts; every expected number is worked out in the comments."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec
from runtime.cache.memory_planner import CacheLayout, MemoryPlanError, build_pools, plan_memory
from testkit.engine_toy import available_families

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # copies of the published configs (SOURCES.md)
GiB = 1 << 30


def qwen3_next_registry(value_heads=32, conv_channels=8192, kv_heads=2) -> LayerRegistry:
    """Qwen3-Next-80B-A3B: 48 layers, full attention at (i+1) % 4 == 0 (3, 7, ..., 47), GDN elsewhere.

    GDN: recurrent [Hv=32, Dk=128, Dv=128] f32, conv [8192 = 2*16*128 + 32*128 channels, K-1 = 3] bf16.
    Gated GQA: k, v [2 heads, 256] bf16. Shards (tensor parallel) divide heads and channels.
    """
    layers = []
    for i in range(48):
        if (i + 1) % 4 == 0:
            kv = {"k": TensorSpec((kv_heads, 256), "bfloat16"), "v": TensorSpec((kv_heads, 256), "bfloat16")}
            layers.append(LayerSpec(i, LayerKind.FULL_GQA, kv=kv))
        else:
            state = {"recurrent": TensorSpec((value_heads, 128, 128), "float32"),
                     "conv": TensorSpec((conv_channels, 3), "bfloat16")}
            layers.append(LayerSpec(i, LayerKind.GDN, state=state))
    return LayerRegistry(layers)


# Per slot: 36 GDN layers x (32*128*128*4 = 2,097,152 recurrent + 8192*3*2 = 49,152 conv) = 36 x 2,146,304.
QWEN3_NEXT_STATE = 77_266_944
# Per token: 12 GQA layers x (k + v) x 2 heads x 256 x 2 bytes = 12 x 2,048.
QWEN3_NEXT_KV = 24_576
QWEN3_NEXT_PARAMS = 81_324_862_720  # every tensor of the 41 shards (configs/SOURCES.md)


def small_registry() -> LayerRegistry:
    """One GDN layer: recurrent [2,4,4] f32 = 128 B + conv [8,3] bf16 = 48 B -> 176 B/slot.
    One GQA layer: k, v [1,8] bf16 = 16 B each -> 32 B/token (128 B per page of 4)."""
    return LayerRegistry([
        LayerSpec(0, LayerKind.GDN, state={"recurrent": TensorSpec((2, 4, 4), "float32"),
                                           "conv": TensorSpec((8, 3), "bfloat16")}),
        LayerSpec(1, LayerKind.FULL_GQA, kv={"k": TensorSpec((1, 8), "bfloat16"), "v": TensorSpec((1, 8), "bfloat16")}),
    ])


def test_layout_of_hand_built_qwen3_next():
    layout = CacheLayout.from_registry(qwen3_next_registry())
    assert layout == CacheLayout(QWEN3_NEXT_KV, QWEN3_NEXT_STATE, num_full_layers=12, num_linear_layers=36)


@pytest.mark.parametrize("family,config,kv_per_token,state_per_slot", [
    # Same numbers as the hand-built registry: the family reads the published config.
    ("qwen3_next", "qwen3_next_80b_a3b.json", QWEN3_NEXT_KV, QWEN3_NEXT_STATE),
    # 30 GDN layers x 2,146,304; 10 GQA layers + the MTP draft layer (an 11th full layer) x 2,048.
    ("qwen3_5", "qwen3_5_35b_a3b.json", 11 * 2_048, 30 * 2_146_304),
    # 20 KDA layers x (32*128*128*4 + q,k,v conv 3*4096*3*2 = 73,728); 7 MLA layers x (512 + 64) x 2 bytes.
    ("kimi_linear", "kimi_linear_48b_a3b.json", 7 * 1_152, 20 * (2_097_152 + 73_728)),
    # 16 lightning layers x 16*128*128*4; 4 softmax layers x (k + v) x 4 heads x 128 x 2 bytes.
    ("bailing_linear", "ring_mini_linear_2_0.json", 4 * 2_048, 16 * 1_048_576),
])
def test_layout_of_published_configs(family, config, kv_per_token, state_per_slot):
    if family not in available_families():
        pytest.skip(f"models/{family}.py is not there yet")
    from models.families import get_family
    fam = get_family(family)
    registry = fam.registry(fam.text_config(json.loads((CONFIGS / config).read_text())))
    layout = CacheLayout.from_registry(registry)
    assert (layout.kv_bytes_per_token, layout.state_bytes_per_slot) == (kv_per_token, state_per_slot)


def test_explicit_slots_on_an_8_gpu_shard_of_qwen3_next_80b():
    # Tensor parallel 8: 4 of 32 value heads and 1,024 of 8,192 conv channels per GPU; the 2 KV heads
    # become 1 per GPU (replicated). Per slot 36 x (4*128*128*4 + 1024*3*2) = 36 x 268,288 = 9,658,368;
    # per token 12 x 2 x 256 x 2 = 12,288 (196,608 per page of 16).
    registry = qwen3_next_registry(value_heads=4, conv_channels=1024, kv_heads=1)
    weights = QWEN3_NEXT_PARAMS * 2 // 8  # bf16, split 8 ways: 20,331,215,680
    plan = plan_memory(registry, budget_bytes=72_000_000_000,  # 90% of an 80 GB card
                       weight_bytes=weights, reserved_bytes=2_000_000_000, max_seq_len=32_768, num_slots=256)
    # available 72,000,000,000 - 20,331,215,680 - 2,000,000,000 = 49,668,784,320
    assert plan.main_state_bytes == 257 * 9_658_368 == 2_482_200_576
    assert plan.intermediate_bytes == 0
    # KV share 49,668,784,320 - 2,482,200,576 = 47,186,583,744 = 240,003 pages of 196,608 + 73,920
    assert (plan.num_slots, plan.num_pages, plan.leftover_bytes) == (256, 240_003, 73_920)
    assert plan.kv_bytes == 240_003 * 196_608
    # 32,768 tokens = 2,048 pages per request: the pages hold 117 full-length requests at once.
    assert plan.full_length_requests == 117
    assert plan.weight_bytes + plan.reserved_bytes + plan.state_bytes + plan.kv_bytes + plan.leftover_bytes == 72_000_000_000


def test_qwen3_next_80b_in_bf16_does_not_fit_one_80gb_card():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(qwen3_next_registry(), budget_bytes=80_000_000_000, weight_bytes=QWEN3_NEXT_PARAMS * 2,
                    max_seq_len=4096, state_ratio=0.5)
    # weights 162,649,725,440 + 2 slots (1 + padding) x 77,266,944 + 256 pages x 393,216 = 162,904,922,624
    assert err.value.missing_bytes == 162_904_922_624 - 80_000_000_000
    assert "82,904,922,624 bytes are missing" in str(err.value)


def test_ratio_gives_half_the_caches_to_state():
    # 10 GiB of caches, ratio 1: a state share of 5,368,709,120 bytes. (S+1) x 77,266,944 <= share:
    # 69 x 77,266,944 = 5,331,419,136 fits, 70 x ... = 5,408,686,080 does not -> S = 68.
    plan = plan_memory(qwen3_next_registry(), budget_bytes=10 * GiB, weight_bytes=0, max_seq_len=4096, state_ratio=1)
    assert plan.num_slots == 68 and plan.main_state_bytes == 5_331_419_136
    # The rest, 10,737,418,240 - 5,331,419,136 = 5,405,999,104 = 13,748 pages of 393,216 + 65,536.
    assert (plan.num_pages, plan.leftover_bytes) == (13_748, 65_536)


@pytest.mark.parametrize("draft_tokens,slots,rows,pages", [
    # share 5,368,709,120 = 69.48 slots' worth (s = 77,266,944); max_running 32.
    # D=1: S <= 32 would allow s + S*2s <= share -> S = 34 > 32, so past R: (S+1)s + 32s <= share
    #      -> S + 33 <= 69 -> S = 36; state 69 s, rest as with no drafts.
    (1, 36, 32, 13_748),
    # D=3: s + 4 S s <= share -> S = 17 (<= 32): main 18 s + intermediate 17*3 s = 69 s.
    (3, 17, 17, 13_748),
    # D=7: s + 8 S s <= share -> S = 8: main 9 s + intermediate 8*7 s = 65 s = 5,022,351,360;
    #      KV 10,737,418,240 - 5,022,351,360 = 5,715,066,880 = 14,534 pages + 65,536.
    (7, 8, 8, 14_534),
])
def test_speculative_decoding_solves_main_and_intermediate_state_jointly(draft_tokens, slots, rows, pages):
    s = QWEN3_NEXT_STATE
    plan = plan_memory(qwen3_next_registry(), budget_bytes=10 * GiB, weight_bytes=0, max_seq_len=4096,
                       state_ratio=1, draft_tokens=draft_tokens, max_running=32)
    assert (plan.num_slots, plan.intermediate_rows, plan.num_pages, plan.leftover_bytes) == (slots, rows, pages, 65_536)
    assert plan.main_state_bytes == (slots + 1) * s
    assert plan.intermediate_bytes == rows * draft_tokens * s
    # Neither over- nor under-reserved: S fits the share, S + 1 does not.
    share = 10 * GiB // 2
    rows_next = min(slots + 1, 32)
    assert plan.state_bytes <= share < (slots + 2) * s + rows_next * draft_tokens * s


def test_explicit_slots_with_drafts_reserve_intermediates_for_running_requests_only():
    s = 176
    plan = plan_memory(small_registry(), budget_bytes=100_000, weight_bytes=0, max_seq_len=10, page_size=4,
                       num_slots=8, draft_tokens=3, max_running=4)
    assert plan.main_state_bytes == 9 * s  # 8 slots + padding
    assert plan.intermediate_bytes == 4 * 3 * s  # min(8, 4) running requests x 3 drafts
    assert plan.num_pages == (100_000 - 21 * s) // 128


def test_budget_exactly_enough_vs_one_page_or_one_byte_short():
    # weights 1,000 + 2 slots x 176 + ceil(10 / 4) = 3 pages x 128 = 1,736 bytes for one request.
    kwargs = dict(weight_bytes=1_000, max_seq_len=10, page_size=4, num_slots=1)
    plan = plan_memory(small_registry(), budget_bytes=1_736, **kwargs)
    assert (plan.num_slots, plan.num_pages, plan.leftover_bytes) == (1, 3, 0)
    with pytest.raises(MemoryPlanError, match="128 bytes are missing") as err:
        plan_memory(small_registry(), budget_bytes=1_736 - 128, **kwargs)
    assert err.value.missing_bytes == 128
    with pytest.raises(MemoryPlanError, match="1 bytes are missing"):
        plan_memory(small_registry(), budget_bytes=1_735, **kwargs)


def test_exact_budget_with_a_ratio_and_drafts():
    # D = 2: 1 slot + padding (352) + 1 x 2 intermediate entries (352) = 704 state bytes; pages for
    # 10 + 2 draft tokens = 3 pages (384). A ratio of exactly 704 / 384 = 11 / 6 splits 1,088 exactly.
    plan = plan_memory(small_registry(), budget_bytes=1_000 + 704 + 384, weight_bytes=1_000, max_seq_len=10,
                       page_size=4, state_ratio=Fraction(11, 6), draft_tokens=2)
    assert (plan.num_slots, plan.intermediate_bytes, plan.num_pages, plan.leftover_bytes) == (1, 352, 3, 0)
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(small_registry(), budget_bytes=1_000 + 704 + 384 - 1, weight_bytes=1_000, max_seq_len=10,
                    page_size=4, state_ratio=Fraction(11, 6), draft_tokens=2)
    assert err.value.missing_bytes == 1


def test_a_ratio_that_starves_one_pool_says_so():
    common = dict(budget_bytes=100_000, weight_bytes=0, max_seq_len=10, page_size=4)
    with pytest.raises(MemoryPlanError, match="state_ratio 0.001 gives the state pool 99 bytes"):
        plan_memory(small_registry(), state_ratio=0.001, **common)
    with pytest.raises(MemoryPlanError, match="leaves the KV pool"):
        plan_memory(small_registry(), state_ratio=10_000, **common)


def test_minimum_of_several_requests():
    # min_requests 2: 3 slots x 176 + 2 x 3 pages x 128 = 528 + 768 = 1,296 bytes.
    plan = plan_memory(small_registry(), budget_bytes=1_296, weight_bytes=0, max_seq_len=10, page_size=4,
                       num_slots=2, min_requests=2)
    assert plan.num_pages == 6 and plan.full_length_requests == 2
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(small_registry(), budget_bytes=1_295, weight_bytes=0, max_seq_len=10, page_size=4,
                    num_slots=2, min_requests=2)
    assert err.value.missing_bytes == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one of"):
        plan_memory(small_registry(), budget_bytes=10_000, weight_bytes=0, max_seq_len=10)
    with pytest.raises(ValueError, match="exactly one of"):
        plan_memory(small_registry(), budget_bytes=10_000, weight_bytes=0, max_seq_len=10, num_slots=1, state_ratio=1)
    with pytest.raises(ValueError, match="page_size"):
        plan_memory(small_registry(), budget_bytes=10_000, weight_bytes=0, max_seq_len=10, num_slots=1, page_size=0)


def test_plan_matches_the_pools_it_builds():
    plan = plan_memory(small_registry(), budget_bytes=50_000, weight_bytes=0, max_seq_len=10, page_size=4,
                       state_ratio=0.5)
    kv_pool, state_pool = build_pools(small_registry(), plan)
    assert kv_pool.nbytes() == plan.kv_bytes and state_pool.nbytes() == plan.main_state_bytes
    assert (kv_pool.num_pages, state_pool.num_slots) == (plan.num_pages, plan.num_slots)
    assert plan.budget_bytes == plan.weight_bytes + plan.state_bytes + plan.kv_bytes + plan.leftover_bytes


def test_a_kv_dtype_override_is_planned_and_built():
    # fp8 K/V: 16 B/token instead of 32, so 64 B pages. 10,000 - 2 x 176 state = 9,648 = 150 pages + 48.
    plan = plan_memory(small_registry(), budget_bytes=10_000, weight_bytes=0, max_seq_len=10, page_size=4,
                       num_slots=1, kv_dtype=torch.float8_e4m3fn)
    assert (plan.page_bytes, plan.num_pages, plan.leftover_bytes, plan.kv_dtype) == (64, 150, 48, "float8_e4m3fn")
    kv_pool, _ = build_pools(small_registry(), plan)
    assert kv_pool.nbytes() == plan.kv_bytes


def test_table_is_readable():
    plan = plan_memory(qwen3_next_registry(), budget_bytes=10 * GiB, weight_bytes=0, max_seq_len=4096,
                       state_ratio=1, draft_tokens=3, max_running=32)
    table = plan.table()
    assert "state: intermediate" in table and "17 requests x 3 draft tokens" in table
    assert "13748 pages x 16 tokens" in table and "5,405,933,568" in table
    assert json.dumps(plan.to_json())  # serialisable for `hgc run --json`


def test_the_snapshot_pool_takes_its_share_first_and_is_built_as_planned():
    from runtime.cache.memory_planner import build_snapshot_pool

    # 10,000 available; a 0.1 share is 1,000 B = 5 snapshots of 176 B (880 B). The rest, 9,120:
    # 2 x 176 for the slot and the padding slot, then (9,120 - 352) // 128 = 68 pages + 64 left.
    plan = plan_memory(small_registry(), budget_bytes=10_000, weight_bytes=0, max_seq_len=10, page_size=4,
                       num_slots=1, snapshot_share=0.1)
    assert (plan.num_snapshots, plan.snapshot_bytes, plan.num_pages, plan.leftover_bytes) == (5, 880, 68, 64)
    assert plan.budget_bytes == plan.weight_bytes + plan.state_bytes + plan.kv_bytes + plan.leftover_bytes
    assert "5 prefix-cache snapshots" in plan.table()
    assert build_snapshot_pool(small_registry(), plan).nbytes() == plan.snapshot_bytes
    # Qwen3-Next at 60 GiB for weights and caches: 6 GiB of snapshots is 83 of 77,266,944 B each.
    big = plan_memory(qwen3_next_registry(), budget_bytes=60 * GiB, weight_bytes=0, max_seq_len=4096, num_slots=16,
                      snapshot_share=0.1)
    assert big.num_snapshots == int(6 * GiB // QWEN3_NEXT_STATE) == 83


def test_a_snapshot_share_that_leaves_too_little_is_refused_by_name():
    with pytest.raises(MemoryPlanError, match=r"5 snapshots \(snapshot_share 0\.5\)"):
        plan_memory(small_registry(), budget_bytes=2_000, weight_bytes=0, max_seq_len=40, page_size=4, num_slots=1,
                    snapshot_share=0.5)
    with pytest.raises(ValueError, match="snapshot_share must be in"):
        plan_memory(small_registry(), budget_bytes=2_000, weight_bytes=0, max_seq_len=4, num_slots=1, snapshot_share=1)
