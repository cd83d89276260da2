"""The .pt2 archives of an artifact: refuse anything torch.export.load could use to run code, then load.

What torch.export.load would unpickle or execute (torch 2.13, torch/export/pt2_archive/_package.py
and torch/_export/serde/serialize.py), and what `check_pt2_bytes` does about each:

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

`load_program` checks a program's hash and archive on the bytes already read, and torch.export.load
gets those same bytes, so the file cannot change between check and load.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import re
import types
import typing
import zipfile
from pathlib import Path

import sympy
import torch
import torch.utils._sympy.functions as sympy_functions

from runtime.artifact.docs import LoadError, check_hash

__all__ = ["check_pt2_bytes", "load_program"]

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


@contextlib.contextmanager
def _in_deserializer(module, **overrides):
    """For the duration of a load, torch's program deserializer sees `module` (which it imports as
    a module attribute of the same name) with `overrides` in place of some of its functions. Where
    a torch build names the module otherwise, nothing is patched and the load is as slow as before."""
    from torch._export.serde import serialize

    name = module.__name__
    if getattr(serialize, name, None) is not module:
        yield
        return
    patched = types.SimpleNamespace(**{a: getattr(module, a) for a in dir(module) if not a.startswith("__")})
    patched.__dict__.update(overrides)
    setattr(serialize, name, patched)
    try:
        yield
    finally:
        setattr(serialize, name, module)


def _once(compute, key):
    """`compute` answered once per `key(*args, **kwargs)` (None: not memoized) for one load."""
    answers: dict = {}

    def call(*args, **kwargs):
        k = key(*args, **kwargs)
        if k is None:
            return compute(*args, **kwargs)
        if k not in answers:
            answers[k] = (compute(*args, **kwargs), args, kwargs)  # the arguments kept alive: their ids stay theirs
        return answers[k][0]
    return call


@contextlib.contextmanager
def _schema_plans():
    """torch.export.load turns the program's JSON into schema dataclasses through
    `serialize._dict_to_dataclass(cls, data)`, which asks the same questions of `cls` for every
    value (is it Optional, a union, a dataclass; its fields; their type hints): about 75,000 calls
    for a bench-size program, a fifth to a quarter of a warm load on the CPU. Here each `cls` is
    asked once per load and the answers kept as a plan, which does what torch's function does for
    that kind of class. Where a torch build has no such function, nothing is patched."""
    from torch._export.serde import serialize

    original = getattr(serialize, "_dict_to_dataclass", None)
    union_base = getattr(serialize, "_Union", None)  # the schema's tagged unions, built through `create`
    if original is None or union_base is None:
        yield
        return
    resolve = getattr(serialize, "_resolve_schema_cls", lambda cls: cls)
    schema_names = vars(serialize.schema)
    plans: dict = {}

    def convert(cls, data):
        try:
            plan = plans.get(cls)
        except TypeError:  # an unhashable annotation: torch's own path
            return original(cls, data)
        if plan is None:
            plan = plans[cls] = plan_for(cls)
        return plan(data)

    def plan_for(cls):
        cls = resolve(cls)
        if isinstance(cls, str):
            return lambda data: original(cls, data)  # raises as torch does
        origin = typing.get_origin(cls)
        if origin is typing.Annotated:
            inner = cls.__origin__
            return lambda data: convert(inner, data)
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(cls):
            if len(typing.get_args(cls)) != 2:
                return lambda data: original(cls, data)  # raises as torch does
            inner = typing.get_args(cls)[0]
            return lambda data: None if data is None else convert(inner, data)
        if isinstance(cls, type) and issubclass(cls, union_base):
            hints = typing.get_type_hints(cls, globalns=schema_names)

            def union(data):
                if not isinstance(data, dict) or len(data) != 1 or not isinstance(next(iter(data)), str):
                    return original(cls, data)  # raises as torch does
                (tag, value), = data.items()
                return cls.create(**{tag: convert(hints[tag], value)})
            return union
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls, globalns=schema_names)
            fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
            # keys the class does not define are ignored, as torch does (forward compatibility)
            return lambda data: cls(**{name: convert(hint, data[name]) for name, hint in fields if name in data})
        args = typing.get_args(cls)

        def value(data):
            if isinstance(data, list):
                return [convert(args[0], d) for d in data] if data else data
            if isinstance(data, dict):
                return {k: convert(args[1], v) for k, v in data.items()}
            return float(data) if cls is float else data
        return value

    serialize._dict_to_dataclass = convert
    try:
        yield
    finally:
        serialize._dict_to_dataclass = original


def _deserializer_memos(plans: bool = True):
    """Questions torch.export.load asks again and again, answered once per load:

    - `typing.get_type_hints(cls)` for a schema class's field types, once per object: tens of
      thousands of calls for a bench-size model, the largest single cost of the load under
      cProfile (`startup_bench.py --profile` shows the load's costs). The classes do not change
      while a load runs.
    - `sympy.sympify(text, locals=...)` for every symbolic size it meets: a thousand parses of a
      handful of distinct expressions ("s0", "2*s0"), a quarter of a warm load on the CPU. The same
      text with the same names bound to the same objects gives the same (immutable) expression.
    - the shape of each schema class, once per class (`_schema_plans`; `plans=False` leaves
      torch's converter, for benchmarks/host/program_load_bench.py's comparison).
    """
    hints = _once(typing.get_type_hints,
                  lambda cls, globalns=None, localns=None, include_extras=False:
                  (cls, id(globalns), id(localns), include_extras))
    parse = _once(sympy.sympify,
                  lambda a, locals=None, *args, **kwargs: None if not isinstance(a, str) or args or kwargs else
                  (a, tuple((n, id(v)) for n, v in (locals or {}).items())))
    stack = contextlib.ExitStack()
    stack.enter_context(_in_deserializer(typing, get_type_hints=hints))
    stack.enter_context(_in_deserializer(sympy, sympify=parse))
    if plans:
        stack.enter_context(_schema_plans())
    return stack


def load_program(path: Path, expected_sha: str):
    data = path.read_bytes()
    check_hash(path, expected_sha, path.name, data)
    check_pt2_bytes(data, str(path))
    with _deserializer_memos():
        return torch.export.load(io.BytesIO(data))

