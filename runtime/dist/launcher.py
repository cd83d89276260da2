"""Start the ranks of a tensor-parallel command and watch them: what `hgc run --tp N` / `hgc serve --tp N` do.

1. `launch(tp, command)`: one process per rank, each running `command` (the same hgc command line)
   with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a free
   port on this host), so a rank cannot tell our launch from torchrun's, plus the settings the
   GPU machines require of every process that may touch NCCL (`REQUIRED_ENV`). Rank 0 keeps
   the terminal's stdout; the other ranks' stdout is dropped (they print nothing), stderr is shared.
2. Watch: poll the ranks; once one ends with a failure (or killed by a signal), the others get
   `settle_s` to stop by themselves (each rank's watchdog sees the loss and says so, the way it
   does under torchrun), then are stopped (SIGTERM, then SIGKILL after `grace_s`), and `launch`
   returns 1 after one line naming the rank and how it ended. When rank 0 ends cleanly, the others get `grace_s` to follow
   (they stop on rank 0's STOP message, runtime/dist/distributed.py) before they are killed.
3. SIGTERM / SIGINT to the launcher go to rank 0, which shuts down the way one process does
   (`hgc serve` drains its requests) and stops the others.

torchrun does all of this itself: `torchrun --standalone --nproc-per-node N -m hgc run ART --tp N`
runs the same ranks. What it does not do: set up the process group (each rank does,
runtime/dist/distributed.py) or restart anything.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

__all__ = ["launch", "REQUIRED_ENV", "describe_exit"]

# NVLink multicast (NCCL's NVLS, PyTorch's symmetric memory, NVSHMEM's) stays off on the shared
# machines hgc is measured on: a program using it can take the host's GPUs out of service. Every
# rank process gets these, whatever the caller's environment holds.
REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop(procs: list[subprocess.Popen], grace_s: float, settle_s: float = 0.0) -> None:
    """Stop every rank still running: after `settle_s` for them to end by themselves, SIGTERM, then
    SIGKILL after `grace_s`."""
    settled = time.monotonic() + settle_s
    while time.monotonic() < settled and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(tp: int, command: list[str], label: str = "hgc", grace_s: float = 10.0, poll_s: float = 0.1,
           timeout_s: float | None = None, settle_s: float = 3.0) -> int:
    """Run `command` as `tp` ranks (steps 1-3 of the module docstring); rank 0's exit status, or 1
    if any rank failed. `timeout_s`: stop every rank after that long and return 124 (a benchmark's
    bound on a launch that hangs with every rank alive)."""
    base = {**os.environ, **REQUIRED_ENV, "WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port())}
    procs = []
    for rank in range(tp):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(command, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
    print(f"{label}: launched {tp} ranks (pids {', '.join(str(p.pid) for p in procs)}; "
          f"{' '.join(f'{k}={v}' for k, v in REQUIRED_ENV.items())})", file=sys.stderr, flush=True)

    def forward(signum, frame):
        if procs[0].poll() is None:
            procs[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs, grace_s)
                print(f"{label}: the ranks ran past {timeout_s:.0f} s; stopped them", file=sys.stderr, flush=True)
                return 124
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = {r for r, _ in failed}
                _stop(procs, grace_s, settle_s)
                failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
                # The rank that failed first leads, then one killed by a signal (where it started);
                # the others failed because it went.
                failed.sort(key=lambda rc: (rc[0] not in first, rc[1] >= 0, rc[0]))
                ended = "; ".join(f"rank {r} (pid {procs[r].pid}) {describe_exit(c)}" for r, c in failed)
                print(f"{label}: {ended}; stopped the other ranks", file=sys.stderr, flush=True)
                return 1
            if codes[0] == 0:
                deadline = time.monotonic() + grace_s
                while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
                    time.sleep(poll_s)
                late = [r for r, p in enumerate(procs) if p.poll() is None]
                _stop(procs, 0.0)
                bad = [(r, p.returncode) for r, p in enumerate(procs) if r in late or p.returncode != 0]
                if bad:
                    rank, code = bad[0]
                    why = "did not stop after rank 0 did" if rank in late else describe_exit(code)
                    print(f"{label}: rank {rank} (pid {procs[rank].pid}) {why}", file=sys.stderr, flush=True)
                    return 1
                return 0
            time.sleep(poll_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs, 0.0)
