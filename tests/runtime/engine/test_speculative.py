"""Speculative decoding on the CPU: draft + target_verify gives exactly the tokens of plain decoding.

1. Greedy exactness with the artifact's own MTP draft: qwen3_next, qwen3_5 and bailing_linear tiny
   checkpoints, D = 1, 3, 7, eight requests of mixed lengths that are admitted and finish at
   different steps (4 slots, a 16-token budget, so prompts are chunked and requests queue). Every
   slot and page is free afterwards.
2. Acceptance exercised: a test-only drafter that proposes the target's own greedy continuation
   (testkit/spec_drafters.py) is kept in full, so each verify step moves a request D + 1 positions,
   with the same tokens; one that always disagrees is never kept, one position per step.
3. The same through the graph runner (testkit/graph_cases.RerunGraphs standing in for CUDA graphs):
   target_verify keys for the main program, decode and verify-layout keys for the draft,
   captured and checked by the start-up parity check, then serving the same tokens.
4. The pieces: intermediate states kept for the accepted position (the CPU reference's verify
   path against decode steps), acceptance rules, draft counts for penalties.
5. The draft chain kept on the device (greedy requests without grammar): the drafts it proposes
   are the per-step path's, eagerly and through a GraphRunner, with no `Choices.choose` call after
   position 0; a grammar or a temperature sends the call step by step, penalties do not; a
   greedy request whose next d_1 was left on the device joins a round chosen on the host; the
   draft's step after a verify, run on the device before the round's read, leaves what the host
   path leaves for every m. A draft layer with a linear state of its own is refused.
"""

from __future__ import annotations

import pytest
import torch

from hgc import main
from compiler.splitops import MODES, BackendCapability, Mode
from runtime.engine.acceptance import draft_counts, greedy_accept, rejection_accept
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.step.bound_ops import BoundOps
from runtime.engine.engine import SamplingParams
from runtime.engine.generate import make_pools
from runtime.cache.kv_pool import KVPool
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.engine.speculative import SpeculativeDecoder
from runtime.cache.state_pool import StatePool
from testkit.helpers import shared_artifact
from testkit.spec_drafters import DisagreeingDrafter, GreedyContinuationDrafter

pytestmark = pytest.mark.usefixtures("one_thread", "shared_loads")

