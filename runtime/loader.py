"""Load an hgc artifact without executing code from it, and run its programs on a backend.

    art = load_artifact("artifacts/tiny")                  # checks, weights bound, no code run
    forward = art.bind(ops)                                # ops: BoundOps over a backend
    tokens = greedy_generate(forward, ops, kv_pool, state_pool, prompts, 8)

Lifecycle:

1. `read_artifact(path)` reads manifest.json and checks the format version, the torch version
   (major.minor must match the compiler's: .pt2 files are not stable across releases) and the
   SHA-256 of every listed file, and refuses files it does not list. It parses the registry,
   routing.json, split.json and lints.json. `hgc inspect` stops here.
2. `load_artifact(path)` also checks each .pt2 archive (below) and loads it with
   torch.export.load, and binds the weights by name: weights.json says which checkpoint tensors
   (from weights.safetensors, or from the checkpoint files recorded by --link-weights, whose size
   and header hash are checked) fill each program parameter.
3. `forward_for(mode, ops)` re-applies the split plan recorded for that mode
   (`compiler.splitops.artifact.apply_split_plan`; the compiler's passes are never imported),
   rewrites the meta device the graph was traced on to the load device, and binds every hgc op
   node to the op table `ops` (a BoundOps), so each op runs `backend.<op>(ctx, ...)`. `bind(ops)`
   returns a callable with the model's forward signature that picks the plan of each step's mode
   from `ops.ctx.mode`.

What torch.export.load would unpickle or execute (torch 2.13, torch/export/pt2_archive/_package.py
and torch/_export/serde/serialize.py), and what this loader does about each:

- weights or constants stored with `use_pickle: true` are read with torch.load(weights_only=False):
  arbitrary code. The weights config must list no pickled entry, and every weight record must be
  empty: hgc programs are weightless (traced on the meta device).
- constants of torchbind / opaque types are read with torch._C._pickle_load_obj / pickle.loads: the
  constants config must be empty.
- the sample inputs record is read with torch.load(weights_only=True) and, when that fails, again
  with weights_only=False: the record must be empty (the compiler saves no example inputs).
- legacy weight/constant files (data/weights/<model>.pt), AOTInductor packages under
  data/aotinductor/ (a shared library loaded with dlopen: native code), and any other entry are
  refused: the archive may hold exactly the entries torch.export.save writes for a weightless
  program, nothing else.
- symbolic shape expressions (`expr_str`) are parsed with sympy.sympify, which evaluates Python:
  each one must parse to calls of sympy / torch sympy classes on names and constants only.
- node targets are resolved by getattr chains from the torch, operator and math modules (which
  would reach, say, torch.os.system): every target must be a torch.ops.{aten,prims,hgc} overload
  or an allowlisted operator function.

The checks run on the bytes already read and hashed, and torch.export.load gets those same bytes,
so the file cannot change between check and load.

Linked weights (`hgc compile --link-weights`) are checked by file size and the SHA-256 of each
safetensors header (names, dtypes, shapes, offsets), not of the data: a checkpoint rewritten with
the same layout and other values passes. Hashing every weight byte at each load is exactly what
linking avoids; copy the weights into the artifact when that matters.

What it does not do: allocate caches (runtime pools), schedule requests (the engine), capture
CUDA graphs (the graph runner), or trust anything it has not checked.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Callable

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
import torch.utils._sympy.functions as sympy_functions
from torch.export.graph_signature import InputKind, OutputKind

from compiler.splitops import LayerRegistry, Mode, op_name_of, op_schemas  # also registers the hgc ops graphs call
from compiler.splitops.artifact import (DRAFT_GRAPH, GRAPH, LINTS, MANIFEST, PROGRAM_FILES,
                                        PROGRAM_INPUTS, ROUTING, SPLIT, WEIGHT_MAP, WEIGHTS, ArtifactFormatError,
                                        ParamSource, SplitPlan, apply_split_plan, check_format, load_json,
                                        parse_split_doc, parse_weights_doc, program_outputs, safetensors_header,
                                        sha256_file)

__all__ = ["LoadError", "ArtifactDocs", "LoadedArtifact", "ProgramRunner", "read_artifact", "load_artifact",
           "check_pt2_bytes"]


class LoadError(ValueError):
    """An artifact this runtime refuses; the message names the file, the field and what to do."""


# -- 1. documents and hashes -------------------------------------------------------------------


@dataclasses.dataclass
class ArtifactDocs:
    """Everything in an artifact except the programs and the weights: checked, parsed JSON."""

    path: Path
    manifest: dict
    registry: LayerRegistry
    routing: dict
    split_plans: dict[str, dict[Mode, SplitPlan]]
    lints: dict

    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def programs(self) -> list[str]:
        return list(self.manifest["programs"])


def _torch_release(version: str) -> tuple[str, str]:
    parts = version.split("+")[0].split(".")
    return parts[0], parts[1] if len(parts) > 1 else "0"


def _listed_files(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(out)


def _check_op_schemas(root: Path, manifest: dict) -> None:
    """The programs call hgc ops positionally in the schemas they were traced with: refuse an
    artifact whose ops differ from this runtime's, naming each op that changed."""
    recorded = manifest.get("op_schemas")
    if not isinstance(recorded, dict):
        raise LoadError(f"{root / MANIFEST}: no 'op_schemas' (compiled by an hgc that did not record its op "
                        f"vocabulary): recompile the checkpoint with this hgc")
    here = op_schemas()
    changed = sorted(name for name in set(recorded) | set(here) if recorded.get(name) != here.get(name))
    if changed:
        detail = "; ".join(f"hgc.{n}: artifact {recorded.get(n, 'absent')}, runtime {here.get(n, 'absent')}"
                           for n in changed[:2])
        raise LoadError(f"{root}: compiled for other hgc op schemas ({', '.join(changed)} changed: {detail}); "
                        f"recompile the checkpoint with this hgc")


