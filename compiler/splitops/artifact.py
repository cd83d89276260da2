"""The artifact format: file names, JSON documents and the split-plan re-application, in one place.

The compiler's writer (compiler/artifact_writer.py) and the runtime's loader (runtime/artifact/loader.py)
both use this module, so the two cannot disagree on a field. It depends on torch only.

An artifact is a folder::

    manifest.json         format version, versions, SHA-256 of every other file, family, registry,
                          capture buckets, pass fingerprints, weight source; sealed by
                          `manifest_sha256`, the SHA-256 of its own other fields
    graph.pt2             torch.export.save of the weightless main program (meta parameters)
    draft.pt2             the draft (MTP) program, where the model has one
    weights.safetensors   checkpoint tensors under their checkpoint names (absent with --link-weights, --no-weights)
    weights.json          how each program parameter is assembled from checkpoint tensors
    computed.safetensors  tensors the model computes from its config that ranks take slices of (tp > 1, where any)
    sharding.json         --tp > 1: the rank count, how each rank reads each tensor, the collectives
    routing.json          the backend (and kernel options) of every hgc op node: the binding the runtime executes
    split.json            per program and mode, the ordered pieces: captured or eager, with node names,
                          and a captured piece's side-stream branches (fork, nodes, join; `--overlap`)
    lints.json            every lint finding of the compile
    tokenizer.json ...    the checkpoint's tokenizer files, when it has them (data; listed in the manifest)
    dumps/                NN_<pass>.{txt,onnx,svg}: the graph after each pass (for people, not hashed by the loader's run path)

Lifecycle:

1. The writer builds each document with the `*_doc` helpers and writes it with `dump_json`
   (sorted keys, fixed indentation: the same input gives the same bytes).
   The manifest is written last, sealed with `seal_manifest` (an edit to any field of it, not
   only to the files it lists, is then refused by `check_manifest_seal`).
2. The loader reads each document back with the matching `parse_*` helper, which checks the
   format version and the fields it needs and raises `ArtifactFormatError` naming file and field.
3. `apply_split_plan` turns a recorded plan back into a GraphModule of pieces; the compiler's
   split pass produces plans, and the loader re-applies them without importing the compiler.

What this module does not do: decide anything (passes do), open an artifact folder, or check
hashes against files (the loader does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
from pathlib import Path
import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from .capability import BackendCapability, CapabilityError, instance_key
from .policy import MODES, Mode
from .rows import GroupedRows
from .sharding import ShardSpec

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "GRAPH", "DRAFT_GRAPH", "WEIGHTS", "WEIGHT_MAP", "ROUTING",
    "SPLIT", "LINTS", "DUMPS", "PROGRAM_FILES", "PROGRAM_INPUTS", "program_outputs", "DEFAULT_DECODE_BATCH_SIZES",
    "DEFAULT_EXTEND_TOKEN_COUNTS", "BUCKET_CHOICES", "BUCKET_COSTS_FORMAT", "BucketCosts", "bucket_costs_doc",
    "parse_bucket_costs", "CAPTURED", "EAGER", "extend_graphs", "whole_bound_refusal", "ArtifactFormatError", "dump_json", "load_json",
    "sha256_file", "safetensors_header", "SideBranch", "Piece", "SplitPlan", "split_doc", "parse_split_doc",
    "apply_split_plan", "plan_node_names", "retarget_meta_devices", "TensorView", "ParamSource", "weights_doc", "parse_weights_doc",
    "check_format", "piece_module_names", "RouteEntry", "RoutingTable", "routing_doc", "parse_routing_doc",
    "SHARDING", "COMPUTED", "Sharding", "sharding_doc", "parse_sharding_doc",
    "MANIFEST_SEAL", "seal_manifest", "check_manifest_seal",
]

FORMAT_NAME = "hgc-artifact"
# 2: routing.json is the binding (per node backend, kernel options, declarations used)
# 3: manifest.json is sealed by its own hash; linked weight files record the SHA-256 of their data
# 4: a captured piece of split.json may carry side-stream branches (the overlap pass): a runtime
#    that ignored them would silently run a plan other than the one recorded
# 5: a view of weights.json may carry a row order (rows.GroupedRows; Qwen3-Next's GDN projections):
#    a runtime that ignored it would load those rows in the checkpoint's order, silently wrong
FORMAT_VERSION = 5

MANIFEST = "manifest.json"
GRAPH = "graph.pt2"
DRAFT_GRAPH = "draft.pt2"
WEIGHTS = "weights.safetensors"
WEIGHT_MAP = "weights.json"
ROUTING = "routing.json"
SPLIT = "split.json"
LINTS = "lints.json"
SHARDING = "sharding.json"
COMPUTED = "computed.safetensors"
DUMPS = "dumps"

PROGRAM_FILES: dict[str, str] = {"main": GRAPH, "draft": DRAFT_GRAPH}
# The user inputs of each program, in call order: the model's forward signature.
PROGRAM_INPUTS: dict[str, tuple[str, ...]] = {
    "main": ("input_ids", "positions", "logits_index"),
    "draft": ("input_ids", "positions", "hidden", "logits_index"),
}


def program_outputs(program: str, programs) -> tuple[str, ...]:
    """What `program` returns, in order, in an artifact holding `programs`.

    logits [R, V] always. The draft returns its hidden states [T, D] too (the next draft position
    reads them), and so does the main program of a model that has a draft: the draft's first
    position after a main step reads the main model's final hidden state at the same position.
    """
    return ("logits", "hidden") if program == "draft" or "draft" in programs else ("logits",)

# Capture buckets recorded for the runtime's graph runner. Decode: padded request counts (powers of
# two up to 256 cover serving batch sizes with at most 2x padding). Extend: padded token counts of
# an extend or mixed step, powers of two from 16 (a prefix-cache hit's suffix, a short prompt, a
# chat turn: padded to 256 tokens they cost several decode steps) to a 4096-token chunk. A bucket of
# t tokens holds min(t, largest decode bucket) requests (runtime/graphs/buckets.py), so the small
# ones cap no larger step's requests.
DEFAULT_DECODE_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_EXTEND_TOKEN_COUNTS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# How an artifact's buckets were chosen, recorded as the manifest's buckets.chosen_by: the defaults
# above, --decode-buckets / --extend-buckets, or from measured step costs (`hgc compile
# --bucket-costs FILE`, a bucket-costs document; its costs are kept as buckets.measured). An
# artifact compiled before the field has none.
BUCKET_CHOICES: tuple[str, ...] = ("defaults", "flags", "measured")
BUCKET_COSTS_FORMAT = "hgc-bucket-costs"

CAPTURED = "captured"
EAGER = "eager"


class ArtifactFormatError(ValueError):
    """A document that is not what this format version says it is; the message names file and field."""


# -- bytes ---------------------------------------------------------------------------------------


def dump_json(obj) -> bytes:
    """Canonical JSON bytes: sorted keys, two-space indent, trailing newline (byte-identical reruns)."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True) + "\n").encode()