FAMILIES = ("qwen3_next", "qwen3_5", "bailing_linear")
# Eight requests: lengths 1..17, new tokens 3..14, so they are admitted and finish at different steps.
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([1, 5, 17, 3, 9, 2, 12, 7])]
NEW_TOKENS = [9, 4, 14, 6, 11, 3, 8, 13]
MAX_LEN = 64


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """family -> its tiny artifact, loaded; compiled once per session (testkit/helpers.shared_artifact)."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = load_artifact(shared_artifact(tmp_path_factory, family)[1])
        return made[family]

    return get


def run(engine) -> tuple[list[list[int]], dict]:
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(PROMPTS, NEW_TOKENS)]
    results = engine.run_until_done()
    return [list(results[i].output_ids) for i in ids], engine.stats()


def options(D: int) -> EngineOptions:
    return EngineOptions(slots=4, token_budget=16, speculative_tokens=D)


@pytest.fixture(scope="module")
def plain(artifacts):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = run(engine_for_artifact(artifacts(family), options(0), MAX_LEN))[0]
        return cache[family]

    return get


def all_free(stats: dict) -> bool:
    return stats["free_slots"] == stats["total_slots"] and stats["free_pages"] == stats["total_pages"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_tokens", (1, 3, 7))
def test_mtp_draft_and_verify_give_the_tokens_of_plain_decoding(artifacts, plain, family, draft_tokens):
    outputs, stats = run(engine_for_artifact(artifacts(family), options(draft_tokens), MAX_LEN))
    assert outputs == plain(family)
    assert [len(o) for o in outputs] == NEW_TOKENS
    assert stats["spec_verify_steps"] > 0 and stats["spec_drafted"] == stats["spec_verified_requests"] * draft_tokens
    assert all_free(stats), stats


class Recording:
    """Wraps a drafter: where each request stood (its output length) at each proposal."""

    def __init__(self, drafter):
        self.drafter, self.at = drafter, {}

    def after_prefill(self, *args):
        self.drafter.after_prefill(*args)

    def after_verify(self, *args):
        self.drafter.after_verify(*args)

    def after_verify_on_device(self, *args):
        self.drafter.after_verify_on_device(*args)

    def _record(self, requests):
        for req in requests:
            self.at.setdefault(tuple(req.prompt), []).append(len(req.output))

    def propose(self, requests, choose):
        self._record(requests)
        self.drafter.propose(requests, choose)

    def propose_on_device(self, requests):
        self._record(requests)
        return self.drafter.propose_on_device(requests)

    def first_drafts(self, requests):
        return self.drafter.first_drafts(requests)


def engine_with(art, D: int, drafter):
    return engine_for_artifact(art, options(D), MAX_LEN, drafter_wrap=lambda mtp: drafter)


@pytest.mark.parametrize("draft_tokens", (3, 7))
def test_a_draft_that_agrees_is_kept_and_moves_d_plus_one_positions_per_step(artifacts, plain, draft_tokens):
    art, reference = artifacts("qwen3_next"), plain("qwen3_next")
    drafter = Recording(GreedyContinuationDrafter({tuple(p): o for p, o in zip(PROMPTS, reference)}, draft_tokens,
                                                  int(art.manifest["model"]["vocab_size"])))
    outputs, stats = run(engine_with(art, draft_tokens, drafter))
    assert outputs == reference
    for prompt, new in zip(PROMPTS, NEW_TOKENS):
        # the first token comes from the prefill; each verify step then keeps D drafts + 1
        assert drafter.at.get(tuple(prompt), []) == list(range(1, new, draft_tokens + 1)), prompt
    # only drafts past a request's last token (its reference ends there) are ever refused
    assert stats["spec_acceptance_rate"] > 0.5 and stats["spec_tokens_per_verify"] > 2
    assert all_free(stats)


def test_a_draft_that_always_disagrees_is_never_kept(artifacts, plain):
    art, reference = artifacts("qwen3_next"), plain("qwen3_next")
    drafter = Recording(DisagreeingDrafter({tuple(p): o for p, o in zip(PROMPTS, reference)}, 3,
                                           int(art.manifest["model"]["vocab_size"])))
    outputs, stats = run(engine_with(art, 3, drafter))
    assert outputs == reference
    assert stats["spec_accepted"] == 0 and stats["spec_tokens_per_verify"] == 1
    for prompt, new in zip(PROMPTS, NEW_TOKENS):
        assert drafter.at.get(tuple(prompt), []) == list(range(1, new)), prompt
    assert all_free(stats)


PENALISED = SamplingParams(max_new_tokens=10, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5,
                           logit_bias={7: 3.0, 11: -2.0, 140: 2.5}, logprobs=2)


@pytest.mark.parametrize("drafter", ("agrees", "mtp"))
def test_penalties_bias_and_logprobs_at_verified_positions_match_plain_decoding(artifacts, drafter):
    """Row j of a verify step is penalised as if d_1 .. d_j had been generated: greedy tokens with
    penalties and bias, and their log-probabilities (the raw rows), equal plain decoding's. With a
    drafter that agrees, rows past the first decide most tokens."""
    art, D = artifacts("qwen3_next"), 3

    def go(engine):
        ids = [engine.add_request(p, PENALISED) for p in PROMPTS]
        results = engine.run_until_done()
        return [results[i] for i in ids]

    plain_results = go(engine_for_artifact(art, options(0), MAX_LEN))
    reference = {tuple(p): list(r.output_ids) for p, r in zip(PROMPTS, plain_results)}
    if drafter == "agrees":
        engine = engine_with(art, D, GreedyContinuationDrafter(reference, D, int(art.manifest["model"]["vocab_size"])))
    else:
        engine = engine_for_artifact(art, options(D), MAX_LEN)
    spec_results = go(engine)
    assert [r.output_ids for r in spec_results] == [r.output_ids for r in plain_results]
    for a, b in zip(spec_results, plain_results):
        assert [e.token for e in a.logprobs] == list(a.output_ids)
        assert torch.allclose(torch.tensor([e.logprob for e in a.logprobs]), torch.tensor([e.logprob for e in b.logprobs]),
                              atol=1e-4)
        assert [[t for t, _ in e.top] for e in a.logprobs] == [[t for t, _ in e.top] for e in b.logprobs]
    if drafter == "agrees":
        assert engine.stats()["spec_tokens_per_verify"] > 2


def test_a_builds_tuning_step_runs_in_both_programs_and_serves_the_same_tokens(artifacts, plain, monkeypatch):
    """A build's start-up (runtime/assembly.py `_is_build`) runs each runner's largest extend step
    eagerly before its captures, the draft program's with its hidden-state input; the engine then
    serves the tokens of plain decoding."""
    import runtime.assembly as assembly
    from testkit.graph_cases import RerunGraphs

    monkeypatch.setattr(assembly, "_is_build", lambda art: True)
    lines: list[str] = []
    engine = engine_for_artifact(artifacts("qwen3_next"), options(3), MAX_LEN, graphs=RerunGraphs(),
                                 log=lines.append)
    for runner in (engine.runner, engine.spec.drafter.steps):
        extend = [k for k in runner.keys if k.mode == Mode.EXTEND]
        assert runner.tuning_step and runner.tuned_on == max(extend, key=lambda k: (k.tokens, k.seqs))
    assert any(line.startswith("tuning step: extend[") for line in lines)
    outputs, _ = run(engine)
    assert outputs == plain("qwen3_next")


def test_graph_runner_captures_verify_and_draft_keys_and_serves_the_same_tokens(artifacts, plain):
    from testkit.graph_cases import RerunGraphs

    art, D, lines = artifacts("qwen3_next"), 3, []
    engine = engine_for_artifact(art, options(D), MAX_LEN, graphs=RerunGraphs(), log=lines.append)
    main_runner, draft_runner = engine.runner, engine.spec.drafter.steps
    assert [str(k) for k in main_runner.keys][:3] == ["target_verify[tokens=16, seqs=4, rows=16]",
                                                      "target_verify[tokens=8, seqs=2, rows=8]",
                                                      "target_verify[tokens=4, seqs=1, rows=4]"]
    assert Mode.TARGET_VERIFY in main_runner.full_modes, "the verify plan of a CPU artifact is one captured piece"
    draft_keys = {str(k) for k in draft_runner.keys}
    assert {"decode[tokens=4, seqs=4]", "target_verify[tokens=16, seqs=4, rows=4]"} <= draft_keys
    assert any("start-up parity" in line for line in lines) and any("draft program" in line for line in lines)
    assert not any("run eagerly" in line for line in lines)  # 4 slots: bucket 4 holds every verify step
    outputs, stats = run(engine)
    assert outputs == plain("qwen3_next")
    assert main_runner.counters["graph_replays"] > 0 and draft_runner.counters["graph_replays"] > 0
    assert all_free(stats)


def test_verify_steps_past_the_last_bucket_the_intermediate_states_hold_are_named_at_start_up(artifacts):
    """3 slots: the recorded bucket 4 would write intermediate states for 4 requests, so it is not
    captured; start-up says which verify steps then run eagerly and how to capture them all."""
    import dataclasses

    from testkit.graph_cases import RerunGraphs

    art, D, lines = artifacts("qwen3_next"), 3, []
    engine = engine_for_artifact(art, dataclasses.replace(options(D), slots=3), MAX_LEN, graphs=RerunGraphs(),
                                 log=lines.append)
    assert [str(k) for k in engine.runner.keys if k.mode == Mode.TARGET_VERIFY] == [
        "target_verify[tokens=8, seqs=2, rows=8]", "target_verify[tokens=4, seqs=1, rows=4]"]
    said = [line for line in lines if "run eagerly" in line]
    assert len(said) == 1 and "verify steps of 3 to 3 requests run eagerly" in said[0]


def test_the_compiled_pieces_start_up_check_runs_the_draft_program_with_its_hidden_states(artifacts):
    """Without a GraphRunner, `hgc run` / `hgc serve` compare an artifact's compiled pieces with its
    traced glue at start-up; with drafts, the draft program's too, its hidden-state input filled.
    This artifact has no bundle, so both sides run the traced glue: what is checked here is that
    the check reaches the draft program and runs it (op by op, through the draft's own backend set)."""
    from runtime.assembly import compiled_start_up_parity

    art = artifacts("qwen3_next")
    engine = engine_for_artifact(art, options(3), MAX_LEN)
    reports = compiled_start_up_parity(engine.runner, engine.spec, engine.kv_pool, engine.state_pool,
                                       int(art.manifest["model"]["vocab_size"]), 16)
    assert [r.get("key", r["mode"]) for r in reports] == ["extend", "decode", "draft extend", "draft decode"]
    draft_layers = {e.layer_id for e in art.docs.routing.entries("draft")}
    assert {int(o["layer"]) for r in reports[2:] for o in r["ops"]} == draft_layers
    assert all(r["logits"] == 0.0 and r["worst_op"] == 0.0 for r in reports)
    assert all_free(engine.stats())


class DraftReference(CPUReferenceBackend):
    """The reference math under another name, bound only by a route: the draft (MTP) layer routed
    apart from every main layer. It records the modes of the steps it was told to plan."""

    name = "draft_reference"
    capability = BackendCapability(name="draft_reference", device="cpu", ops=CPUReferenceBackend.capability.ops,
                                   modes_capturable=frozenset(MODES), explicit_only=True,
                                   doc="the reference, as the draft layer's own backend in routing tests")
    built: list = []

    @classmethod
    def build(cls, setup):
        instance = cls(setup.kv_pool, setup.state_pool)
        instance.planned = []
        cls.built.append((instance, setup.layer_ids()))
        return instance

    def init_step_metadata(self, ctx):
        self.planned.append(Mode(ctx.mode))
        super().init_step_metadata(ctx)


def test_a_draft_layer_routed_apart_is_bound_and_planned_through_the_draft_programs_own_set(artifacts, plain,
                                                                                               tmp_path,
                                                                                               tmp_path_factory):
    """routing.json binds the draft program's nodes as it binds the main program's: a draft layer
    routed to its own backend runs there and only there, that instance is built once and is no
    member of the main program's set, and the draft's steps (after a prefill, the chain, after a
    verify) reach it through the draft's BackendSet. The tokens stay plain decoding's."""
    from hgc.wiring import toolchain
    from compiler.passes.context import CompileConfig
    from compiler.passes.routing import parse_route
    from compiler.pipeline import compile_checkpoint
    from runtime.backends import discover

    registry = discover().with_classes(DraftReference, source="tests/runtime/engine/test_speculative.py")
    art = artifacts("qwen3_next")
    draft_layers = sorted({e.layer_id for e in art.docs.routing.entries("draft")})
    route = parse_route(f"layers={','.join(map(str, draft_layers))}:draft_reference")
    checkpoint = shared_artifact(tmp_path_factory, "qwen3_next")[0]
    compile_checkpoint(checkpoint, tmp_path / "a", CompileConfig(routes=(route,)), toolchain(registry), dumps=False,
                       force=True)
    routed = load_artifact(tmp_path / "a")
    assert routed.routed_backends("draft") == ["draft_reference"]
    assert "draft_reference" not in routed.routed_backends("main")
    DraftReference.built.clear()
    engine = engine_for_artifact(routed, options(3), MAX_LEN, registry=registry)
    outputs, stats = run(engine)
    assert outputs == plain("qwen3_next") and all_free(stats)
    ((instance, layers),) = DraftReference.built
    assert layers == draft_layers
    assert "draft_reference" not in engine.ops.backend.members
    assert set(engine.spec.drafter.steps.ops.backend.members) == {"draft_reference"}
    assert {Mode.EXTEND, Mode.DECODE, Mode.TARGET_VERIFY} <= set(instance.planned)
    executed = engine.ops.executed_backends()  # the draft's calls are recorded with the main program's
    assert all(executed[str(i)] == ["draft_reference"] for i in draft_layers)
    assert all(names == ["cpu_reference"] for layer, names in executed.items() if int(layer) not in draft_layers)


# -- the pieces --------------------------------------------------------------------------------


def test_verify_step_keeps_each_positions_state_as_decode_steps_leave_it(artifacts):
    """A target_verify step of D + 1 tokens leaves, in intermediate entry i, the state D + 1 decode
    steps leave after token i, and in the slot the state after the last; keep_verified hands a
    request the state after its last accepted token. (Equal to float32 rounding: the projections
    before the ops multiply 4 rows at once instead of 1, and CPU kernels round by shape.)"""
    art, D = artifacts("qwen3_next"), 3
    tokens = [5, 9, 13, 17]
    states = {}
    for how in ("decode", "verify"):
        kv = KVPool(art.registry, 8, 16)
        st = StatePool(art.registry, 2, draft_tokens=D, verify_rows=2)
        ops = BoundOps(CPUReferenceBackend(kv, st))
        forward = art.bind(ops)
        seq = SeqState(st.alloc())
        prefill = build_step([(seq, [1, 2, 3])], kv)
        with ops.step(prefill.ctx), torch.no_grad():
            forward(prefill.input_ids, prefill.positions, prefill.logits_index)
        commit_step([(seq, [1, 2, 3])])
        after = []
        if how == "decode":
            for t in tokens:
                step = build_step([(seq, [t])], kv)
                with ops.step(step.ctx), torch.no_grad():
                    forward(step.input_ids, step.positions, step.logits_index)
                commit_step([(seq, [t])])
                after.append({layer: {n: e[seq.slot].clone() for n, e in entries.items()}
                              for layer, entries in st.buffers.items()})
        else:
            step = build_step([(seq, tokens)], kv, mode=Mode.TARGET_VERIFY, logits_rows=[D + 1])
            with ops.step(step.ctx), torch.no_grad():
                forward(step.input_ids, step.positions, step.logits_index)
            after = [{layer: {n: st.verify_buffers[layer][n][0, i].clone() for n in entries}
                      for layer, entries in st.buffers.items()} for i in range(D)]
            after.append({layer: {n: e[seq.slot].clone() for n, e in entries.items()}
                          for layer, entries in st.buffers.items()})
            st.keep_verified([seq.slot], [2])  # tokens 0 and 1 kept
            kept = {layer: {n: e[seq.slot].clone() for n, e in entries.items()} for layer, entries in st.buffers.items()}
        states[how] = after
    for i in range(D + 1):
        for layer, entries in states["decode"][i].items():
            for name, value in entries.items():
                assert torch.allclose(states["verify"][i][layer][name], value, rtol=1e-4, atol=1e-6), (i, layer, name)
                assert not torch.equal(value, states["decode"][i - 1][layer][name]) if i else True
    assert all(torch.equal(kept[layer][n], states["verify"][1][layer][n]) for layer in kept for n in kept[layer])


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert greedy_accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert greedy_accept([4, 9, 6], [4, 5, 6, 7]) == [4, 5]
    assert greedy_accept([9, 5, 6], [4, 5, 6, 7]) == [4]


def test_rejection_sampling_keeps_a_draft_the_target_is_sure_of_and_never_one_it_excludes():
    g = torch.Generator().manual_seed(0)
    sure = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    never = torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    for _ in range(50):
        assert rejection_accept([1], [q], [sure, never], g) in ([1, 0], [1, 2])
        assert rejection_accept([1], [q], [never, sure], g)[0] in (0, 2)  # refused, drawn from the residual


def test_draft_counts_mark_the_drafts_before_each_row():
    counts = draft_counts([[2, 2, 1], [0, 3, 3]], 4, "cpu").view(2, 4, 4)
    assert counts[0].tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 2, 0]]
    assert counts[1].tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 1], [1, 0, 0, 2]]


