"""A pipeline worker: rank s > 0 runs stage s, obeying commands from rank s-1 until shutdown.

    python -m memra.pp.dist_worker MODEL [--device cpu|cuda] [--dtype float32] [--threads N]

MODEL is a checkpoint path, or `random:NAME:LAYERS` for a random-weight model of a named shape
(memra.random_model, seed 0: what launch_local passes for one; HELLO's fingerprint refuses a mismatch).

(started by memra.pp.dist.launch_local, or by torchrun through memra.pp.dist.join_from_env).

The loop: receive a command from the previous stage; do this stage's part of it (create/free a
sequence, run a prime piece / decode rows / verify over its layers, roll back); pass the command on
with this stage's output — or, on the last stage, send the result (logits) back to rank 0.

Failures never hang the driver: a command that fails here becomes an ERROR message naming this rank,
which travels on to rank 0 in place of the result (later messages of the same command are dropped, so
rank 0 reads exactly one answer per command). A lost upstream (its process died, or it stopped
answering mid-command) is reported downstream the same way, and the worker exits 1. SHUTDOWN makes
every worker pass it on and exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

from memra.pp.dist_launch import DistConfig, dist_fence, join_group, leave_group, rank_device
from memra.pp.dist_stage import PLAN_NAMES, StageState, fingerprint, release_foreign_weights
from memra.pp.dist_wire import POSTED, Flag, Link, Message, Op, flip_one_byte
from memra.pp.fence import PipelineError

FORWARD, REPLY = 1, 2  # link channels: stage s -> s+1, and last stage -> rank 0
STAT_WORDS = 8  # per rank in a STATS reply: rank, messages, rows, pieces, verifies, canaries, sequences, bytes


def links_for(cfg: DistConfig, device: torch.device) -> tuple[Link | None, Link]:
    """(upstream, downstream) of this rank: rank 0 has no upstream and sends to rank 1; the last
    stage sends its results back to rank 0 on the reply channel."""
    r, poll = cfg.rank, cfg.backend == "nccl"
    up = Link(r - 1, FORWARD, device, f"stage {r - 1} -> stage {r}", poll) if r > 0 else None
    if r == cfg.last:
        return up, Link(0, REPLY, device, f"stage {r} -> rank 0 (replies)", poll)
    return up, Link(r + 1, FORWARD, device, f"stage {r} -> stage {r + 1}", poll)


def comm_device(cfg: DistConfig, device: torch.device) -> torch.device:
    return device if cfg.backend == "nccl" else torch.device("cpu")


def stats_words(state: StageState, rank: int, link_bytes: int) -> tuple[int, ...]:
    c = state.counts
    return (rank, c["messages"], c["rows"], c["pieces"], c["verifies"], c["canaries"], len(state.caches), link_bytes)


def handle(state: StageState, msg: Message, rank: int, link_bytes: int) -> Message | None:
    """This stage's part of one command. -> what to send downstream (None: nothing, e.g. a posted
    command on the last stage, or a prime piece before the final one)."""
    last = state.last
    op = msg.op
    state.counts["messages"] += 1
    if op in POSTED:
        seq = msg.seqs[0]
        if op is Op.NEW:
            state.new_seq(seq, msg.args[0])
        elif op is Op.FREE:
            state.free_seq(seq)
        else:
            state.rollback(seq, msg.args[0], msg.args[1])
        return None if last else msg
    if op is Op.STATS:
        args = msg.args + stats_words(state, rank, link_bytes)
        return Message(Op.REPLY, msg.cmd, args=args) if last else msg.but(args=args)
    h = msg.tensors[0].to(state.model.device)  # [rows, E] in the model dtype, the sender's exact bytes
    if msg.flags & Flag.CANARY:
        flip_one_byte(h)  # the gate's negative control: this stage computes on a corrupted boundary
        state.counts["canaries"] += 1
    flags = msg.flags & ~Flag.CANARY
    if op is Op.DECODE:
        out = state.rows(h, msg.seqs, msg.positions, PLAN_NAMES[msg.args[0]])
        return Message(Op.REPLY, msg.cmd, tensors=(out,)) if last else msg.but(tensors=(out,), flags=flags)
    if op is Op.PRIME:
        out = state.piece(h, msg.seqs[0], msg.positions[0], bool(msg.flags & Flag.LAST_PIECE),
                          bool(msg.flags & Flag.ALL_LOGITS))
        if last:
            return None if out is None else Message(Op.REPLY, msg.cmd, tensors=(out,))
        return msg.but(tensors=(out,), flags=flags)
    if op is Op.VERIFY:
        out = state.verify(h, msg.seqs[0], msg.positions[0], PLAN_NAMES[msg.args[0]], bool(msg.flags & Flag.TRAIL))
        return Message(Op.REPLY, msg.cmd, tensors=tuple(out)) if last else msg.but(tensors=(out,), flags=flags)
    raise PipelineError(f"stage {state.stage}: unexpected command {op.name}")


def hello(state: StageState | None, msg: Message, rank: int, fp: int, problem: str | None, device) -> Message:
    """Check that this rank belongs in the pipeline rank 0 describes; add this rank's line."""
    if problem is not None:
        return Message(Op.ERROR, msg.cmd, text=problem)
    want_fp, n_stages, *bounds = msg.args
    if fp != want_fp:
        return Message(Op.ERROR, msg.cmd, text=f"rank {rank} loaded a different model than rank 0 (fingerprint {fp:#x} "
                       f"!= {want_fp:#x}): every rank must load the same checkpoint with the same dtype")
    if tuple(bounds) != state.fence.bounds:
        return Message(Op.ERROR, msg.cmd, text=f"rank {rank} computed the fence {list(state.fence.bounds)} but rank 0 "
                       f"uses {bounds}: give every rank the same MEMRA_PP_STAGES / MEMRA_PP_SPLITS")
    a, b = state.layers
    line = f"rank {rank}: stage {state.stage}, layers [{a}, {b}), {device}, pid {os.getpid()}"
    text = f"{msg.text}\n{line}" if msg.text else line
    return Message(Op.REPLY, msg.cmd, text=text) if state.last else msg.but(text=text)


