"""Rules about backend wrappers: every hook a child implements is forwarded, with arguments it accepts.

A wrapper backend (the hybrid one holds a full-attention child and a linear-attention child)
must forward each hook explicitly. Two failures seen in serving engines (docs/DESIGN.md):

- failure 3: the wrapper lacked `init_mha_chunk_metadata`, which its full-attention child had; a
  `hasattr` guard skipped planning silently and prefill crashed later with a shape mismatch.
- failure 4: the forwarded hook passed an argument one child's signature does not take.

Rules, checked by introspection of classes (nothing is instantiated):

- hook-not-forwarded (error; warning for a hook that is defined but calls no child, or forwards
  through a hasattr guard): for every child, every hook the child implements is defined on the
  wrapper.
- hook-signature-mismatch (error): the wrapper's hook signature, and every call forwarding that
  hook in the wrapper's source, bind against each child's signature.

Hooks are the names any class lists in a `HOOKS` tuple (the runtime's protocol class, BackendHooks,
lists its hooks there) and every public method whose name starts with "init_".

Children of a wrapper, first that applies: the `children` argument; an instance's `children`; a
class attribute `children` holding classes (a tuple, or a dict role -> class); otherwise the
wrapper's protocol (the class of its MRO that declares `HOOKS`: BackendHooks) stands for "any
child" (the wrapper must forward every protocol hook with the protocol's arguments). Forwarded
calls are matched against every child, since a class alone does not say which attribute holds
which child. The rules import no runtime module: the classes they look at are handed to them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Iterable, Sequence

from compiler.lints.base import ERROR, WARNING, LintRule

__all__ = ["HookNotForwarded", "HookSignatureMismatch", "BACKEND_RULES", "wrapper_findings", "hook_names",
           "children_of"]


def _protocol_of(cls: type):
    """The protocol class `cls` derives from: the outermost class of its MRO declaring `HOOKS`, or None."""
    return next((c for c in reversed(cls.__mro__) if "HOOKS" in vars(c)), None)


def _cls(obj) -> type:
    return obj if isinstance(obj, type) else type(obj)


def _is_declaration_only(fn) -> bool:
    return getattr(fn, "__isabstractmethod__", False) or getattr(fn, "_hgc_protocol_stub", False)


def implemented(cls: type, name: str) -> bool:
    """`cls` has its own (non-abstract, non-stub) method `name`."""
    fn = getattr(cls, name, None)
    return callable(fn) and not _is_declaration_only(fn)


def hook_names(*classes: type) -> list[str]:
    names: set[str] = set()
    for cls in classes:
        names |= set(getattr(cls, "HOOKS", ()) or ())
        for name in dir(cls):
            if name.startswith("init_") and callable(getattr(cls, name, None)):
                names.add(name)
    return sorted(names)


def children_of(wrapper, children: Sequence | None = None) -> list[type]:
    if children is not None:
        return [_cls(c) for c in children]
    declared = getattr(wrapper, "children", None)
    if isinstance(declared, dict):
        declared = list(declared.values())
    if isinstance(declared, (tuple, list)) and declared and all(not isinstance(c, str) for c in declared):
        return [_cls(c) for c in declared]
    protocol = _protocol_of(_cls(wrapper))
    return [protocol] if protocol is not None else []


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _mirror_call(sig: inspect.Signature) -> tuple[list, dict] | None:
    """Arguments a caller of `sig` may pass (after self): required and defaulted positionals, keyword-onlys."""
    args, kwargs = [], {}
    params = list(sig.parameters.values())[1:]  # drop self
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            args.append(p.name)
        elif p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = p.name
        else:
            return None  # *args / **kwargs: anything may come through
    return args, kwargs


def _forwarding_calls(fn, hook: str) -> list[tuple[int, list[str], list[str], str]] | None:
    """Calls `<x>.<hook>(...)` in fn's source: (line, positional arg texts, keyword names, receiver text)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == hook:
            receiver = node.func.value
            if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super":
                continue  # super().hook(...) is not a forward to a child
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue  # *args / **kwargs: the binding is unknowable statically
            calls.append((node.lineno + fn.__code__.co_firstlineno - 1, [ast.unparse(a) for a in node.args],
                          [k.arg for k in node.keywords], ast.unparse(receiver)))
    return calls


def _uses_hasattr_guard(fn, hook: str) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            if any(isinstance(a, ast.Constant) and a.value == hook for a in node.args):
                return True
    return False


