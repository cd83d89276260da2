"""For every family: the compiled artifact gives exactly the eager model's greedy tokens.

The eager side is `runtime.engine.generate.greedy_generate` over the checkpoint's model bound to
BoundOps(CPUReferenceBackend); the compiled side is `hgc compile` + `runtime.artifact.loader` (the split
pieces with their eager gaps) on the same backend. Tiny and small sizes, prompts of several lengths.
"""

from __future__ import annotations

import pytest
import torch

from hgc.wiring import toolchain
from compiler.passes.context import CompileConfig
from compiler.pipeline import compile_checkpoint
from models.families import FAMILY_IDS
from models.loader import init_checkpoint, load_checkpoint
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState, build_step
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import greedy_generate, make_pools
from runtime.artifact.loader import load_artifact
from testkit.helpers import shared_artifact

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19], [20]]
NEW_TOKENS = 6


pytestmark = pytest.mark.usefixtures("one_thread")


def _eager(ckpt, prompts, new_tokens):
    _, _, model = load_checkpoint(ckpt)
    kv, st = make_pools(model.layer_registry, max(map(len, prompts)) + new_tokens, len(prompts))
    ops = BoundOps(CPUReferenceBackend(kv, st))
    model.set_ops(ops)
    return greedy_generate(model, ops, kv, st, prompts, new_tokens)


def _compiled(art, prompts, new_tokens):
    kv, st = make_pools(art.registry, max(map(len, prompts)) + new_tokens, len(prompts))
    ops = BoundOps(CPUReferenceBackend(kv, st))
    return greedy_generate(art.bind(ops), ops, kv, st, prompts, new_tokens)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """family, size -> (checkpoint dir, loaded artifact), built once for the module. Tiny is the
    test run's (testkit/helpers.shared_artifact: the same compile, made once for every module that
    reads it); small is compiled here."""
    cache = {}

    def get(family, size):
        if (family, size) not in cache:
            if size == "tiny":
                ckpt, art = shared_artifact(tmp_path_factory, family)
            else:
                root = tmp_path_factory.mktemp(f"{family}_{size}")
                ckpt = init_checkpoint(family, size, seed=3, out_dir=root / "ckpt", log=open("/dev/null", "w"))
                art = root / "art"
                compile_checkpoint(ckpt, art, CompileConfig(), toolchain(), dumps=False)
            cache[family, size] = (ckpt, load_artifact(art))
        return cache[family, size]

    return get


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_tiny_compiled_run_matches_eager_greedy(family, artifacts):
    ckpt, art = artifacts(family, "tiny")
    assert _compiled(art, PROMPTS, NEW_TOKENS) == _eager(ckpt, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_tiny_mixed_step_matches_eager_logits(family, artifacts):
    """A MIXED step (one request decoding, one extending) through the mixed plan, against the eager model."""
    ckpt, art = artifacts(family, "tiny")
    _, _, model = load_checkpoint(ckpt)
    results = []
    for forward_of in (lambda ops: art.forward_for("mixed", ops), lambda ops: model.set_ops(ops)):
        kv, st = make_pools(art.registry, 32, 2)
        ops = BoundOps(CPUReferenceBackend(kv, st))
        forward = forward_of(ops)
        a, b = SeqState(st.alloc()), SeqState(st.alloc())
        first = build_step([(a, [1, 2, 3])], kv)
        with ops.step(first.ctx), torch.no_grad():
            forward(first.input_ids, first.positions, first.logits_index)
        a.num_cached = 3
        step = build_step([(a, [4]), (b, [5, 6, 7, 8])], kv)
        assert step.ctx.mode.value == "mixed"
        with ops.step(step.ctx), torch.no_grad():
            results.append(forward(step.input_ids, step.positions, step.logits_index))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("family", [f for f in FAMILY_IDS if f != "kimi_linear"])
def test_tiny_draft_program_matches_eager_draft(family, artifacts):
    ckpt, art = artifacts(family, "tiny")
    assert "draft" in art.programs
    _, text, model = load_checkpoint(ckpt)
    hidden = torch.randn(5, int(text["hidden_size"]), generator=torch.Generator().manual_seed(0))
    results = []
    for forward_of in (lambda ops: art.forward_for("extend", ops, program="draft"),
                       lambda ops: model.set_ops(ops).draft):
        kv, st = make_pools(art.registry, 16, 1)
        ops = BoundOps(CPUReferenceBackend(kv, st))
        forward = forward_of(ops)
        step = build_step([(SeqState(st.alloc()), [3, 4, 5, 6, 7])], kv)
        with ops.step(step.ctx), torch.no_grad():
            results.append(forward(step.input_ids, step.positions, hidden, step.logits_index))
    compiled, eager = (r if isinstance(r, tuple) else (r,) for r in results)  # (logits, hidden) for every family
    assert len(compiled) == len(eager) and all(torch.equal(c, e) for c, e in zip(compiled, eager))
