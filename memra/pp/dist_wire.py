"""The wire between pipeline ranks: messages, their byte layout, and one double-buffered link.

A message crosses a link as two torch.distributed point-to-point transfers:

    header  int64[HEADER_WORDS]: magic, op, step, slot, cmd, flags, counts, byte sizes (fixed size, so
            the receiver can always post it)
    body    uint8[body_bytes]:   int64 words (sequence ids, positions, op arguments, one descriptor per
            tensor), then each tensor's raw bytes (8-byte aligned), then UTF-8 text (errors, hello)

Tensors travel as their raw bytes in their native dtype and are rebuilt with `view`, so a boundary
moves bytes unchanged (E2: the receiving stage computes on exactly the bits the sender produced).

A `Link` is one direction between two ranks with TWO slots, like the in-process BoundaryRt: message k
uses slot k % 2 (its own tags, its own persistent grow-only buffers). The sender may have one message
in flight per slot; reusing a slot first waits for its previous send to complete, which under gloo
means the receiver has posted the matching receive — the same "TX only after RX drained" ordering the
in-process Handoff gives. Every wait has a timeout and every transport failure becomes a
PipelineError naming the peer rank (a hung or dead stage must never hang the driver).
"""

from __future__ import annotations

import datetime
import enum
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from memra.pp.fence import PipelineError

MAGIC = 0x6D656D7261  # "memra": a header that is not ours means the two sides lost step
HEADER_WORDS = 16
FOREVER_S = 10 * 365 * 86400.0  # an idle worker waits for its next command this long (gloo needs a number)


class Op(enum.IntEnum):
    HELLO = 1  # bring-up: fence, model fingerprint; every rank checks and appends its description
    NEW = 2  # a new sequence: args (max_ctx,)
    FREE = 3  # drop a sequence's caches
    PRIME = 4  # one prompt piece: positions (pos0,), tensors (h [n, E],); flags LAST_PIECE / ALL_LOGITS
    DECODE = 5  # one token per row: seqs [B], positions [B], args (plan,), tensors (h [B, E],)
    VERIFY = 6  # T tokens of one sequence: positions (pos0,), args (plan,), tensors (h [T, E],); flag TRAIL
    ROLLBACK = 7  # keep the first `keep` of the tokens verified from pos0: args (pos0, keep)
    STATS = 8  # every rank appends its counters to args
    SHUTDOWN = 9  # forwarded to the last rank, which acknowledges to rank 0; then every worker exits 0
    REPLY = 10  # last rank -> rank 0: the result of a command (logits, ...)
    ERROR = 11  # a rank failed: text names it and why; forwarded unchanged to rank 0


class Flag(enum.IntFlag):
    NONE = 0
    LAST_PIECE = 1  # PRIME: the prompt's final piece (the last stage replies after it)
    ALL_LOGITS = 2  # PRIME: reply with every position's logits [T, V]
    TRAIL = 4  # VERIFY: record GDN states per column for a later ROLLBACK
    CANARY = 8  # negative control (gate only): the receiving stage flips one byte of the boundary payload


# Ops that produce no reply when they succeed: they travel in order with the compute ops, so a
# failure still reaches rank 0, as an ERROR read in place of the next command's reply.
POSTED = frozenset({Op.NEW, Op.FREE, Op.ROLLBACK})

_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int64: 4, torch.uint8: 5, torch.int32: 6,
           torch.float64: 7}
_CODES = {v: k for k, v in _DTYPES.items()}
_DESC = 6  # words per tensor descriptor: dtype code, ndim, up to 4 dims


@dataclass(frozen=True)
class Message:
    op: Op
    cmd: int = 0  # the driver's command number, echoed in the reply (a stale reply is detected)
    flags: Flag = Flag.NONE
    seqs: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    args: tuple[int, ...] = ()
    tensors: tuple[torch.Tensor, ...] = field(default=())
    text: str = ""

    def but(self, **changes) -> Message:
        """This message with some fields replaced (a stage forwards the command with its own output)."""
        return Message(**{**self.__dict__, **changes})


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _dims(t: torch.Tensor) -> list[int]:
    if t.dim() > 4:
        raise PipelineError(f"a boundary tensor has {t.dim()} dimensions; the wire carries at most 4")
    if t.dtype not in _DTYPES:
        raise PipelineError(f"a boundary tensor has dtype {t.dtype}, which the wire does not carry")
    return [_DTYPES[t.dtype], t.dim(), *t.shape, *([0] * (4 - t.dim()))]


