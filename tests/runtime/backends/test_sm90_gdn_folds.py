"""The GDN layer's folded kernels compiled for sm90 without a GPU (testkit/sm90.py).

The folds (the q / k norm and gates in the conv's launch, kernels/linear.py `ConvQk`, in the extend
conv's two layouts and the decode conv; the gated norm in the chunk output kernel and in the decode
recurrence, kernels/linear.py `GatedNorm`) run in Triton's interpreter in the CPU tests, which executes Python and so cannot tell
whether the compiler takes them (a value defined in one branch only, a select between pointers,
a reshape of a mask). Here each launch of bench qwen3_next's dims (Hk 16, Hv 32, Dk = Dv = 128, the
conv's 8192 channels, K 4, bf16), recorded under the interpreter at the launch sites, is compiled for
sm90 to a cubin in a process of its own outside the interpreter (each conv also without its fold,
the default path beside the fold's code): it compiles, spills nothing, and an SM holds at least two
programs (the output kernel's whole-row tile on 4 warps: 2 programs an SM where 8 warps would leave 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from testkit.sm90 import Launch, compile_sm90, programs_per_sm, record, resources

ROOT = Path(__file__).resolve().parents[3]
HK, HV, DK, DV, KW = 16, 32, 128, 128, 4  # bench qwen3_next's GDN layers
C = 2 * HK * DK + HV * DV


def _bf16(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16)


def _conv_qk(T: int):
    from runtime.backends.kernels.linear import ConvQk

    ba = _bf16(T, 2 * HV)  # b and a: views of one projection's rows
    return ConvQk(_bf16(T, HK, DK), _bf16(T, HK, DK), torch.empty(T, HV), _bf16(T, HV), ba[:, :HV], ba[:, HV:],
                  torch.empty(HV), torch.empty(HV), 1e-6, 20.0)


def fold_launches() -> dict[str, Launch]:
    """label -> the launch of each folded kernel at the bench dims, recorded (not run)."""
    pytest.importorskip("triton")
    from runtime.backends.kernels import chunk as TC
    from runtime.backends.kernels import linear as TL
    from runtime.backends.kernels.launch_math import token_blocks

    def conv_extend(T: int, config) -> None:
        blocks = torch.from_numpy(token_blocks(np.asarray([T, 0]), TL.CONV_EXTEND_BLOCK_T))
        history = _bf16(2, KW - 1, C).transpose(1, 2)  # the state pool's channels-last storage
        TL.short_conv_extend(_bf16(T, C), _bf16(C, KW), None, _bf16(T, C), history, torch.tensor([1]),
                             torch.tensor([0, T, T]), blocks, True, config=config, qk=_conv_qk(T))

    def conv_decode(B: int) -> None:
        history = _bf16(B + 1, KW - 1, C).transpose(1, 2)
        TL.short_conv_decode(_bf16(B, C), _bf16(C, KW), None, _bf16(B, C), history, torch.arange(B), True,
                             qk=_conv_qk(B))

    def chunk_with_norm(T: int) -> None:
        gated = TC.GatedNorm(_bf16(T, HV, DV + 64)[..., :DV], _bf16(DV), 1e-6)
        chunks = torch.from_numpy(token_blocks(np.asarray([T]), TC.CHUNK_T))
        TC.chunk_extend(_bf16(T, HK, DK), _bf16(T, HK, DK), _bf16(T, HV, DV), torch.empty(T, HV), _bf16(T, HV),
                        _bf16(T, HV, DV), _bf16(2, HV, DK, DV), torch.tensor([1]), torch.tensor([0, T]), chunks,
                        DK ** -0.5, TL.GATE_PER_HEAD, gated_norm=gated)

    def recurrence_with_norm(B: int) -> None:
        gated = TL.GatedNorm(_bf16(B, HV, DV + 64)[..., :DV], _bf16(DV), 1e-6)
        TL.recurrent_decode(_bf16(B, HK, DK), _bf16(B, HK, DK), _bf16(B, HV, DV), torch.empty(B, HV), _bf16(B, HV),
                            _bf16(B, HV, DV), _bf16(B + 1, HV, DK, DV), torch.arange(B), DK ** -0.5, TL.GATE_PER_HEAD,
                            TL.whole_row_config(DK, DV), gated_norm=gated)

    tile, rows = record(lambda: [conv_extend(4096, TL.conv_extend_config(129, C, torch.device("cpu"))),
                                 conv_extend(4096, TL.conv_extend_rows_config(C))])
    (decode,) = record(lambda: conv_decode(128))
    output = [launch for launch in record(lambda: chunk_with_norm(4096)) if launch.name == "_chunk_output_kernel"]
    (recurrence,) = record(lambda: recurrence_with_norm(128))
    return {"conv extend tile": tile, "conv extend rows": rows, "conv decode": decode, "chunk output": output[0],
            "decode recurrence": recurrence}


def _compile_main(spec_path: str, out_path: str) -> None:
    """Outside the interpreter: each launch compiled for sm90, its resources and programs an SM."""
    work = Path(out_path).parent
    out = {}
    for name, spec in json.loads(Path(spec_path).read_text()).items():
        launch = Launch(**spec)
        # and each conv without its fold (the default path the fold's code sits beside)
        for label, overrides in ((name, {}),) + (((f"{name}, no fold", {"QK": False}),) if "QK" in launch.args
                                                 else ()):
            compiled = compile_sm90(launch, **overrides)
            res = resources(compiled.asm["cubin"], str(work))
            shared = compiled.metadata.shared + res["static_shared_bytes"]
            out[label] = {**res, "programs_per_sm": programs_per_sm(res["registers"], shared,
                                                                    launch.options.get("num_warps", 4))["programs"]}
    Path(out_path).write_text(json.dumps(out))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    launches = fold_launches()
    for launch in launches.values():
        assert launch.args.get("QK", launch.args.get("NORM")) is True, f"{launch.name}: recorded without its fold"
    work = tmp_path_factory.mktemp("sm90_folds")
    specs, result = work / "specs.json", work / "compiled.json"
    specs.write_text(json.dumps({name: dataclasses.asdict(launch) for name, launch in launches.items()}))
    # a cache of its own: the compiles must not land in (or come from) the suite's Triton cache
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(work / "cache"), PYTHONPATH=str(ROOT))
    script = (f"from tests.runtime.backends.test_sm90_gdn_folds import _compile_main; "
              f"_compile_main({str(specs)!r}, {str(result)!r})")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return {"launches": launches, "resources": json.loads(result.read_text())}


@pytest.mark.parametrize("name", ["conv extend tile", "conv extend rows", "conv decode", "chunk output",
                                  "decode recurrence", "conv extend tile, no fold", "conv extend rows, no fold",
                                  "conv decode, no fold"])
def test_each_fold_compiles_for_sm90_without_spills(compiled, name):
    res = compiled["resources"][name]
    assert res["local_bytes"] == 0 and res["stack_bytes"] == 0, f"{name}: spills {res}"
    assert res["programs_per_sm"] >= 2, f"{name}: {res}"


def test_the_normalising_kernels_take_whole_rows(compiled):
    """The chunk output kernel's on the default tile's 4 warps, the decode recurrence's on 8 (the
    default tile's state floats a thread): a program a head's whole row."""
    output, recurrence = compiled["launches"]["chunk output"], compiled["launches"]["decode recurrence"]
    assert output.args["BV"] == DV and output.grid[2] == 1 and output.options["num_warps"] == 4
    assert recurrence.args["BV"] == DV and recurrence.grid == [128, HV, 1] and recurrence.options["num_warps"] == 8
