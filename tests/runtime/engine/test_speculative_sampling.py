"""Speculative sampling keeps the output distribution: token frequencies with and without drafts agree.

1. End to end: a tiny qwen3_next cut to two layers (GDN + MoE, full attention) and its MTP layer,
   with a 12-token vocabulary and its output projection scaled up (x10), so the target's
   distributions are far from uniform and the MTP draft's differ from them (acceptance about 17%:
   both branches of the rejection rule run). 1,000 seeded requests per arm sample 4 tokens at
   temperature 1 (with top_k 10 and a frequency penalty, so the p the rule must reproduce is the
   processed distribution), plain and with D = 3 drafts, up to 512 at a time. Tokens 2-4 come
   from verify steps. For each of those positions a chi-square test of homogeneity on the 2 x V
   table of counts (cells expected below 5 merged) must not reject at significance 0.001 (three
   tests: 0.003 family-wise). Power: at 1,000 samples per arm, two distributions 0.1 apart in
   total variation are told apart with probability 0.94 to 0.99 (4 to 11 degrees of freedom; the
   last test here shows one such pair rejected). Seeds are fixed, so the test is deterministic;
   it runs with one torch thread (two threads on a shared 2-core machine were 10x slower). Tried
   against broken rules: keeping every draft is rejected at p < 1e-25 at every position.
2. The rule alone (runtime/engine/acceptance.py), where samples are cheap: 5,000 verify steps of two
   drafts drawn from a fixed q against a fixed p, by a goodness-of-fit test of the first kept
   token against p at significance 0.001; the same test rejects a rule that draws a refused
   position from p instead of the residual max(0, p - q) (a bias too small for part 1's sample).
   Power: that rule's first token has the distribution q min(1, p/q) + 0.45 p, whose
   noncentrality at 5,000 samples is 723 against a critical value of 20.5 (5 degrees of
   freedom): it is rejected with certainty (p < 1e-150 at the seed used).

Penalties at verified positions (row j counts d_1 .. d_j) are checked exactly, not statistically:
greedy tokens with penalties and bias equal plain decoding's (tests/runtime/engine/test_speculative.py).
"""

from __future__ import annotations

import pytest
import torch

from hgc import main
from runtime.engine.acceptance import draw, rejection_accept
from runtime.engine.engine import SamplingParams
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact

VOCAB = 12
REQUESTS = 1000
NEW = 4
ALPHA = 1e-3
RULE_SAMPLES = 5_000  # part 2 (module docstring: its power)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from models.checkpoint import write_checkpoint
    from models.families import get_family

    root = tmp_path_factory.mktemp("specsample")
    family = get_family("qwen3_next")
    # two layers (a GDN layer with its MoE, a full-attention layer) and the MTP layer: every kind of
    # state the rule must hand back, at half the tiny model's cost per sampled token
    config = {**family.make_config("tiny"), "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1,
              "num_hidden_layers": 2, "full_attention_interval": 2, "mlp_only_layers": [1]}
    model = family.build(family.text_config(config))
    family.init_weights(model, 3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # logits of a few units: peaked distributions, p != q
    write_checkpoint(root / "c", config, model.checkpoint_tensors())
    assert main(["compile", str(root / "c"), "-o", str(root / "a"), "--no-dumps"]) == 0
    return load_artifact(root / "a")


def sample(art, D: int) -> tuple[torch.Tensor, dict]:
    """[REQUESTS, NEW] tokens of seeded requests, and the engine's stats."""
    engine = engine_for_artifact(art, EngineOptions(slots=128, token_budget=512, speculative_tokens=D,
                                                    prefix_cache=False), 16)
    base = 10_000 * (D + 1)  # each arm its own seeds: independent samples
    ids = [engine.add_request([2, 5 + i % 3], SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=10,
                                                            frequency_penalty=2.0, seed=base + i))
           for i in range(REQUESTS)]
    results = engine.run_until_done()
    return torch.tensor([list(results[i].output_ids) for i in ids]), engine.stats()


def chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the chi-square test that counts a [V] and b [V] come from one distribution."""
    table = torch.stack([a, b]).double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    rare = expected.min(0).values < 5
    if rare.any():  # merge the rare cells into one
        table = torch.cat([table[:, ~rare], table[:, rare].sum(1, keepdim=True)], 1)
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_token_frequencies_with_and_without_drafts_agree(artifact, one_thread):
    plain, _ = sample(artifact, 0)
    spec, stats = sample(artifact, 3)
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95, stats["spec_acceptance_rate"]  # both branches run
    for position in range(1, NEW):
        a = torch.bincount(plain[:, position], minlength=VOCAB)
        b = torch.bincount(spec[:, position], minlength=VOCAB)
        p = chi_square_p(a, b)
        assert p > ALPHA, (position, a.tolist(), b.tolist(), p)


def chi_square_fit_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the chi-square goodness-of-fit test of counts [V] against probabilities [V]."""
    expected = counts.sum() * probs.double()
    stat = float(((counts.double() - expected) ** 2 / expected).sum())
    df = counts.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def residual_from_p(drafts, q, p, generator):
    """A wrong rule: a refused position drawn from p itself instead of max(0, p - q)."""
    for j, d in enumerate(drafts):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q[j][d]) >= float(p[j][d]):
            return drafts[:j] + [draw(p[j], generator)]
    return list(drafts) + [draw(p[-1], generator)]


def test_rejection_rule_outputs_the_target_distribution():
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.1, 0.05], dtype=torch.float64)
    for rule, agrees in ((rejection_accept, True), (residual_from_p, False)):
        g = torch.Generator().manual_seed(1)
        first = torch.zeros(6, dtype=torch.int64)
        for _ in range(RULE_SAMPLES):
            drafts = [draw(q, g), draw(q, g)]
            first[rule(drafts, [q, q], [p, p, p], g)[0]] += 1
        assert (chi_square_fit_p(first, p) > ALPHA) == agrees, (rule.__name__, first.tolist())


def test_the_chi_square_test_tells_different_distributions_apart():
    """The test has the power to reject: two samples of 1,000 from distributions 0.1 apart in
    total variation are told apart."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])
    q = torch.tensor([0.2, 0.3, 0.3, 0.1, 0.1])
    a = torch.bincount(torch.multinomial(p, REQUESTS, True, generator=g), minlength=5)
    b = torch.bincount(torch.multinomial(q, REQUESTS, True, generator=g), minlength=5)
    c = torch.bincount(torch.multinomial(p, REQUESTS, True, generator=g), minlength=5)
    assert chi_square_p(a, b) < ALPHA
    assert chi_square_p(a, c) > ALPHA
