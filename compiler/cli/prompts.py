"""What every generating command shares: prompt ids from the command line, and how outputs are printed."""

from __future__ import annotations

import json

__all__ = ["UsageError", "parse_prompt_ids", "check_vocab", "print_outputs"]


class UsageError(ValueError):
    """A command-line argument the user can fix: one line, exit code 2."""


def parse_prompt_ids(text: str) -> list[list[int]]:
    """"1,2,3;4,5" -> [[1, 2, 3], [4, 5]]."""
    prompts = []
    for i, part in enumerate(text.split(";")):
        try:
            ids = [int(tok) for tok in part.replace(" ", "").split(",") if tok != ""]
        except ValueError:
            raise UsageError(f"--prompt-ids: prompt {i + 1} ({part!r}) is not a comma-separated list of integers") from None
        if not ids:
            raise UsageError(f"--prompt-ids: prompt {i + 1} is empty")
        if any(t < 0 for t in ids):
            raise UsageError(f"--prompt-ids: prompt {i + 1} has a negative token id")
        prompts.append(ids)
    return prompts


def check_vocab(prompts: list[list[int]], vocab_size: int) -> None:
    for i, p in enumerate(prompts):
        bad = [t for t in p if t >= vocab_size]
        if bad:
            raise UsageError(f"--prompt-ids: prompt {i + 1} has token id {bad[0]}, outside the vocabulary of {vocab_size}")


def print_outputs(prompts, outputs, as_json: bool, extra: dict | None = None) -> None:
    if as_json:
        doc = {"outputs": [{"prompt_ids": p, "output_ids": o} for p, o in zip(prompts, outputs)]}
        doc.update(extra or {})
        print(json.dumps(doc))
    else:
        for p, o in zip(prompts, outputs):
            print(f"{p} -> {o}")
