"""Lint rules: data about what would go wrong at run time, found at compile time.

Three groups, run by the lint passes listed in compiler/pipeline.py:

- REGISTRY_RULES (registry_rules.py): the graphs against the LayerRegistry; run before routing.
- CAPTURE_RULES (capture_rules.py): what the split plans would capture; run after the split.
- BACKEND_RULES (backend_rules.py): wrapper backends forward every hook with compatible arguments.
"""

from compiler.lints.backend_rules import BACKEND_RULES, wrapper_findings
from compiler.lints.base import ERROR, INFO, WARNING, Finding, LintRule, has_errors, sort_findings
from compiler.lints.capture_rules import CAPTURE_RULES
from compiler.lints.registry_rules import REGISTRY_RULES

ALL_RULES = REGISTRY_RULES + CAPTURE_RULES + BACKEND_RULES

__all__ = ["REGISTRY_RULES", "CAPTURE_RULES", "BACKEND_RULES", "ALL_RULES", "Finding", "LintRule", "ERROR",
           "WARNING", "INFO", "has_errors", "sort_findings", "wrapper_findings"]