def load_json(path: str | os.PathLike, what: str | None = None):
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ArtifactFormatError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactFormatError(f"{path}: not valid JSON{f' ({what})' if what else ''}: {e}") from None


def sha256_file(path: str | os.PathLike) -> str:
    """The file's SHA-256, in one call over a memory map: hashlib holds no GIL while it hashes, so a
    multi-GB weights file hashed on one thread does not wait on another thread's Python once per
    block (the runtime hashes the weights while the programs load)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # an empty file cannot be mapped
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            h.update(mapped)
    return h.hexdigest()


def safetensors_header(path: str | os.PathLike) -> tuple[bytes, dict]:
    """(the header bytes: 8-byte length + JSON, the parsed JSON) of a safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ArtifactFormatError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > 100 << 20:
            raise ArtifactFormatError(f"{path}: safetensors header claims {n} bytes (over 100 MiB): corrupt")
        body = f.read(n)
    if len(body) < n:
        raise ArtifactFormatError(f"{path}: truncated safetensors header")
    try:
        return head + body, json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactFormatError(f"{path}: safetensors header is not JSON: {e}") from None


MANIFEST_SEAL = "manifest_sha256"


def _manifest_digest(manifest: dict) -> str:
    return hashlib.sha256(dump_json({k: v for k, v in manifest.items() if k != MANIFEST_SEAL})).hexdigest()


def seal_manifest(manifest: dict) -> dict:
    """The manifest with `manifest_sha256`: the SHA-256 of its canonical bytes without that field."""
    return {**manifest, MANIFEST_SEAL: _manifest_digest(manifest)}


