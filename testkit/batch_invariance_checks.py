"""A decode row alone against the same row among other requests, on any device (hgc compile --batch-invariant).

An artifact compiled with --batch-invariant promises that a request's decode row has the bits its
decode step alone would give, whatever shares the step (docs/DESIGN.md "Batch invariance").
`decode_alone_against_batched` measures that on a started GraphRunner of the main program with
decode buckets of 1 and `batch`:

1. Twin requests a and b get the same random history, each in an eager prefill of its own (one
   step shape, so the same bits in both), and `batch` - 1 others get histories of other lengths.
2. Each step feeds a and b the same random token: a alone (the bucket of 1), b with the others
   at row `step % batch` (every request real in even steps; in odd steps half of them, the
   bucket's other rows padding), each through `runner.build` / `runner.run` (replayed graphs).
3. Per step: whether a's and b's logits are equal bit for bit, and if not their largest
   difference and whether the argmaxes agree.

Used by tests/gpu/test_gpu_batch_invariance.py. Slots and pages are freed after.
"""

from __future__ import annotations

import torch

from runtime.cache.batch import SeqState, build_step, commit_step

__all__ = ["decode_alone_against_batched"]


def _run(runner, items) -> tuple[torch.Tensor, str]:
    step, key = runner.build(items)
    logits = runner.run(step, key).float().cpu()  # a copy: the graph's output is rewritten by its next replay
    commit_step(items)
    return logits, str(key)


def decode_alone_against_batched(art, *, batch: int = 8, steps: int = 6, history: int = 300,
                                 generator: torch.Generator, page_size: int = 16, device: str = "cuda",
                                 graphs=None) -> dict:
    """{"steps": [{"step", "row", "requests", "equal", "max_abs_diff", "argmax_equal"}], "keys": {captured keys run}}.
    graphs: the runner's graph maker (default CudaGraphs; tests on the CPU pass a stand-in)."""
    from runtime.step.bound_ops import BoundOps
    from runtime.graphs.runner import GraphRunner
    from runtime.cache.kv_pool import KVPool
    from runtime.cache.state_pool import StatePool

    vocab = int(art.manifest["model"]["vocab_size"])
    lengths = [history + 37 * i for i in range(batch - 1)]  # the others: up to history + 222 tokens
    pages = -(-(max(lengths) + steps) // page_size)
    kv = KVPool(art.registry, (batch + 1) * pages + 1, page_size, device)
    st = StatePool(art.registry, batch + 1, device)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, device, decode_buckets=(1, batch), extend_buckets=(),
                         max_pages_per_seq=pages, extend_max_seqs=batch, chunk_size=max(lengths) * batch,
                         graphs=graphs)
    runner.start(vocab)
    a, b = SeqState(st.alloc()), SeqState(st.alloc())
    others = [SeqState(st.alloc()) for _ in lengths]
    draw = lambda n: torch.randint(1, vocab, (n,), generator=generator).tolist()  # noqa: E731
    try:
        shared = draw(history)
        for twin in (a, b):  # one prefill each: the same step shape, the same bits
            _run(runner, [(twin, shared)])
        _run(runner, [(seq, draw(n)) for seq, n in zip(others, lengths)])
        found, keys = [], set()
        for step in range(steps):
            token = draw(1)
            alone, key = _run(runner, [(a, token)])
            keys.add(key)
            company = others if step % 2 == 0 else others[: batch // 2 - 1]
            items = [(seq, draw(1)) for seq in company]
            row = step % (len(items) + 1)
            items.insert(row, (b, token))
            together, key = _run(runner, items)
            keys.add(key)
            got, want = together[row], alone[0]
            found.append({"step": step, "row": row, "requests": len(items), "equal": torch.equal(got, want),
                          "max_abs_diff": float((got - want).abs().max()),
                          "argmax_equal": int(got.argmax()) == int(want.argmax())})
        return {"steps": found, "keys": keys}
    finally:
        for seq in [a, b, *others]:
            kv.free(seq.pages)
            st.free(seq.slot)


def main(argv=None) -> int:
    """`python -m testkit.batch_invariance_checks ARTIFACT`: the check on CUDA in a process of its own, as
    JSON on stdout. An artifact with compiled pieces must be loaded before anything imports
    FlashInfer (runtime/artifact/bundle.py), which a test process that ran other builds has done."""
    import argparse
    import json

    from runtime.artifact.bundle import CompiledOptions
    from runtime.artifact.loader import load_artifact

    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("artifact")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    # built by another process of this machine: trust its signature, and build a kernel its bundle
    # lacks (the invariance, not the bundle, is under test)
    art = load_artifact(args.artifact, "cuda", compiled=CompiledOptions(trust=True, allow_builds=True))
    found = decode_alone_against_batched(art, steps=args.steps, generator=torch.Generator().manual_seed(args.seed))
    print(json.dumps({"compiled": art.compiled is not None, "batch_invariant": art.batch_invariant,
                      "steps": found["steps"], "keys": sorted(found["keys"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