def read_artifact(path: str | os.PathLike, verify_hashes: bool = True) -> ArtifactDocs:
    root = Path(path)
    if not root.is_dir():
        raise LoadError(f"{root}: not an artifact folder (compile one with `hgc compile CHECKPOINT -o {root}`)")
    try:
        manifest = check_format(load_json(root / MANIFEST, "manifest"), str(root / MANIFEST))
    except ArtifactFormatError as e:
        raise LoadError(str(e)) from None
    for field in ("versions", "family", "registry", "programs", "files", "weights"):
        if field not in manifest:
            raise LoadError(f"{root / MANIFEST}: field {field!r} missing")
    _check_op_schemas(root, manifest)
    built, here = manifest["versions"].get("torch", "?"), torch.__version__
    if _torch_release(built) != _torch_release(here):
        raise LoadError(f"{root}: compiled with torch {built}, this runtime has torch {here}; .pt2 programs are not "
                        f"portable across torch releases: recompile with this torch")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise LoadError(f"{root / MANIFEST}: field 'files' must map file names to SHA-256")
    present = [f for f in _listed_files(root) if f != MANIFEST]
    unlisted = sorted(set(present) - set(files))
    if unlisted:
        raise LoadError(f"{root}: file(s) {unlisted[:3]} are not listed in manifest.json (an artifact holds only what "
                        f"the compiler wrote)")
    for name, digest in sorted(files.items()):
        target = (root / name)
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise LoadError(f"{root / MANIFEST}: listed file {name!r} lies outside the artifact")
        if not target.is_file() or target.is_symlink():
            raise LoadError(f"{root}: listed file {name} is missing (or not a plain file): the artifact is incomplete")
        if verify_hashes and name not in _HASHED_ON_LOAD:
            _check_hash(target, digest, name)
    for name in (ROUTING, SPLIT, LINTS):
        if name not in files:
            raise LoadError(f"{root}: {name} is not listed in manifest.json")
        if not verify_hashes:  # these are parsed below: always checked
            _check_hash(root / name, files[name], name)
    try:
        registry = LayerRegistry.from_json(manifest["registry"])
        routing = check_format(load_json(root / ROUTING), ROUTING)
        split_plans = parse_split_doc(load_json(root / SPLIT), SPLIT)
        lints = check_format(load_json(root / LINTS), LINTS)
    except (ArtifactFormatError, KeyError, ValueError, TypeError) as e:
        raise LoadError(f"{root}: {e}") from None
    for program in manifest["programs"]:
        if program not in PROGRAM_FILES or program not in split_plans:
            raise LoadError(f"{root}: program {program!r} has no split plan or is unknown to this runtime")
    return ArtifactDocs(root, manifest, registry, routing, split_plans, lints)


