"""Graph runner on the CPU: the dispatcher's choice of key, padding into static buffers, the
refusals, and the whole start-up (capture, parity, replayed steps, the engine on a runner) with
testkit/graph_cases.RerunGraphs standing in for CUDA graphs. Real capture needs CUDA:
tests/gpu/test_gpu_graphs.py (marked gpu) covers it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hgc import main
from compiler.splitops import OP_SPECS, Mode, op_arguments
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState, commit_step
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import make_pools
from runtime.cache.state_pool import PADDING_SLOT
from runtime.graphs.runner import (KERNEL_VARIANT_REQUEST_TOKENS, KERNEL_VARIANT_TOKENS, CaptureError, CaptureKey,
                                   GraphRunner, ParityError)
from runtime.graphs.parity import CacheWatch, OpRecord, first_difference, rel_err
from runtime.graphs.startup_parity import check_parity, parity_items, release_items
from runtime.graphs.step_runner import EagerRunner
from testkit.graph_cases import RerunGraphs, greedy
from runtime.artifact.loader import LoadError, load_artifact
from runtime.backends.flashinfer_attention import FlashInferAttentionBackend
from testkit.helpers import edit_routing, shared_artifact

OP_NAMES = frozenset(OP_SPECS)

# the tiny configs traced once, compiles on copies; each artifact deserialized once, loads of copies
pytestmark = pytest.mark.usefixtures("shared_traces", "shared_loads", "one_thread")

FULL_DEFAULTS = FlashInferAttentionBackend.capability.resolve_options({})


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The test run's tiny qwen3_next (testkit/helpers.shared_artifact), loaded: its files are only read."""
    return load_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1])


def make_runner(art, decode=(1, 2, 4), extend=(32, 64), graphs=None, decode_graphs="full"):
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=decode, extend_buckets=extend,
                         max_pages_per_seq=16, extend_max_seqs=4, debug=True, graphs=graphs,
                         decode_graphs=decode_graphs)
    return runner, kv, st


def test_keys_pick_the_smallest_bucket_and_eager_above_the_largest(artifact):
    runner, _, _ = make_runner(artifact)
    assert runner.key_for(Mode.DECODE, 3, 3) is None, "nothing is captured before capture()"
    runner.sealed = True  # as after capture(): the dispatcher's table alone is under test here
    assert runner.key_for(Mode.DECODE, 3, 3) == CaptureKey(Mode.DECODE, 4, 4)
    assert runner.key_for(Mode.DECODE, 5, 5) is None
    assert runner.key_for(Mode.EXTEND, 40, 2) == CaptureKey(Mode.EXTEND, 64, 4)
    assert runner.key_for(Mode.EXTEND, 40, 1) == CaptureKey(Mode.EXTEND, 64, 1), "one request: the bucket's one-row key"
    assert runner.key_for(Mode.MIXED, 20, 3) == CaptureKey(Mode.EXTEND, 32, 4)
    assert runner.key_for(Mode.EXTEND, 65, 1) is None
    assert runner.key_for(Mode.EXTEND, 20, 5) is None, "more requests than the extend graphs hold: eager"


def test_capture_needs_cuda_and_happens_once(artifact):
    runner, _, _ = make_runner(artifact)
    with pytest.raises(CaptureError, match="need a CUDA device"):
        runner.capture()
    runner.sealed = True
    with pytest.raises(CaptureError, match="capture after start-up"):
        runner.capture()


def test_padded_static_step_gives_the_unpadded_tokens(artifact):
    """Steps padded to a key's shape (reserved slot, no KV writes, dummy logits rows) give the
    unpadded step's logits for the real requests."""
    runner, kv, st = make_runner(artifact)
    ref_runner, ref_kv, ref_st = make_runner(artifact)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    seqs = [SeqState(st.alloc()) for _ in prompts]
    ref_seqs = [SeqState(ref_st.alloc()) for _ in prompts]
    pending = [list(p) for p in prompts]
    for _ in range(4):
        items = list(zip(seqs, pending))
        step, _ = runner.build(items)
        key = CaptureKey(step.ctx.mode if step.ctx.mode == Mode.DECODE else Mode.EXTEND,
                         4 if step.ctx.mode == Mode.DECODE else 32, 4)
        from runtime.cache.batch import build_step
        padded = build_step(items, kv, "cpu", mode=step.ctx.mode, pad_tokens_to=key.tokens, pad_seqs_to=key.seqs,
                            max_pages=16)
        got = runner.run(padded, None)  # eager, at the key's padded shape
        ref_items = list(zip(ref_seqs, pending))
        ref_step, _ = ref_runner.build(ref_items)
        want = ref_runner.run(ref_step, None)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        commit_step(items)
        commit_step(ref_items)
        pending = [[int(t)] for t in want.argmax(-1)]
    assert runner.counters["eager_steps"] + runner.counters["piecewise_steps"] == 4


