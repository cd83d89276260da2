"""lm-evaluation-harness on several models in one process, on the tasks of one folder only.

    python -m testkit.lm_eval_runs SPEC.json OUT.json

SPEC: {"tasks": [task names], "include_path": folder of their yaml files, "batch_size": n,
"runs": {name: [model, model_args]}}. Each run is lm-eval's `simple_evaluate` (what `lm_eval run`
calls, with its seeds and defaults) with log_samples; OUT gets {name: {task: its samples, by doc_id}},
the rows `lm_eval run --log_samples` writes (JSON: tuples as lists).

Used by tests/server/test_lm_eval.py. One process and one task index for every run: `lm_eval run`
indexes every task lm-eval ships (some 14,000 yaml files, 5 to 15 s on 2 cores) before it looks at
--include_path, and each run paid its imports again (about 6 s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    import lm_eval.evaluator
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # simple_evaluate adds a report of the environment to each run's results (torch's collect_env:
    # `pip list` and other probes in subprocesses, about 2.5 s a run); OUT holds the samples alone
    lm_eval.evaluator.add_env_info = lambda results: None

    spec = json.loads(Path(spec_path).read_text())
    tasks = TaskManager(include_path=spec["include_path"], include_defaults=False)
    out = {}
    for name, (model, model_args) in spec["runs"].items():
        results = simple_evaluate(model=model, model_args=model_args, tasks=list(spec["tasks"]), task_manager=tasks,
                                  batch_size=spec["batch_size"], device="cpu", log_samples=True)
        out[name] = {task: sorted(results["samples"][task], key=lambda row: row["doc_id"]) for task in spec["tasks"]}
    Path(out_path).write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:])