def check_manifest_seal(manifest: dict, source: str) -> None:
    """Refuse a manifest whose content is not what the compiler sealed (a field edited by hand)."""
    recorded = manifest.get(MANIFEST_SEAL)
    if not isinstance(recorded, str):
        raise ArtifactFormatError(f"{source}: no {MANIFEST_SEAL!r} (the hash of its own content): recompile "
                                  f"the checkpoint with this hgc")
    if recorded != _manifest_digest(manifest):
        raise ArtifactFormatError(f"{source}: its content does not match its {MANIFEST_SEAL} (a field was edited "
                                  f"after compile); an artifact is written whole by `hgc compile`: recompile")


def check_format(doc, source: str) -> dict:
    """Every JSON document starts with format name and version; refuse anything else."""
    if not isinstance(doc, dict):
        raise ArtifactFormatError(f"{source}: expected a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise ArtifactFormatError(f"{source}: field 'format' is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ArtifactFormatError(f"{source}: format_version {doc.get('format_version')!r}; this hgc reads "
                                  f"version {FORMAT_VERSION}: recompile the checkpoint with this hgc")
    return doc


def _header() -> dict:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}


# -- measured bucket costs -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BucketCosts:
    """What one step of each captured bucket cost on a device: an extend step of one request filling
    the bucket, and a decode step of the bucket's requests (milliseconds, medians)."""

    device: str
    extend_ms: tuple[tuple[int, float], ...]  # (tokens, ms), increasing tokens
    decode_ms: tuple[tuple[int, float], ...] = ()  # (requests, ms)

    def to_json(self) -> dict:
        return {"device": self.device, "extend_ms": {str(t): ms for t, ms in self.extend_ms},
                "decode_ms": {str(b): ms for b, ms in self.decode_ms}}


def bucket_costs_doc(costs: BucketCosts, **facts) -> dict:
    """The document a measurement writes and `hgc compile --bucket-costs` reads; `facts` (model,
    dtype, ...) are kept for people."""
    return {"format": BUCKET_COSTS_FORMAT, **facts, **costs.to_json()}


def parse_bucket_costs(doc, source: str) -> BucketCosts:
    """A bucket-costs document (or the manifest's buckets.measured) back, naming the bad field."""
    if not isinstance(doc, dict):
        raise ArtifactFormatError(f"{source}: expected a JSON object")
    if not isinstance(doc.get("device"), str):
        raise ArtifactFormatError(f"{source}: field 'device' must be a string (the device measured)")

    def table(field: str, required: bool) -> tuple[tuple[int, float], ...]:
        raw = doc.get(field, None if required else {})
        if not isinstance(raw, dict) or (required and not raw):
            raise ArtifactFormatError(f"{source}: field {field!r} must be an object of bucket size -> milliseconds")
        try:
            rows = sorted((int(k), float(v)) for k, v in raw.items())
        except (TypeError, ValueError):
            raise ArtifactFormatError(f"{source}: field {field!r} must map integer sizes to milliseconds") from None
        if any(size < 1 or not ms > 0 or math.isinf(ms) for size, ms in rows):
            raise ArtifactFormatError(f"{source}: field {field!r} must hold sizes >= 1 and times > 0")
        return tuple(rows)

    return BucketCosts(doc["device"], table("extend_ms", True), table("decode_ms", False))