def test_static_buffers_take_each_key_in_one_packed_copy(artifact):
    """Each key's fields lie back to back in the block, the int64 ones then the int32 ones (each
    starting 16-byte aligned), so one copy of its used bytes sends a step; a smaller key after a
    larger one leaves no stale row in what it reads, and a step not padded to its key is refused."""
    from runtime.cache.batch import build_step

    runner, kv, st = make_runner(artifact)
    staging = runner.staging
    seqs = [SeqState(st.alloc(), num_cached=0) for _ in range(3)]
    big = build_step([(s, [7] * 9) for s in seqs], kv, "cpu", pad_tokens_to=32, pad_seqs_to=4, max_pages=16)
    inputs, ctx = runner._fill(big, CaptureKey(Mode.EXTEND, 32, 4))
    _, dev, used = staging.views(32, 4)
    # per token: ids, positions, slot mapping; per request: logits rows, state slots, snapshot rows and ids;
    # query_start_loc's 5 rows padded to 8 so seq_lens starts 16-byte aligned
    assert used == (3 * 32 + 4 * 4) * 8 + (8 + 4 + 4 * 16) * 4, "bytes"
    assert dev["positions"].data_ptr() == dev["input_ids"].data_ptr() + 32 * 8, "packed back to back"
    assert dev["query_start_loc"].data_ptr() == dev["input_ids"].data_ptr() + (3 * 32 + 4 * 4) * 8, \
        "the int32 fields right after the int64 ones"
    assert inputs[0].data_ptr() == dev["input_ids"].data_ptr() and ctx.page_table.data_ptr() == dev["page_table"].data_ptr()
    assert torch.equal(ctx.slot_mapping, big.ctx.slot_mapping) and torch.equal(ctx.page_table, big.ctx.page_table)
    assert inputs[2].tolist() == [8, 17, 26, 0], "the padded request's logits row reads row 0"

    one = SeqState(st.alloc(), pages=kv.alloc(1), num_cached=3)
    small = build_step([(one, [5])], kv, "cpu", pad_tokens_to=1, pad_seqs_to=1, max_pages=16)
    inputs, ctx = runner._fill(small, CaptureKey(Mode.DECODE, 1, 1))
    assert inputs[0].tolist() == [5] and inputs[1].tolist() == [3] and ctx.seq_lens.tolist() == [4]
    assert ctx.page_table.tolist() == [[one.pages[0]] + [0] * 15], "no column left from the larger step"

    unpadded = build_step([(s, [7] * 9) for s in seqs], kv, "cpu", max_pages=16)
    with pytest.raises(CaptureError, match="input_ids has 27 rows for 32"):
        runner._fill(unpadded, CaptureKey(Mode.EXTEND, 32, 4))


def test_gpu_backend_facts_come_from_the_graph(tmp_path):
    """What FlashInfer is built with, on the CPU: per-layer q heads, scales and dtype read off a
    cuda-target artifact's graph (the calls routing.json routes to it), every pooled full layer (the
    draft's too) found there; and a routing.json edited to bind a head dim FlashInfer does not build
    is refused at start-up, naming the layer, before any kernel is asked."""
    from runtime.backends.flashinfer_attention import full_layer_options
    from runtime.backends.protocol import BackendSetup
    from runtime.artifact.binding import build_backends, routed_calls
    from compiler.splitops import call_facts
    from testkit.helpers import tiny_checkpoint

    tiny_checkpoint("qwen3_next", tmp_path / "c", head_dim=64)
    assert main(["compile", str(tmp_path / "c"), "-o", str(tmp_path / "a"), "--target", "cuda", "--dtype",
                 "bfloat16", "--no-dumps", "--no-inductor"]) == 0
    art = load_artifact(tmp_path / "a")
    calls = [call_facts(node) for program, ep in art.programs.items()
             for entry, node in routed_calls(art.docs, program, ep.graph_module) if entry.backend == "flashinfer"]
    kv, st = make_pools(art.registry, 64, 2, page_size=8)
    options = full_layer_options(BackendSetup(kv, st, torch.device("cuda"), tuple(calls), {}))
    assert options["layers"] == sorted(kv.buffers), "every pooled full layer (the draft's too) is found in a graph"
    assert options["q_dtype"] == torch.bfloat16
    for layer_id in options["layers"]:
        k = kv.buffers[layer_id]["k"]
        assert options["q_heads"][layer_id] % k.shape[2] == 0
        assert options["scales"][layer_id] == pytest.approx(k.shape[-1] ** -0.5)

    tiny_checkpoint("qwen3_next", tmp_path / "hd32")  # tiny: head_dim 32, which FlashInfer does not build
    assert main(["compile", str(tmp_path / "hd32"), "-o", str(tmp_path / "b"), "--target", "cuda", "--dtype",
                 "bfloat16", "--no-dumps", "--no-inductor", "--route", "gqa_attention=torch_reference"]) == 0
    edit_routing(tmp_path / "b", lambda e: {**e, "backend": "flashinfer", "options": FULL_DEFAULTS}
                  if e["op"] == "gqa_attention" else e)
    edited = load_artifact(tmp_path / "b")
    kv, st = make_pools(edited.registry, 64, 2, page_size=8)
    with pytest.raises(LoadError, match=r"binds layer 3 \(main program, node gqa_attention, hgc.gqa_attention\) to "
                                        r"flashinfer, which this runtime cannot bind: flashinfer q dim -1 is 32, it "
                                        r"takes \[64, 128, 256\]"):
        build_backends(edited.docs, edited.programs, kv, st, "cuda")