def test_speculative_tokens_outside_one_to_seven_are_refused(artifacts):
    with pytest.raises(ValueError, match="--speculative-tokens must be in 0..7"):
        EngineOptions(speculative_tokens=8)
    kv, st = make_pools(artifacts("qwen3_next").registry, 32, 1)
    with pytest.raises(ValueError, match="intermediate states for 0"):
        SpeculativeDecoder(None, None, 3, st)


# -- the commands ----------------------------------------------------------------------------------


def test_hgc_run_with_speculative_tokens_gives_plain_tokens_and_reports_acceptance(artifacts, plain, capsys):
    """The eight mixed-length prompts through `hgc run` (chunked by a 16-token budget, so they start
    decoding at different steps): greedy tokens with drafts are plain decoding's, and --json
    reports acceptance, tokens per verify step and draft time. One family and D: `hgc run` builds
    its engine with engine_for_artifact, whose tokens the test above checks for every family and D."""
    import json

    family, draft_tokens = "qwen3_5", 7
    art = artifacts(family)
    prompt_ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
    assert main(["run", str(art.docs.path), "--prompt-ids", prompt_ids, "--max-new-tokens", "6",
                 "--max-tokens-per-step", "16", "--speculative-tokens", str(draft_tokens), "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    for got, want in zip(ran["outputs"], plain(family)):  # greedy: the plain run's tokens, as far as both go
        n = min(len(want), 6)
        assert len(got["output_ids"]) == 6 and got["output_ids"][:n] == want[:n]
    spec = ran["timing"]["speculative"]
    assert spec["draft_tokens"] == draft_tokens and spec["verify_steps"] > 0 and spec["draft_s"] > 0
    assert {"acceptance_rate", "tokens_per_verify", "verify_s"} <= set(spec)
    draft_layers = {str(e.layer_id) for e in art.docs.routing.entries("draft")}
    assert draft_layers <= set(ran["executed_backends"])  # the draft's calls are reported with the main program's


def test_hgc_run_refuses_speculation_without_a_draft_program(tmp_path, capsys):
    import io

    from models.loader import init_checkpoint

    init_checkpoint("kimi_linear", "tiny", 0, tmp_path / "c", log=io.StringIO())
    assert main(["compile", str(tmp_path / "c"), "-o", str(tmp_path / "a"), "--no-dumps"]) == 0
    capsys.readouterr()
    # bad input (exit 2), found in the artifact's documents before anything loads
    assert main(["run", str(tmp_path / "a"), "--prompt-ids", "1,2", "--speculative-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs a draft (MTP) program" in err and "kimi_linear" in err and "Traceback" not in err
    assert main(["run", str(tmp_path / "a"), "--prompt-ids", "1,2", "--speculative-tokens", "8"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "hgc run: --speculative-tokens must be in 0..7 (got 8)" and err[1].startswith("  hint:")


def test_a_draft_layer_with_a_linear_state_is_refused_naming_it(artifacts):
    """No supported family has one (their MTP layers are full attention), and nothing would keep or
    roll back its state: the factory refuses it, naming the layer, before anything is built."""
    import types

    from compiler.splitops.registry import LayerKind, LayerSpec, TensorSpec
    from runtime.engine.speculative import check_drafter

    art = artifacts("qwen3_next")
    linear = LayerSpec(99, LayerKind.GDN, draft=True, state={"recurrent": TensorSpec((2, 4, 4), "float32")})
    registry = types.SimpleNamespace(draft_layers=lambda: [linear])
    with pytest.raises(ValueError, match=r"draft layer\(s\) \[99\] keep a linear-attention state"):
        check_drafter(types.SimpleNamespace(docs=art.docs, registry=registry))
    check_drafter(art)  # the real draft layer: full attention


async def served_tokens(url: str, model: str = "m") -> list[list[int]]:
    """The eight prompts sent to a server at once (greedy, NEW_TOKENS each, every other one
    streamed): each one's token ids."""
    import asyncio
    import json

    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        replies = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": model, "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1})
            for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))))
    out = []
    for r in replies:
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            out.append([t for c in chunks for choice in c["choices"] for t in choice["token_ids"]])
        else:
            out.append(r.json()["choices"][0]["token_ids"])
    return out


