"""What a lint rule is and what it reports: `LintRule` and `Finding`.

A rule is a small class with an `id`, a `severity`, a one-line `doc`, the failure class of
docs/DESIGN.md it guards where there is one (named in its messages), and `check(...)` yielding
`Finding`s. Each finding names what is wrong (the layer, node or backend), why it matters, and a
fix. Findings are data: the lints pass collects them in the CompileContext, the writer stores
them in lints.json, `hgc lint` prints them, and any finding of severity "error" fails the compile.

Rules come in three scopes, by what they look at:

1. "graph": one program's graph at a time (`check(gm, ctx)`), e.g. an op node whose layer id
   the registry lacks.
2. "artifact": every program together (`check(ctx)`), e.g. a registry layer no program uses.
3. "backends": the backend classes of the runtime (`check(ctx)`), e.g. a wrapper that does not
   forward a hook.

This module holds no rules (see registry_rules.py, capture_rules.py, backend_rules.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

__all__ = ["ERROR", "WARNING", "INFO", "SEVERITIES", "Finding", "LintRule", "has_errors", "sort_findings"]

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)


@dataclasses.dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    message: str
    fix: str
    program: Optional[str] = None  # "main" / "draft"; None for findings about backends
    node: Optional[str] = None
    layer_id: Optional[int] = None
    backend: Optional[str] = None

    def __post_init__(self) -> None:
        assert self.severity in SEVERITIES, f"finding of rule {self.rule}: unknown severity {self.severity!r}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Finding":
        return cls(**{f.name: obj.get(f.name) for f in dataclasses.fields(cls)})

    def where(self) -> str:
        parts = []
        if self.program:
            parts.append(self.program)
        if self.layer_id is not None:
            parts.append(f"layer {self.layer_id}")
        if self.node:
            parts.append(f"node {self.node}")
        if self.backend:
            parts.append(f"backend {self.backend}")
        return ", ".join(parts)

    def line(self) -> str:
        return f"[{self.severity}] {self.rule}: {self.message} (fix: {self.fix})"


class LintRule:
    """Base of every rule; subclasses set the class attributes and implement `check`."""

    id: str = ""
    severity: str = ERROR
    scope: str = "graph"  # "graph" | "artifact" | "backends"
    doc: str = ""
    failure: int | None = None  # the failure class of docs/DESIGN.md this rule guards, named in its messages

    def finding(self, message: str, fix: str, **where) -> Finding:
        if self.failure is not None:
            message = f"{message} (docs/DESIGN.md failure {self.failure})"
        return Finding(self.id, self.severity, message, fix, **where)

    def check(self, *args) -> Iterable[Finding]:  # pragma: no cover - every rule overrides it
        raise NotImplementedError(f"lint rule {self.id} has no check")


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == ERROR for f in findings)


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Errors first, then by program, layer, node: a stable order for lints.json and the table."""
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (rank[f.severity], f.program or "", -1 if f.layer_id is None else f.layer_id,
                                           f.node or "", f.rule, f.backend or "", f.message))
