"""The wiring: models/ and runtime/ handed to the compiler as a Toolchain (compiler/toolchain.py).

The one place that puts the three side-by-side layers together for a compile: the backends'
capability table from the runtime's registry (built-in backends and installed plugins), the model
reader and checkpoint lists from models/, the tokenizer file list from the runtime. Commands and
tests call `toolchain()`; an embedding program (or a test) adds backends of its own by passing a
registry (`runtime.backends.discover().with_classes(...)`).
"""

from __future__ import annotations

from compiler.toolchain import Toolchain

__all__ = ["toolchain"]


def toolchain(registry=None) -> Toolchain:
    from models.checkpoint import CheckpointReader
    from models.loader import load_config
    from runtime.backends import discover, wrapper_classes
    from runtime.tokenizer import tokenizer_files

    registry = registry if registry is not None else discover()
    return Toolchain(capabilities=registry.capability_table(), read_model=load_config,
                     checkpoint_files=lambda ckpt_dir: CheckpointReader(ckpt_dir).files,
                     tokenizer_files=tokenizer_files, backend_wrappers=wrapper_classes())