# Files whose hash `load_artifact` checks on the bytes it reads anyway (read once, not twice).
_HASHED_ON_LOAD = {GRAPH, DRAFT_GRAPH, WEIGHTS}


def _check_hash(path: Path, expected: str, name: str, data: bytes | None = None) -> None:
    import hashlib
    got = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
    if got != expected:
        raise LoadError(f"{path}: SHA-256 {got[:16]}... does not match manifest.json ({str(expected)[:16]}...): "
                        f"{name} was modified or corrupted after compile; recompile")


# -- 2. .pt2 archives ------------------------------------------------------------------------------

_TARGET_RE = re.compile(r"^torch\.ops\.(aten|prims|hgc)\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+$")
_OPERATOR_TARGETS = {f"_operator.{n}" for n in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pos", "pow", "eq", "ne", "lt", "le",
    "gt", "ge", "and_", "or_", "not_", "abs")}
_SYM_TARGETS = {f"torch.{n}" for n in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite",
                                       "sym_sqrt", "_sym_sqrt")}
_SYMPY_NAMES = {"oo", "zoo", "nan", "true", "false", "True", "False", "None", "pi", "E", "I"}
_ARCHIVE_FIXED = ("archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
                  "models/model.json", "data/weights/model_weights_config.json",
                  "data/constants/model_constants_config.json", "data/sample_inputs/model.pt")
_WEIGHT_RECORD = re.compile(r"^data/weights/weight_[0-9]+$")


def _sympy_callable(name: str) -> bool:
    for module in (sympy, sympy_functions):
        obj = getattr(module, name, None)
        if isinstance(obj, type) and issubclass(obj, sympy.Basic):
            return True
    return False


def _check_expr(expr: str, source: str, cache: dict) -> None:
    """An expression sympify may evaluate: sympy constructors applied to names and constants only."""
    if expr in cache:
        return
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise LoadError(f"{source}: symbolic expression {expr[:80]!r} does not parse") from None
    allowed_ops = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.Load, ast.BinOp, ast.UnaryOp, ast.keyword)) or isinstance(node, allowed_ops):
            if isinstance(node, ast.keyword) and (node.arg is None or node.arg.startswith("_")):
                raise LoadError(f"{source}: symbolic expression {expr[:80]!r} passes **kwargs or a private keyword")
            continue
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and _sympy_callable(node.func.id)):
                raise LoadError(f"{source}: symbolic expression {expr[:80]!r} calls something that is not a sympy "
                                f"constructor: refused (sympify would evaluate it as Python)")
            continue
        if isinstance(node, ast.Name):
            if not (node.id in _SYMPY_NAMES or _sympy_callable(node.id) or re.fullmatch(r"[a-z]{1,3}[0-9]+", node.id)):
                raise LoadError(f"{source}: symbolic expression {expr[:80]!r} names {node.id!r}, which is neither a "
                                f"shape symbol nor a sympy class: refused")
            continue
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", node.value):
                raise LoadError(f"{source}: symbolic expression {expr[:80]!r} holds a string that is not a symbol name")
            if not isinstance(node.value, (str, int, float, bool)) and node.value is not None:
                raise LoadError(f"{source}: symbolic expression {expr[:80]!r} holds a constant of type "
                                f"{type(node.value).__name__}")
            continue
        raise LoadError(f"{source}: symbolic expression {expr[:80]!r} uses Python syntax {type(node).__name__}: refused")
    cache[expr] = True