@pytest.mark.slow  # two server processes: about 20 s on 2 cores
def test_hgc_serve_with_speculative_tokens_gives_the_tokens_of_plain_decoding(artifacts, plain, monkeypatch):
    """`hgc serve` with 4 slots and a 16-token budget (requests queue, prompts are chunked): the
    eight prompts' greedy tokens with drafts are plain decoding's, and /metrics reports the drafts.
    qwen3_5 with D = 7 and bailing_linear with D = 1 here; qwen3_next with D = 3 through `hgc serve`
    is tests/server/test_structured_output.py's (its plain and speculative servers, these eight prompts):
    a server process costs seconds of start-up, and that module has both already."""
    import asyncio

    pytest.importorskip("httpx")
    from testkit.helpers import ServerProcess
    from tests.server.test_server import wait_all_free

    runs = {"qwen3_5": 7, "bailing_linear": 1}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the servers' torch threads, as this process's (one_thread)
    servers = {family: ServerProcess([str(artifacts(family).docs.path), "--served-model-name", "m", "--slots", "4",
                                      "--token-budget", "16", "--max-model-len", str(MAX_LEN),
                                      "--speculative-tokens", str(D)])
               for family, D in runs.items()}
    try:
        for family, server in servers.items():
            server.wait_ready()
            assert asyncio.run(served_tokens(server.url)) == plain(family), family
            m = wait_all_free(server.url)
            assert m["hgc_spec_draft_tokens"] == runs[family] and m["hgc_spec_verify_steps_total"] > 0
    finally:
        for server in servers.values():
            assert server.stop() == 0, server.log()