def test_start_up_then_replayed_steps_give_the_eager_tokens(artifact):
    """capture (largest first, full decode graphs, piecewise extend), parity, then greedy steps
    through the dispatcher equal the eager tokens; nothing stays held; a second capture is refused."""
    runner, kv, st = make_runner(artifact, graphs=RerunGraphs())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], list(range(9, 30))]
    eager, keys = greedy(runner, st, prompts, 6)
    assert all(k is None for k in keys)
    free_slots, free_pages = st.num_free, kv.num_free
    report = runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])
    assert runner.sealed and runner.full_decode
    assert [str(k) for k in runner.keys] == [str(k) for k in runner.capture_keys()]
    assert [(k.tokens, k.seqs) for k in runner.keys] == [(4, 4), (2, 2), (1, 1), (64, 4), (64, 1), (32, 4), (32, 1)], \
        "largest first, decode then extend"
    assert set(report) == {str(k) for k in runner.keys} and max(report.values()) < 1e-5
    assert (st.num_free, kv.num_free) == (free_slots, free_pages), "capture and parity hold nothing afterwards"
    before = dict(runner.counters)
    graph, keys = greedy(runner, st, prompts, 6)
    assert graph == eager
    assert keys[0] == CaptureKey(Mode.EXTEND, 32, 4) and keys[1] == CaptureKey(Mode.DECODE, 4, 4)
    assert runner.counters["graph_replays"] - before["graph_replays"] == 5
    assert runner.counters["piecewise_steps"] - before["piecewise_steps"] == 1
    with pytest.raises(CaptureError, match="capture after start-up"):
        runner.capture()


class VariantBackend(CPUReferenceBackend):
    """The reference backend, naming two token counts whose eager steps pick kernels of their own."""

    def __init__(self, *args, counts=(3, 40), **kwargs):
        super().__init__(*args, **kwargs)
        self.counts, self.asked, self.eager_steps = counts, [], []

    def kernel_variant_tokens(self, max_tokens):
        self.asked.append(max_tokens)
        return self.counts

    def init_step_metadata(self, ctx):
        self.eager_steps.append((ctx.mode, ctx.num_tokens, ctx.num_seqs, ctx.state_slots.tolist()))
        super().init_step_metadata(ctx)


def test_capture_runs_one_eager_step_of_each_kernel_variant_count(artifact):
    """After the captures, one eager extend step of each count the backend names (up to
    KERNEL_VARIANT_TOKENS, past the step budget), its requests each within the budget, on the
    padding slot: no slot, page or counter of serving changes."""
    kv, st = make_pools(artifact.registry, 128, 8, page_size=8)
    backend = VariantBackend(kv, st)
    ops = BoundOps(backend)
    runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cpu", decode_buckets=(1, 2), extend_buckets=(32,),
                         max_pages_per_seq=4, extend_max_seqs=4, graphs=RerunGraphs(), chunk_size=16)
    free = (st.num_free, kv.num_free)
    runner.capture()
    assert backend.asked == [KERNEL_VARIANT_TOKENS]
    # a request carries at most 16 tokens (the budget; 4 pages of 8 would hold 32): 40 tokens take three
    variant_steps = [s for s in backend.eager_steps if s[1] in (3, 40)]
    assert [(m, t, b) for m, t, b, _ in variant_steps] == [(Mode.EXTEND, 3, 1), (Mode.EXTEND, 40, 3)]
    assert all(slot == PADDING_SLOT for *_, slots in variant_steps for slot in slots)
    assert (st.num_free, kv.num_free) == free and runner.counters["eager_steps"] == 0
    assert runner.variant_steps[0] == (3, 40)


@pytest.mark.parametrize("tuning", [True, False])
def test_a_tuning_step_runs_the_largest_extend_bucket_eagerly_before_any_capture(artifact, tuning):
    """With tuning_step (a build's start-up) the first forward of capture() is the largest extend
    key's step, eagerly, so kernels that time their candidates at first launch time them there; on
    the padding slot: no slot, page or counter of serving changes. Without it the largest decode
    bucket's capture comes first and no extra step runs."""
    kv, st = make_pools(artifact.registry, 128, 8, page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cpu", decode_buckets=(1, 2), extend_buckets=(16, 32),
                         max_pages_per_seq=4, extend_max_seqs=4, graphs=RerunGraphs(), tuning_step=tuning)
    forwards = []  # (tokens, whether inside a capture) of each forward, in order
    call = runner._call

    def recording_call(module, inputs):
        ids = dict(zip(runner.input_names, inputs))["input_ids"]
        forwards.append((ids.shape[0], runner.graphs.inside))
        return call(module, inputs)

    runner._call = recording_call
    free = (st.num_free, kv.num_free)
    runner.capture()
    if tuning:
        extend_keys = [k for k in runner.keys if k.mode == Mode.EXTEND]
        assert runner.tuned_on == max(extend_keys, key=lambda k: (k.tokens, k.seqs)) and runner.tuned_on.tokens == 32
        assert forwards[0] == (32, False)
    else:
        assert runner.tuned_on is None and forwards[0][0] == 2
    assert (st.num_free, kv.num_free) == free and runner.counters["eager_steps"] == 0


def test_piecewise_decode_runs_the_extend_pieces_and_gives_the_eager_tokens(artifact):
    runner, kv, st = make_runner(artifact, decode=(2, 4), extend=(32,), graphs=RerunGraphs(),
                                 decode_graphs="piecewise")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    eager, _ = greedy(runner, st, prompts, 4)
    runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])
    assert not runner.full_decode
    graph, keys = greedy(runner, st, prompts, 4)
    assert graph == eager and keys[1] == CaptureKey(Mode.DECODE, 2, 2)
    assert runner.counters["graph_replays"] == 0 and runner.counters["piecewise_steps"] >= 4
    extend_pieces = runner.program.plans[Mode.EXTEND].pieces
    assert sum(p.kind == "captured" for p in extend_pieces) > 1, "decode ran pieces with eager gaps"