# -- routing ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RouteEntry:
    """One op node's binding: which backend (with which kernel options) runs it, and why."""

    node: str
    op: str
    layer_id: int
    kind: str | None
    backend: str
    options: dict  # kernel option -> choice, every option the backend declares
    dtype: str | None
    chosen_by: str  # "priority", or the --route that bound it

    @property
    def instance(self) -> str:
        """The backend instance the runtime binds this node to (capability.instance_key)."""
        return instance_key(self.backend, self.options)

    @classmethod
    def from_json(cls, obj, source: str) -> "RouteEntry":
        try:
            options = obj.get("options") or {}
            if not isinstance(options, dict) or not all(isinstance(v, str) for v in options.values()):
                raise TypeError("options must map names to strings")
            return cls(str(obj["node"]), str(obj["op"]), int(obj["layer_id"]), obj.get("kind"), str(obj["backend"]),
                       dict(options), obj.get("dtype"), str(obj.get("chosen_by", "priority")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactFormatError(f"{source}: an entry needs node, op, layer_id and backend: {e}") from None


@dataclasses.dataclass(frozen=True)
class RoutingTable:
    """routing.json parsed: the compile target, the user's routes, the declarations of the backends
    the entries name (as they were at compile time), and each program's entries in graph order."""

    target: str
    routes: tuple[str, ...]
    backends: dict[str, BackendCapability]
    programs: dict[str, tuple[RouteEntry, ...]]

    def entries(self, program: str) -> tuple[RouteEntry, ...]:
        return self.programs.get(program, ())

    def backend_names(self, program: str | None = None) -> list[str]:
        """The backends the entries name (of one program, or all), in order of first use."""
        programs = [program] if program is not None else list(self.programs)
        return list(dict.fromkeys(e.backend for p in programs for e in self.entries(p)))


def routing_doc(target: str, routes, capabilities, programs: dict[str, list[dict]],
                unfused: dict[str, list[dict]] | None = None) -> dict:
    """routing.json: the target, the routes asked for, the declarations of the backends used, the
    entries, and (where the fusion pass left any) each program's regions left unfused, with why."""
    used = list(dict.fromkeys(e["backend"] for entries in programs.values() for e in entries))
    left = {program: entries for program, entries in (unfused or {}).items() if entries}
    return {**_header(), "target": target, "routes": [str(r) for r in routes],
            "backends": [{**capabilities[name].to_json(), "source": capabilities.sources[name]} for name in used],
            "programs": programs, **({"unfused": left} if left else {})}


def parse_routing_doc(doc, source: str = ROUTING) -> RoutingTable:
    check_format(doc, source)
    target, programs, backends = doc.get("target"), doc.get("programs"), doc.get("backends")
    if not isinstance(target, str) or not isinstance(programs, dict) or not isinstance(backends, list):
        raise ArtifactFormatError(f"{source}: needs 'target' (a string), 'backends' (a list) and 'programs' (an object)")
    try:
        declared = {str(b["name"]): BackendCapability.from_json(b) for b in backends}
    except (KeyError, TypeError, ValueError, CapabilityError) as e:
        raise ArtifactFormatError(f"{source}: field 'backends': {e}") from None
    parsed = {}
    for program, entries in programs.items():
        if not isinstance(entries, list):
            raise ArtifactFormatError(f"{source}: programs.{program} must be a list of entries")
        parsed[program] = tuple(RouteEntry.from_json(e, f"{source} programs.{program}") for e in entries)
    return RoutingTable(target, tuple(str(r) for r in doc.get("routes", ())), declared, parsed)


# -- split plans ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SideBranch:
    """Nodes of a captured piece that run on the side stream (stream 1) while the main stream (0)
    runs the piece's other nodes between `fork_after` and `join_before`.

    fork_after: the main node after which the side stream waits on the main stream (None: the
    piece's start); join_before: the main node before which the main stream waits on the side
    stream (None: the piece's end). No side node reads a main node after the fork, and no main
    node before the join reads a side node (compiler/passes/overlap.py checks it on the dataflow
    graph; the runtime checks it again on the piece it rewrites). `anchor` is the main node the
    branch overlaps (the reason it exists); the bytes are the size rule's estimates, at one token.
    """

    nodes: tuple[str, ...]  # graph order
    fork_after: str | None
    join_before: str | None
    anchor: str
    side_bytes: int
    main_bytes: int

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "fork_after": self.fork_after, "join_before": self.join_before,
                "anchor": self.anchor, "side_bytes": self.side_bytes, "main_bytes": self.main_bytes}

    @classmethod
    def from_json(cls, obj, source: str) -> "SideBranch":
        try:
            fork, join = obj.get("fork_after"), obj.get("join_before")
            branch = cls(tuple(str(n) for n in obj["nodes"]), None if fork is None else str(fork),
                         None if join is None else str(join), str(obj["anchor"]), int(obj["side_bytes"]),
                         int(obj["main_bytes"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactFormatError(f"{source}: a side branch needs nodes, fork_after, join_before, anchor and "
                                      f"the bytes: {e}") from None
        if not branch.nodes:
            raise ArtifactFormatError(f"{source}: a side branch with no nodes")
        return branch


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of consecutive graph nodes: captured (may be one CUDA graph) or eager (a gap of op cores).

    A captured piece may hold side-stream branches (`branches`, in graph order of their forks):
    every node not in one runs on the main stream."""

    index: int
    kind: str  # CAPTURED or EAGER
    nodes: tuple[str, ...]  # node names, in graph order
    branches: tuple[SideBranch, ...] = ()

    def stream_of(self) -> dict[str, int]:
        """Every node's stream: 1 for a side branch's nodes, 0 for the rest."""
        side = {n for b in self.branches for n in b.nodes}
        return {n: int(n in side) for n in self.nodes}

    def to_json(self) -> dict:
        out = {"index": self.index, "kind": self.kind, "nodes": list(self.nodes)}
        if self.branches:  # a plan without side streams is written as before the overlap pass existed
            out["side_branches"] = [b.to_json() for b in self.branches]
        return out

    @classmethod
    def from_json(cls, obj: dict, source: str) -> "Piece":
        try:
            piece = cls(int(obj["index"]), str(obj["kind"]), tuple(str(n) for n in obj["nodes"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactFormatError(f"{source}: a piece needs index, kind and nodes: {e}") from None
        if piece.kind not in (CAPTURED, EAGER):
            raise ArtifactFormatError(f"{source}: piece {piece.index} has kind {piece.kind!r} "
                                      f"(expected {CAPTURED!r} or {EAGER!r})")
        where = f"{source} piece {piece.index}"
        branches = tuple(SideBranch.from_json(b, f"{where} side_branches") for b in obj.get("side_branches") or ())
        if branches and piece.kind != CAPTURED:
            raise ArtifactFormatError(f"{where}: an eager piece has side branches (only captured pieces hold glue)")
        _check_branches(piece.nodes, branches, where)
        return dataclasses.replace(piece, branches=branches)


def _check_branches(nodes: tuple[str, ...], branches: tuple[SideBranch, ...], where: str) -> None:
    """What a side branch's names must say about one piece: its nodes are the piece's and nobody
    else's, its fork comes before its join and after the previous branch's join (one side stream
    runs one branch at a time)."""
    position = {n: i for i, n in enumerate(nodes)}
    seen: set[str] = set()
    previous_join = -1
    for i, b in enumerate(branches):
        strays = [n for n in b.nodes if n not in position]
        if strays or seen & set(b.nodes) or len(set(b.nodes)) != len(b.nodes):
            raise ArtifactFormatError(f"{where}: side branch {i} names node(s) not in the piece or in another branch "
                                      f"(first: {(strays or sorted(seen & set(b.nodes)) or list(b.nodes))[0]})")
        seen |= set(b.nodes)
        for point in (b.fork_after, b.join_before, b.anchor):
            if point is not None and (point not in position or point in b.nodes):
                raise ArtifactFormatError(f"{where}: side branch {i}: {point!r} is not a main-stream node of the piece")
        fork = -1 if b.fork_after is None else position[b.fork_after]
        join = len(nodes) if b.join_before is None else position[b.join_before]
        if not previous_join <= fork < join:
            raise ArtifactFormatError(f"{where}: side branch {i} forks after {b.fork_after!r} and joins before "
                                      f"{b.join_before!r}: the fork must come before the join, and after the "
                                      f"previous branch's join")
        previous_join = join


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How one program runs in one mode: its pieces in order.

    Example: a GDN layer followed by a full layer, in extend mode, GDN's ops captured (chunk_impl=triton)::

        captured [embedding ... short_conv ... gdn_core ... linear]   eager [gqa_attention]   captured [...]
    """

    mode: Mode
    pieces: tuple[Piece, ...]
    # A plan with eager gaps: the most tokens of a step whose gap ops may all be captured too, so
    # that the step may be one whole-step graph (every gap op's backend captures it in steps of up
    # to that many tokens: BackendCapability.capture_tokens); 0: never. `whole_why` names the gap
    # ops and the kernel options that set it. A plan without gaps is whole at any size.
    whole_up_to: int = 0
    whole_why: str = ""

    def piece_of(self) -> dict[str, int]:
        return {name: p.index for p in self.pieces for name in p.nodes}

    def eager_nodes(self) -> list[str]:
        return [n for p in self.pieces if p.kind == EAGER for n in p.nodes]

    def counts(self) -> dict[str, int]:
        return {CAPTURED: sum(p.kind == CAPTURED for p in self.pieces), EAGER: sum(p.kind == EAGER for p in self.pieces)}

    def side_branches(self) -> list[tuple[int, SideBranch]]:
        """(piece index, branch) of every side-stream branch, in piece order."""
        return [(p.index, b) for p in self.pieces for b in p.branches]

    def has_gaps(self) -> bool:
        return any(p.kind == EAGER for p in self.pieces)

    def whole_at(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens may run this plan as one whole-step graph."""
        return not self.has_gaps() or tokens <= self.whole_up_to

    def to_json(self) -> dict:
        doc = {"mode": self.mode.value, "pieces": [p.to_json() for p in self.pieces]}
        if self.has_gaps():
            doc.update(whole_up_to=self.whole_up_to, whole_why=self.whole_why)
        return doc

    @classmethod
    def from_json(cls, obj: dict, source: str) -> "SplitPlan":
        try:
            mode = Mode(obj["mode"])
        except (KeyError, ValueError, TypeError):
            raise ArtifactFormatError(f"{source}: unknown or missing mode {obj.get('mode')!r}") from None
        pieces = tuple(Piece.from_json(p, f"{source} mode {mode.value}") for p in obj.get("pieces", ()))
        if [p.index for p in pieces] != list(range(len(pieces))):
            raise ArtifactFormatError(f"{source}: mode {mode.value}: piece indices must be 0..{len(pieces) - 1} in order")
        up_to = obj.get("whole_up_to", 0)  # recorded before the field: gaps were never captured
        if not isinstance(up_to, int) or up_to < 0:
            raise ArtifactFormatError(f"{source}: mode {mode.value}: whole_up_to must be a token count, not {up_to!r}")
        return cls(mode, pieces, up_to, str(obj.get("whole_why", "")))


def extend_graphs(plans: dict[Mode, SplitPlan], buckets) -> list[dict]:
    """How each extend bucket of `buckets` is captured, from one program's plans (by mode): "whole"
    (one graph of the whole step) where the extend plan and the mixed plan both allow it at the
    bucket's tokens (mixed steps replay the extend keys' graphs), else "pieces" (captured pieces
    around eager gaps); with why. The graph runner decides by the same `SplitPlan.whole_at`."""
    rows = []
    for tokens in sorted(buckets):
        gapped = [plans[m] for m in (Mode.EXTEND, Mode.MIXED) if plans[m].has_gaps()]
        whole = all(p.whole_at(tokens) for p in gapped)
        if not gapped:
            why = "the extend and mixed plans are one captured piece each"
        else:
            limit = min(p.whole_up_to for p in gapped)
            why = next((p.whole_why for p in gapped if p.whole_up_to == limit), "")
            why = (f"gaps captured up to {limit} tokens: {why}" if limit else f"gaps never captured: {why}")
        rows.append({"tokens": int(tokens), "graph": "whole" if whole else "pieces", "why": why})
    return rows


def whole_bound_refusal(plans: dict[Mode, SplitPlan], buckets) -> str | None:
    """Why one program's plans cannot serve these extend buckets, or None. A gap op captured only in
    steps of up to N tokens runs, eagerly, a kernel chosen by the step's tokens (FlashInfer's
    whole_extend_tokens); a step of at most N tokens must then go to a bucket of at most N, or its
    eager run (start-up parity's reference) and its graph would take different kernels: N must be
    a bucket, or at least the largest."""
    gapped = [plans[m] for m in (Mode.EXTEND, Mode.MIXED) if plans[m].has_gaps() and plans[m].whole_up_to]
    buckets = sorted(buckets)
    for plan in gapped:
        n = plan.whole_up_to
        if buckets and n not in buckets and n < buckets[-1]:
            return (f"the {plan.mode.value} plan's gaps are captured in steps of up to {n} tokens ({plan.whole_why}), "
                    f"which is no extend bucket of {buckets}: a step of at most {n} tokens padded into a larger "
                    f"bucket would replay another kernel than its eager run")
    return None


def split_doc(plans: dict[str, dict[Mode, SplitPlan]], extend_buckets=()) -> dict:
    """split.json: {"programs": {program: {mode: plan}}, "extend_graphs": {program: rows}}, the rows
    how each of the artifact's extend buckets is captured (`extend_graphs`, for people: a run
    decides from the plans, for the buckets it captures)."""
    return {**_header(), "programs": {
        program: {m.value: by_mode[m].to_json() for m in MODES if m in by_mode} for program, by_mode in plans.items()},
        "extend_graphs": {program: extend_graphs(by_mode, extend_buckets) for program, by_mode in plans.items()}}


def parse_split_doc(doc, source: str = SPLIT) -> dict[str, dict[Mode, SplitPlan]]:
    check_format(doc, source)
    programs = doc.get("programs")
    if not isinstance(programs, dict):
        raise ArtifactFormatError(f"{source}: field 'programs' must be an object")
    out: dict[str, dict[Mode, SplitPlan]] = {}
    for program, by_mode in programs.items():
        if not isinstance(by_mode, dict):
            raise ArtifactFormatError(f"{source}: programs.{program} must be an object of modes")
        plans = {Mode(m): SplitPlan.from_json(p, f"{source} programs.{program}") for m, p in by_mode.items()
                 if m in {x.value for x in MODES}}
        missing = [m.value for m in MODES if m not in plans]
        if missing:
            raise ArtifactFormatError(f"{source}: programs.{program} has no plan for mode(s) {missing}")
        out[program] = plans
    return out


def plan_node_names(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes a plan must cover: everything but placeholders and the output, in graph order."""
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def piece_module_names(plan: SplitPlan) -> list[str]:
    """The submodule name split_module gives each piece, in piece order."""
    return [f"submod_{p.index}" for p in plan.pieces]


def apply_split_plan(gm: torch.fx.GraphModule, plan: SplitPlan) -> torch.fx.GraphModule:
    """Cut `gm` into the plan's pieces: a GraphModule calling submod_0, submod_1, ... in order.

    `keep_original_order=True` is what makes this correct: the op nodes in eager pieces mutate
    their `out` argument and return nothing, so no data edge orders a gap before the piece that
    reads its `out`. split_module's default orders pieces topologically by data edges alone and
    could run that reader first; keeping the original order preserves every in-place effect.

    Refuses a plan that does not cover the graph exactly (a stale split.json): every node in one
    piece, pieces in graph order, no unknown names.
    """
    names = plan_node_names(gm)
    piece_of = plan.piece_of()
    planned = [n for p in plan.pieces for n in p.nodes]
    if len(planned) != len(piece_of):
        dup = sorted({n for n in planned if planned.count(n) > 1})
        raise ArtifactFormatError(f"split plan {plan.mode.value}: node(s) {dup[:5]} appear in more than one piece")
    missing = [n for n in names if n not in piece_of]
    unknown = sorted(set(piece_of) - set(names))
    if missing or unknown:
        raise ArtifactFormatError(
            f"split plan {plan.mode.value} does not match the graph: {len(missing)} graph node(s) in no piece "
            f"(first: {missing[:3]}), {len(unknown)} unknown name(s) (first: {unknown[:3]}); "
            f"the plan was recorded for another graph: recompile")
    order = [piece_of[n] for n in names]
    if order != sorted(order):
        at = next(i for i in range(1, len(order)) if order[i] < order[i - 1])
        raise ArtifactFormatError(f"split plan {plan.mode.value}: node {names[at]} is in piece {order[at]} after "
                                  f"a node of piece {order[at - 1]}: pieces must follow graph order")
    # split_module records its partition on each node as an attribute: work on a copy so the
    # caller's graph stays clean.
    src = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
    by_name = {n.name: n for n in src.graph.nodes}
    index = {by_name[n]: piece_of[n] for n in names}
    return split_module(src, None, lambda node: index[node], keep_original_order=True, keep_original_node_name=True)


def retarget_meta_devices(graph: torch.fx.Graph, device: torch.device) -> None:
    """Programs are traced on the meta device: every device argument of `graph`'s nodes (allocations,
    checks) names `device` instead, in place. The loader does it to bind a program, the bundle
    builder to compile its glue."""
    def rewrite(value):
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(rewrite(v) for v in value)
        if isinstance(value, dict):
            return {k: rewrite(v) for k, v in value.items()}
        return value

    for node in graph.nodes:
        node.args, node.kwargs = rewrite(node.args), rewrite(node.kwargs)


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    env: dict = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    for old, copied in env.items():
        copied.meta = dict(old.meta)
    return new


# -- weights -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorView:
    """Checkpoint tensor `name` fills the view (offset, shape, stride) of a program parameter;
    with `rows`, its rows rearranged first (rows.GroupedRows.to_held: the order the program holds
    them in, for the rows this rank reads)."""

    name: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    rows: GroupedRows | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter on the device (a rank's part, for a tensor-parallel program)."""
        return self.numel * getattr(torch, self.dtype).itemsize

    def to_json(self) -> list:
        plain = [self.name, self.offset, list(self.shape), list(self.stride)]
        return plain if self.rows is None else plain + [self.rows.to_json()]

    @classmethod
    def from_json(cls, obj, source: str) -> "TensorView":
        try:
            name, offset, shape, stride, *rows = obj
            if len(rows) > 1:
                raise ValueError(f"{len(obj)} fields")
            return cls(str(name), int(offset), tuple(int(s) for s in shape), tuple(int(s) for s in stride),
                       GroupedRows.from_json(rows[0]) if rows else None)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactFormatError(f"{source}: a view is [name, offset, shape, stride] or [name, offset, shape, "
                                      f"stride, {{groups, segments}}]: {e}") from None


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """A model tensor (by model FQN): its shape and dtype in the program, and the views that fill it."""

    shape: tuple[int, ...]
    dtype: str
    views: tuple[TensorView, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter on the device (a rank's part, for a tensor-parallel program)."""
        return self.numel * getattr(torch, self.dtype).itemsize

    def is_whole(self) -> bool:
        """One checkpoint tensor is the whole parameter, rows in order (the common case: copy, no assembly)."""
        v = self.views
        return (len(v) == 1 and v[0].offset == 0 and v[0].shape == self.shape and v[0].stride == _contiguous(self.shape)
                and v[0].rows is None)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def weights_doc(tensors: dict[str, ParamSource], programs: dict[str, dict[str, str]]) -> dict:
    """weights.json: model tensors with their checkpoint views, and each program's FQN -> model tensor."""
    return {**_header(),
            "tensors": {fqn: {"shape": list(s.shape), "dtype": s.dtype, "views": [v.to_json() for v in s.views]}
                        for fqn, s in tensors.items()},
            "programs": programs}


def parse_weights_doc(doc, source: str = WEIGHT_MAP) -> tuple[dict[str, ParamSource], dict[str, dict[str, str]]]:
    check_format(doc, source)
    tensors, programs = doc.get("tensors"), doc.get("programs")
    if not isinstance(tensors, dict) or not isinstance(programs, dict):
        raise ArtifactFormatError(f"{source}: needs objects 'tensors' and 'programs'")
    out = {}
    for fqn, obj in tensors.items():
        try:
            out[fqn] = ParamSource(tuple(int(s) for s in obj["shape"]), str(obj["dtype"]),
                                   tuple(TensorView.from_json(v, f"{source} tensors.{fqn}") for v in obj["views"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactFormatError(f"{source}: tensors.{fqn}: needs shape, dtype, views: {e}") from None
    for program, mapping in programs.items():
        if not isinstance(mapping, dict) or any(v not in out for v in mapping.values()):
            raise ArtifactFormatError(f"{source}: programs.{program} must map program FQNs to listed tensors")
    return out, programs



# -- tensor parallel -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sharding:
    """sharding.json parsed: the rank count, each checkpoint tensor's ShardSpec, and the rest as
    written (layers' whole and rank shapes, the collectives and why), for `hgc inspect`."""

    tp: int
    tensors: dict[str, ShardSpec]
    doc: dict

    def spec(self, name: str) -> ShardSpec:
        try:
            return self.tensors[name]
        except KeyError:
            raise ArtifactFormatError(f"{SHARDING}: no spec for tensor {name!r}: the document belongs to another "
                                      f"compile; recompile") from None


def sharding_doc(summary: dict) -> dict:
    """sharding.json: the sharding pass's summary (compiler/passes/sharding.py sharding_summary)."""
    return {**_header(), **summary}


def parse_sharding_doc(doc, source: str = SHARDING) -> Sharding:
    check_format(doc, source)
    tp, tensors = doc.get("tp"), doc.get("tensors")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2 or not isinstance(tensors, dict):
        raise ArtifactFormatError(f"{source}: needs 'tp' (an integer >= 2) and 'tensors' (an object)")
    try:
        specs = {str(name): ShardSpec.from_json(obj) for name, obj in tensors.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise ArtifactFormatError(f"{source}: tensors: each spec is {{dim, segments}}: {e}") from None
    return Sharding(tp, specs, doc)