# -- with the engine's other features --------------------------------------------------------------


def test_shared_prefill_prefix_cache_and_preemption_keep_plain_tokens(artifacts):
    """Requests forked from another's prefill (n choices), prompts that share a cached prefix, and
    a KV pool so small that requests are preempted and re-prefilled: with drafts, the same greedy
    tokens as without, and everything free afterwards."""
    art = artifacts("qwen3_next")
    shared = [(5 * j) % 200 + 3 for j in range(40)]
    prompts = [shared + [7], shared + [9, 11], list(range(3, 30)), [4, 5]]

    def go(D: int, kv_pages: int | None) -> tuple[list, dict]:
        engine = engine_for_artifact(art, EngineOptions(slots=4, token_budget=16, speculative_tokens=D,
                                                        kv_pages=kv_pages, page_size=8), MAX_LEN)
        params = SamplingParams(max_new_tokens=12)
        first = engine.add_request(prompts[0], params)
        ids = [first, engine.add_request(prompts[0], params, prefill_from=first)]
        ids += [engine.add_request(p, params) for p in prompts[1:]]
        results = engine.run_until_done()
        return [list(results[i].output_ids) for i in ids], engine.stats()

    reference, _ = go(0, None)
    assert reference[0] == reference[1]
    for D, pages in ((3, None), (5, 10)):
        outputs, stats = go(D, pages)
        assert outputs == reference, (D, pages)
        assert all_free(stats)
        if pages is None:  # room for everything: the second choice shares the first's prefill
            assert stats["prefills_shared"] == 1
        else:  # 10 pages of 8 tokens: requests are preempted, and re-prefill from the prefix cache
            assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_the_memory_plan_sizes_the_intermediate_states_the_pool_allocates(artifacts):
    from runtime.cache.memory_planner import build_pools, plan_memory

    art = artifacts("bailing_linear")
    plan = plan_memory(art.registry, budget_bytes=64 << 20, weight_bytes=0, max_seq_len=128, num_slots=6,
                       max_running=4, draft_tokens=3)
    _, st = build_pools(art.registry, plan)
    assert (st.draft_tokens, st.verify_rows) == (3, 4)
    assert st.verify_nbytes() == plan.intermediate_bytes > 0