def runner_wrong_in_graphs(artifact, graphs, wrong):
    """A runner over a reference backend whose gqa_attention output is halved where wrong(ctx) holds,
    inside a capture or a replay only."""
    class WrongInGraphs(CPUReferenceBackend):
        def gqa_attention(self, ctx, q, k, v, out, layer_id, scale):
            super().gqa_attention(ctx, q, k, v, out, layer_id, scale)
            if graphs.inside and wrong(ctx):
                out.mul_(0.5)

    kv, st = make_pools(artifact.registry, 128, 8, page_size=8)
    ops = BoundOps(WrongInGraphs(kv, st))
    runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cpu", decode_buckets=(1, 2, 4), extend_buckets=(32,),
                         max_pages_per_seq=16, extend_max_seqs=4, graphs=graphs)
    return runner, kv


def test_start_up_parity_refuses_a_replay_that_differs(artifact):
    """A graph whose replay differs from eager stops the start-up, naming the mode and bucket."""
    graphs = RerunGraphs()
    runner, _ = runner_wrong_in_graphs(artifact, graphs, lambda ctx: ctx.mode == Mode.DECODE and ctx.num_seqs == 2)
    with pytest.raises(ParityError, match=r"decode\[tokens=2, seqs=2\] with 1 real request.*replay against padded eager.*"
                                          r"first differing: layer \d+ \(gqa_attention.*refusing to serve"):
        runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])


def test_parity_names_the_first_differing_layer(artifact):
    """A backend whose captured ops misbehave only when replayed: the error names that layer's op."""
    graphs = RerunGraphs()
    runner, kv = runner_wrong_in_graphs(artifact, graphs, lambda ctx: True)
    full_layer = next(iter(kv.buffers))
    with pytest.raises(ParityError, match=rf"first differing: layer {full_layer} \(gqa_attention"):
        runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])


class LeaksPadding(CPUReferenceBackend):
    """A linear-attention core with a padding fault: the rows past the real ones (padding, present
    only in a padded step) run through the recurrence of the first request's slot, as a kernel that
    treated the padding as part of the last sequence would. Padded and unpadded, the real rows'
    outputs are the same; the state left in the real slot is not."""

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        super().gdn_core(ctx, q, k, v, g, beta, out, layer_id, scale)
        n = ctx.num_real_tokens
        if n < q.shape[0]:
            from runtime.backends.cpu_reference import gated_recurrence
            state = self.state_pool.layer(layer_id)["recurrent"][int(ctx.state_slots[0])]
            rep = v.shape[1] // q.shape[1]
            gated_recurrence(q[n:].repeat_interleave(rep, 1), k[n:].repeat_interleave(rep, 1), v[n:],
                             g[n:].unsqueeze(-1), beta[n:], state, scale)


def test_start_up_parity_refuses_a_padding_leak_that_padded_eager_hides(artifact):
    """DESIGN.md failure 8. A backend that writes padding rows into a real request's slot gives the
    same result padded in a graph and padded eagerly (the old check's comparison: it passes), but not
    unpadded: the start-up check refuses it, naming the state and the layer."""
    from runtime.cache.batch import build_step

    kv, st = make_pools(artifact.registry, 128, 8, page_size=8)
    ops = BoundOps(LeaksPadding(kv, st))
    runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cpu", decode_buckets=(), extend_buckets=(32,),
                         max_pages_per_seq=16, extend_max_seqs=4, graphs=RerunGraphs())
    runner.capture()
    vocab = artifact.manifest["model"]["vocab_size"]
    key = CaptureKey(Mode.EXTEND, 32, 4)
    # The old comparison: the same padded step eagerly and replayed, from the same caches.
    items = parity_items(runner, key, vocab, torch.Generator().manual_seed(0))
    try:
        padded = build_step(items, kv, "cpu", mode=Mode.EXTEND, pad_tokens_to=32, pad_seqs_to=4, max_pages=16)
        watch = CacheWatch(kv, st, [seq.slot for seq, _ in items], [p for seq, _ in items for p in seq.pages])
        eager = runner.run(padded, None).clone()
        eager_written = watch.written()
        watch.restore()
        replay = runner.run(padded, key).clone()
        assert rel_err(replay, eager) < 1e-5
        assert watch.differences(eager_written, watch.written(), rtol=1e-5) is None
    finally:
        release_items(runner, items)
    linear = min(st.buffers)
    with pytest.raises(ParityError, match=rf"extend\[tokens=32, seqs=4\].*unpadded against padded eager: written for a "
                                          rf"real request: layer {linear}'s recurrent state in slot \d+.*refusing"):
        check_parity(runner, vocab_size=vocab)


