"""LintPass: run a group of lint rules and record their findings; errors stop the pipeline.

The pipeline holds two lint passes (compiler/pipeline.py): `lint_registry` before routing (the
graphs against the LayerRegistry: routing cannot bind a node whose layer is unknown) and
`lint_capture` after the split (what would be captured; backend wrappers).

For each program:

1. every "graph" rule checks this program's graph;
2. on the last program, every "artifact" and "backends" rule checks all programs together (the
   manager runs each pass on every program before the next pass, so all are in the same state);
3. findings go to ctx.findings; if any is an error, `stop=True` ends the pipeline after this pass.

Rules are data-producing functions (compiler/lints/); this pass only runs them.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from compiler.lints.base import LintRule, has_errors
from compiler.passes.base import CompilePass, PassResult, class_source

__all__ = ["LintPass"]


class LintPass(CompilePass):
    version = 1

    def __init__(self, name: str, rules: Sequence[LintRule], stop_on_error: bool = True):
        ids = [r.id for r in rules]
        assert len(set(ids)) == len(ids), f"lint pass {name}: duplicate rule ids {ids}"
        self.name = name
        self.rules = tuple(rules)
        self.stop_on_error = stop_on_error

    def config(self) -> dict:
        return {"rules": [r.id for r in self.rules], "stop_on_error": self.stop_on_error}

    def fingerprint(self) -> dict:
        fp = super().fingerprint()
        sources = "".join(class_source(type(r)) for r in self.rules)
        fp["rules_sha256"] = hashlib.sha256(sources.encode()).hexdigest()
        return fp

    def __call__(self, gm, ctx) -> PassResult:
        found = []
        for rule in self.rules:
            if rule.scope == "graph":
                found.extend(rule.check(gm, ctx))
        if ctx.program == ctx.program_names[-1]:
            for rule in self.rules:
                if rule.scope in ("artifact", "backends"):
                    found.extend(rule.check(ctx))
        ctx.findings.extend(found)
        return PassResult(gm, modified=False, stop=self.stop_on_error and has_errors(found))