def serve_stage(state: StageState | None, cfg: DistConfig, fp: int = 0, problem: str | None = None) -> int:
    """The worker loop of rank cfg.rank (> 0). `problem`: why this rank could not load (it still takes
    part, to report that at bring-up). -> the process exit code: 0 after an orderly shutdown."""
    device = state.model.device if state is not None else torch.device("cpu")
    up, down = links_for(cfg, comm_device(cfg, device))
    last = cfg.rank == cfg.last
    failed_cmd = None  # a command that failed here: its later messages (prime pieces) are dropped
    mid_command = False  # inside a prime (more pieces due): waits are command waits, not idle waits
    with torch.inference_mode():
        while True:
            try:
                msg = up.recv(cfg.timeout_s if mid_command else cfg.idle_timeout_s)
            except PipelineError as err:
                _tell(down, Message(Op.ERROR, text=f"stage {cfg.rank} lost its upstream: {err}"), cfg)
                return 1
            mid_command = msg.op is Op.PRIME and not msg.flags & Flag.LAST_PIECE
            if msg.op is Op.SHUTDOWN:
                out = Message(Op.REPLY, msg.cmd) if last else msg
            elif msg.op is Op.ERROR:
                out = msg  # another stage's failure, on its way to rank 0
            elif msg.cmd == failed_cmd:
                continue
            elif msg.op is Op.HELLO:
                out = hello(state, msg, cfg.rank, fp, problem, device)
            elif state is None:
                out = Message(Op.ERROR, msg.cmd, text=problem or f"rank {cfg.rank} has no model")
            else:
                try:
                    out = handle(state, msg, cfg.rank, up.bytes + down.bytes)
                except Exception as err:  # noqa: BLE001 - reported to rank 0, which stops the pipeline
                    failed_cmd = msg.cmd
                    seqs = f" (sequence {', '.join(map(str, msg.seqs))})" if msg.seqs else ""
                    out = Message(Op.ERROR, msg.cmd, text=f"stage {cfg.rank} (rank {cfg.rank}) failed {msg.op.name}"
                                  f"{seqs}: {type(err).__name__}: {err}")
            if out is None:
                continue
            try:
                down.send(out, cfg.timeout_s)
                if msg.op is Op.SHUTDOWN:
                    down.drain_all(cfg.timeout_s)
                    return 0 if problem is None else 1
            except PipelineError as err:
                print(f"memra pp worker rank {cfg.rank}: {err}", file=sys.stderr)
                return 1


def _tell(down: Link, msg: Message, cfg: DistConfig) -> None:
    """Best effort: pass a failure on (the downstream may be gone too)."""
    try:
        down.send(msg, min(cfg.timeout_s, 5.0))
        down.drain_all(min(cfg.timeout_s, 5.0))
    except PipelineError:
        pass
    print(f"memra pp worker rank {cfg.rank}: {msg.text}", file=sys.stderr)


def load_stage_model(source: str, device: torch.device, dtype: str | None):
    """This rank's copy of the model (weights outside its stage are dropped later): a checkpoint path,
    or `random:NAME[:LAYERS]`, rebuilt by memra.random_model with seed 0 on this rank's device."""
    import memra
    from memra.settings import Settings

    settings = Settings.from_env().in_one_process()  # this rank is one stage: no in-process split of its own
    if not source.startswith("random:"):
        return memra.load(source, device=device, dtype=dtype, tokenizer=False, settings=settings)
    from memra.random_model import random_model

    name, _, layers = source.removeprefix("random:").partition(":")
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return random_model(name, device, torch_dtype, n_layers=int(layers) if layers else None, settings=settings)


def run_worker(model_path: str, cfg: DistConfig, device: torch.device, dtype: str | None) -> int:
    """Join, load, serve. -> the exit code."""
    join_group(cfg)
    state, fp, problem = None, 0, None
    try:
        model = load_stage_model(model_path, device, dtype)
        fence = dist_fence(model.cfg.n_layers, cfg.world_size)
        fp = fingerprint(model)  # before trimming: it reads the embedding and the head
        state = StageState(model, fence, cfg.rank)
        release_foreign_weights(model, fence, cfg.rank)
        if model.settings.exact:
            from memra.kernels.exact import require_exact

            require_exact(model.dtype, model.device)
    except Exception as err:  # noqa: BLE001 - reported at bring-up through the pipeline
        problem = f"rank {cfg.rank} cannot serve {model_path}: {type(err).__name__}: {err}"
    try:
        return serve_stage(state, cfg, fp, problem)
    finally:
        leave_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memra.pp.dist_worker", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda runs on cuda:LOCAL_RANK")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # rank 0's count: CPU kernels may pick reductions by thread count
    cfg = DistConfig.from_env(args.device)
    if cfg.own_store:
        # A local worker lives and dies with its rank 0, which shuts it down in order after draining (or
        # kills it); a terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process group,
        # and must not take a stage away under requests rank 0 is still finishing. A dead rank 0 still
        # ends the worker: its connections close.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = rank_device(args.device, cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return run_worker(args.model, cfg, device, args.dtype)


if __name__ == "__main__":
    sys.exit(main())