def test_start_up_parity_names_an_op_whose_real_rows_change_when_padded(artifact):
    """An attention op that lets padding rows into real rows' outputs (in every padded step, eager or
    replayed): the op-by-op comparison on the same inputs names its layer."""
    class MixesPaddingIn(CPUReferenceBackend):
        def gqa_attention(self, ctx, q, k, v, out, layer_id, scale):
            super().gqa_attention(ctx, q, k, v, out, layer_id, scale)
            n = ctx.num_real_tokens
            if n < q.shape[0]:
                out[:n] += q[n:].float().mean(0).to(out.dtype) + 1.0

    kv, st = make_pools(artifact.registry, 128, 8, page_size=8)
    ops = BoundOps(MixesPaddingIn(kv, st))
    runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cpu", decode_buckets=(), extend_buckets=(32,),
                         max_pages_per_seq=16, extend_max_seqs=4, graphs=RerunGraphs())
    full_layer = next(iter(kv.buffers))
    with pytest.raises(ParityError, match=rf"unpadded against padded eager, op by op: first differing: layer "
                                          rf"{full_layer} \(gqa_attention, rel err [0-9.e+-]+ on the same inputs\)"):
        runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])
    # the refused key's op-by-op record stays readable (benchmarks/probes/parity_drift_probe.py reads it)
    (record,) = runner.parity.errors.values()
    worst = max(record["per_op"], key=lambda r: r["op_err"])
    assert (worst["layer"], worst["op"]) == (full_layer, "gqa_attention") and worst["op_err"] > 1e-3


def test_start_up_parity_refuses_a_write_to_the_padding_slot(artifact):
    """Padded requests sit on the reserved slot, which no kernel may write: a backend that stores
    into it is refused even though every real row is right."""
    class WritesPaddingSlot(CPUReferenceBackend):
        def short_conv(self, ctx, x, weight, bias, out, layer_id, silu):
            super().short_conv(ctx, x, weight, bias, out, layer_id, silu)
            if ctx.num_seqs > ctx.num_real_seqs:
                self.state_pool.layer(layer_id)["conv"][int(ctx.state_slots[-1])] += 1.0

    kv, st = make_pools(artifact.registry, 128, 8, page_size=8)
    ops = BoundOps(WritesPaddingSlot(kv, st))
    runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cpu", decode_buckets=(4,), extend_buckets=(),
                         max_pages_per_seq=16, extend_max_seqs=4, graphs=RerunGraphs())
    with pytest.raises(ParityError, match=r"decode\[tokens=4, seqs=4\] with 3 real.*the replay touched the "
                                          r"padding slot's conv state of layer \d+"):
        runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])


def test_engine_on_a_started_runner_gives_the_eager_engine_tokens(artifact):
    """The engine's steps through the runner's dispatcher: same tokens as the eager engine, steps
    counted as graph replays, piecewise or eager in its stats."""
    from runtime.engine.engine import Engine, SamplingParams

    prompts = [list(range(1, 12)), [5, 6, 7], list(range(40, 90)), [3] * 7, [9, 8, 7, 6, 5]]
    params = SamplingParams(max_new_tokens=9)

    def serve(runner_too: bool):
        runner, kv, st = make_runner(artifact, graphs=RerunGraphs() if runner_too else None)
        runner.chunk_size = 64
        if runner_too:
            runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])
        steps = runner if runner_too else EagerRunner(artifact.bind(runner.ops), runner.ops, kv, "cpu", 64)
        engine = Engine(steps, kv, st, max_tokens_per_step=64, max_running=4)
        ids = [engine.add_request(p, params) for p in prompts]
        results = engine.run_until_done()
        return [results[i].output_ids for i in ids], engine.stats()

    want, _ = serve(False)
    got, stats = serve(True)
    assert got == want
    assert stats["graph_replays"] > 0 and stats["piecewise_steps"] > 0
    assert stats["graph_replays"] + stats["piecewise_steps"] + stats["eager_steps"] >= stats["steps"]


@pytest.mark.parametrize("in_step", [False, True])
def test_prefix_cache_on_a_started_runner_gives_the_eager_engine_tokens(artifact, in_step):
    """Requests that reuse cached prefixes while steps replay graphs: the shared pages are page
    ids in the static page table, the snapshots are copied outside the graphs, or, `in_step`, written
    by the replayed step at the rows the static tables name (the first prompt's last page boundary,
    16, inside its chunk); the tokens equal those of the eager engine without a cache."""
    from runtime.engine.engine import Engine, SamplingParams
    from runtime.cache.prefix_cache import PrefixCache
    from runtime.cache.snapshot_pool import SnapshotPool

    system = list(range(10, 31))  # 21 tokens: two pages of 8 and a part
    prompts = [system + [40], system + [41, 41], system, system + [7, 7, 7]]
    params = SamplingParams(max_new_tokens=4)

    def serve(cached: bool):
        kv, st = make_pools(artifact.registry, 512, 8, page_size=8)
        snapshots = SnapshotPool(artifact.registry, 8)
        ops = BoundOps(CPUReferenceBackend(kv, st, snapshots=snapshots if in_step else None))
        runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cpu", decode_buckets=(1,), extend_buckets=(32,),
                             max_pages_per_seq=16, extend_max_seqs=1, graphs=RerunGraphs() if cached else None)
        runner.chunk_size = 32
        if cached:
            runner.start(vocab_size=artifact.manifest["model"]["vocab_size"])
        cache = PrefixCache(kv, st, snapshots) if cached else None
        steps = runner if cached else EagerRunner(artifact.bind(ops), ops, kv, "cpu", 32)
        engine = Engine(steps, kv, st, max_tokens_per_step=32, max_running=1, prefix_cache=cache)
        assert cache is None or cache.in_step == in_step
        outputs = []
        for prompt in prompts:  # one after another, so each finds what the earlier ones cached
            outputs.append(engine.generate(prompt, params))
        return outputs, engine.stats()

    want, _ = serve(False)
    got, stats = serve(True)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.cached_tokens for r in got] == [0, 16, 16, 16], "the system prompt's two whole pages"
    assert stats["graph_replays"] > 0 and stats["piecewise_steps"] > 0
    assert stats["prefill_steps"] == 4 + (not in_step), "the first prompt's snapshot at 16 splits its chunk"


