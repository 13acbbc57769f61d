"""Starting a process-per-stage pipeline: its doors, the rendezvous, and local worker processes.

Two ways in:
  * local: rank 0 (the caller's process) spawns ranks 1..N-1 as `python -m memra.pp.dist_worker` on
    this machine (MASTER_ADDR=127.0.0.1, a free port) and hosts the rendezvous store itself, so it can
    watch its children while they join — a worker that dies before joining is reported at once
    instead of after the whole start timeout;
  * torchrun: every rank reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT and joins
    through env:// (the launcher owns the rendezvous and restarts/kills ranks as a group).

Doors (read when a pipeline starts; every value is checked and a bad one names itself):
  MEMRA_PP_DIST_TIMEOUT_S        every wait inside a command (a reply, a boundary message, a slot to
                                 drain); past it the stage is declared hung or dead. Default 30.
  MEMRA_PP_DIST_IDLE_TIMEOUT_S   how long a worker waits for its next command; 0 (default) = forever
                                 (an idle server is not a failure; a dead driver closes the connection).
  MEMRA_PP_DIST_START_TIMEOUT_S  joining and loading the model on every rank. Default 600.
  MEMRA_PP_DIST_BACKEND          gloo | nccl; default nccl on CUDA, gloo on CPU.
  MEMRA_PP_DIST_SHARE_GPUS       1: NCCL ranks may share GPUs round-robin when a node has fewer GPUs than
                                 ranks (gloo ranks always may). Off by default: recent NCCL refuses two
                                 ranks of one communicator on one GPU (on the H200, NCCL 2.28.9: "invalid
                                 usage" at the first send), which ends the pipeline with that error.
The fence comes from the in-process doors (MEMRA_PP_STAGES / MEMRA_PP_SPLITS / MEMRA_PP_SPLIT, memra.pp.fence),
with one rank per stage: MEMRA_PP_STAGES defaults to the world size and must equal it when set.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from memra.errors import MemraError
from memra.pp import fence as pf
from memra.pp.dist_wire import FOREVER_S
from memra.settings import process_env

Env = Mapping[str, str]
LOCAL_DOOR = "MEMRA_PP_DIST_LOCAL"  # set by the local launcher on its workers: rank 0 hosts the store


def launcher_world_size(env: Env | None = None) -> int | None:
    """WORLD_SIZE as a launcher (torchrun) set it for this process, or None where none did."""
    raw = (process_env() if env is None else env).get("WORLD_SIZE", "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise MemraError(f"WORLD_SIZE={raw!r} is not an integer") from None


def launcher_rank(env: Env | None = None) -> int | None:
    """RANK as a launcher set it for this process (None where none did): only rank 0 serves HTTP."""
    if launcher_world_size(env) is None:
        return None
    return _int(process_env() if env is None else env, "RANK")


def _seconds(env: Env, name: str, default: float, zero_ok: bool = False) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise MemraError(f"{name}={raw!r} is not a number of seconds") from None
    if v < 0 or (v == 0 and not zero_ok) or v != v:
        raise MemraError(f"{name}={raw!r} must be {'>= 0' if zero_ok else '> 0'} seconds")
    return v


def _int(env: Env, name: str, default: int | None = None) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        if default is None:
            raise MemraError(f"{name} is not set; launch the ranks with torchrun (or memra.pp.dist.launch_local)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise MemraError(f"{name}={raw!r} is not an integer") from None


def backend_for(device_type: str, env: Env) -> str:
    raw = env.get("MEMRA_PP_DIST_BACKEND", "").strip().lower()
    if raw in ("", "auto"):
        return "nccl" if device_type == "cuda" else "gloo"
    if raw not in ("gloo", "nccl"):
        raise MemraError(f"MEMRA_PP_DIST_BACKEND={raw!r} is not gloo or nccl")
    if raw == "nccl" and device_type != "cuda":
        raise MemraError("MEMRA_PP_DIST_BACKEND=nccl needs CUDA devices; use gloo on CPU")
    return raw


@dataclass(frozen=True)
class DistConfig:
    """One rank's view of the process group and the pipeline's waits."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    backend: str  # gloo | nccl
    timeout_s: float = 30.0
    idle_timeout_s: float = FOREVER_S
    start_timeout_s: float = 600.0
    own_store: bool = False  # True: memra hosts the rendezvous store on rank 0 (local launch)
    share_gpus: bool = False  # NCCL ranks may share a GPU (MEMRA_PP_DIST_SHARE_GPUS)

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise pf.PipelineError(f"a process-per-stage pipeline needs at least 2 ranks, got WORLD_SIZE={self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise pf.PipelineError(f"RANK={self.rank} is outside 0..{self.world_size - 1}")
        if not 0 < self.master_port < 65536:
            raise pf.PipelineError(f"MASTER_PORT={self.master_port} is not a TCP port")
        if self.backend not in ("gloo", "nccl"):
            raise pf.PipelineError(f"unknown torch.distributed backend {self.backend!r}; use gloo or nccl")

    @property
    def last(self) -> int:
        return self.world_size - 1

    @classmethod
    def from_env(cls, device_type: str, env: Env | None = None, **override) -> DistConfig:
        """The torchrun variables plus the MEMRA_PP_DIST_* doors."""
        e = process_env() if env is None else env
        rank = _int(e, "RANK")
        values = dict(
            rank=rank, world_size=_int(e, "WORLD_SIZE"), local_rank=_int(e, "LOCAL_RANK", rank),
            master_addr=e.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1", master_port=_int(e, "MASTER_PORT"),
            backend=backend_for(device_type, e), own_store=e.get(LOCAL_DOOR) == "1", **doors_from_env(e))
        values.update(override)
        return cls(**values)


def doors_from_env(env: Env | None = None) -> dict:
    e = process_env() if env is None else env
    idle = _seconds(e, "MEMRA_PP_DIST_IDLE_TIMEOUT_S", 0.0, zero_ok=True)
    share = e.get("MEMRA_PP_DIST_SHARE_GPUS", "").strip()
    if share not in ("", "0", "1"):
        raise MemraError(f"MEMRA_PP_DIST_SHARE_GPUS={share!r} must be 0 or 1")
    return dict(timeout_s=_seconds(e, "MEMRA_PP_DIST_TIMEOUT_S", 30.0), idle_timeout_s=idle or FOREVER_S,
                start_timeout_s=_seconds(e, "MEMRA_PP_DIST_START_TIMEOUT_S", 600.0), share_gpus=share == "1")


def dist_fence(n_layers: int, world_size: int, env: Env | None = None) -> pf.StageFence:
    """The stage fence for one rank per stage, from the in-process doors, with their refusals."""
    e = process_env() if env is None else env
    raw = e.get("MEMRA_PP_STAGES")
    stages = raw if raw not in (None, "") else str(world_size)
    if e.get("MEMRA_PP_DEVICES"):
        raise pf.PipelineError("MEMRA_PP_DEVICES places in-process stages; across processes each rank runs on its own "
                               "device (cuda:LOCAL_RANK or cpu). Unset it")
    fence = pf.parse_fence(n_layers, stages, e.get("MEMRA_PP_SPLITS"), e.get("MEMRA_PP_SPLIT"))
    if fence is None:
        raise pf.PipelineError(f"no usable stage fence for {stages} stages over {n_layers} layers (see the "
                               "PpDoorWarning above: MEMRA_PP_STAGES / MEMRA_PP_SPLITS / MEMRA_PP_SPLIT)")
    if fence.n_stages != world_size:
        raise pf.PipelineError(f"MEMRA_PP_STAGES={stages} but the process group has {world_size} ranks; one rank runs "
                               "one stage, so make them agree (or unset MEMRA_PP_STAGES)")
    return fence


def rank_device(device_type: str, cfg: DistConfig) -> torch.device:
    """cuda:LOCAL_RANK (or cpu). Under gloo, ranks beyond the GPU count share GPUs round-robin (one-GPU
    machines, tests); NCCL needs a GPU of its own per rank, so there it is refused unless
    MEMRA_PP_DIST_SHARE_GPUS=1 asks to try (NCCL may still refuse, at bring-up)."""
    if device_type != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise pf.PipelineError(f"rank {cfg.rank} was asked for CUDA but sees no CUDA device")
    if cfg.local_rank >= count and cfg.backend == "nccl" and not cfg.share_gpus:
        raise pf.PipelineError(f"rank {cfg.rank} wants cuda:{cfg.local_rank} but this node has {count} GPU(s); NCCL needs "
                               "one GPU per rank (MEMRA_PP_DIST_BACKEND=gloo lets ranks share GPUs; "
                               "MEMRA_PP_DIST_SHARE_GPUS=1 tries NCCL anyway)")
    return torch.device("cuda", cfg.local_rank % count)


# --- joining the process group ---------------------------------------------------------------------------


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def join_group(cfg: DistConfig, watch: Callable[[], str | None] | None = None) -> None:
    """Join the default process group as cfg.rank. With own_store, rank 0 hosts the store and waits
    for every worker to check in, calling `watch()` while it waits (a message = a worker is gone)."""
    if dist.is_initialized():
        raise pf.PipelineError("this process already belongs to a torch.distributed process group (another "
                               "pipeline?); shut that one down first")
    # The group's own timeout bounds waits we do not time ourselves (NCCL's watchdog among them), so it
    # must outlast an idle worker's wait for its next command; every wait of ours passes its own timeout.
    group_timeout = _td(max(cfg.idle_timeout_s, cfg.timeout_s, cfg.start_timeout_s))
    if not cfg.own_store:
        process_env().setdefault("MASTER_ADDR", cfg.master_addr)
        process_env().setdefault("MASTER_PORT", str(cfg.master_port))
        dist.init_process_group(cfg.backend, init_method="env://", rank=cfg.rank, world_size=cfg.world_size,
                                timeout=group_timeout)
        return
    store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=cfg.rank == 0,
                          timeout=_td(cfg.start_timeout_s), wait_for_workers=False)
    if cfg.rank == 0:
        keys = [f"memra/joined/{r}" for r in range(1, cfg.world_size)]
        deadline = time.monotonic() + cfg.start_timeout_s
        while not store.check(keys):
            gone = watch() if watch is not None else None
            if gone:
                raise pf.PipelineError(f"a pipeline worker exited before joining: {gone}")
            if time.monotonic() > deadline:
                raise pf.PipelineError(f"not every rank joined within {cfg.start_timeout_s:g}s "
                                       "(MEMRA_PP_DIST_START_TIMEOUT_S)")
            time.sleep(0.02)
    else:
        store.set(f"memra/joined/{cfg.rank}", str(os.getpid()))
    dist.init_process_group(cfg.backend, store=store, rank=cfg.rank, world_size=cfg.world_size, timeout=group_timeout)


