"""BackendCapability: what one backend declares it can do; CapabilityTable: the declarations routing reads.

A backend class carries its declaration as a class attribute (`capability = BackendCapability(...)`),
so the fact lives beside the code it describes (docs/DESIGN.md: "backend capabilities in the
backend's own declaration"). The declarations are written in runtime/backends/ and in third-party
packages (entry-point group `hgc.backends`); this module only says what a declaration holds, on
the ground floor, so the compiler's routing pass and the runtime's binder read one definition
without importing each other.

Lifecycle of a declaration:

1. A backend module declares `capability` on its class: device, ops, modes it runs, modes in which
   it may be captured in a CUDA graph, layer kinds, activation dtypes, shape limits, kernel options,
   priority.
2. The runtime's backend registry (runtime/backends/__init__.py) collects the declarations of every
   backend it can build into a `CapabilityTable`; the command line hands that table to the compiler.
3. The routing pass asks the table which backends of the target serve each op node (`candidates`),
   asks each one why it cannot (`refusal`: op, kind, mode, dtype, shape) and records the choice,
   with its kernel options resolved (`resolve_options`), in routing.json.
4. The split pass captures a node in a mode only where its op's policy AND its routed backend allow it.
5. At start-up the runtime asks the same `refusal` of the backend routing.json names, on the facts
   of the loaded graph, and refuses to serve on any answer.

It chooses nothing (routing does) and runs nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional

from .ops import OP_SPECS
from .policy import MODES, Mode
from .registry import LayerKind

__all__ = ["BackendCapability", "CapabilityTable", "CapabilityError", "ShapeLimit", "OpCapture", "ChoiceScope",
           "OptionDtypes", "DTYPES", "instance_key"]

# The activation dtypes a compile can trace in (hgc compile --dtype): what `dtypes` may name.
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


class CapabilityError(ValueError):
    """A declaration that contradicts itself or the op vocabulary, or a choice it does not offer."""


@dataclasses.dataclass(frozen=True)
class ShapeLimit:
    """The sizes one dimension of one op argument may take on a backend.

    Example (FlashInfer's prefill kernels build head dims 64, 128 and 256 only)::

        ShapeLimit("gqa_attention", "q", -1, sizes=frozenset({64, 128, 256}), why="FlashInfer builds ...")
    """

    op: str
    arg: str  # a schema argument of the op
    dim: int  # index into that argument's shape (negative counts from the end)
    sizes: Optional[frozenset[int]] = None  # allowed sizes; None: any size (other conditions still apply)
    power_of_two: bool = False
    why: str = ""  # where the limit comes from, shown in the refusal

    def __post_init__(self) -> None:
        if self.op not in OP_SPECS:
            raise CapabilityError(f"shape limit on {self.op!r}: not an op of the vocabulary")

    def refusal(self, size: Optional[int]) -> Optional[str]:
        """Why `size` breaks the limit, or None. A dynamic size (None, the token dimension) passes."""
        if size is None:
            return None
        if self.sizes is not None and size not in self.sizes:
            return f"{self.arg} dim {self.dim} is {size}, it takes {sorted(self.sizes)}{self._because()}"
        if self.power_of_two and (size < 1 or size & (size - 1)):
            return f"{self.arg} dim {self.dim} is {size}, it takes powers of two{self._because()}"
        return None

    def _because(self) -> str:
        return f" ({self.why})" if self.why else ""

    def to_json(self) -> dict:
        return {"op": self.op, "arg": self.arg, "dim": self.dim,
                "sizes": None if self.sizes is None else sorted(self.sizes), "power_of_two": self.power_of_two,
                "why": self.why}

    @classmethod
    def from_json(cls, obj: dict) -> "ShapeLimit":
        sizes = obj.get("sizes")
        return cls(str(obj["op"]), str(obj["arg"]), int(obj["dim"]), None if sizes is None else frozenset(sizes),
                   bool(obj.get("power_of_two", False)), str(obj.get("why", "")))


@dataclasses.dataclass(frozen=True)
class OpCapture:
    """One op of a backend capturable in more modes than the backend's `modes_capturable`, where the
    node's kernel options match `when` (every (option, choice) pair; none: always).

    Example (GDN extend steps capturable on our chunk kernels, not on FLA's)::

        OpCapture("gdn_core", frozenset({Mode.EXTEND, Mode.MIXED}), when=(("chunk_impl", "triton"),))

    Example (GQA extend steps of up to `whole_extend_tokens` tokens capturable in whole-step graphs)::

        OpCapture("gqa_attention", frozenset({Mode.EXTEND, Mode.MIXED}), up_to="whole_extend_tokens")
    """

    op: str
    modes: frozenset[Mode]
    when: tuple[tuple[str, str], ...] = ()
    why: str = ""  # what makes these modes capturable, shown by `hgc backends`
    # A kernel option whose choice (a token count) bounds the steps captured: only a step of at most
    # that many tokens may hold the op in a graph ("": any step). The split keeps such an op an eager
    # gap (larger steps run it there) and records the bound, under which a whole-step graph may
    # capture the gap too (SplitPlan.whole_up_to).
    up_to: str = ""

    def __post_init__(self) -> None:
        if self.op not in OP_SPECS:
            raise CapabilityError(f"op capture of {self.op!r}: not an op of the vocabulary")

    def applies(self, op: str, mode: Mode, options: Mapping[str, str]) -> bool:
        return op == self.op and mode in self.modes and all(options.get(k) == v for k, v in self.when)

    def tokens(self, options: Mapping[str, str]) -> Optional[int]:
        """The most tokens of a step this entry captures under `options` (resolved); None: any."""
        return int(options[self.up_to]) if self.up_to else None

    def to_json(self) -> dict:
        return {"op": self.op, "modes": [m.value for m in MODES if m in self.modes],
                "when": {k: v for k, v in self.when}, "why": self.why, "up_to": self.up_to}

    @classmethod
    def from_json(cls, obj: dict) -> "OpCapture":
        return cls(str(obj["op"]), frozenset(Mode(m) for m in obj["modes"]),
                   tuple((str(k), str(v)) for k, v in (obj.get("when") or {}).items()), str(obj.get("why", "")),
                   str(obj.get("up_to", "")))


@dataclasses.dataclass(frozen=True)
class ChoiceScope:
    """A kernel option's choice that serves only some of a backend's ops: routing refuses a node of
    another op routed here with it (a default choice serves every op, so it is never scoped).

    Example (FlashInfer's Triton extend kernel serves GQA layers, not MLA)::

        ChoiceScope("extend_impl", "triton", frozenset({"gqa_attention"}))
    """

    option: str
    choice: str
    ops: frozenset[str]
    why: str = ""  # shown in the refusal

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(OP_SPECS))
        if unknown:
            raise CapabilityError(f"choice scope {self.option}={self.choice}: ops outside the vocabulary {unknown}")

    def refusal(self, op: str, options: Mapping[str, str]) -> Optional[str]:
        """Why a node of `op` with these resolved options cannot take this choice, or None."""
        if options.get(self.option) != self.choice or op in self.ops:
            return None
        why = f" ({self.why})" if self.why else ""
        return (f"{self.option}={self.choice} serves {', '.join(f'hgc.{o}' for o in sorted(self.ops))} only, "
                f"not hgc.{op}{why}")

    def to_json(self) -> dict:
        return {"option": self.option, "choice": self.choice, "ops": sorted(self.ops), "why": self.why}

    @classmethod
    def from_json(cls, obj: dict) -> "ChoiceScope":
        return cls(str(obj["option"]), str(obj["choice"]), frozenset(obj["ops"]), str(obj.get("why", "")))


@dataclasses.dataclass(frozen=True)
class OptionDtypes:
    """Activation dtypes one op of a backend runs beyond its `dtypes`, where the node's kernel options
    match `when` (every (option, choice) pair): kernels of its own there, not the library whose
    dtypes `dtypes` lists.

    Example (FlashInfer's GQA layers on the Triton kernels alone, float32 included)::

        OptionDtypes("gqa_attention", frozenset({"float32"}), when=(("decode_impl", "triton"), ("extend_impl", "triton")))
    """

    op: str
    dtypes: frozenset[str]
    when: tuple[tuple[str, str], ...]
    why: str = ""

    def __post_init__(self) -> None:
        if self.op not in OP_SPECS:
            raise CapabilityError(f"option dtypes of {self.op!r}: not an op of the vocabulary")
        if not set(self.dtypes) <= set(DTYPES):
            raise CapabilityError(f"option dtypes of {self.op}: {sorted(set(self.dtypes) - set(DTYPES))} are not "
                                  f"among {list(DTYPES)}")

    def applies(self, op: str, dtype: str, options: Mapping[str, str]) -> bool:
        return op == self.op and dtype in self.dtypes and all(options.get(k) == v for k, v in self.when)

    def condition(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.when)

    def to_json(self) -> dict:
        return {"op": self.op, "dtypes": sorted(self.dtypes), "when": {k: v for k, v in self.when}, "why": self.why}

    @classmethod
    def from_json(cls, obj: dict) -> "OptionDtypes":
        return cls(str(obj["op"]), frozenset(obj["dtypes"]),
                   tuple((str(k), str(v)) for k, v in (obj.get("when") or {}).items()), str(obj.get("why", "")))


def instance_key(backend: str, options: Mapping[str, str]) -> str:
    """The name of one backend instance: the backend, with its kernel options when it has any.

    Nodes routed to the same backend with the same options share one instance; `flashinfer` with
    options {"extend_impl": "paged"} is the instance "flashinfer[extend_impl=paged]".
    """
    if not options:
        return backend
    return f"{backend}[{','.join(f'{k}={options[k]}' for k in sorted(options))}]"


@dataclasses.dataclass(frozen=True)
class BackendCapability:
    """One backend's declaration.

    Example (a CUDA linear-attention backend that can be captured in decode only)::

        BackendCapability("triton_linear", "cuda",
                          ops=frozenset({"gdn_core", "kda_core", "lightning_core", "short_conv"}),
                          modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}))
    """

    name: str  # unique in a runtime: what routing.json records for each node
    device: str  # "cpu", "cuda", ...: the compile target this backend serves
    ops: frozenset[str]  # hgc op names it implements
    modes_supported: frozenset[Mode] = frozenset(MODES)  # modes it can run at all
    modes_capturable: frozenset[Mode] = frozenset()  # modes in which its kernels may sit in a CUDA graph
    # Ops capturable in more modes than that, under some kernel options: read through `capturable`.
    op_capture: tuple[OpCapture, ...] = ()
    kinds: Optional[frozenset[LayerKind]] = None  # layer kinds it serves; None: any kind the op serves
    dtypes: Optional[frozenset[str]] = None  # activation dtypes (the dtype of an op's `out`); None: any
    # More dtypes for some ops under some kernel options (their own kernels): read through `refusal`.
    option_dtypes: tuple[OptionDtypes, ...] = ()
    limits: tuple[ShapeLimit, ...] = ()  # shape limits of its kernels
    # Kernel alternatives, each an option with its choices, the first the default. Routing records
    # the resolved choice per node; `--route OP=BACKEND[option=choice]` picks another.
    options: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Choices of those options that serve only some of its ops (routing refuses them for the others).
    choice_ops: tuple[ChoiceScope, ...] = ()
    # The kernel options under which every decode and verify row this backend computes is bit for bit
    # the same whatever else shares its step (batch size, rows per request, other requests' lengths):
    # `hgc compile --batch-invariant` sets them on every node routed here. (): always so; None: no
    # such choice, and routing refuses the backend under that flag. batch_invariant_ops: the ops
    # they hold for (None: every op it declares); routing refuses it for the others.
    batch_invariant: Optional[tuple[tuple[str, str], ...]] = None
    batch_invariant_ops: Optional[frozenset[str]] = None
    priority: int = 0  # among several backends that fit a node, the highest wins (then declaration order)
    explicit_only: bool = False  # never chosen by priority: only a --route naming it binds a node here
    # Fused ops (ops.FUSED_OPS) the fusion pass puts in place of their region only when a route names
    # this backend for them (`--route gdn_fused=NAME`): for a backend whose fused kernels do not beat
    # the unfused ops at every size, so that the default program keeps the region.
    fused_on_route: frozenset[str] = frozenset()
    doc: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(OP_SPECS))
        if unknown:
            raise CapabilityError(f"backend {self.name!r}: declares ops outside the vocabulary: {unknown}")
        for field in ("modes_supported", "modes_capturable"):
            bad = [m for m in getattr(self, field) if not isinstance(m, Mode)]
            if bad:
                raise CapabilityError(f"backend {self.name!r}: {field} holds non-Mode values {bad}")
        if not set(self.modes_capturable) <= set(self.modes_supported):
            raise CapabilityError(f"backend {self.name!r}: capturable in modes it does not support: "
                                  f"{sorted(m.value for m in set(self.modes_capturable) - set(self.modes_supported))}")
        for extra in self.op_capture:
            if extra.op not in self.ops:
                raise CapabilityError(f"backend {self.name!r}: op capture of {extra.op!r}, an op it does not declare")
            if not set(extra.modes) <= set(self.modes_supported):
                raise CapabilityError(f"backend {self.name!r}: {extra.op} capturable in modes it does not support")
            choices = dict(self.options)
            for option, choice in extra.when:
                if choice not in choices.get(option, ()):
                    raise CapabilityError(f"backend {self.name!r}: op capture of {extra.op} names {option}={choice}, "
                                          f"not one of its options' choices")
            if extra.up_to and not all(c.isdigit() for c in choices.get(extra.up_to, ("",))):
                raise CapabilityError(f"backend {self.name!r}: op capture of {extra.op} is bounded by option "
                                      f"{extra.up_to!r}, which must be one of its options with token counts for choices")
        for extra in self.option_dtypes:
            if extra.op not in self.ops:
                raise CapabilityError(f"backend {self.name!r}: option dtypes of {extra.op!r}, an op it does not declare")
            choices = dict(self.options)
            for option, choice in extra.when:
                if choice not in choices.get(option, ()):
                    raise CapabilityError(f"backend {self.name!r}: option dtypes of {extra.op} name {option}={choice}, "
                                          f"not one of its options' choices")
        if self.dtypes is not None and not set(self.dtypes) <= set(DTYPES):
            raise CapabilityError(f"backend {self.name!r}: dtypes {sorted(set(self.dtypes) - set(DTYPES))} are not "
                                  f"among {list(DTYPES)}")
        stray = [f"{lim.op}.{lim.arg}" for lim in self.limits if lim.op not in self.ops]
        if stray:
            raise CapabilityError(f"backend {self.name!r}: shape limits on ops it does not declare: {stray}")
        for option, choices in self.options:
            if not choices or len(set(choices)) != len(choices):
                raise CapabilityError(f"backend {self.name!r}: option {option!r} needs distinct choices, got {choices}")
        for scope in self.choice_ops:
            values = dict(self.options).get(scope.option, ())
            if scope.choice not in values[1:]:
                raise CapabilityError(f"backend {self.name!r}: choice scope {scope.option}={scope.choice} names no "
                                      f"choice of its options but their defaults (a default serves every op)")
            if not set(scope.ops) <= set(self.ops):
                raise CapabilityError(f"backend {self.name!r}: choice scope {scope.option}={scope.choice} names ops "
                                      f"{sorted(set(scope.ops) - set(self.ops))} it does not declare")
        for option, choice in self.batch_invariant or ():
            if choice not in dict(self.options).get(option, ()):
                raise CapabilityError(f"backend {self.name!r}: batch-invariant choice {option}={choice} is not one of "
                                      f"its options' choices")
        if self.batch_invariant_ops is not None and not set(self.batch_invariant_ops) <= set(self.ops):
            raise CapabilityError(f"backend {self.name!r}: batch-invariant ops "
                                  f"{sorted(set(self.batch_invariant_ops) - set(self.ops))} it does not declare")

    def serves(self, op: str, kind: Optional[LayerKind]) -> bool:
        """Whether this backend runs `op` for a layer of `kind` (kind None: an op of no layer kind)."""
        if op not in self.ops:
            return False
        return self.kinds is None or kind is None or kind in self.kinds

    def refusal(self, op: str, kind: Optional[LayerKind], dtype: Optional[str],
                shapes: Mapping[str, tuple] = {}, options: Optional[Mapping[str, str]] = None  # noqa: B006 - read only
                ) -> Optional[str]:
        """Why this backend cannot run a node of `op` for a layer of `kind` in `dtype` with these
        argument shapes (name -> sizes, None for a dynamic size) and kernel `options` (unset ones:
        their defaults), in every mode; None when it can."""
        if op not in self.ops:
            return f"does not implement hgc.{op} (it declares {sorted(self.ops)})"
        if not self.serves(op, kind):
            return f"serves {sorted(k.value for k in self.kinds)} layers, not {LayerKind(kind).value}"
        lacking = [m.value for m in MODES if m not in self.modes_supported]
        if lacking:
            return f"does not run mode(s) {lacking}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            resolved = {o: (options or {}).get(o, values[0]) for o, values in self.options}
            extra = [e for e in self.option_dtypes if e.op == op and dtype in e.dtypes]
            if not any(e.applies(op, dtype, resolved) for e in extra):
                elsewhere = "".join(f" (hgc.{op} runs {dtype} with {e.condition()})" for e in extra)
                return f"runs dtypes {sorted(self.dtypes)}, not {dtype}{elsewhere}"
        for limit in self.limits:
            if limit.op != op or limit.arg not in shapes:
                continue
            shape = shapes[limit.arg]
            if not -len(shape) <= limit.dim < len(shape):
                return f"{limit.arg} has {len(shape)} dims, its limit reads dim {limit.dim}"
            why = limit.refusal(shape[limit.dim])
            if why:
                return why
        return None

    def batch_invariant_for(self, op: str) -> Optional[dict[str, str]]:
        """The options that make this backend's rows of `op` batch-invariant, or None: it has none."""
        if self.batch_invariant is None or (self.batch_invariant_ops is not None and op not in self.batch_invariant_ops):
            return None
        return dict(self.batch_invariant)

    def option_choices(self) -> dict[str, tuple[str, ...]]:
        return dict(self.options)

    def capturable(self, op: str, mode: Mode, options: Optional[Mapping[str, str]] = None) -> bool:
        """Whether a node of `op` routed here with kernel `options` (unset ones: their defaults) may
        sit in a CUDA graph in `mode`, in steps of any size: the backend's modes, or an `op_capture`
        entry that applies with no `up_to` bound (a bounded one leaves the node a gap: `capture_tokens`)."""
        return self.capture_tokens(op, mode, options) is None

    def capture_tokens(self, op: str, mode: Mode, options: Optional[Mapping[str, str]] = None) -> Optional[int]:
        """The most tokens of a `mode` step in which a node of `op` routed here with kernel `options`
        may sit in a CUDA graph: None, any step (`capturable`); else the largest bound of the
        `op_capture` entries that apply with an `up_to` option (0: none applies, never captured)."""
        mode = Mode(mode)
        if mode in self.modes_capturable:
            return None
        resolved = {o: (options or {}).get(o, values[0]) for o, values in self.options}
        bounds = [extra.tokens(resolved) for extra in self.op_capture if extra.applies(op, mode, resolved)]
        return None if None in bounds else max(bounds, default=0)

    def choice_refusal(self, op: str, options: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """Why a node of `op` routed here cannot take these kernel `options` (a choice scoped to
        other ops: `choice_ops`), or None."""
        resolved = {o: (options or {}).get(o, values[0]) for o, values in self.options}
        return next((why for scope in self.choice_ops if (why := scope.refusal(op, resolved)) is not None), None)

    def capturable_modes(self, op: str, options: Optional[Mapping[str, str]] = None) -> list[str]:
        """The modes `capturable` allows for `op` with `options`, in mode order (routing.json records them)."""
        return [m.value for m in MODES if self.capturable(op, m, options)]

    def capture_bounds(self, op: str, options: Optional[Mapping[str, str]] = None) -> dict[str, int]:
        """The modes in which `op` with `options` is captured only in steps of up to some tokens, with
        that bound (`capture_tokens`; routing.json records them)."""
        return {m.value: n for m in MODES if (n := self.capture_tokens(op, m, options))}

    def resolve_options(self, given: Mapping[str, str]) -> dict[str, str]:
        """Every declared option with its choice: `given` where set, else the default (first) choice."""
        choices = self.option_choices()
        unknown = sorted(set(given) - set(choices))
        if unknown:
            offered = ", ".join(f"{k} ({'|'.join(v)})" for k, v in choices.items()) or "none"
            raise CapabilityError(f"backend {self.name!r} has no option {unknown[0]!r} (options: {offered})")
        for option, value in given.items():
            if value not in choices[option]:
                raise CapabilityError(f"backend {self.name!r}: option {option} takes {'|'.join(choices[option])}, "
                                      f"not {value!r}")
        return {option: given.get(option, values[0]) for option, values in choices.items()}

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "device": self.device,
            "ops": sorted(self.ops),
            "modes_supported": [m.value for m in MODES if m in self.modes_supported],
            "modes_capturable": [m.value for m in MODES if m in self.modes_capturable],
            "op_capture": [extra.to_json() for extra in self.op_capture],
            "kinds": None if self.kinds is None else sorted(k.value for k in self.kinds),
            "dtypes": None if self.dtypes is None else sorted(self.dtypes),
            "option_dtypes": [extra.to_json() for extra in self.option_dtypes],
            "limits": [lim.to_json() for lim in self.limits],
            "options": {k: list(v) for k, v in self.options},
            "choice_ops": [scope.to_json() for scope in self.choice_ops],
            "batch_invariant": None if self.batch_invariant is None else dict(self.batch_invariant),
            "batch_invariant_ops": None if self.batch_invariant_ops is None else sorted(self.batch_invariant_ops),
            "priority": self.priority,
            "explicit_only": self.explicit_only,
            "fused_on_route": sorted(self.fused_on_route),
        }

    @classmethod
    def from_json(cls, obj: dict) -> "BackendCapability":
        return cls(
            name=str(obj["name"]), device=str(obj["device"]), ops=frozenset(obj["ops"]),
            modes_supported=frozenset(Mode(m) for m in obj["modes_supported"]),
            modes_capturable=frozenset(Mode(m) for m in obj["modes_capturable"]),
            op_capture=tuple(OpCapture.from_json(extra) for extra in obj.get("op_capture", ())),
            kinds=None if obj.get("kinds") is None else frozenset(LayerKind(k) for k in obj["kinds"]),
            dtypes=None if obj.get("dtypes") is None else frozenset(obj["dtypes"]),
            option_dtypes=tuple(OptionDtypes.from_json(extra) for extra in obj.get("option_dtypes", ())),
            limits=tuple(ShapeLimit.from_json(lim) for lim in obj.get("limits", ())),
            options=tuple((k, tuple(v)) for k, v in (obj.get("options") or {}).items()),
            choice_ops=tuple(ChoiceScope.from_json(scope) for scope in obj.get("choice_ops", ())),
            batch_invariant=(None if obj.get("batch_invariant") is None
                             else tuple((k, str(v)) for k, v in obj["batch_invariant"].items())),
            batch_invariant_ops=(None if obj.get("batch_invariant_ops") is None
                                 else frozenset(obj["batch_invariant_ops"])),
            priority=int(obj.get("priority", 0)), explicit_only=bool(obj.get("explicit_only", False)),
            fused_on_route=frozenset(obj.get("fused_on_route", ())),
        )


class CapabilityTable:
    """The declarations of one runtime's backends, in declaration order, looked up by name and device.

    `sources` says where each declaration came from ("built-in runtime.backends...", or the entry
    point of the package that installed it); `hgc backends` and routing's messages show it.
    """

    def __init__(self, capabilities: Iterable[BackendCapability], sources: Optional[Mapping[str, str]] = None):
        self.capabilities: tuple[BackendCapability, ...] = tuple(capabilities)
        self._by_name: dict[str, BackendCapability] = {}
        for cap in self.capabilities:
            if cap.name in self._by_name:
                raise CapabilityError(f"two backends declare the name {cap.name!r}"
                                      f"{self._where(sources, cap.name)}")
            self._by_name[cap.name] = cap
        self.sources: dict[str, str] = {c.name: (sources or {}).get(c.name, "declared in code")
                                        for c in self.capabilities}

    @staticmethod
    def _where(sources, name) -> str:
        return f" ({sources[name]})" if sources and name in sources else ""

    def __iter__(self):
        return iter(self.capabilities)

    def __len__(self) -> int:
        return len(self.capabilities)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> BackendCapability:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no backend named {name!r} (backends: {sorted(self._by_name)})") from None

    def names(self) -> list[str]:
        return [c.name for c in self.capabilities]

    def devices(self) -> list[str]:
        return sorted({c.device for c in self.capabilities})

    def on_device(self, device: str) -> list[BackendCapability]:
        return [c for c in self.capabilities if c.device == device]

    def candidates(self, op: str, kind: Optional[LayerKind], device: str) -> list[BackendCapability]:
        """Backends on `device` that run `op` for layers of `kind`, best first (priority, then
        declaration order); `explicit_only` ones are left out: only a route binds a node to them."""
        fits = [c for c in self.on_device(device) if not c.explicit_only and c.serves(op, kind)]
        order = {c.name: i for i, c in enumerate(self.capabilities)}
        return sorted(fits, key=lambda c: (-c.priority, order[c.name]))

    def to_json(self) -> list[dict]:
        return [{**c.to_json(), "source": self.sources[c.name]} for c in self.capabilities]