# -- the draft chain kept on the device ---------------------------------------------------------


class ChainWatch:
    """Wraps an engine's drafter and `Choices.choose`: the drafts each proposal left, the positions
    `Choices.choose` was called for, and how many proposals took the device chain. `per_step` sends
    every proposal through `Choices.choose` step by step (the path of requests whose drafts are not the
    argmax), to compare the device chain with."""

    def __init__(self, engine):
        self.drafter = engine.spec.drafter
        engine.spec.drafter = self
        choices = engine.choices
        choose, self.by_argmax = choices.choose, choices.drafts_by_argmax
        choices.choose = lambda reqs, logits, position: (self.chose_at.append(position), choose(reqs, logits, position))
        choices.drafts_by_argmax = lambda req: self.by_argmax(req) and not self.per_step
        self.reset(per_step=False)

    def reset(self, per_step: bool) -> "ChainWatch":
        self.per_step, self.drafts, self.chose_at, self.chained = per_step, [], [], 0
        return self

    def after_prefill(self, *args):
        self.drafter.after_prefill(*args)

    def after_verify(self, *args):
        self.drafter.after_verify(*args)

    def after_verify_on_device(self, *args):
        self.drafter.after_verify_on_device(*args)

    def propose(self, requests, choose):
        self.drafter.propose(requests, choose)
        self.drafts.append([list(r.drafts) for r in requests])

    def propose_on_device(self, requests):
        self.chained += 1
        drafts = self.drafter.propose_on_device(requests)
        self.drafts.append(drafts.tolist())
        return drafts

    def first_drafts(self, requests):
        return self.drafter.first_drafts(requests)