def body_size(msg: Message) -> tuple[list[int], int]:
    """(the body's int64 words, its total byte size)."""
    words = [*msg.seqs, *msg.positions, *msg.args]
    for t in msg.tensors:
        words += _dims(t)
    size = 8 * len(words) + sum(_pad8(t.numel() * t.element_size()) for t in msg.tensors)
    return words, size + len(msg.text.encode())


def encode(msg: Message, step: int, slot: int, header: torch.Tensor, body: torch.Tensor | None) -> int:
    """Write msg into the slot's header [HEADER_WORDS] int64 and body uint8 buffers (body large enough,
    or None when the message has no body). -> the body's byte size."""
    words, size = body_size(msg)
    text = msg.text.encode()
    head = [MAGIC, int(msg.op), step, slot, msg.cmd, int(msg.flags), len(msg.seqs), len(msg.positions),
            len(msg.args), len(msg.tensors), len(text), size]
    header.copy_(torch.tensor(head + [0] * (HEADER_WORDS - len(head)), dtype=torch.int64))
    if size == 0:
        return 0
    off = 8 * len(words)
    if words:
        body[:off].copy_(torch.tensor(words, dtype=torch.int64).view(torch.uint8))
    for t in msg.tensors:
        n = t.numel() * t.element_size()
        body[off : off + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))  # complete before the send
        off += _pad8(n)
    if text:
        body[off : off + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    return size


@dataclass(frozen=True)
class Header:
    op: Op
    step: int
    slot: int
    cmd: int
    flags: Flag
    n_seqs: int
    n_pos: int
    n_args: int
    n_tensors: int
    text_bytes: int
    body_bytes: int


def parse_header(words: list[int], what: str) -> Header:
    if words[0] != MAGIC:
        raise PipelineError(f"{what}: received a header without the memra magic ({words[0]:#x}); the two ranks "
                            "run different protocols or lost step — restart the pipeline")
    try:
        op = Op(words[1])
    except ValueError:
        raise PipelineError(f"{what}: unknown op {words[1]}") from None
    return Header(op, words[2], words[3], words[4], Flag(words[5]), *words[6:12])


def decode(h: Header, body: torch.Tensor | None) -> Message:
    """The message from its header and body bytes. Tensors are fresh copies (the slot's buffer is
    reused two messages later), on the body's device, with the sender's exact bytes."""
    if h.body_bytes == 0:
        return Message(h.op, h.cmd, h.flags)
    n_words = h.n_seqs + h.n_pos + h.n_args + _DESC * h.n_tensors
    words = body[: 8 * n_words].view(torch.int64).tolist()
    seqs, rest = words[: h.n_seqs], words[h.n_seqs :]
    positions, rest = rest[: h.n_pos], rest[h.n_pos :]
    args, rest = rest[: h.n_args], rest[h.n_args :]
    off, tensors = 8 * n_words, []
    for k in range(h.n_tensors):
        code, ndim, *dims = rest[_DESC * k : _DESC * (k + 1)]
        dtype, shape = _CODES[code], tuple(dims[:ndim])
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        tensors.append(body[off : off + n].view(dtype).view(shape).clone())
        off += _pad8(n)
    text = bytes(body[off : off + h.text_bytes].cpu().tolist()).decode() if h.text_bytes else ""
    return Message(h.op, h.cmd, h.flags, tuple(seqs), tuple(positions), tuple(args), tuple(tensors), text)


def explain(err: BaseException, what: str, peer: int, timeout_s: float) -> str:
    """One line saying what a transport failure means, from the backend's error text."""
    s = str(err)
    low = s.lower()
    if "timed out" in low or "timeout" in low:
        return (f"{what}: rank {peer} did not answer within {timeout_s:g}s (MEMRA_PP_DIST_TIMEOUT_S): the stage is "
                f"hung, stopped or far too slow")
    if "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
        return f"{what}: the connection to rank {peer} closed: that process died or was killed"
    return f"{what}: rank {peer}: {s.splitlines()[0] if s else type(err).__name__}"


class LinkError(PipelineError):
    """A transfer on a link failed (timeout, dead peer): the pipeline cannot continue."""


class Link:
    """One direction between this rank and `peer`: two slots with their own tags and persistent,
    grow-only buffers on `device` (the backend's: CPU for gloo, this rank's GPU for NCCL), a step
    counter that alternates the slots, and the sends still in flight per slot."""

    def __init__(self, peer: int, channel: int, device: torch.device, name: str, poll: bool = False):
        self.peer, self.channel, self.device, self.name = peer, channel, device, name
        self.poll = poll  # NCCL: bound a wait by polling completion (its wait() may only order streams)
        self.step = 0
        self.headers = [torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device) for _ in range(2)]
        self.bodies: list[torch.Tensor | None] = [None, None]
        self.in_flight: list[list] = [[], []]
        self.messages = 0
        self.bytes = 0

    def _tag(self, kind: int, slot: int) -> int:
        return self.channel * 4 + kind * 2 + slot  # header/body x slot 0/1, per channel

    def _wait(self, work, timeout_s: float, what: str) -> None:
        """Wait for one transfer, never longer than timeout_s. Gloo's wait takes the timeout itself (and
        closes the connection when it expires: after a timeout the pipeline is down anyway)."""
        try:
            if self.poll:
                deadline, delay = time.monotonic() + timeout_s, 2e-5
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError("Timed out polling the transfer")
                    time.sleep(delay)
                    delay = min(2 * delay, 1e-3)
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as err:  # noqa: BLE001 - every backend failure means the same thing here
            raise LinkError(explain(err, f"{self.name} ({what})", self.peer, timeout_s)) from err

    def _body(self, slot: int, n: int) -> torch.Tensor:
        buf = self.bodies[slot]
        if buf is None or buf.numel() < n:  # grow-only: the high-water mark, O(distinct widths) allocations
            buf = self.bodies[slot] = torch.empty(max(n, 4096), dtype=torch.uint8, device=self.device)
        return buf

    def drain(self, slot: int, timeout_s: float) -> None:
        """Wait until the slot's previous send has been taken by the peer (its buffers may be reused)."""
        works, self.in_flight[slot] = self.in_flight[slot], []
        for w in works:
            self._wait(w, timeout_s, "send")

    def drain_all(self, timeout_s: float) -> None:
        for slot in (0, 1):
            self.drain(slot, timeout_s)

    @torch.inference_mode()  # buffers grown inside a step body are inference tensors: write them in kind
    def send(self, msg: Message, timeout_s: float) -> None:
        slot = self.step % 2
        self.drain(slot, timeout_s)
        size = body_size(msg)[1]
        body = self._body(slot, size) if size else None
        encode(msg, self.step, slot, self.headers[slot], body)
        try:
            works = [dist.isend(self.headers[slot], self.peer, tag=self._tag(0, slot))]
            if size:
                works.append(dist.isend(body[:size], self.peer, tag=self._tag(1, slot)))
        except Exception as err:  # noqa: BLE001
            raise LinkError(explain(err, f"{self.name} (send)", self.peer, timeout_s)) from err
        self.in_flight[slot] = works
        self.step += 1
        self.messages += 1
        self.bytes += size + 8 * HEADER_WORDS

    @torch.inference_mode()
    def recv(self, timeout_s: float) -> Message:
        slot = self.step % 2
        header = self.headers[slot]
        try:
            work = dist.irecv(header, self.peer, tag=self._tag(0, slot))
        except Exception as err:  # noqa: BLE001
            raise LinkError(explain(err, f"{self.name} (receive)", self.peer, timeout_s)) from err
        self._wait(work, timeout_s, "receive")
        h = parse_header(header.tolist(), self.name)
        if (h.step, h.slot) != (self.step, slot):
            raise PipelineError(f"{self.name}: expected message {self.step} in slot {slot}, got {h.step} in slot "
                                f"{h.slot}; the ranks lost step — restart the pipeline")
        body = None
        if h.body_bytes:
            body = self._body(slot, h.body_bytes)[: h.body_bytes]
            try:
                work = dist.irecv(body, self.peer, tag=self._tag(1, slot))
            except Exception as err:  # noqa: BLE001
                raise LinkError(explain(err, f"{self.name} (receive)", self.peer, timeout_s)) from err
            self._wait(work, timeout_s, "receive")
        self.step += 1
        self.messages += 1
        self.bytes += h.body_bytes + 8 * HEADER_WORDS
        return decode(h, body)


def flip_one_byte(t: torch.Tensor) -> torch.Tensor:
    """The canary's corruption: one bit of one byte in the middle of row 0, in place. -> t."""
    raw = t.view(-1).view(torch.uint8)
    i = min(raw.numel() - 1, (t[0].numel() * t.element_size()) // 2 if t.dim() > 1 else raw.numel() // 2)
    raw[i] ^= 0x10
    return t
