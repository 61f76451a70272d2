"""Async scheduling: schedule and launch step N+1 before reading step N's sampled tokens.

A synchronous step waits for its tokens, then processes them, and only then prepares the next
core call, so the device idles for the host's share of every step. Pipelined, step N+1 is
scheduled while step N's tokens are still on the device: each request sampled at N carries a
placeholder output token (positions, slots and pages of N+1 need only the count, so pages are
taken one token ahead), and N+1's input ids take those tokens from N's device tensor
(`PendingTokens.fill`, or the CUDA graph's `src` field), never through the host. After N+1 is
launched the host waits once, for N's packed tokens and logprobs (one non-blocking copy on a side
stream, one event), and runs output processing for N while N+1 computes.

A request that stops at N already has a step N+1 in flight: that token is discarded (never
emitted); its pages and slots return when it finishes, and stream order keeps the in-flight call's
writes ahead of any later reuse. Per-request RNG advances exactly as synchronously (every draw that
sync makes is made, in the same order, before any later one), so seeded sampling is unchanged.
An abort drops a request's token in flight: the client never saw it, so the aborted output holds
exactly the tokens already returned, as it would synchronously.

Steps that need the previous tokens on the host run synchronously (`fallback_reason`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlt_serve.engine.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from rlt_serve.host_copy import to_device
from rlt_serve.outputs import RequestOutput

if TYPE_CHECKING:
    from rlt_serve.engine.llm_engine import LLMEngine
    from rlt_serve.engine.scheduler import Row


class PendingTokens:
    """Step N's sampled tokens on the device, as the inputs of rows of step N+1."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        self.index = {id(seq): i for i, seq in enumerate(seqs)}
        self.tokens = tokens  # [len(seqs)] int64
        self.tokens32 = tokens.to(torch.int32)  # what the CUDA graph's int32 input buffer takes

    def source(self, seq: Sequence, pos: int) -> int:
        """Row of `tokens` holding the token at `pos` of `seq`, or -1 when the host has it."""
        if not seq.num_pending_tokens or pos != seq.num_tokens - 1:
            return -1
        return self.index[id(seq)]

    def fill(self, rows: list["Row"], ids: list[int], ids_dev: torch.Tensor) -> torch.Tensor:
        """`ids_dev` (the flattened tokens of `rows`) with each placeholder taken from the device."""
        dst, src, offset = [], [], 0
        for seq, span in rows:
            j = self.source(seq, seq.num_tokens - 1)
            if j >= 0 and span.start <= seq.num_tokens - 1 < span.end:
                dst.append(offset + seq.num_tokens - 1 - span.start)
                src.append(j)
            offset += span.num_tokens
        if ids.count(PLACEHOLDER_TOKEN) != len(dst):
            raise AssertionError("a placeholder token reached the prelude without a device source")
        if dst:
            dev = ids_dev.device
            ids_dev[to_device(dst, torch.long, dev)] = self.tokens[to_device(src, torch.long, dev)].to(ids_dev.dtype)
        return ids_dev


