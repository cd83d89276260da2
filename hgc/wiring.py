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
    from models.loader import config_dtype, load_config
    from runtime.backends import discover, wrapper_classes
    from runtime.artifact.tokenizer import tokenizer_files

    registry = registry if registry is not None else discover()

    def checkpoint_files(ckpt_dir) -> list[str]:
        # every tensor's stored dtype checked against the one config.json declares (models/checkpoint.py)
        return CheckpointReader(ckpt_dir, dtype=config_dtype(load_config(ckpt_dir)[2])).files

    return Toolchain(capabilities=registry.capability_table(), read_model=load_config,
                     checkpoint_files=checkpoint_files,
                     tokenizer_files=tokenizer_files, backend_wrappers=wrapper_classes())
