"""Choosing the next token from one request's logits row: greedy, or seeded temperature / top-k / top-p.

1. A request carries `SamplingParams`; the engine makes one `torch.Generator` per sampling request,
   seeded from `params.seed` (`make_generator`).
2. Each time a step ends a request's pending tokens, the engine calls `sample_next(logits_row,
   params, generator)` on that request's row alone.
3. A sampled token costs exactly one uniform draw from the request's own generator. So the n-th
   token of a request depends only on its seed, n and its logits, never on the other requests in
   the batch or on how its prompt was chunked.

Filtering order (what vLLM and transformers do): divide by temperature, keep the top_k most likely
tokens, renormalise, keep the smallest prefix (most likely first) whose probability reaches
top_p, renormalise, then draw by inverse CDF. Ties sort by token id (stable sort), so the order
is deterministic.

The logits a request samples from have had its logit_bias and penalties applied first, on the
device (runtime/engine/penalties.py); the log-probabilities it reports are of the model's own logits
(runtime/engine/logprobs.py). Both are the engine's to call; this module only holds the parameters and
the draw. It does not do batched GPU sampling kernels.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["SamplingParams", "make_generator", "sample_next", "filtered_distribution"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16  # 0 only to score the prompt (prompt_logprobs set): nothing is sampled
    temperature: float = 0.0  # 0: greedy (argmax); top_k, top_p and seed are then unused
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None  # None: a fresh nondeterministic seed per request
    stop_token_ids: frozenset[int] = frozenset()  # a stop token is emitted, then the request ends
    # OpenAI's penalties on the tokens generated so far, and the CTRL / transformers repetition
    # penalty on prompt and generated tokens (runtime/engine/penalties.py has the definitions).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted
    logprobs: int | None = None  # each sampled token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Structured output: a compiled grammar (runtime/engine/grammar.py Grammar); each request matches it
    # with a matcher of its own, and only tokens it allows are chosen.
    grammar: object | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"SamplingParams: max_new_tokens must be >= 1, or 0 with prompt_logprobs "
                             f"(got {self.max_new_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"SamplingParams: {name} must be >= 0 or None (got {getattr(self, name)})")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams: repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams: temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be >= 0, 0 meaning off (got {self.top_k})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether a penalty or a bias applies: the sampler then reads the processed logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own generator (None for greedy: nothing to draw)."""
    if params.greedy:
        return None
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()  # nondeterministic, and touches no global RNG
    else:
        generator.manual_seed(params.seed)
    return generator


def filtered_distribution(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [V] -> (token ids [K], probabilities [K] float64 summing to 1), most likely first."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    probs, ids = torch.sort(probs, descending=True, stable=True)
    keep = probs.shape[0]
    if params.top_k:
        keep = min(keep, params.top_k)
    probs = probs[:keep] / probs[:keep].sum()
    if params.top_p < 1.0:
        # First index whose cumulative probability reaches top_p: keep it and everything before.
        reach = int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(params.top_p, dtype=probs.dtype)))
        keep = min(keep, reach + 1)
        probs = probs[:keep] / probs[:keep].sum()
    return ids[:keep], probs


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one request's logits row [V]."""
    assert logits.dim() == 1, f"sample_next takes one request's row [V], got shape {tuple(logits.shape)}"
    if params.greedy:
        return int(torch.argmax(logits))
    assert generator is not None, "a sampling request needs its generator (make_generator)"
    ids, probs = filtered_distribution(logits, params)
    u = torch.rand((), generator=generator, dtype=torch.float64)  # the one draw of this token
    cdf = torch.cumsum(probs, 0)
    index = min(int(torch.searchsorted(cdf, u, right=True)), ids.shape[0] - 1)  # cdf[-1] may round below u
    return int(ids[index])