def leave_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group still has to be left
            pass


# --- local workers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class LocalWorkers:
    """Ranks 1..N-1 as child processes of rank 0: started, watched, and always reaped (no zombies)."""

    def __init__(self, procs: dict[int, subprocess.Popen]):
        self.procs = procs

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def exited(self) -> str | None:
        """'rank r: how it ended' for every worker that is no longer running, or None."""
        gone = [f"rank {r} {describe_exit(p.poll())}" for r, p in self.procs.items() if p.poll() is not None]
        return ", ".join(gone) or None

    def status(self, settle_s: float = 0.0) -> str | None:
        """Like exited(), after giving a dying worker up to settle_s to be reaped."""
        deadline = time.monotonic() + settle_s
        while self.exited() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.exited()

    def finish(self, grace_s: float) -> dict[int, int]:
        """Wait up to grace_s for every worker to exit, then kill the rest; reap all. -> rank: return code."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        return {r: p.wait() for r, p in self.procs.items()}


def spawn_workers(model_path: str, cfg: DistConfig, device_type: str, dtype: torch.dtype, threads: int,
                  env: Env | None = None) -> LocalWorkers:
    """Start ranks 1..world-1 of a local pipeline (rank 0 is the caller)."""
    import memra

    base = dict(process_env() if env is None else env)
    root = str(Path(memra.__file__).resolve().parent.parent)  # workers import this very memra
    base["PYTHONPATH"] = root + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    dtype_name = str(dtype).removeprefix("torch.")
    procs = {}
    for r in range(1, cfg.world_size):
        # rank r takes the device r after rank 0's (cuda:K -> K + r), so a driver on cuda:1 does not
        # share its GPU with rank 1 (rank_device wraps, or refuses for NCCL, past the last GPU)
        worker_env = dict(base, RANK=str(r), WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(cfg.local_rank + r),
                          MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(cfg.master_port), MEMRA_PP_STAGES=str(cfg.world_size),
                          MEMRA_PP_DIST_BACKEND=cfg.backend, MEMRA_PP_DIST_TIMEOUT_S=repr(cfg.timeout_s),
                          MEMRA_PP_DIST_START_TIMEOUT_S=repr(cfg.start_timeout_s),
                          MEMRA_PP_DIST_SHARE_GPUS="1" if cfg.share_gpus else "0", **{LOCAL_DOOR: "1"})
        worker_env["MEMRA_PP_DIST_IDLE_TIMEOUT_S"] = "0" if cfg.idle_timeout_s >= FOREVER_S else repr(cfg.idle_timeout_s)
        cmd = [sys.executable, "-m", "memra.pp.dist_worker", str(model_path), "--device", device_type,
               "--dtype", dtype_name, "--threads", str(threads)]
        procs[r] = subprocess.Popen(cmd, env=worker_env, stdin=subprocess.DEVNULL)
    return LocalWorkers(procs)
