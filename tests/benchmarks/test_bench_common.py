"""benchmarks/bench_common.py's target verdicts: a dry run never calls a GPU goal missed."""

from benchmarks.bench_common import target_rows, verdict


def test_a_dry_run_judges_only_the_targets_set_for_the_cpu():
    targets = {"hit_speedup": {"value": 1.2, "goal": ">= 10x", "met": False},
               "serve_over_run": {"value": 0.7, "goal": ">= 0.8", "met": False, "on_cpu": True}}
    dry = target_rows({"config": {"dry_run": True}, "targets": targets})
    assert dry == ["hit_speedup: 1.2 (goal >= 10x): not judged (a GPU goal; this is a dry run)",
                   "serve_over_run: 0.7 (goal >= 0.8): MISSED"]
    gpu = target_rows({"config": {"dry_run": False}, "targets": targets})
    assert gpu == ["hit_speedup: 1.2 (goal >= 10x): MISSED", "serve_over_run: 0.7 (goal >= 0.8): MISSED"]
    assert verdict(True, dry_run=False) == "met" and verdict(None, dry_run=False) == "not measured"


def test_replay_host_split_times_a_real_runners_replay(tmp_path_factory):
    """The three host parts of a replayed decode step, on a GraphRunner started on the CPU (its
    graphs rerun the ops): the split reads the runner's own table of whole-step graphs."""
    import torch

    from benchmarks.bench_common import decode_batch, replay_host_split
    from runtime.artifact.loader import load_artifact
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from runtime.step.bound_ops import BoundOps
    from testkit.graph_cases import RerunGraphs
    from testkit.helpers import shared_artifact

    art = load_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1])
    kv, st = make_pools(art.registry, 128, 4, page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(2,), extend_buckets=(32,),
                         max_pages_per_seq=16, extend_max_seqs=2, graphs=RerunGraphs())
    vocab = art.manifest["model"]["vocab_size"]
    runner.start(vocab_size=vocab)
    with decode_batch(runner, st, 2, vocab, torch.Generator().manual_seed(0), history=8) as items:
        step, key = runner.build(items)
        split = replay_host_split(runner, step, key, iters=3, sync=lambda: None)
    assert set(split) == {"fill_ms", "plan_ms", "replay_ms"} and all(v >= 0 for v in split.values())
    assert split["replay_ms"] > 0, "the replay reran the step's ops"


def test_an_artifact_whose_bundle_build_was_cut_off_is_not_taken_for_a_compiled_one(tmp_path):
    """compiled_artifact reuses WORK's artifact only when it is whole: with --compiled-pieces, one
    whose compile stopped before its bundle (manifest, no bundle.json) is built again."""
    from benchmarks.bench_common import _whole

    art = tmp_path / "art"
    assert not _whole(art, pieces=False)
    art.mkdir()
    (art / "manifest.json").write_text("{}")
    assert _whole(art, pieces=False) and not _whole(art, pieces=True)
    (art / "targets" / "sm90-x").mkdir(parents=True)
    assert not _whole(art, pieces=True)  # the build's folder, before it wrote bundle.json
    (art / "targets" / "sm90-x" / "bundle.json").write_text("{}")
    assert _whole(art, pieces=True)


def test_back_to_back_ms_is_one_call_s_share_of_a_run_of_them():
    import time

    import torch

    from benchmarks.bench_common import back_to_back_ms

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.02)

    ms = back_to_back_ms(fn, torch.device("cpu"), steps=3, rounds=2)
    assert len(calls) == 1 + 3 * 2  # a warm-up call, then each round's steps
    # a call's share (20 ms and a busy machine's oversleep), not a round's (60 ms and more)
    assert 20.0 <= ms < 60.0
