"""Tensor parallel at run time: one process per rank; rank 0 schedules and sends each step to the others.

Two planes, kept apart:

- data: torch.distributed's process group (gloo on CPU, NCCL on CUDA), used only by the
  collectives the sharding pass put in the graph (runtime/backends/collectives.py), every call
  under the group's timeout;
- control: a TCP connection from rank 0 to each other rank (the step channel), carrying one
  message per step. A rank that dies closes its socket, so the others see it at once (end of
  stream), whatever they are doing; nothing waits on a timeout to notice a death.

Lifecycle (`hgc run --tp N` / `hgc serve --tp N`, each process; runtime/dist/launcher.py starts them,
or torchrun does: the environment is torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT):

1. `join(tp, device_type)`: check the environment against --tp, pick the device (cuda:LOCAL_RANK,
   or the CPU with its cores shared out), start the process group (NCCL: created eagerly on the
   rank's device and warmed up by one all-reduce, so no communicator is made inside a CUDA graph
   capture), open the step channel (rank 0 listens on a free port and sends its number through
   the group) and start this rank's watchdog (below).
2. Every rank loads its shard of the artifact and builds the same engine (pools, backends, graph
   runner: capture and start-up parity run on every rank, in the same order, collectives
   included).
3. Rank 0: `lead(group, pools...)`, while its engine is built: the pools journal every change to their data made outside a
   forward (slot zeroing and copies, page copies, prefix-cache snapshots), and before each
   forward the engine hands the step to `StepSender`, which sends the journal and the step
   (each request's slot, pages, cached count, in-step snapshot, tokens; the logits rows) to every
   other rank, whose backends then write the same in-step snapshots into their own snapshot pools.
   Rank 0 alone samples, serves HTTP and prints.
4. Other ranks: `follow(engine, group)`: receive a message, replay its journal on their pools,
   run `engine.execute` on the same step (the same forward, eager or graphs, so the collectives
   meet), discard the logits; until rank 0 sends STOP or its socket closes.
5. `group.close()`: rank 0 sends STOP; every rank leaves a gloo process group (an NCCL one ends
   with the process: see `close`). (Between engines of
   one launch, `group.end_engine()` sends END instead: the others return from `follow` and keep
   the channel.)
6. `end_rank_process(code)`: the command has returned (and printed any failure); the process ends
   without the interpreter's teardown. Gloo's worker threads can outlive destroy_process_group,
   and a C++ thread object destroyed joinable at finalization aborts the process (SIGABRT,
   "terminate called without an active exception"): a rank that finished its work would then
   fail its launch, rarely and only under load.

A rank that dies, at any point after `join` (loading, capture, parity, serving): its sockets
close, and the watchdog of every rank it was connected to sees it within `WATCH_INTERVAL_S`:
rank 0 watches every other rank's socket (they never write, so a readable one is an end of
stream); another rank watches rank 0's, peeking so a message waiting there is left for the main
thread. The watchdog prints one line naming the rank that stopped and ends the process (exit
status 3) even while its main thread is blocked inside a collective or a graph replay, which a
dead peer would otherwise leave waiting forever (a captured NCCL call has no timeout). It does
the same when the process that started the rank (the launcher, torchrun's agent) is gone, so a
launcher killed outright leaves no rank behind. Eager collectives also fail on their own (gloo:
the connection closes; NCCL: the group's timeout); the launcher (or torchrun) then stops whatever
is left. A rank that hangs without dying is caught only by the group's timeout on eager
collectives.

What it does not do: schedule (the engine), decide what a rank holds (the artifact's
sharding.json), launch processes (runtime/dist/launcher.py), or run speculative decoding (its draft
and verify steps are not sent to the other ranks: `hgc run/serve --tp N --speculative-tokens D`
is refused, and `lead` refuses draft tokens).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Callable, NoReturn

import numpy as np
import torch

from runtime.cache.batch import SeqState
from runtime.dist.launcher import REQUIRED_ENV

__all__ = ["RankGroup", "PeerLost", "LaunchError", "launched_rank", "join", "end_rank_process", "lead", "follow",
           "StepSender", "encode_step", "decode_step", "DEFAULT_TIMEOUT_S", "WATCH_INTERVAL_S"]

DEFAULT_TIMEOUT_S = 120.0  # a collective that waits longer than this fails (a peer is stuck or gone)
WATCH_INTERVAL_S = 0.2  # how often the watchdog looks at the other ranks' sockets and its launcher
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_STOP, _STEP, _END = 0, 1, 2  # message kinds: the last one; a step; the end of one engine's steps
_JOURNAL_CODES = {"zero_slot": 0, "copy_slot": 1, "copy_pages": 2, "save": 3, "restore": 4}
_JOURNAL_NAMES = {code: name for name, code in _JOURNAL_CODES.items()}
_NO_SNAPSHOT = (-1, 0)  # a request's in-step snapshot (position, id) in a step message, when it has none


class PeerLost(RuntimeError):
    """Another rank of the group stopped (its step channel closed, or a send to it failed)."""


class LaunchError(ValueError):
    """A launch this process cannot join as a rank: its environment disagrees with --tp, or a rank
    has no device (bad input: the command line or torchrun's flags are what to fix)."""


def launched_rank() -> bool:
    """Whether this process is one rank of a launch (ours or torchrun's): the rank environment is set."""
    return all(name in os.environ for name in _ENV)


# -- the step channel ------------------------------------------------------------------------------


def _send_all(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(len(payload).to_bytes(8, "little") + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class StepChannel:
    """Rank 0's sockets to every other rank (`peers`), or another rank's socket to rank 0 (`leader`)."""

    def __init__(self, rank: int, peers: dict[int, socket.socket] | None = None, leader: socket.socket | None = None):
        self.rank, self.peers, self.leader = rank, peers or {}, leader
        self.closing = False  # set before a clean close: the end of stream that follows is no loss
        # Held by `recv` (another rank's main thread) while it reads: the watchdog peeks only
        # between reads, so it never takes a message's bytes nor races the main thread for STOP.
        self._reading = threading.Lock()

    @classmethod
    def open(cls, rank: int, world_size: int, host: str, port_of: Callable[[int | None], int],
             timeout_s: float) -> "StepChannel":
        """`port_of(port)`: rank 0 gives its listening port, every rank gets it back (through the group)."""
        if rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.bind(("0.0.0.0", 0))
            server.listen(world_size)
            server.settimeout(timeout_s)  # a rank that died before connecting must not block start-up
            port_of(server.getsockname()[1])
            peers = {}
            try:
                for _ in range(world_size - 1):
                    conn, _ = server.accept()
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    peers[int.from_bytes(_recv_exact(conn, 8), "little")] = conn
            except socket.timeout:
                missing = sorted(set(range(1, world_size)) - set(peers))
                raise PeerLost(f"ranks {missing} did not open their step channel within {timeout_s:.0f} s") from None
            finally:
                server.close()
            return cls(0, peers=peers)
        port = port_of(None)
        conn = socket.create_connection((host, port), timeout=timeout_s)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(rank.to_bytes(8, "little"))
        return cls(rank, leader=conn)

    def send(self, message: np.ndarray) -> None:
        payload = message.astype(np.int64).tobytes()
        for peer, sock in self.peers.items():
            try:
                _send_all(sock, payload)
            except OSError as e:
                raise PeerLost(f"rank {peer} stopped: sending it the next step failed ({e.strerror or e})") from None

    def recv(self) -> np.ndarray:
        with self._reading:
            try:
                n = int.from_bytes(_recv_exact(self.leader, 8), "little")
                message = np.frombuffer(_recv_exact(self.leader, n), dtype=np.int64)
            except (EOFError, OSError):
                raise PeerLost("rank 0 stopped: its step channel closed before it sent STOP") from None
            if int(message[0]) == _STOP:
                self.closing = True
            return message

    def lost_peer(self) -> str | None:
        """Which rank's end of stream this rank sees now, if any (one check, no waiting)."""
        if self.peers:  # rank 0: the other ranks never write, so a readable socket has ended
            ready, _, _ = select.select(list(self.peers.values()), [], [], 0)
            return next((f"rank {peer}" for peer, sock in self.peers.items() if sock in ready), None)
        if not self._reading.acquire(blocking=False):
            return None  # the main thread is reading: it sees an end of stream itself (PeerLost)
        try:
            ready, _, _ = select.select([self.leader], [], [], 0)
            # Readable with nothing to peek: the end of stream. A waiting message stays for recv.
            return "rank 0" if ready and not self.leader.recv(1, socket.MSG_PEEK) else None
        except OSError:
            return "rank 0"
        finally:
            self._reading.release()

    def close(self) -> None:
        self.closing = True
        if self.peers:
            try:
                self.send(np.array([_STOP], dtype=np.int64))
            except PeerLost:
                pass
        for sock in list(self.peers.values()) + ([self.leader] if self.leader is not None else []):
            sock.close()


def _watchdog(channel: StepChannel, parent: int, on_lost: Callable[[str], None], interval_s: float) -> threading.Thread:
    """A daemon thread calling `on_lost(message)` once another rank's socket ends without a clean
    close, or the process that started this rank (the launcher, torchrun's agent) is gone: with it
    gone nothing would stop this rank, and a rank 0 would go on serving its port. It looks every
    `interval_s` seconds until the channel closes."""
    def run():
        while not channel.closing:
            try:
                who = channel.lost_peer()
            except (OSError, ValueError):  # a socket closed under it: by close(), or lost
                who = "a rank"
            if who is not None and not channel.closing:
                on_lost(f"{who} stopped: its step channel closed")
                return
            if os.getppid() != parent:
                on_lost(f"the process that started this rank (pid {parent}) ended")
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="hgc-tp-watchdog", daemon=True)
    thread.start()
    return thread


# -- step messages ---------------------------------------------------------------------------------


def encode_step(journal: list, seq_items, logits_rows) -> np.ndarray:
    """[STEP, journal entries, requests, logits rows] as one int64 array (no pickle)."""
    out = [_STEP, len(journal)]
    for entry in journal:
        name, *args = entry
        flat = []
        for a in args:
            flat += [len(a), *a] if isinstance(a, list) else [a]
        out += [_JOURNAL_CODES[name], len(flat), *flat]
    out.append(len(seq_items))
    for seq, tokens in seq_items:
        out += [seq.slot, seq.num_cached, *(seq.snapshot or _NO_SNAPSHOT), len(seq.pages), *seq.pages, len(tokens),
                *tokens]
    out += [0] if logits_rows is None else [1, *logits_rows]
    return np.asarray(out, dtype=np.int64)


def _take(values, at: int, n: int) -> tuple[list[int], int]:
    return [int(v) for v in values[at:at + n]], at + n


def decode_step(message: np.ndarray):
    """(journal, seq_items, logits_rows) of a STEP message, or None for STOP and END."""
    if int(message[0]) in (_STOP, _END):
        return None
    assert int(message[0]) == _STEP, f"step channel: unknown message kind {int(message[0])}"
    at, journal = 2, []
    for _ in range(int(message[1])):
        name, n = _JOURNAL_NAMES[int(message[at])], int(message[at + 1])
        flat, at = _take(message, at + 2, n)
        args, i = [], 0
        while i < len(flat):
            if name in ("zero_slot", "copy_slot"):
                args.append(flat[i])
                i += 1
            else:
                args.append(flat[i + 1:i + 1 + flat[i]])
                i += 1 + flat[i]
        journal.append((name, *args))
    count, at = int(message[at]), at + 1
    seq_items = []
    for _ in range(count):
        slot, cached, position, snapshot, npages = (int(v) for v in message[at:at + 5])
        pages, at = _take(message, at + 5, npages)
        tokens, at = _take(message, at + 1, int(message[at]))
        seq_items.append((SeqState(slot, pages, cached, None if position < 0 else (position, snapshot)), tokens))
    rows = None
    if int(message[at]):
        rows, at = _take(message, at + 1, count)
    return journal, seq_items, rows


def _replay(journal, engine) -> None:
    """Apply rank 0's pool changes to this rank's pools, in order."""
    snapshots = engine.prefix_cache.snapshots if engine.prefix_cache is not None else None
    for name, *args in journal:
        if name == "zero_slot":
            engine.state_pool.zero_slot(*args)
        elif name == "copy_slot":
            engine.state_pool.copy_slot(*args)
        elif name == "copy_pages":
            engine.kv_pool.copy_pages(*args)
        elif name == "save":
            snapshots.save(engine.state_pool, *args)
        elif name == "restore":
            snapshots.restore(engine.state_pool, *args)


# -- the group -------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankGroup:
    rank: int
    world_size: int
    device: torch.device
    channel: StepChannel

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def end_engine(self) -> None:
        """Rank 0: the other ranks return from `follow` and keep the channel, to build the next
        engine (a benchmark that runs several models in one launch)."""
        assert self.leader, "only rank 0 ends an engine's steps"
        self.channel.send(np.array([_END], dtype=np.int64))

    def barrier(self) -> None:
        """Every rank waits here for the others (work that is not a step: `hgc build` on ranks)."""
        import torch.distributed as dist

        dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def wait_for_stop(self) -> None:
        """Another rank, with no steps to follow: block until rank 0 sends STOP, so that this rank
        closes its channel after rank 0 has (closing first would read to rank 0's watchdog as a
        rank lost). Raises PeerLost when rank 0 stops without it."""
        assert not self.leader, "rank 0 sends STOP (close)"
        while int(self.channel.recv()[0]) != _STOP:
            pass

    def close(self) -> None:
        """Rank 0: STOP to the others; every rank: its channel closed. The process group is left
        only on gloo: NCCL's destroy_process_group can block forever once a collective was captured
        in a CUDA graph (pytorch/pytorch#115388; seen here as `hgc build` ranks that had written
        their bundle and never ended). An NCCL rank's communicators go with its process, which
        `end_rank_process` ends right after."""
        import torch.distributed as dist

        self.channel.close()
        if dist.is_initialized() and dist.get_backend() != "nccl":
            dist.destroy_process_group()


def end_rank_process(code: int) -> NoReturn:
    """Step 6 of the module docstring: streams flushed, then os._exit(code)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join(tp: int, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S, label: str = "hgc") -> RankGroup:
    """Step 1 of the module docstring: this process as one rank of `tp`. `label` starts the line
    the watchdog prints ("hgc serve")."""
    import torch.distributed as dist

    if not launched_rank():
        raise LaunchError(f"--tp {tp}: this process has no rank environment ({', '.join(_ENV)}); start it with "
                           f"`hgc run --tp {tp}` / `hgc serve --tp {tp}` (which launch the ranks) or torchrun")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise LaunchError(f"--tp {tp}, but the launch has WORLD_SIZE {world} processes: they must agree "
                           f"(torchrun --nproc-per-node {tp})")
    if os.environ["MASTER_PORT"] == "0":  # torchrun --master-port 0 hands its ranks the 0, not the port it took
        raise LaunchError("--tp: MASTER_PORT is 0, which no rank can connect to; start torchrun with --standalone "
                           "(or a --master-port of its own)")
    local = int(os.environ.get("LOCAL_RANK", rank))
    timeout = datetime.timedelta(seconds=timeout_s)
    os.environ.update(REQUIRED_ENV)  # under torchrun too: NCCL reads them when the communicator is made
    if device_type == "cuda":
        if local >= torch.cuda.device_count():
            raise LaunchError(f"--tp {tp}: rank {rank} (LOCAL_RANK {local}) has no GPU: this host shows "
                               f"{torch.cuda.device_count()}; one GPU per rank is needed")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        # device_id: the communicator is made now, on this rank's GPU, not lazily by the first
        # collective (which could be one recorded into a CUDA graph).
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm)
        torch.cuda.synchronize(device)
        if int(warm.item()) != world:
            raise RuntimeError(f"--tp {tp}: a warm-up all-reduce over NCCL gave {warm.item()}, expected {world}")
        # The port of rank 0's listener goes through a gloo group on the same store: one small
        # broadcast of a Python int (NCCL moves only GPU tensors).
        control = dist.new_group(backend="gloo", timeout=timeout)
    else:
        # N ranks on one host share its cores: more threads than cores per rank only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        control = None

    def port_of(port):
        box = [port]
        dist.broadcast_object_list(box, src=0, group=control)
        return int(box[0])

    channel = StepChannel.open(rank, world, os.environ["MASTER_ADDR"], port_of, timeout_s)
    _watchdog(channel, os.getppid(), _lost(f"{label} [rank {rank}]"), WATCH_INTERVAL_S)
    if rank > 0:
        # Ctrl-C reaches every process of the terminal's group; only rank 0 acts on it (it stops
        # and sends STOP). Here it would only turn a clean stop into a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return RankGroup(rank, world, device, channel)


class StepSender:
    """Rank 0's engine's `broadcast`: the journal so far, then the step, to every other rank."""

    def __init__(self, channel: StepChannel, journal: list):
        self.channel, self.journal = channel, journal

    def __call__(self, seq_items, logits_rows) -> None:
        message = encode_step(self.journal, seq_items, logits_rows)
        self.journal.clear()
        self.channel.send(message)


def _lost(prefix: str) -> Callable[[str], None]:
    def on_lost(message: str) -> None:
        print(f"{prefix}: {message}; stopping (the other ranks stop with it)", file=sys.stderr, flush=True)
        os._exit(3)  # from the watchdog thread: a blocked main thread could not be woken otherwise
    return on_lost


def lead(group: RankGroup, kv_pool, state_pool, snapshots, draft_tokens: int) -> StepSender:
    """Step 3: rank 0's pools journal every change to their data made outside a forward (the
    snapshot pool's too, with a prefix cache); returns the engine's `broadcast`, which sends every
    step (and the journal before it) to the others (runtime/assembly.engine_for_artifact's tp_lead)."""
    if draft_tokens:  # its draft and verify steps, and keep_verified, are not sent (the CLI refuses it)
        raise ValueError("speculative decoding does not run on tensor-parallel ranks yet")
    journal: list = []
    state_pool.journal = kv_pool.journal = journal
    if snapshots is not None:
        snapshots.journal = journal
    return StepSender(group.channel, journal)


def follow(engine, group: RankGroup) -> int:
    """Step 4: run rank 0's steps until STOP (or END: `RankGroup.end_engine`); returns the number of
    steps run. Raises PeerLost when rank 0's channel closes without STOP."""
    steps = 0
    while True:
        decoded = decode_step(group.channel.recv())
        if decoded is None:
            return steps
        journal, seq_items, logits_rows = decoded
        _replay(journal, engine)
        engine.execute(seq_items, logits_rows)
        steps += 1
