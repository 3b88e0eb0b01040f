"""EventSink: the single ordered writer of one stream key, one writer of the process's shared
WriteStreams call (libs/streams/writer.py). Its batches, answers and failures: docs/design/streams.md."""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from agentmesh.events.v1 import events_pb2
from agentmesh.libs import events, identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import (
    Cancelled,
    FailedPrecondition,
    Internal,
    MeshError,
    ResourceExhausted,
    from_reason,
    from_rpc_error,
    is_lost_send,
)
from agentmesh.libs.streams.reconnect import went_away
from agentmesh.libs.streams.writer import BATCH_BYTES, EVENT_BYTES, Writer, WritesCall
from agentmesh.stream.v1.stream_service_pb2 import StreamBatch, StreamBatchAnswer, WriteStreamResponse

_MAX_BATCH = 256
_MAX_UNANSWERED = 64  # batches without an answer: then one asks (it bounds what is held)
_MERGE_CHARS = 16 * 1024  # the text of deltas merged into one event, at most
_DELTAS = {"text_delta": events.text_delta, "reasoning_delta": events.reasoning_delta}  # by oneof field
_Entry = tuple[events_pb2.Event, "asyncio.Future[str] | None"]  # a future only where someone waits


def merged(pending: list[_Entry]) -> list[_Entry]:
    """`pending` with each run of consecutive deltas of one kind (text, or reasoning) that nobody waits
    for as one delta of their joined text: one event to encode, store and read instead of one per model
    token (docs/design/streams.md, "Merged deltas")."""
    out: list[_Entry] = []
    texts: list[str] = []
    kind, chars = "", 0

    def end_run() -> None:
        if len(texts) > 1:
            out[-1] = (_DELTAS[kind]("".join(texts)), None)
        texts.clear()

    for entry in pending:
        event, fut = entry
        which = event.WhichOneof("payload") if fut is None else None
        if which in _DELTAS:  # (the oneof field, and its message's one string field)
            text = getattr(getattr(event, which), which)
            if which == kind and chars + len(text) <= _MERGE_CHARS:
                texts.append(text)
                chars += len(text)
                continue
            end_run()
            kind, chars = which, len(text)
            texts.append(text)
        else:
            end_run()
            kind, chars = "", 0
        out.append(entry)
    end_run()
    return out


@dataclass(eq=False)
class _Sent:
    """A batch sent and not answered yet (by its own answer or a later one)."""

    entries: list[_Entry]
    asked: bool  # it asked for its answer (no defer_answer): an answer ends with it


