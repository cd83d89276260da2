"""Loading a program through runtime/artifact/pt2_check.py gives what torch.export.load gives.

The checked load answers the deserializer's repeated questions once per load (a class's type
hints, the parse of a symbolic size's text, a schema class's shape): the program must come out the same, node for node,
with the same symbolic shapes and ranges, and torch's module must be left as it was.
"""

from __future__ import annotations

import sympy
import torch
from torch._export.serde import serialize

from compiler.splitops.artifact import MANIFEST, PROGRAM_FILES, load_json
from runtime.artifact.pt2_check import load_program
from testkit.helpers import shared_artifact
from testkit.program_text import described


def test_the_checked_load_gives_the_program_torch_loads(tmp_path_factory):
    _, art = shared_artifact(tmp_path_factory, "qwen3_next")
    path = art / PROGRAM_FILES["main"]
    checked = load_program(path, load_json(art / MANIFEST, "manifest")["files"][PROGRAM_FILES["main"]])
    plain = torch.export.load(path)
    assert any(isinstance(s, torch.SymInt) for n in checked.graph.nodes
               for s in getattr(n.meta.get("val"), "shape", ()))  # the token count is symbolic: parsed texts
    assert described(checked) == described(plain)
    assert serialize.sympy is sympy and serialize.typing.get_type_hints.__module__ == "typing"
    assert serialize._dict_to_dataclass.__module__ == serialize.__name__  # torch's own again after the load
