"""Toolchain: what the compiler is handed from outside it, as values; how models/ and runtime/ reach it.

The compiler (frontend, passes, lints, artifact writer, pipeline) imports neither models/ nor
runtime/: they sit beside it above the op vocabulary (docs/DESIGN.md, "Dependency direction";
tests/architecture/test_imports.py checks it). The command line on top builds one Toolchain from them
(hgc/wiring.py) and hands it to the pipeline, which hands each part to the stage that
uses it:

- `capabilities`: the backends' declarations (runtime/backends: built-in and installed plugins),
  read by routing, split and the capture lints;
- `backend_wrappers`: the classes that forward hooks to other backends, checked by the hook lint;
- `read_model(ckpt_dir) -> (family, config.json, text config)`: the frontend builds
  `family.build(text config)` on the meta device and traces it;
- `checkpoint_files(ckpt_dir) -> [safetensors file names]`: the writer copies or links them (the
  callable checks index, duplicates, truncation and each tensor's dtype against config.json's);
- `tokenizer_files(ckpt_dir) -> {name: bytes}`: the tokenizer files the runtime reads, copied into
  the artifact as data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from compiler.splitops import CapabilityTable

__all__ = ["Toolchain"]


@dataclasses.dataclass(frozen=True)
class Toolchain:
    capabilities: CapabilityTable
    read_model: Callable[[Path], tuple[object, dict, dict]]
    checkpoint_files: Callable[[Path], list[str]]
    tokenizer_files: Callable[[Path], dict[str, bytes]] = lambda ckpt_dir: {}
    backend_wrappers: tuple[type, ...] = ()

    def with_capabilities(self, capabilities: CapabilityTable) -> "Toolchain":
        return dataclasses.replace(self, capabilities=capabilities)
