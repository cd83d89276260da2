"""Speculative decoding: the draft (MTP) program proposes D tokens per request, one target_verify
step of the main program checks them all, and each request keeps what agrees.

What it owns: running the two programs' steps for it (the main program's steps with their hidden
states, the draft's steps), the draft's per-request hidden state, and handing the verify step's
intermediate linear states back to the requests. What a request keeps (greedy, rejection
sampling, penalties, grammar) is the engine's (runtime/engine/engine.py, runtime/engine/acceptance.py).

A program's steps run through a step runner (runtime/graphs/step_runner.py): a GraphRunner
(captured graphs, eager above its buckets) or an EagerRunner (a bound forward, every step eager).
Both have `build(items, mode, logits_rows) -> (step, key)` and `run_outputs(step, key,
input_ids=None, logits_index=None) -> [logits, hidden]`; `input_ids` (token ids) and
`logits_index` (logits rows), on the device, replace the step's first rows of each
(runtime/cache/batch.write_rows). The main program's runner is the engine's own: its `execute`
gives the hidden states the draft reads. runtime/assembly.py builds both runners.

Lifecycle of a decoding request (p: its cached tokens; x_p, its last token, is not cached yet):

1. The step that ends its prompt runs the main program over the prompt's last chunk (the
   engine's runner: logits and hidden states) and samples x_p. `MTPDrafter.after_prefill` then runs the draft over
   the same positions, each fed the token one ahead and the main model's hidden state there, as
   the released MTP layers are trained: the draft layer's KV is written for every position, and
   its logits at the last one give d_1 (the engine's `choose`: grammar, greedy or a draw).
   The draft's hidden state there is kept, by state slot.
2. Each later step, `propose`: D - 1 draft decode steps at positions p .. p + D - 2, each fed the
   previous draft token and the draft's own previous hidden state (chained, as the released
   models do), give d_2 .. d_D, each step's drafts chosen on the host (`choose`) before the next
   step is built. When every request's drafts are the draft's argmax (the engine's
   `_drafts_by_argmax`: greedy, no grammar), `propose_on_device` runs the chain on the device
   instead: d_1 is the argmax the last draft step left by slot (`first`), each step is laid out
   with a placeholder token and fed the previous step's argmax there, and nothing is read: the
   verify step takes the drafts from the device too, and the engine reads them back with the
   target's argmax in one read per round (its `_verify_on_device`).
3. `verify`: one target_verify step of the main program over [x_p, d_1 .. d_D] at positions
   p .. p + D, logits and hidden states at each; linear layers keep the state after each of the
   first D positions (StatePool intermediate entries), the last in the request's slot.
4. The engine keeps m drafts and one token of the target's own (1 <= m + 1 <= D + 1). `keep`:
   the state after position p + m becomes the request's (StatePool.keep_verified) and p grows by
   m + 1. Full-attention KV written at p + m + 1 .. p + D (main and draft layers) is stale and is
   never read: a query reads positions up to its own, and every later step writes a position
   before any query at or past it runs.
5. `after_verify`: the draft runs positions p .. p + D in the verify layout (a fixed shape per
   batch, so it can be captured), fed the kept tokens and the main model's hidden states there;
   its logits at position p + m give the next d_1 (chosen on the host, or left on the device as
   the argmax when no request needs the host), its hidden state there is kept. In a round that
   reads the device once (greedy, drafts on the device), `after_verify_on_device` runs it before
   that read: m, the kept tokens and the logits rows are worked out on the device from the drafts
   and the verify step's argmax (the greedy rule), so the host lays the draft step out while the
   device still runs the verify step, instead of after it while the device idles. A request that
   the read then stops has had its draft step for nothing: it wrote only its own pages and slot.

Pages: a verify step and the draft after it write up to position p + D, the chain up to
p + D - 2, so the engine reserves pages for D tokens past a decoding request's next one.

With a prefix cache, the draft layer's KV of a cached prefix comes with the shared pages; at the
prefix's last position it was computed from the first owner's next token, which may differ from
the new request's. That changes what the draft proposes, never what is kept.

For the same reason the draft's captured graphs run torch's own matrix products under
`--batch-invariant` (runtime/backends/batch_invariant_aten.products_to_torch): the fixed-order
kernel is slower at a draft step's one row, and only the verify rows must be fixed-order.

It does not schedule or sample (the engine does) nor capture graphs (the graph runner does).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from compiler.splitops import Mode
from runtime.cache.batch import SeqState
from runtime.step.host_copy import to_device
from runtime.cache.state_pool import StatePool

__all__ = ["DraftChunk", "MTPDrafter", "SpeculativeDecoder", "MAX_DRAFT_TOKENS", "check_draft_program",
           "check_drafter"]

MAX_DRAFT_TOKENS = 7  # D: the verify step's buckets and the intermediate states grow with it


def _view(seq: SeqState, start: int) -> SeqState:
    """The request's slot and pages, starting at position `start` (the draft rewrites positions the
    main program already ran). Shares the page list: the pages are there already."""
    return SeqState(seq.slot, seq.pages, start)


@dataclasses.dataclass
class DraftChunk:
    """Positions start .. start + len(ids) - 1 of one request, for the draft after a main step."""

    seq: SeqState
    start: int
    ids: list[int]  # the token one ahead of each position
    rows: torch.Tensor  # the main step's hidden-state rows of those positions [len(ids)] int64
    request: object | None  # the request that takes its next d_1 from the last position (None: no draft)


class MTPDrafter:
    """The artifact's draft program as a proposer (see the module docstring, steps 1, 2 and 5).

    choose(requests, logits [B, V], position) -> None appends each request's draft token at
    `position` (0 .. D-1) to its drafts (`request.drafts`), after its grammar and sampling.
    `propose_on_device` and `first_drafts` hand back argmax drafts for the engine to append
    (its `_take_drafts`)."""

    def __init__(self, steps, draft_tokens: int, num_slots: int, hidden_size: int, dtype: torch.dtype, device):
        self.steps, self.draft_tokens = steps, draft_tokens
        # the draft's hidden state at each request's last drafted position, by state slot
        self.hidden = torch.zeros(num_slots + 1, hidden_size, dtype=dtype, device=device)
        # the draft logits' argmax there, by state slot: d_1 of the request's next round, on the
        # device, for a round that chains on the device (`propose_on_device`)
        self.first = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)

    def _index(self, values: list[int]) -> torch.Tensor:
        """values as an int64 index on the drafter's device, the copy queued (runtime/step/host_copy.py)."""
        return to_device(values, self.hidden.device)

    def first_drafts(self, requests: list) -> list[int]:
        """The d_1 each request's last draft step left on the device (`first`), read on the host."""
        return self.first[self._index([r.seq.slot for r in requests])].tolist()

    def _run(self, items, hidden: torch.Tensor, mode: Optional[Mode] = None, logits_rows=None,
             input_ids: Optional[torch.Tensor] = None, logits_index: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """input_ids, logits_index: on the device, over the step's first ids and logits rows."""
        step, key = self.steps.build(items, mode=mode, logits_rows=logits_rows)
        step.hidden = hidden  # the step is this call's own: set in place, not copied
        return self.steps.run_outputs(step, key, input_ids=input_ids, logits_index=logits_index)

    def after_prefill(self, chunks: list[DraftChunk], main_hidden: torch.Tensor, choose) -> None:
        if not chunks:
            return
        items = [(_view(c.seq, c.start), c.ids) for c in chunks]
        hidden = main_hidden[torch.cat([c.rows for c in chunks]).to(main_hidden.device)]
        logits, draft_hidden = self._run(items, hidden)  # logits: the last position of each chunk
        wants = [i for i, c in enumerate(chunks) if c.request is not None]
        if not wants:
            return
        ends = (torch.tensor([len(c.ids) for c in chunks]).cumsum(0) - 1)[wants].tolist()
        mine = logits[self._index(wants)]
        choose([chunks[i].request for i in wants], mine, 0)
        slots = self._index([chunks[i].seq.slot for i in wants])
        self.hidden[slots] = draft_hidden[self._index(ends)].to(self.hidden.dtype)
        self.first[slots] = mine.argmax(-1)

    def propose(self, requests: list, choose) -> None:
        """d_2 .. d_D for requests whose drafts hold d_1: D - 1 chained draft decode steps, each fed
        the previous step's hidden states as they come out (only the last are kept, by slot), and
        `choose` picks each step's drafts on the host before the next step is built."""
        slots = self._index([r.seq.slot for r in requests])
        hidden = self.hidden[slots]
        for k in range(1, self.draft_tokens):
            items = [(_view(r.seq, r.seq.num_cached + k - 1), [r.drafts[k - 1]]) for r in requests]
            logits, hidden = self._run(items, hidden, mode=Mode.DECODE)
            choose(requests, logits, k)
        self.hidden[slots] = hidden.to(self.hidden.dtype)

    def propose_on_device(self, requests: list) -> torch.Tensor:
        """d_1 .. d_D of each request as the draft logits' argmax, [B, D] int64 on the device, read by
        nobody here: d_1 from `first`, then D - 1 chained draft decode steps, each laid out with a
        placeholder token (the layout does not depend on it) and fed the previous step's argmax
        and hidden states on the device. For requests whose drafts are the argmax (greedy, no
        grammar: the engine's `_drafts_by_argmax`)."""
        slots = self._index([r.seq.slot for r in requests])
        hidden, chosen = self.hidden[slots], [self.first[slots]]
        for k in range(1, self.draft_tokens):
            items = [(_view(r.seq, r.seq.num_cached + k - 1), [0]) for r in requests]
            logits, hidden = self._run(items, hidden, mode=Mode.DECODE, input_ids=chosen[-1])
            chosen.append(logits.argmax(-1))
        if self.draft_tokens > 1:
            self.hidden[slots] = hidden.to(self.hidden.dtype)
        return torch.stack(chosen, 1)

    def after_verify(self, requests: list, starts: list[int], kept: list[list[int]], verify_hidden: torch.Tensor,
                     choose=None) -> None:
        """requests: those that go on; starts: their positions p before the verify step; kept: the
        tokens each kept; verify_hidden [len(requests) * (D + 1), H]: their rows of the verify step.
        choose None: every request's next d_1 is the argmax, left on the device (`first`) for the
        next round's `propose_on_device`, with no read here."""
        if not requests:
            return
        width = self.draft_tokens + 1
        tokens = [toks + [toks[-1]] * (width - len(toks)) for toks in kept]
        rows = self._index([b * width + len(toks) - 1 for b, toks in enumerate(kept)])
        self._verify_layout(requests, starts, tokens, rows, verify_hidden, choose)

    def after_verify_on_device(self, requests: list, starts: list[int], drafts: torch.Tensor, target: torch.Tensor,
                               verify_hidden: torch.Tensor) -> None:
        """`after_verify` for greedy requests before the host knows what they keep (module
        docstring, step 5): drafts [B, D] and the verify step's argmax target [B, D + 1] on the
        device give each request's m (its leading drafts equal to the target's) and its kept
        tokens d_1 .. d_m, t_m, as `greedy_accept` computes them on the host. Each next d_1 is left
        on the device (`first`); nothing is read."""
        if not requests:
            return
        B, width = len(requests), self.draft_tokens + 1
        # m per request: the first column where a draft differs (a column of False appended: D if none
        # does). argmin takes the first of equal minima; an eager sum would, under --batch-invariant,
        # go through the row-sum kernel's Python launch.
        agree = torch.cat([drafts == target[:, :-1], torch.zeros_like(drafts[:, :1], dtype=torch.bool)], 1)
        kept = agree.to(torch.uint8).argmin(1)
        # Fed at p + j: d_{j+1} while j < m, then the target's token at m (repeated as padding).
        column = torch.arange(width, device=drafts.device)[None, :]
        tokens = torch.where(column < kept[:, None], torch.cat([drafts, drafts[:, -1:]], 1), target.gather(1, kept[:, None]))
        rows = torch.arange(B, device=drafts.device) * width + kept
        self._verify_layout(requests, starts, [[0] * width] * B, rows, verify_hidden, input_ids=tokens.flatten())

    def _verify_layout(self, requests: list, starts: list[int], tokens: list[list[int]], rows: torch.Tensor,
                       verify_hidden: torch.Tensor, choose=None, input_ids: Optional[torch.Tensor] = None) -> None:
        """The draft over positions p .. p + D of each request (the verify layout), fed `tokens`
        (or placeholders there, replaced on the device by `input_ids`), with logits at each
        request's row `rows` [B] on the device; keeps the hidden state there and the argmax (after
        `choose`, if given) as each next d_1."""
        items = [(_view(r.seq, p), toks) for r, p, toks in zip(requests, starts, tokens)]
        logits, draft_hidden = self._run(items, verify_hidden, mode=Mode.TARGET_VERIFY, logits_rows=[1] * len(items),
                                         input_ids=input_ids, logits_index=rows)
        if choose is not None:
            choose(requests, logits, 0)
        slots = self._index([r.seq.slot for r in requests])
        self.hidden[slots] = draft_hidden[rows].to(self.hidden.dtype)
        self.first[slots] = logits.argmax(-1)


class SpeculativeDecoder:
    """The engine's side of speculative decoding: the main program's steps, the drafter, the verify step."""

    def __init__(self, main, drafter, draft_tokens: int, state_pool: StatePool):
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-tokens must be in 1..{MAX_DRAFT_TOKENS} (got {draft_tokens})")
        if state_pool.buffers and state_pool.draft_tokens < draft_tokens:
            raise ValueError(f"speculative decoding with {draft_tokens} draft tokens: the state pool holds intermediate "
                             f"states for {state_pool.draft_tokens}; build it with draft_tokens={draft_tokens} "
                             f"(runtime/cache/memory_planner.py)")
        self.main, self.drafter, self.draft_tokens, self.state_pool = main, drafter, draft_tokens, state_pool
        self.draft_s = 0.0  # seconds in the drafter (its host reads of the chosen tokens end each call)
        # A round that reads the device once runs the draft's step after the verify before that
        # read (`MTPDrafter.after_verify_on_device`). False: after it, from the host's kept tokens,
        # as every other round does (benchmarks/serving/spec_bench.py times that order as its baseline).
        self.draft_before_read = True

    @property
    def max_verify(self) -> int:
        """The most requests one verify step holds (the state pool's intermediate rows)."""
        return self.state_pool.verify_rows if self.state_pool.buffers else 1 << 30

    def timed(self, call, *args):
        """call(*args), its seconds counted as the drafter's."""
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.draft_s += time.perf_counter() - start

    def verify(self, items, input_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One target_verify step: items (request state, [last token, d_1 .. d_D]) ->
        (logits [B * (D + 1), V], hidden [B * (D + 1), H]), request b's rows b*(D+1) .. b*(D+1)+D.
        input_ids: the B * (D + 1) ids on the device, in that order, over the items' own (then placeholders)."""
        width = self.draft_tokens + 1
        assert all(len(tokens) == width for _, tokens in items), "a verify step feeds D + 1 tokens per request"
        step, key = self.main.build(items, mode=Mode.TARGET_VERIFY, logits_rows=[width] * len(items))
        logits, hidden = self.main.run_outputs(step, key, input_ids=input_ids)
        return logits, hidden

    def keep(self, seqs: list[SeqState], kept: list[int]) -> None:
        """Request b of the verify step kept kept[b] tokens: its state and cached count follow."""
        if self.state_pool.buffers:
            self.state_pool.keep_verified([seq.slot for seq in seqs], kept)
        for seq, n in zip(seqs, kept):
            seq.num_cached += n


def check_draft_program(docs) -> None:
    """Refuse speculative decoding for an artifact (its ArtifactDocs) that holds no draft program."""
    if "draft" not in docs.programs:
        raise ValueError(f"{docs.path}: --speculative-tokens needs a draft (MTP) program, and this "
                         f"{docs.family} artifact has none (its config enables no MTP layer)")


def check_drafter(artifact) -> None:
    """Refuse speculative decoding for an artifact whose draft program is missing or keeps a state.

    The state pool keeps per-position states for the main program's linear layers only, and a
    round may run the draft's step after a verify before those are kept (after_verify_on_device):
    a draft layer with a state of its own would be neither kept nor rolled back."""
    check_draft_program(artifact.docs)
    stateful = [layer.layer_id for layer in artifact.registry.draft_layers() if layer.state]
    if stateful:
        raise ValueError(f"{artifact.docs.path}: draft layer(s) {stateful} keep a linear-attention state; "
                         f"speculative decoding supports full-attention draft (MTP) layers only")