class InFlight:
    """A launched step whose tokens have not been read: its device tensors and the host copy."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, packed: torch.Tensor,
                 stream: "torch.cuda.Stream | None") -> None:  # fmt: skip
        self.seqs = seqs
        self.pending = PendingTokens(seqs, tokens)
        self.done: torch.cuda.Event | None = None
        if stream is None:  # CPU: the draws are already done
            self.host = packed
            return
        ready = torch.cuda.Event()
        ready.record()
        self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        with torch.cuda.stream(stream):  # device-to-host on its own stream, ordered by events
            stream.wait_event(ready)
            self.host.copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(stream)
        packed.record_stream(stream)

    def read(self) -> list[list[float]]:
        """Wait for the copy (the step's one host synchronisation) and return the packed rows."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class AsyncStep:
    """The pipelined `LLMEngine.step` (EngineConfig.async_scheduling)."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        dev = engine.device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.num_readbacks = 0  # host waits for sampled tokens (one per pipelined step)
        self.num_sync_steps = 0  # steps that fell back to the synchronous path
        self.last_fallback: str | None = None

    def fallback_reason(self) -> str | None:
        """Why the next step must see the previous step's tokens on the host (None: it need not)."""
        e = self.engine
        if e.scheduler.wants_speculation():
            return "self-speculative decoding drafts, verifies and accepts tokens on the host"
        if e.handoff.num_held:
            return "prefill/decode handoff samples first tokens and ships states on the host"
        for seq in e.scheduler.running + e.scheduler.waiting:
            if seq.adaptive:
                return "early exit decides depths on the host (and replays recorded exit depths by position)"
            if seq.pd_role is not None:
                return "a prefill/decode handoff request"
        return None

    def step(self) -> list[RequestOutput]:
        e = self.engine
        outputs: list[RequestOutput] = []
        reason = self.fallback_reason()
        if reason is not None:
            self.num_sync_steps += 1
            self.last_fallback = reason
            return outputs + self.resolve() + e._sync_step()
        spec = e.scheduler.spec  # adaptive K while it is off: plain steps are timed as they run here
        started = spec.clock() if spec is not None else 0.0
        e.scheduler.spec_paused = True  # in case the batch changed since fallback_reason asked
        try:
            begun, sched = e._begin_step(in_flight=self.inflight is not None)
        finally:
            e.scheduler.spec_paused = False
        outputs += begun
        if sched is None:
            return outputs + self.resolve()
        if spec is not None:
            spec.start_step(sched.rows, started)
        e.runner.pending = self.inflight.pending if self.inflight is not None else None
        try:
            result = e._execute(sched)
        finally:
            e.runner.pending = None
        new = None
        if result.sample_seqs:
            tokens, packed = e.sampler.sample_packed(result.sample_logits, result.sample_seqs)
            new = InFlight(result.sample_seqs, tokens, packed, self._stream)
        outputs += self.resolve()
        if new is not None:
            live = [seq for seq in new.seqs if not seq.status.finished]
            for seq in live:
                seq.output_token_ids.append(PLACEHOLDER_TOKEN)
                seq.num_pending_tokens = 1
            self.inflight = new if live else None
        if spec is not None:
            spec.end_step()  # one pipelined step's period: what a plain token costs here
        return outputs

    def resolve(self) -> list[RequestOutput]:
        """Read the step in flight and run output processing for its live requests."""
        f, self.inflight = self.inflight, None
        if f is None:
            return []
        e = self.engine
        live = [(i, seq) for i, seq in enumerate(f.seqs) if seq.num_pending_tokens]
        if not live:  # every request of the step finished meanwhile: its tokens are discarded
            return []
        rows = f.read()
        self.num_readbacks += 1
        samples = e.sampler.unpack([rows[i] for i, _ in live], [seq for _, seq in live])
        outputs = []
        for (_, seq), sample in zip(live, samples):
            seq.output_token_ids.pop()
            seq.num_pending_tokens = 0
            if seq.status.finished:  # aborts discard first; nothing else ends a request between steps
                raise AssertionError(f"request {seq.request_id} finished with a token in flight")
            e._stats.num_generation_tokens += 1
            outputs.append(e._process_sample(seq, sample))
            if seq.status is SequenceStatus.RUNNING and e.block_manager.enable_prefix_caching:
                e.scheduler.register_full_pages(seq)  # pages that became full with this token (not preempted)
        return outputs

    @staticmethod
    def discard(seq: Sequence) -> None:
        """Drop `seq`'s token in flight (it is being aborted): the client never saw it, so the
        aborted output holds exactly the tokens already returned, as synchronously."""
        if seq.num_pending_tokens:
            del seq.output_token_ids[-seq.num_pending_tokens :]
            seq.num_pending_tokens = 0