def reusable(D: int) -> EngineOptions:
    """options(D) without a prefix cache: a second run of the same prompts is scheduled as the first."""
    return EngineOptions(slots=4, token_budget=16, speculative_tokens=D, prefix_cache=False)


def chained_and_per_step(engine, expected) -> dict:
    """The eight requests through one engine (built with `reusable`) twice, chained then per step:
    {how: (drafts of each proposal, proposals chained, positions `Choices.choose` was called for)}."""
    watch, seen = ChainWatch(engine), {}
    for how in ("chained", "per_step"):
        watch.reset(per_step=how == "per_step")
        outputs, stats = run(engine)
        assert outputs == expected and all_free(stats), how
        seen[how] = (watch.drafts, watch.chained, list(watch.chose_at))
    (chained, n_chained, chose_chained), (stepped, n_stepped, chose_stepped) = seen["chained"], seen["per_step"]
    assert chained == stepped and len(chained) > 3
    assert n_chained == len(chained) and n_stepped == 0
    assert [p for p in chose_chained if p >= 1] == []
    return seen


@pytest.mark.parametrize("draft_tokens", (3, 7))
def test_chained_drafts_equal_per_step_drafts_and_plain_tokens(artifacts, plain, draft_tokens):
    """Greedy requests without grammar: the chain of D - 1 draft steps runs on the device with no
    read in between (`Choices.choose` is never called for positions >= 1), proposes exactly the drafts
    the per-step path proposes, and the tokens are plain decoding's; everything is free after.
    (D = 1 has no chain: its proposals are d_1 alone, and the tests above run it chained.)"""
    engine = engine_for_artifact(artifacts("qwen3_next"), reusable(draft_tokens), MAX_LEN)
    seen = chained_and_per_step(engine, plain("qwen3_next"))
    assert sorted(set(seen["per_step"][2])) == list(range(draft_tokens))


def test_chained_drafts_through_a_graph_runner_feed_the_replayed_steps_on_the_device(artifacts, plain):
    """The same through GraphRunners (graphs rerun on the CPU): the draft's decode steps are
    replayed from captured graphs with the previous step's argmax written into their static input
    ids, and propose what the per-step path proposes."""
    from testkit.graph_cases import RerunGraphs

    art, D = artifacts("qwen3_next"), 3
    engine = engine_for_artifact(art, reusable(D), MAX_LEN, graphs=RerunGraphs())
    draft_runner = engine.spec.drafter.steps
    replays = draft_runner.counters["graph_replays"]
    chained_and_per_step(engine, plain("qwen3_next"))
    assert draft_runner.counters["graph_replays"] > replays


def test_the_draft_after_a_verify_on_the_device_leaves_what_the_host_path_leaves(artifacts):
    """`after_verify_on_device` works out each request's m, its kept tokens and its logits row from
    the drafts and the verify step's argmax on the device, before the host reads anything; for m
    from 0 to D it leaves the next d_1 and the hidden state that `after_verify` leaves from the
    kept tokens the host computed (`greedy_accept`). (With random weights the engine's own rounds
    keep almost nothing, so m > 0 is set up here.)"""
    import types

    art, D = artifacts("qwen3_next"), 3
    engine = engine_for_artifact(art, options(D), MAX_LEN)
    drafter, kv = engine.spec.drafter, engine.kv_pool
    vocab, width = int(art.manifest["model"]["vocab_size"]), D + 1
    starts = [5, 17, 30, 9]
    reqs = [types.SimpleNamespace(seq=SeqState(slot, kv.alloc(kv.pages_for(p + width)), p))
            for slot, p in zip((0, 2, 1, 3), starts)]
    g = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, vocab, (len(reqs), D), generator=g)
    target = torch.randint(0, vocab, (len(reqs), width), generator=g)
    for b, m in enumerate((0, 1, 2, D)):  # request b keeps m drafts: the target agrees up to m, not at m
        target[b, :m] = drafts[b, :m]
        if m < D:
            target[b, m] = (drafts[b, m] + 1) % vocab
    kept = [greedy_accept(drafts[b].tolist(), target[b].tolist()) for b in range(len(reqs))]
    assert [len(k) - 1 for k in kept] == [0, 1, 2, D]
    hidden = torch.randn(len(reqs) * width, drafter.hidden.shape[1], generator=g).to(drafter.hidden.dtype)
    slots = torch.tensor([r.seq.slot for r in reqs])

    left = {}
    for how in ("host", "device"):
        drafter.first.zero_()
        drafter.hidden.zero_()
        if how == "host":
            drafter.after_verify(reqs, starts, kept, hidden)
        else:
            drafter.after_verify_on_device(reqs, starts, drafts, target, hidden)
        left[how] = (drafter.first[slots].clone(), drafter.hidden[slots].clone())
    assert torch.equal(left["host"][0], left["device"][0])
    assert torch.equal(left["host"][1], left["device"][1]) and left["host"][1].abs().sum() > 0


