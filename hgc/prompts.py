"""What every generating command shares: prompt ids from the command line, the limits a request is
checked against before any work, how outputs are printed, and the timing line on stderr."""

from __future__ import annotations

import json

from hgc.errors import UsageError

__all__ = ["UsageError", "parse_prompt_ids", "check_vocab", "print_outputs", "check_request_limits", "timing_line"]


def parse_prompt_ids(text: str) -> list[list[int]]:
    """"1,2,3;4,5" -> [[1, 2, 3], [4, 5]]."""
    prompts = []
    for i, part in enumerate(text.split(";")):
        if not part.strip():
            raise UsageError(f"--prompt-ids: prompt {i + 1} is empty")
        try:  # every item an integer: an empty one ("1,,2") is a typo, not a token to drop
            ids = [int(tok) for tok in part.replace(" ", "").split(",")]
        except ValueError:
            raise UsageError(f"--prompt-ids: prompt {i + 1} ({part!r}) is not a comma-separated list of integers") from None
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


def check_request_limits(prompts: list[list[int]], max_new_tokens: int, *, positions: int | None, registry,
                         weight_bytes: int, device: str, page_size: int = 16) -> None:
    """Refuse, before anything is allocated, prompts and --max-new-tokens that the model's positions
    (max_position_embeddings) or the device's free memory cannot hold. The memory check is the
    memory planner's, for one slot and a full-length KV reservation per prompt: what `hgc run` and
    `hgc generate` then allocate."""
    from runtime.cache.memory_planner import GiB, MemoryPlanError, available_bytes, plan_memory

    longest = max(map(len, prompts))
    if positions is not None and longest >= positions:  # no --max-new-tokens can help: the prompt is too long
        which = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        raise UsageError(f"--prompt-ids: prompt {which + 1} has {longest} tokens; the model has {positions} positions "
                         f"(max_position_embeddings), so a prompt may have at most {positions - 1}",
                         hint="shorten the prompt")
    if positions is not None and longest + max_new_tokens > positions:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: the longest prompt has {longest} tokens and the model "
                         f"{positions} positions (max_position_embeddings), so at most {positions - longest} new "
                         f"tokens fit", hint=f"pass --max-new-tokens {max(positions - longest, 1)} or less")
    budget = available_bytes(device)
    try:
        plan_memory(registry, budget_bytes=budget, weight_bytes=weight_bytes, max_seq_len=longest + max_new_tokens,
                    page_size=page_size, num_slots=len(prompts), min_requests=len(prompts))
    except MemoryPlanError as e:
        need = budget + e.missing_bytes
        raise UsageError(f"--max-new-tokens {max_new_tokens}: {len(prompts)} request(s) of up to "
                         f"{longest + max_new_tokens} tokens need {need / GiB:.1f} GiB (weights, KV cache and state); "
                         f"{device} has {budget / GiB:.1f} GiB available",
                         hint="lower --max-new-tokens or send fewer prompts at once") from None


def timing_line(command: str, outputs: list[list[int]], seconds: float, detail: str = "") -> str:
    """One line for stderr: prompts, tokens, wall time and rate (and what `detail` adds)."""
    tokens = sum(map(len, outputs))
    rate = f", {tokens / seconds:.1f} tok/s" if seconds > 0 else ""
    return (f"hgc {command}: {len(outputs)} prompt(s), {tokens} new token(s) in {seconds:.2f} s{rate}"
            + (f" ({detail})" if detail else ""))