def test_buckets_are_clipped_to_what_the_engine_can_send():
    from runtime.graphs.runner import buckets_for
    assert buckets_for((1, 2, 4, 8, 16), (256, 512, 1024), max_running=5, token_budget=512) == ((1, 2, 4, 8), (256, 512))
    assert buckets_for((1, 2, 4), (64, 128), max_running=8, token_budget=100) == ((1, 2, 4), (64, 128))
    assert buckets_for((1, 2, 4), (64, 128, 256), max_running=3, token_budget=512, max_seq_len=20) == ((1, 2, 4), (64,))


def test_extend_graphs_hold_every_running_request_a_mixed_step_can_carry():
    from runtime.graphs.buckets import extend_seqs
    assert extend_seqs(64, (256, 512)) == 64, "64 decodes beside a prefill chunk still replay"
    assert extend_seqs(300, (256, 512)) == 300, "the 512-token bucket holds 300 (the 256-token one 256: extend_rows)"
    assert extend_seqs(600, (256, 512)) == 512, "a 512-token bucket holds at most 512 requests"
    assert extend_seqs(8, ()) == 8


def test_engine_for_artifact_with_a_graph_runner_on_a_small_pool(artifact):
    """engine_for_artifact with a started GraphRunner, as `hgc serve` / `hgc run` build it on CUDA:
    3 slots and 1-page requests, fewer pages than the largest bucket has rows; same tokens as eager."""
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.engine.engine import SamplingParams

    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23]]
    options = EngineOptions(slots=3, page_size=16)
    outs = []
    for graphs in (False, RerunGraphs()):
        engine = engine_for_artifact(artifact, options, 15, graphs=graphs)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
        results = engine.run_until_done()
        outs.append([results[i].output_ids for i in ids])
    assert isinstance(engine.runner, GraphRunner) and engine.kv_pool.num_pages == 3
    assert [str(k) for k in engine.runner.keys][:3] == ["decode[tokens=4, seqs=4]", "decode[tokens=2, seqs=2]",
                                                          "decode[tokens=1, seqs=1]"]
    assert engine.stats()["graph_replays"] > 0
    assert outs[0] == outs[1]