def _check_model_json(doc, source: str) -> None:
    cache: dict = {}
    stack = [doc]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            target = obj.get("target")
            if isinstance(target, str) and "inputs" in obj and "outputs" in obj:
                if not (_TARGET_RE.match(target) or target in _OPERATOR_TARGETS or target in _SYM_TARGETS):
                    raise LoadError(f"{source}: node target {target!r} is outside the allowed set (torch.ops.aten / "
                                    f"prims / hgc overloads and basic operators): refused")
            for key, value in obj.items():
                if key == "expr_str":
                    if not isinstance(value, str):
                        raise LoadError(f"{source}: expr_str must be a string")
                    _check_expr(value, source, cache)
                else:
                    stack.append(value)
        elif isinstance(obj, list):
            stack.extend(obj)
    for name in (doc.get("range_constraints") or {}):
        if not re.fullmatch(r"[a-z]{1,3}[0-9]+", str(name)):
            raise LoadError(f"{source}: range constraint on {name!r}, which is not a shape symbol")


def check_pt2_bytes(data: bytes, name: str) -> None:
    """Refuse a .pt2 archive torch.export.load could use to run code (see the module docstring)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except zipfile.BadZipFile as e:
        raise LoadError(f"{name}: not a .pt2 archive ({e})") from None
    roots = {info.filename.split("/", 1)[0] for info in infos}
    if len(roots) != 1:
        raise LoadError(f"{name}: archive entries under several roots {sorted(roots)[:3]}")
    root = roots.pop()
    entries = {info.filename[len(root) + 1:]: info for info in infos}
    for entry, info in entries.items():
        if entry in _ARCHIVE_FIXED:
            continue
        if _WEIGHT_RECORD.match(entry):
            if info.file_size != 0:
                raise LoadError(f"{name}: weight record {entry} holds {info.file_size} bytes; hgc programs are "
                                f"weightless (weights come from weights.safetensors)")
            continue
        raise LoadError(f"{name}: unexpected archive entry {entry!r} (AOTInductor code, pickled objects and extra "
                        f"files are refused)")
    for needed in ("models/model.json", "data/weights/model_weights_config.json",
                   "data/constants/model_constants_config.json"):
        if needed not in entries:
            raise LoadError(f"{name}: archive lacks {needed}")
    if "data/sample_inputs/model.pt" in entries and entries["data/sample_inputs/model.pt"].file_size != 0:
        raise LoadError(f"{name}: archive carries pickled sample inputs, which torch would unpickle without "
                        f"weights_only when safe loading fails: refused")

    def read_json(entry):
        try:
            return json.loads(archive.read(f"{root}/{entry}"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LoadError(f"{name}: {entry} is not JSON ({e})") from None

    weights = read_json("data/weights/model_weights_config.json")
    for fqn, meta in (weights.get("config") or {}).items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False or \
                not re.fullmatch(r"weight_[0-9]+", str(meta.get("path_name"))):
            raise LoadError(f"{name}: weight {fqn!r} is stored pickled or under an unexpected record: refused")
    constants = read_json("data/constants/model_constants_config.json")
    if constants.get("config"):
        raise LoadError(f"{name}: the program carries constants ({sorted(constants['config'])[:3]}); hgc programs "
                        f"have none (custom objects and tensor constants would be unpickled)")
    _check_model_json(read_json("models/model.json"), name)


def _load_program(path: Path, expected_sha: str):
    data = path.read_bytes()
    _check_hash(path, expected_sha, path.name, data)
    check_pt2_bytes(data, str(path))
    return torch.export.load(io.BytesIO(data))


# -- 2b. weights ---------------------------------------------------------------------------------------


class _WeightFiles:
    """name -> (file, safe_open handle) over weights.safetensors or the linked checkpoint files."""

    def __init__(self, docs: ArtifactDocs, device: str):
        from safetensors import safe_open

        root, spec = docs.path, docs.manifest["weights"]
        if spec.get("mode") == "copy":
            paths = [root / spec.get("file", WEIGHTS)]
            _check_hash(paths[0], docs.manifest["files"][WEIGHTS], WEIGHTS)
        elif spec.get("mode") == "link":
            paths = [self._linked(root, entry) for entry in spec.get("files", [])]
        else:
            raise LoadError(f"{root / MANIFEST}: weights.mode {spec.get('mode')!r} (expected 'copy' or 'link')")
        self.where: dict[str, object] = {}
        for p in paths:
            handle = safe_open(str(p), framework="pt", device="cpu")
            for name in handle.keys():
                self.where.setdefault(name, handle)

    @staticmethod
    def _linked(root: Path, entry: dict) -> Path:
        import hashlib
        candidates = [root / entry["relative_path"], Path(entry["absolute_path"])]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise LoadError(f"{root}: linked weights file {entry['relative_path']} (absolute {entry['absolute_path']}) "
                            f"is missing: the checkpoint moved; recompile or restore it")
        size = found.stat().st_size
        if size != entry["size"]:
            raise LoadError(f"{found}: {size} bytes, the artifact linked a file of {entry['size']} bytes: the checkpoint "
                            f"changed after compile; recompile")
        header, _ = safetensors_header(found)
        if hashlib.sha256(header).hexdigest() != entry["header_sha256"]:
            raise LoadError(f"{found}: its safetensors header differs from the one the artifact linked: the "
                            f"checkpoint changed after compile; recompile")
        return found

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)
        except KeyError:
            raise LoadError(f"weights: tensor {name!r} listed in weights.json is in no weights file") from None


def _assemble(fqn: str, source: ParamSource, files: _WeightFiles, device: str) -> torch.Tensor:
    dtype = getattr(torch, source.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise LoadError(f"{WEIGHT_MAP}: tensor {fqn} has unknown dtype {source.dtype!r}")
    # Always a fresh allocation filled with copy_, as the eager model's load does: a tensor read
    # from safetensors may sit at any 8-byte offset of the file, and CPU kernels pick different
    # vector paths (different rounding) for differently aligned data.
    out = torch.empty(source.shape, dtype=dtype, device=device)
    if source.is_whole():
        t = files.get(source.views[0].name)
        if tuple(t.shape) != source.shape:
            raise LoadError(f"weights: {source.views[0].name} has shape {list(t.shape)}, {fqn} needs {list(source.shape)}")
        return out.copy_(t)
    if sum(v.numel for v in source.views) != source.numel:
        raise LoadError(f"{WEIGHT_MAP}: the views of {fqn} do not cover it exactly")
    for v in source.views:
        t = files.get(v.name)
        if tuple(t.shape) != v.shape:
            raise LoadError(f"weights: {v.name} has shape {list(t.shape)}, its place in {fqn} is {list(v.shape)}")
        out.as_strided(v.shape, v.stride, v.offset).copy_(t)
    return out


# -- 3. programs -------------------------------------------------------------------------------------


def _rewrite_device(value, device: torch.device):
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_rewrite_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _rewrite_device(v, device) for k, v in value.items()}
    return value


def _bound_op(ops, name: str) -> Callable:
    method = getattr(ops, name)

    def call(*args):
        return method(*args)

    call.__name__ = call.__qualname__ = f"hgc_{name}"
    return call


def _bind_graph(gm: torch.fx.GraphModule, ops, device: torch.device) -> torch.fx.GraphModule:
    """A copy of `gm` on `device` whose hgc op nodes call `ops` (positional arguments in schema order)."""
    graph = torch.fx.Graph()
    env: dict = {}
    graph.output(graph.graph_copy(gm.graph, env))
    bound: dict[str, Callable] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        node.args = _rewrite_device(node.args, device)
        node.kwargs = _rewrite_device(node.kwargs, device)
        op = op_name_of(node.target)
        if op is None:
            continue
        schema = node.target._schema
        args = list(node.args)
        for arg in schema.arguments[len(args):]:
            if arg.name in node.kwargs:
                args.append(node.kwargs[arg.name])
            elif arg.has_default_value():
                args.append(arg.default_value)
            else:
                raise LoadError(f"graph node {node.name}: hgc.{op} lacks argument {arg.name!r}")
        if op not in bound:
            bound[op] = _bound_op(ops, op)
        node.target, node.args, node.kwargs = bound[op], tuple(args), {}
    return torch.fx.GraphModule(gm, graph)


class ProgramRunner:
    """One program bound to one op table: `runner(mode, *user inputs)` runs the mode's recorded split.

    It returns what the program returns: logits, or (logits, hidden) where `outputs` names two
    (compiler/splitops/artifact.py `program_outputs`)."""

    def __init__(self, name: str, program, plans: dict[Mode, SplitPlan], weights: list[torch.Tensor], ops,
                 device: torch.device, outputs: tuple[str, ...] = ("logits",)):
        self.name, self.program, self.plans, self.ops, self.device = name, program, plans, ops, device
        self.weights = weights
        self.outputs = tuple(outputs)
        sig = program.graph_signature
        self.num_mutations = sum(1 for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT)
        self._bound = _bind_graph(program.graph_module, ops, device)
        self._by_plan: dict[tuple, torch.fx.GraphModule] = {}

    def module_for(self, mode: Mode) -> torch.fx.GraphModule:
        plan = self.plans[Mode(mode)]
        key = tuple((p.kind, p.nodes) for p in plan.pieces)
        if key not in self._by_plan:
            try:
                self._by_plan[key] = apply_split_plan(self._bound, plan)
            except ArtifactFormatError as e:
                raise LoadError(f"{self.name} program: {e}") from None
        return self._by_plan[key]

    def __call__(self, mode: Mode, *inputs):
        outputs = self.module_for(mode)(*self.weights, *inputs)
        user = list(outputs)[self.num_mutations:]
        return pytree.tree_unflatten(user, self.program.call_spec.out_spec)


@dataclasses.dataclass
class LoadedArtifact:
    docs: ArtifactDocs
    programs: dict  # name -> ExportedProgram (weightless)
    weights: dict[str, torch.Tensor]  # model FQN -> tensor on the device
    program_fqns: dict[str, dict[str, str]]
    device: torch.device

    @property
    def manifest(self) -> dict:
        return self.docs.manifest

    @property
    def registry(self) -> LayerRegistry:
        return self.docs.registry

    @property
    def split_plans(self) -> dict[str, dict[Mode, SplitPlan]]:
        return self.docs.split_plans

    def routed_backends(self, program: str = "main") -> set[str]:
        return {e["backend"] for e in self.docs.routing["programs"].get(program, [])}

    def _check_backend(self, ops, program: str) -> None:
        from runtime.backends.capability import BackendCapability

        backend = getattr(ops, "backend", None)
        children = getattr(backend, "children", None)
        offered = set()
        for obj in [backend, *(children if isinstance(children, (tuple, list)) else ())]:
            cap = getattr(type(obj), "capability", None)
            if isinstance(cap, BackendCapability):
                offered |= {cap.name, *cap.children}
            if isinstance(getattr(obj, "name", None), str):
                offered.add(obj.name)
        missing = sorted(self.routed_backends(program) - offered)
        if missing:
            raise LoadError(f"{self.docs.path}: the {program} program routes ops to backend(s) {missing}, and the op "
                            f"table given runs on {sorted(n for n in offered if n)}; build the runtime with those "
                            f"backends or compile with --target {self.manifest['compile']['target']} backends")

    def runner(self, ops, program: str = "main") -> ProgramRunner:
        if program not in self.programs:
            raise LoadError(f"{self.docs.path}: no {program} program (programs: {sorted(self.programs)})")
        self._check_backend(ops, program)
        ep = self.programs[program]
        lifted = [s.target for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
        tensors = [self.weights[self.program_fqns[program][fqn]] for fqn in lifted]
        return ProgramRunner(program, ep, self.split_plans[program], tensors, ops, self.device,
                             program_outputs(program, self.programs))

    def forward_for(self, mode: Mode | str, ops, program: str = "main") -> Callable:
        """The program's forward in one mode: (input_ids, positions, logits_index) -> logits for "main"
        (the main program's hidden states, where it returns them, are left out: `bind(all_outputs=True)`)."""
        run = self.runner(ops, program)
        mode = Mode(mode)
        pick = _pick_outputs(run, program, all_outputs=False)
        return lambda *inputs: pick(run(mode, *inputs))

    def bind(self, ops, program: str = "main", all_outputs: bool = False) -> Callable:
        """The program's forward, choosing each step's plan from `ops.ctx.mode` (call inside `ops.step(ctx)`).

        "main" returns logits, as a family model's forward does; with `all_outputs` it returns
        every output `program_outputs` names (logits, hidden) where there are two. "draft" always
        returns (logits, hidden)."""
        run = self.runner(ops, program)
        pick = _pick_outputs(run, program, all_outputs)

        def forward(*inputs):
            if ops.ctx is None:
                raise LoadError("artifact forward called outside a runtime step (use `with ops.step(ctx):`)")
            return pick(run(ops.ctx.mode, *inputs))

        forward.__name__ = f"{self.docs.family}_{program}_forward"
        return forward


def _pick_outputs(run: ProgramRunner, program: str, all_outputs: bool) -> Callable:
    """What a bound forward hands back: the main program's logits alone unless every output is asked for."""
    if program == "main" and not all_outputs and len(run.outputs) > 1:
        return lambda outputs: outputs[0]
    return lambda outputs: outputs


def load_artifact(path: str | os.PathLike, device: str | torch.device = "cpu",
                  expected_pipeline: str | None = None) -> LoadedArtifact:
    """Steps 1-2 of the module docstring. `expected_pipeline`: the pipeline fingerprint
    (manifest "pipeline_sha256") this runtime accepts; None accepts any pipeline of this format."""
    docs = read_artifact(path)
    if expected_pipeline is not None and docs.manifest.get("pipeline_sha256") != expected_pipeline:
        raise LoadError(f"{docs.path}: compiled by another pipeline (fingerprint "
                        f"{str(docs.manifest.get('pipeline_sha256'))[:12]}..., expected {expected_pipeline[:12]}...): "
                        f"recompile with this hgc")
    device = torch.device(device)
    files = docs.manifest["files"]
    programs = {}
    for program in docs.programs:
        fname = PROGRAM_FILES[program]
        if fname not in files:
            raise LoadError(f"{docs.path}: program {program} has no {fname} listed in manifest.json")
        programs[program] = _load_program(docs.path / fname, files[fname])
    if WEIGHT_MAP not in files:
        raise LoadError(f"{docs.path}: {WEIGHT_MAP} is not listed in manifest.json")
    try:
        sources, program_fqns = parse_weights_doc(load_json(docs.path / WEIGHT_MAP), WEIGHT_MAP)
    except ArtifactFormatError as e:
        raise LoadError(f"{docs.path}: {e}") from None
    for program, ep in programs.items():
        lifted = [s.target for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
        unmapped = [f for f in lifted if f not in program_fqns.get(program, {})]
        if unmapped:
            raise LoadError(f"{docs.path}: {WEIGHT_MAP} does not say where {program} parameter {unmapped[0]!r} comes from")
        users = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        if tuple(users) != PROGRAM_INPUTS[program]:
            raise LoadError(f"{docs.path}: the {program} program takes {users}, expected {list(PROGRAM_INPUTS[program])}")
        outputs = program_outputs(program, programs)
        returned = sum(s.kind == OutputKind.USER_OUTPUT for s in ep.graph_signature.output_specs)
        recorded = docs.manifest["programs"][program].get("outputs")
        if returned != len(outputs) or (recorded is not None and tuple(recorded) != outputs):
            raise LoadError(f"{docs.path}: the {program} program returns {returned} output(s) (manifest: {recorded}); "
                            f"this runtime expects {list(outputs)}: recompile the checkpoint with this hgc")
    weight_files = _WeightFiles(docs, str(device))
    weights = {fqn: _assemble(fqn, src, weight_files, str(device)) for fqn, src in sources.items()}
    return LoadedArtifact(docs, programs, weights, program_fqns, device)