class EventSink:
    def __init__(self, clients: Clients, key: str, since: str = "") -> None:
        self.writer: Writer = clients.writes
        self.key = key
        self._signer = clients.signer
        principal = identity.current()
        self._user = "" if principal is None else principal.user  # the buffer's writer
        # An offset of its buffer (the turn's `start`, then its own latest answered one): named when it
        # binds to a call, so that after a stream service's restart it fails instead of writing into a
        # newer buffer of its key (another turn's).
        self._since = since
        # Its name as the buffer's producer, and how many events it handed out in batches: a batch sent
        # again after its call failed unanswered is stored once (WriteStreamRequest.producer).
        self._producer = secrets.token_hex(8)
        self._sequence = 0
        self._flush_wanted = False  # someone waits until everything emitted is stored
        self._pending: list[_Entry] = []
        self._resending = 0  # pending entries at the front that went before: sent again as they were
        self._unanswered: collections.deque[_Sent] = collections.deque()
        self._call: WritesCall | None = None  # the call it writes on, and its id there
        self._id = 0
        self._idle = asyncio.Event()  # nothing queued and nothing unanswered
        self._idle.set()
        self._sent_any = False
        self._closed = False
        self._last_sent = False  # the writer's last batch went: the service forgets it once answered
        self._finished = False  # the last batch was answered (or there was nothing to write)
        self._failure: MeshError | None = None

    def emit(self, event: events_pb2.Event) -> None:
        """Queues `event` (dropped once the sink failed or closed: `failure` tells why)."""
        self._queue(event, None)

    async def store(self, event: events_pb2.Event) -> str:
        """Queues `event` and waits until it is stored; returns its offset (or raises the failure)."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue(event, fut)
        return await fut

    def _queue(self, event: events_pb2.Event, fut: asyncio.Future[str] | None) -> None:
        if self._failure is not None or self._closed:
            if fut is not None:
                fut.set_exception(
                    self._failure
                    or Cancelled(f"the writer of {self.key} is closed: this event was not stored")
                )
            return
        self._pending.append((event, fut))
        self._idle.clear()
        self.writer.ready(self, urgent=fut is not None or not self._sent_any)

    @property
    def failure(self) -> MeshError | None:
        return self._failure

    # --- what the Writer asks (libs.streams.writer.Batches) ---------------------------------------

    def take(self, current: WritesCall, slot: Callable[[WritesCall], StreamBatch]) -> None:
        """The next batch, when one is due: the queued events, or an empty one asking for the answer
        that a flush or the close waits for. On `current`, or on the call this sink is bound
        to while that one owes it answers (a batch goes after the one before it on the same call)."""
        if self._failure is not None or self._finished:
            return
        if self._unanswered and self._unanswered[-1].asked:
            return  # its answer comes first (then the sink is ready again)
        closing = self._closed and self._call is not None and not self._last_sent  # a last batch is owed
        flushing = self._flush_wanted and bool(self._unanswered)
        # its call retired: what it owes answers for is asked for there, even with nothing to send
        settling = self._call is not None and self._call.retired and bool(self._unanswered)
        if not (self._pending or closing or flushing or settling):
            self._leave_retired()
            return
        if len(self._pending) - self._resending > 1:
            self._pending[self._resending :] = merged(self._pending[self._resending :])
        count = self._batch_length()
        if count < 0:
            return  # failed: its next event is more than a request may carry
        call = self._call
        moving = call is not None and call is not current
        if call is None or (moving and not self._unanswered):
            if call is not None:
                call.unbind(self._id)
            call, self._call = current, current
            self._id = current.bind(self)
            self._last_sent = False
            announce = True
        else:
            announce = False
        entries, self._pending = self._pending[:count], self._pending[count:]
        self._resending = max(0, self._resending - count)
        last = self._closed and not self._pending
        asked = (
            last
            or call is not current  # the old call must answer it before the sink moves on
            or any(fut is not None for _, fut in entries)
            or (self._flush_wanted and not self._pending)
            or len(self._unanswered) + 1 >= _MAX_UNANSWERED
        )
        item = slot(call)
        item.writer = self._id
        if announce:
            item.batch.key = self.key
            item.batch.since = self._since
            item.identity = self._signer.mint(self._user) if self._user else ""
        item.batch.events.extend(event for event, _ in entries)
        item.batch.producer = self._producer
        item.batch.sequence = self._sequence
        self._sequence += len(entries)
        item.batch.defer_answer = not asked
        item.last = last
        self._last_sent = last
        self._unanswered.append(_Sent(entries, asked))
        self._sent_any = True
        if self._pending and not asked:
            self.writer.ready(self)

    def _batch_length(self) -> int:
        """How many pending events the next batch takes: up to _MAX_BATCH and BATCH_BYTES, at least
        one; -1 (the sink failed) when that one alone is over EVENT_BYTES: no request could carry it."""
        size = count = 0
        for event, _ in self._pending[:_MAX_BATCH]:
            size += event.ByteSize()
            if count and size > BATCH_BYTES:
                break
            if size > EVENT_BYTES:
                kind = event.WhichOneof("payload") or "empty"
                self._fail(
                    ResourceExhausted(f"a {kind} event of {size} bytes is over the {EVENT_BYTES}-byte limit")
                )
                return -1
            count += 1
        return count

    def answered(self, call: WritesCall, answer: StreamBatchAnswer) -> None:
        if call is not self._call or self._failure is not None:
            return
        if answer.error_reason:
            err = from_reason(answer.error_reason, answer.error_message)
            if isinstance(err, FailedPrecondition):
                # Someone closed the buffer under a running writer: the run was cancelled.
                err = Cancelled(f"{self.key} was closed: {err.message}")
            self._fail(err)
            return
        try:
            self._settle(answer.answer)
        except MeshError as err:
            self._fail(err)
            return
        self._progress()

    def call_ended(self, call: WritesCall, error: BaseException) -> None:
        """The call this sink is bound to ended: the sink goes on on another one. What it sent that was
        not answered is sent again when the service went away (restarted, stopping) or the request
        never left; stored once, as its producer's (the Writer waits for the service meanwhile, within
        the reconnect budget). Another failure is the sink's."""
        if call is not self._call or self._failure is not None or self._finished:
            return
        self._call = None
        if self._unanswered:
            lost = isinstance(error, grpc.aio.AioRpcError) and is_lost_send(error)
            failed = error if isinstance(error, MeshError) else from_rpc_error(error)  # type: ignore[arg-type]
            if not (lost or went_away(failed)):
                self._fail(failed)
                return
            again = [entry for sent in self._unanswered for entry in sent.entries]
            self._pending[:0] = again
            self._resending += len(again)  # (its producer's sequence names them: never merged anew)
            self._sequence -= len(again)
            self._unanswered.clear()
        self._progress()

    def unreachable(self, error: MeshError) -> None:
        if self._failure is None and not self._finished:
            self._fail(error)

    # --- state ---------------------------------------------------------------------------------------

    def _progress(self) -> None:
        """After an answer or a call's end: the next batch is due, or the sink is idle (or done)."""
        if self._unanswered:
            return
        self._leave_retired()
        if self._pending or (self._closed and self._call is not None and not self._last_sent):
            self.writer.ready(self, urgent=self._closed or self._flush_wanted)
            return
        self._flush_wanted = False
        self._idle.set()
        if self._closed:
            self._finish()

    def _leave_retired(self) -> None:
        """Nothing owed on a call that takes no new writers: leave it (it half-closes once all left)."""
        if self._call is not None and self._call.retired and not self._unanswered and not self._last_sent:
            self._call.unbind(self._id)
            self._call = None

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if self._call is not None:
                self._call.unbind(self._id)
                self._call = None

    def _settle(self, resp: WriteStreamResponse) -> None:
        """Gives an answer's offsets to the oldest unanswered batches, in order, up to the one that
        asked for it (a stopping service's last answer covers deferred batches alone)."""
        offsets, used, settled = resp.offsets, 0, 0
        while self._unanswered:
            sent = self._unanswered[0]
            size = len(sent.entries)
            if used + size > len(offsets):
                break
            self._unanswered.popleft()
            for (event, fut), offset in zip(sent.entries, offsets[used : used + size], strict=True):
                event.offset = offset
                if fut is not None and not fut.done():
                    fut.set_result(offset)
            used += size
            settled += 1
            if sent.asked:
                break
        if used != len(offsets) or not settled:
            raise Internal(
                f"the stream service answered {len(offsets)} offsets for the batches of {self.key}"
            )
        for offset in reversed(offsets):  # ("": an event stored before, by a batch sent again)
            if offset:
                self._since = offset
                break

    def _fail(self, err: MeshError) -> None:
        self._failure = err
        self._drop_all(err)
        if self._call is not None:
            self._call.unbind(self._id)
            self._call = None

    def _drop_all(self, err: MeshError) -> None:
        """Nothing queued or unanswered is waited for any more: whoever awaits one of them (`store`)
        gets `err`."""
        for _, fut in [e for sent in self._unanswered for e in sent.entries] + self._pending:
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._resending = 0
        self._unanswered.clear()
        self._idle.set()

    async def flush(self) -> None:
        """Waits until everything emitted so far is stored (raises the append error, if any)."""
        if not self._idle.is_set():
            self._flush_wanted = True
            self.writer.ready(self, urgent=True)
        await self._idle.wait()
        if self._failure is not None:
            raise self._failure

    async def aclose(self) -> None:
        """Flushes and ends the writer (its last batch)."""
        if self._closed:
            return
        self._closed = True
        if self._failure is not None:
            return
        if self._idle.is_set() and self._call is None:
            self._finish()  # nothing was ever written, or nothing is owed: no batch needed
            return
        self._idle.clear()
        self.writer.ready(self, urgent=True)
        await self._idle.wait()

    def cancel(self) -> None:
        """Gives up: nothing more is sent (what was is not waited for). Whoever waits for an event to be
        stored (`store`) learns that it may never be: Cancelled, not a wait for ever."""
        self._closed = True
        self._drop_all(Cancelled(f"the writer of {self.key} gave up before this event was stored"))
        if self._call is not None:
            self._call.abandon(self._id)
            self._call = None
        self._finished = True