def test_a_run_with_short_requests_lays_the_kernel_variant_steps_out_as_a_build(artifact):
    """`hgc run` sizes max_seq_len to its prompts (here 15 tokens: one page); the build's start-up has a
    long one. Their eager kernel-variant steps must still be the same shapes, or the run launches
    kernel variants (a conv tile chosen by the request count) that the bundle lacks."""
    from runtime.assembly import EngineOptions, engine_for_artifact

    steps = {}
    for max_len in (15, 2048):
        made = []

        def factory(kv, st):
            made.append(VariantBackend(kv, st, counts=(3, 200)))
            return made[-1]

        engine_for_artifact(artifact, EngineOptions(slots=3, page_size=16, token_budget=256), max_len,
                            graphs=RerunGraphs(), backend_factory=factory)
        steps[max_len] = [s[:3] for s in made[0].eager_steps if s[0] == Mode.EXTEND and s[1] in (3, 200)]
    # 200 tokens in ceil(200 / KERNEL_VARIANT_REQUEST_TOKENS) requests either way (16-token requests before)
    assert steps[15] == steps[2048] == [(Mode.EXTEND, 3, 1), (Mode.EXTEND, 200, -(-200 // KERNEL_VARIANT_REQUEST_TOKENS))]


def test_triton_linear_backend_under_the_runner(artifact, tmp_path, tmp_path_factory):
    """The GPU path's linear-attention backend (Triton decode kernels reading slot ids from its static
    buffer in graphs; in extend graphs our chunk kernels and the extend conv over the static extend
    plan, padded to the bucket) under capture, parity and replayed steps, on the CPU: Triton's
    interpreter, FLA stood in by testkit/linear_cases.FakeFLA, declared for
    the cpu device under another name so routing binds the linear ops to it and the other ops to the
    reference. Greedy tokens equal the reference backend's. (The fused MoE's replay path has its own
    tests in test_triton_moe.py: under the interpreter it would take most of a minute here.)"""
    from hgc.wiring import toolchain
    from compiler.passes.context import CompileConfig
    from compiler.passes.routing import parse_route
    from compiler.pipeline import compile_checkpoint
    from runtime.backends import discover
    from testkit.linear_cases import interpreted_triton_linear

    InterpretedTritonLinear = interpreted_triton_linear()
    registry = discover().with_classes(InterpretedTritonLinear, source="tests/runtime/graphs/test_graph_runner.py")
    routes = tuple(parse_route(f"{op}={InterpretedTritonLinear.name}") for op in ("gdn_core", "short_conv"))
    checkpoint = shared_artifact(tmp_path_factory, "qwen3_next")[0]  # the module artifact's
    compile_checkpoint(checkpoint, tmp_path / "a", CompileConfig(routes=routes), toolchain(registry), dumps=False)
    art = load_artifact(tmp_path / "a")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    reference, _, reference_st = make_runner(artifact)
    want, _ = greedy(reference, reference_st, prompts, 3)
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(art.backends(kv, st, registry).for_program("main"))
    # members are keyed by backend and kernel options ("name[option=choice]")
    triton_key = (f"{InterpretedTritonLinear.name}[chunk_impl=triton,decode_norm=apart,decode_tiles=by_batch,"
                  f"extend_norm=apart,flashinfer_past=512,kda_graph=off,qk_gates=apart,short_extend_tokens=64,"
                  f"split_decode=one_launch]")
    assert set(ops.backend.members) == {"cpu_reference", triton_key}
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(2,), extend_buckets=(16,),
                         max_pages_per_seq=16, extend_max_seqs=2, debug=True, graphs=RerunGraphs())
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    # Where each member's replay state is made in a replayed decode step: the Triton backend's
    # (a device copy of the slot ids) inside the graph, the reference's (no such declaration) on the host.
    where: list[tuple[str, bool]] = []
    for name, member in ops.backend.members.items():
        hook = member.init_replay_state
        member.init_replay_state = lambda ctx, bucket, name=name, hook=hook: (
            where.append((name, runner.graphs.inside)) if Mode(ctx.mode) == Mode.DECODE else None, hook(ctx, bucket))
    got, keys = greedy(runner, st, prompts, 3)
    assert got == want
    assert keys[0] == CaptureKey(Mode.EXTEND, 16, 2) and keys[1] == CaptureKey(Mode.DECODE, 2, 2)
    assert ops.executed_backends()["0"] == ["cpu_reference", InterpretedTritonLinear.name]
    assert sorted(set(where)) == [("cpu_reference", False), (triton_key, True)]
    assert len(where) == 4, "each member once per replayed decode step (2 steps)"


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_linear", "qwen3_5"])
def test_start_up_and_replayed_steps_on_the_other_families(family, tmp_path_factory):
    """KDA + MLA, Lightning + MLA/GQA, Qwen3.5: capture, parity and graph tokens equal to eager.
    Each family's tiny artifact is the test run's (testkit/helpers.shared_artifact), only read here."""
    art = load_artifact(shared_artifact(tmp_path_factory, family)[1])
    runner, kv, st = make_runner(art, decode=(2,), extend=(32,), graphs=RerunGraphs())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    eager, _ = greedy(runner, st, prompts, 3)
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    graph, keys = greedy(runner, st, prompts, 3)
    assert graph == eager and keys[1] == CaptureKey(Mode.DECODE, 2, 2)


def test_a_record_summed_in_place_later_is_compared_through_the_later_op():
    """A captured graph keeps op outputs by reference; a tensor-parallel all_reduce then sums the
    MoE's partial output where it lies. The MoE's record shows the sum, the eager copy the partial:
    not a difference. The all_reduce's own record is still compared, so a wrong sum is found."""
    partial = torch.ones(4, 8)
    eager = [OpRecord(0, "moe", partial.clone()), OpRecord(0, "all_reduce", 2 * partial)]
    summed = 2 * partial  # the replay's buffer after the in-place sum: both records point at it
    assert first_difference(eager, [OpRecord(0, "moe", summed), OpRecord(0, "all_reduce", summed)], 1e-5) is None
    wrong = 3 * partial
    assert first_difference(eager, [OpRecord(0, "moe", wrong), OpRecord(0, "all_reduce", wrong)],
                            1e-5).startswith("layer 0 (all_reduce")
    # Separate tensors (records copied as they left their op) are each compared.
    assert first_difference(eager, [OpRecord(0, "moe", 2 * partial), OpRecord(0, "all_reduce", 2 * partial)],
                            1e-5).startswith("layer 0 (moe")


def test_glue_drift_that_grows_layer_by_layer_passes_and_a_jump_is_named():
    """The drift rule (runtime/graphs/parity.py): what the glue carries past the ops adds up with depth and
    is allowed up to PARITY_DRIFT_LIMIT tolerances; an error that enters in one piece (more than
    rtol over the largest before it), a NaN, or drift past the limit is the first fault."""
    from runtime.graphs.parity import PARITY_DRIFT_LIMIT, TeacherForcing, beyond_drift, first_glue_fault

    rtol = 2e-2
    drift = [0.0, 0.0, 0.004, 0.011, 0.019, 0.026, 0.034]  # a 64-layer dense model's kind of growth
    assert first_glue_fault(drift, rtol) is None
    assert first_glue_fault([0.0, 0.003, 0.03], rtol) == (2, 0.003)  # from nothing to past rtol in one piece
    assert first_glue_fault([0.01, 0.015, 0.006, 0.045], rtol) == (3, 0.015)  # 0.03 over the 0.015 carried
    creeping = [0.015 * i for i in range(10)]
    beyond = next(i for i, e in enumerate(creeping) if e > PARITY_DRIFT_LIMIT * rtol)
    assert first_glue_fault(creeping, rtol) == (beyond, creeping[beyond - 1])
    assert first_glue_fault([0.0, float("nan")], rtol) == (1, 0.0)
    assert not beyond_drift(0.05, 0.034, rtol) and beyond_drift(0.06, 0.034, rtol)  # the logits over the carried drift

    records = [OpRecord(layer, op, torch.zeros(1), {}) for layer, op in ((0, "short_conv"), (1, "gdn_core"),
                                                                          (2, "gqa_attention"))]
    forced = TeacherForcing(records)
    forced._read = ([0.012, 0.025, 0.07], [0.0, 0.0, 0.0])
    assert forced.carried == 0.07
    assert forced.first_beyond(rtol) == ("the pieces before layer 2 (gqa_attention: its inputs' rel err 0.07, "
                                         "0.025 carried from earlier layers)")
    forced._read = ([0.012, 0.025, 0.03], [0.0, 0.021, 0.0])  # an op on the same inputs: held to rtol itself
    assert forced.first_beyond(rtol) == "layer 1 (gdn_core, rel err 0.021 on the same inputs)"


class GapReferenceCapability(CPUReferenceBackend):
    """A second reference instance's name and capability, `gap_reference`: what routing and the
    compile read (gap_reference_runner's logging class declares the same)."""

    name = "gap_reference"
    capability = dataclasses.replace(CPUReferenceBackend.capability, name=name)


@pytest.fixture(scope="module")
def gap_reference_art(tmp_path_factory):
    """The test run's tiny qwen3_next compiled with its GQA attention routed to `gap_reference`,
    once for the module: its tests only read the folder."""
    from hgc.wiring import toolchain
    from compiler.passes.context import CompileConfig
    from compiler.passes.routing import parse_route
    from compiler.pipeline import compile_checkpoint
    from runtime.backends import discover

    registry = discover().with_classes(GapReferenceCapability, source="tests/runtime/graphs/test_graph_runner.py")
    checkpoint = shared_artifact(tmp_path_factory, "qwen3_next")[0]
    out = tmp_path_factory.mktemp("gap-reference") / "a"
    compile_checkpoint(checkpoint, out, CompileConfig(routes=(parse_route("gqa_attention=gap_reference"),)),
                       toolchain(registry), dumps=False)
    return out


def gap_reference_runner(art_dir, log: list):
    """A runner (CPU stand-in graphs) over `gap_reference_art`'s folder: the tiny qwen3_next with its GQA
    attention on a second reference instance, `gap_reference`, whose extend calls are eager gaps
    there (as the reference's are), so in extend steps it owns nodes in the gaps alone. `log` gets
    ("plan", mode) for each of its step plans and (op, layer) for every op call of either instance."""
    from runtime.backends import discover

    class Logged(CPUReferenceBackend):
        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            if name in OP_NAMES:
                return lambda ctx, *args: (log.append((name, args[op_arguments(name).index("layer_id")])),
                                           attr(ctx, *args))
            return attr

    class GapReference(Logged):
        name = GapReferenceCapability.name
        capability = GapReferenceCapability.capability

        def init_step_metadata(self, ctx):
            log.append(("plan", Mode(ctx.mode)))

    registry = discover().with_classes(GapReference, source="tests/runtime/graphs/test_graph_runner.py")
    art = load_artifact(art_dir)
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(art.backends(kv, st, registry).for_program("main"))
    members = ops.backend.members
    assert set(members) == {"cpu_reference", "gap_reference"}
    members["cpu_reference"].__class__ = Logged  # the same instance, its op calls logged too
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(2,), extend_buckets=(16,),
                         max_pages_per_seq=16, extend_max_seqs=2, debug=True, graphs=RerunGraphs())
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    return runner, st


@pytest.mark.parametrize("defer", [True, False])
def test_a_gap_only_backend_plans_just_before_its_first_op_of_a_replayed_step(artifact, gap_reference_art, defer):
    """GraphRunner._plan leaves the plan of a backend whose nodes are all in a piecewise step's eager
    gaps to BoundOps.before_first_call: in a replayed extend step it runs once, right before that
    backend's first op, after the ops of the layers before it (the pieces launched first, which the
    device runs meanwhile); with defer_gap_plans off it precedes the step's first op. The tokens are
    the single-backend runner's either way."""
    log: list = []
    runner, st = gap_reference_runner(gap_reference_art, log)
    runner.defer_gap_plans = defer
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    reference, _, reference_st = make_runner(artifact)
    want, _ = greedy(reference, reference_st, prompts, 2)
    log.clear()
    piecewise = runner.counters["piecewise_steps"]
    got, keys = greedy(runner, st, prompts, 1)  # the prompts' step alone: one replayed extend step
    assert got == [w[:1] for w in want] and keys == [CaptureKey(Mode.EXTEND, 16, 2)]
    assert runner.counters["piecewise_steps"] == piecewise + 1
    plans = [i for i, e in enumerate(log) if e[0] == "plan"]
    first_attention = next(i for i, e in enumerate(log) if e[0] == "gqa_attention")
    assert len(plans) == 1, log
    if defer:
        assert plans[0] == first_attention - 1, log
        assert {layer for op, layer in log[:plans[0]]} == set(range(log[first_attention][1])), \
            "every layer before the first attention layer ran before the plan"
    else:
        assert plans[0] == 0, log
    assert runner.ops.before_first_call is None


def test_before_first_call_runs_each_backend_s_work_once_before_its_first_op():
    """BoundOps.before_first_call: a backend's work runs just before its first op call of the step,
    once; another backend's calls leave it pending; the table empties to None."""
    from runtime.step.bound_ops import BoundOps

    log = []

    class Named:
        def __init__(self, name):
            self.name = name

        def gdn_core(self, ctx, *args):
            log.append(self.name)

    a, b = Named("a"), Named("b")
    ops = BoundOps(a)
    call_a, call_b = ops.call_of(a, "gdn_core"), ops.call_of(b, "gdn_core")
    args = [None] * len(op_arguments("gdn_core"))
    args[op_arguments("gdn_core").index("layer_id")] = 0
    ops.before_first_call = {b: lambda: log.append("plan b")}
    with ops.step(object()):
        call_a(*args)
        assert ops.before_first_call is not None
        call_b(*args)
        call_b(*args)
    assert log == ["a", "plan b", "b", "b"] and ops.before_first_call is None