def test_a_grammar_or_a_draw_sends_the_proposal_through_choose_and_penalties_do_not(artifacts):
    """`Choices.drafts_by_argmax`: a request with a grammar or a temperature has its drafts chosen on the
    host, step by step, and so has every request proposed with it; penalties and bias change only
    the target's rows (verification), so a penalised greedy request keeps the device chain. Greedy
    tokens are plain decoding's either way."""
    from runtime.engine.grammar import StructuredOutput
    from runtime.artifact.tokenizer import TextTokenizer

    art, D = artifacts("qwen3_next"), 3
    tok = TextTokenizer.from_dir(art.docs.path)
    grammar = StructuredOutput(tok, int(art.manifest["model"]["vocab_size"]), [tok.eos_token_id]).compile(
        {"type": "json_object"})
    cases = {"grammar": SamplingParams(max_new_tokens=8, grammar=grammar),
             "temperature": SamplingParams(max_new_tokens=8, temperature=0.8, seed=1),
             "penalties": SamplingParams(max_new_tokens=8, frequency_penalty=1.5, repetition_penalty=1.3,
                                         logit_bias={7: 3.0})}
    greedy = SamplingParams(max_new_tokens=8)
    spec_engine, plain_engine = engine_for_artifact(art, reusable(D), MAX_LEN), engine_for_artifact(art, reusable(0), MAX_LEN)
    watch = ChainWatch(spec_engine)

    def go(engine, params):
        ids = [engine.add_request(PROMPTS[0], greedy), engine.add_request(PROMPTS[1], params)]
        results = engine.run_until_done()
        assert all_free(engine.stats())
        return [list(results[i].output_ids) for i in ids]

    for name, params in cases.items():
        watch.reset(per_step=False)
        outputs, reference = go(spec_engine, params), go(plain_engine, params)
        assert outputs[0] == reference[0], name
        if name != "temperature":
            assert outputs[1] == reference[1], name
        if name == "penalties":
            assert watch.chained == len(watch.drafts) > 0 and not [p for p in watch.chose_at if p >= 1]
        else:  # both requests are proposed together at first: the whole call goes step by step
            assert watch.chained < len(watch.drafts) and {1, 2} <= set(watch.chose_at), name


def test_a_greedy_request_whose_next_draft_is_on_the_device_joins_a_round_chosen_on_the_host(artifacts):
    """A greedy request runs alone first (its rounds read the device once: each next d_1 stays
    there); then a sampled request joins, and the rounds go step by step on the host, the greedy
    request's d_1 read back from the device (`first_drafts`). Its tokens stay plain decoding's,
    and rounds of both kinds ran."""
    art, D = artifacts("qwen3_next"), 3
    greedy, drawn = SamplingParams(max_new_tokens=14), SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
    spec_engine, plain_engine = engine_for_artifact(art, reusable(D), MAX_LEN), engine_for_artifact(art, reusable(0), MAX_LEN)
    watch = ChainWatch(spec_engine)
    first_reads = []
    first_drafts = watch.first_drafts
    watch.first_drafts = lambda requests: (first_reads.append(len(requests)), first_drafts(requests))[1]

    def go(engine, steps_alone):
        ids = [engine.add_request(PROMPTS[2], greedy)]
        for _ in range(steps_alone):
            engine.step()
        ids.append(engine.add_request(PROMPTS[0], drawn))
        results = engine.run_until_done()
        assert all_free(engine.stats())
        return [list(results[i].output_ids) for i in ids]

    outputs, reference = go(spec_engine, 4), go(plain_engine, 4)
    assert outputs[0] == reference[0]
    assert watch.chained > 0 and first_reads == [1], (watch.chained, first_reads)
    assert {1, 2} <= set(watch.chose_at), "the mixed rounds chose their drafts on the host"


def test_a_run_without_drafts_loads_the_main_program_alone_and_decodes_the_same(artifacts, plain, tmp_path_factory,
                                                                                  monkeypatch):
    """load_artifact(programs=("main",)), as `hgc run` / `hgc serve` without --speculative-tokens load:
    the draft's archive is not opened, the tokens are plain decoding's, and asking the load for a
    draft runner says the load left it out."""
    from runtime.artifact import loader
    from runtime.artifact.docs import LoadError

    art_dir = shared_artifact(tmp_path_factory, "qwen3_next")[1]
    full = artifacts("qwen3_next")
    opened = []
    real = loader.load_program
    monkeypatch.setattr(loader, "load_program", lambda path, sha: opened.append(path.name) or real(path, sha))
    main_only = load_artifact(art_dir, programs=("main",))
    assert opened == ["graph.pt2"] and sorted(main_only.programs) == ["main"]
    assert set(main_only.weights) == set(full.weights)
    assert run(engine_for_artifact(main_only, options(0), MAX_LEN))[0] == plain("qwen3_next")
    with pytest.raises(LoadError, match=r"no draft program loaded \(load_artifact\(\.\.\., programs=\.\.\.\) left it out\)"):
        main_only.runner(None, "draft")
    with pytest.raises(LoadError, match=r"no verify program to load"):
        load_artifact(art_dir, programs=("main", "verify"))