def _child_label(child: type) -> str:
    if _protocol_of(child) is child:
        return "the backend protocol (any child)"
    return child.__name__


def wrapper_findings(wrapper, children: Sequence | None = None) -> list:
    """Both rules' findings for one wrapper class (or instance)."""
    out = []
    for rule in BACKEND_RULES:
        out.extend(rule.check_wrapper(wrapper, children))
    return out


class _WrapperRule(LintRule):
    scope = "backends"

    def check(self, ctx) -> Iterable:
        for wrapper in ctx.backend_wrappers:
            yield from self.check_wrapper(wrapper, None)

    def check_wrapper(self, wrapper, children) -> Iterable:  # pragma: no cover
        raise NotImplementedError


class HookNotForwarded(_WrapperRule):
    id = "hook-not-forwarded"
    severity = ERROR
    failure = 3
    doc = "a wrapper defines every hook any of its children implements, and forwards it"

    def check_wrapper(self, wrapper, children=None):
        w = _cls(wrapper)
        kids = children_of(wrapper, children)
        for child in kids:
            generic = _protocol_of(child) is child
            for hook in hook_names(w, child):
                child_has = (hook in child.HOOKS) if generic else implemented(child, hook)
                if not child_has:
                    continue
                if not implemented(w, hook):
                    yield self.finding(
                        f"wrapper {w.__name__} lacks hook {hook}, which {_child_label(child)} implements: a caller "
                        f"guarding with hasattr would skip the child's planning silently",
                        f"define {w.__name__}.{hook} and forward it explicitly to every child that has it",
                        backend=w.__name__)
                    continue
                fn = getattr(w, hook)
                if _uses_hasattr_guard(fn, hook):
                    yield self.finding(
                        f"wrapper {w.__name__}.{hook} forwards through a hasattr/getattr guard: a child without the "
                        f"hook is skipped silently", f"call each child's {hook} unconditionally (the protocol makes "
                        f"every hook abstract)", backend=w.__name__, severity=WARNING)
                calls = _forwarding_calls(fn, hook)
                if calls is not None and not calls:
                    yield self.finding(
                        f"wrapper {w.__name__}.{hook} never calls a child's {hook}, though {_child_label(child)} "
                        f"implements it", f"forward {hook} to every child in {w.__name__}.{hook}",
                        backend=w.__name__, severity=WARNING)

    def finding(self, message, fix, severity=None, **where):
        f = super().finding(message, fix, **where)
        if severity is not None and severity != f.severity:
            f = dataclasses.replace(f, severity=severity)
        return f


class HookSignatureMismatch(_WrapperRule):
    id = "hook-signature-mismatch"
    severity = ERROR
    failure = 4
    doc = "a wrapper's hooks, and the calls that forward them, fit every child's signature"

    def check_wrapper(self, wrapper, children=None):
        w = _cls(wrapper)
        for child in children_of(wrapper, children):
            for hook in hook_names(w, child):
                if not implemented(w, hook) or not callable(getattr(child, hook, None)):
                    continue
                child_sig = _signature(getattr(child, hook))
                wrapper_sig = _signature(getattr(w, hook))
                if child_sig is None or wrapper_sig is None:
                    continue
                mirrored = _mirror_call(wrapper_sig)
                if mirrored is not None:
                    args, kwargs = mirrored
                    try:
                        child_sig.bind(None, *args, **kwargs)
                    except TypeError as e:
                        yield self.finding(
                            f"wrapper {w.__name__}.{hook}{wrapper_sig} takes arguments that {_child_label(child)}."
                            f"{hook}{child_sig} does not accept ({e})",
                            f"give {w.__name__}.{hook} the child's (protocol's) parameters", backend=w.__name__)
                for line, args, kwargs, receiver in _forwarding_calls(getattr(w, hook), hook) or []:
                    try:
                        child_sig.bind(None, *args, **{k: k for k in kwargs})
                    except TypeError as e:
                        passed = ", ".join(args + [f"{k}=..." for k in kwargs])
                        yield self.finding(
                            f"wrapper {w.__name__}.{hook} forwards {receiver}.{hook}({passed}) (line {line}), which "
                            f"{_child_label(child)}.{hook}{child_sig} does not accept ({e}): a TypeError waiting for "
                            f"whoever uses that child",
                            f"forward exactly the protocol's arguments of {hook}", backend=w.__name__)


BACKEND_RULES: tuple[LintRule, ...] = (HookNotForwarded(), HookSignatureMismatch())
