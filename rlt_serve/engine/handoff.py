"""Prefill/decode handoff: one engine computes a prompt, another continues it.

Why it is shaped this way:
- The decode side owns the request. It reserves the receiving pages before anything is computed
  (so a prefill never produces KV with nowhere to go), picks the seed (so the prefill side's
  seed-dependent state, Huginn's random initial state, matches), and samples the first token with
  the request's own generator from the shipped final state. Seeded sampling therefore equals a
  single engine, whatever the placement.
- What crosses is exactly what a single engine keeps between the last prompt row and the first
  sample: the KV of every plane (prelude, every core depth slot, Huginn's coda) and the
  post-coda state of the last prompt position, which is what `compute_logits` reads (a hidden
  vector, not logits: smaller, and the head runs where the sampler is). Per-request model state
  (Huginn's exit records, its seed-keyed cache salt) travels as a small dict and is checked.
- KV is reported page by page as it becomes final (a page once all of its positions finished
  every depth, the last partial page with the prompt's end), so a transport can push while later
  chunks compute, and every page is sent exactly once: a page written twice by two transfers
  could land out of order.
- A page under a transfer is never reused. A prefill request is never preempted (it takes its
  whole prompt's pages at admission, so it can always finish) and holds its pages until
  `release_prefill`; the decode side holds
  a reservation's pages until activation or abort. Every reservation carries an allocation
  generation, monotonic per engine, so a write or activation for a reservation that was aborted
  (its pages possibly reused) is refused instead of corrupting another request.
- prompt_logprobs are rejected in PD mode: they would need the head over every prompt position on
  the prefill side and a second result channel; a clear error beats a silently missing field.
- Positions [0, skip_tokens) are already on the decode side (its prefix-cache hit): never sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlt_serve.engine.block_manager import OutOfPages
from rlt_serve.engine.sequence import Sequence, SequenceStatus
from rlt_serve.outputs import RequestOutput
from rlt_serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rlt_serve.engine.llm_engine import LLMEngine

# Final-state slots per engine, per max_num_seqs: the registered buffer a transport moves the
# last prompt position's state through (held from prefill completion / reservation to release /
# activation).
STATE_SLOTS_PER_SEQ = 4


class StaleGeneration(ValueError):
    """A transfer or activation names a reservation that no longer exists in that generation."""


@dataclass
class KVChunk:
    """Pages [first_page, first_page + len(page_ids)) of a prefill request's page table became
    final in every plane (token range [start, end)). `page_ids` are the prefill engine's pages;
    the decode side's are `Reservation.page_ids[first_page:...]`. The last chunk (`last`) also
    carries what decode needs to continue."""

    request_id: str
    index: int  # 0, 1, ... per request
    start: int
    end: int
    first_page: int
    page_ids: list[int]
    last: bool = False
    final_state: torch.Tensor | None = None  # [H] model dtype, on the engine's device (last chunk)
    state_slot: int | None = None  # row of `engine.handoff.state_buffer` holding final_state
    model_state: dict[str, Any] | None = None  # per-request model state (last chunk)
    ready: Any = None  # CUDA event after which the pages' contents are final (None on CPU)


@dataclass
class Reservation:
    request_id: str
    generation: int
    page_ids: list[int]  # the whole prompt's page table, cached prefix pages first
    num_cached_tokens: int  # prefix-cache hit: the prefill side skips (does not send) these
    num_prompt_tokens: int
    seed: int  # the prefill side must run with this seed
    state_slot: int  # row of `state_buffer` the final state may be written into
    page_size: int


@dataclass
class _Prefill:
    seq: Sequence
    skip_pages: int
    next_page: int = 0  # pages reported so far (from skip_pages on)
    chunks: int = 0
    slot: int | None = None
    done: bool = False  # every chunk reported; pages held until release


@dataclass
class _Remote:
    seq: Sequence
    slot: int
    cached_pages: int
    received: set[int] = field(default_factory=set)
    got_last: bool = False  # the chunk carrying the final state has landed


class Handoff:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        mc, ec = engine.model_config, engine.engine_config
        n_slots = STATE_SLOTS_PER_SEQ * ec.max_num_seqs
        self.state_buffer = torch.zeros(n_slots, mc.hidden_size, dtype=engine.dtype, device=engine.device)
        self._free_slots = list(range(n_slots))
        self._prefills: dict[str, _Prefill] = {}
        self._remotes: dict[str, _Remote] = {}
        self._first: list[tuple[Sequence, torch.Tensor]] = []  # activated: (seq, final state [1, H])
        self._chunks: list[KVChunk] = []
        self._generation = 0

    def holds(self, request_id: str) -> bool:
        return request_id in self._prefills or request_id in self._remotes

    @property
    def num_held(self) -> int:
        """Requests whose pages only a release or abort from outside gives back: finished
        prefills awaiting `release_prefill`, and reservations awaiting activation."""
        return sum(pf.done for pf in self._prefills.values()) + len(self._remotes)

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def _take_slot(self, what: str) -> int:
        if not self._free_slots:
            raise OutOfPages(f"{what}: all {len(self.state_buffer)} final-state slots are in use")
        return self._free_slots.pop()

    def _free_slot(self, slot: int | None) -> None:
        if slot is not None:
            self._free_slots.append(slot)

    @staticmethod
    def _check_params(params: SamplingParams) -> None:
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not supported with prefill/decode disaggregation; "
                             "send the request to a 'both' worker")

    # -- prefill side ---------------------------------------------------------------------
    def add_prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, skip_tokens: int,
        seed: int | None, priority: int,
    ) -> None:
        self._check_params(params)
        ps = self.engine.block_manager.page_size
        if skip_tokens < 0 or skip_tokens % ps or skip_tokens >= max(1, len(prompt_token_ids)):
            raise ValueError(f"skip_tokens: {skip_tokens} must be a multiple of page_size={ps} below the prompt length")
        seq = self.engine._new_sequence(request_id, prompt_token_ids, params, None, priority, seed)
        seq.pd_role = "prefill"
        # Never preempted: its chunks may be under transfer, and it takes its whole prompt's pages
        # at admission (scheduler._admit), so every admitted prefill can finish.
        seq.transfer_pinned = True
        slot = self._take_slot("prefill")
        self._prefills[request_id] = _Prefill(seq, skip_tokens // ps, slot=slot)
        self.engine._seqs[request_id] = seq
        self.engine.scheduler.add(seq)

    def after_step(self, final_states: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Report the pages that became final in this step; a prefill whose last row left the
        coda leaves the scheduler holding its pages."""
        finals = {id(seq): state for seq, state in final_states}
        if not self._prefills:
            return
        new: list[KVChunk] = []
        for rid, pf in self._prefills.items():
            if pf.done:
                continue
            state = finals.get(id(pf.seq))
            chunk = self._report(pf, state)
            if chunk is not None:
                new.append(chunk)
            if state is not None:
                pf.done = True
                self.engine.scheduler.running.remove(pf.seq)
                self.engine._seqs.pop(rid, None)
        if new and self.engine.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            for chunk in new:
                chunk.ready = event
        self._chunks.extend(new)

    def _report(self, pf: _Prefill, state: torch.Tensor | None) -> KVChunk | None:
        seq, ps = pf.seq, self.engine.block_manager.page_size
        complete = state is not None
        final_pages = -(-seq.num_prompt_tokens // ps) if complete else seq.num_computed // ps
        first = max(pf.next_page, pf.skip_pages)
        if final_pages <= first and not complete:
            return None
        chunk = KVChunk(
            request_id=seq.request_id,
            index=pf.chunks,
            start=first * ps,
            end=min(final_pages * ps, seq.num_prompt_tokens),
            first_page=first,
            page_ids=list(seq.page_table[first:final_pages]),
        )
        pf.next_page, pf.chunks = max(first, final_pages), pf.chunks + 1
        if complete:
            self.state_buffer[pf.slot].copy_(state[0])
            chunk.last = True
            chunk.final_state = self.state_buffer[pf.slot]
            chunk.state_slot = pf.slot
            chunk.model_state = _model_state(seq)
        return chunk

    def pop_chunks(self) -> list[KVChunk]:
        out, self._chunks = self._chunks, []
        return out

    def release_prefill(self, request_id: str) -> bool:
        pf = self._prefills.get(request_id)
        if pf is None:
            return False
        if not pf.done:
            raise ValueError(f"{request_id!r}: its prefill has not finished; use abort_request to cancel it")
        self._drop_prefill(pf)
        return True

    def _drop_prefill(self, pf: _Prefill) -> None:
        seq = pf.seq
        del self._prefills[seq.request_id]
        self._free_slot(pf.slot)
        self._chunks = [c for c in self._chunks if c.request_id != seq.request_id]
        if pf.done:  # out of the scheduler already
            self.engine.block_manager.release(seq.page_table)
        else:
            self.engine.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self.engine._seqs.pop(seq.request_id, None)
        seq.transfer_pinned = False

    # -- decode side ----------------------------------------------------------------------
    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None, priority: int
    ) -> Reservation:
        self._check_params(params)
        eng = self.engine
        bm, sched = eng.block_manager, eng.scheduler
        seq = eng._new_sequence(request_id, prompt_token_ids, params, prompt, priority)
        seq.pd_role = "decode"
        sched._match_prefix(seq)
        if not bm.can_ensure(seq.page_table, seq.num_prompt_tokens):
            need = bm.pages_needed(seq.page_table, seq.num_prompt_tokens)
            bm.release(seq.page_table)
            raise OutOfPages(f"{request_id!r}: the prompt needs {need} more pages, {bm.num_free_pages} are free")
        slot = self._take_slot(request_id)
        bm.ensure(seq.page_table, seq.num_prompt_tokens)
        self._generation += 1
        seq.kv_generation = self._generation
        self._remotes[request_id] = _Remote(seq, slot, seq.num_computed // bm.page_size)
        return Reservation(
            request_id=request_id,
            generation=seq.kv_generation,
            page_ids=list(seq.page_table),
            num_cached_tokens=seq.num_computed,
            num_prompt_tokens=seq.num_prompt_tokens,
            seed=seq.generator.initial_seed(),
            state_slot=slot,
            page_size=bm.page_size,
        )

    def check_generation(self, request_id: str, generation: int) -> bool:
        r = self._remotes.get(request_id)
        return r is not None and r.seq.kv_generation == generation

    def commit(self, request_id: str, generation: int, first_page: int, num_pages: int, last: bool) -> bool:
        if not self.check_generation(request_id, generation):
            return False
        r = self._remotes[request_id]
        n = len(r.seq.page_table)
        if first_page < r.cached_pages or first_page + num_pages > n:
            raise ValueError(f"{request_id!r}: pages [{first_page}, {first_page + num_pages}) are outside the "
                             f"reservation's uncached pages [{r.cached_pages}, {n})")
        r.received.update(range(first_page, first_page + num_pages))
        r.got_last |= last
        return True

    def ready(self, request_id: str) -> bool:
        """Every uncached page and the final state have landed (notifications of separate writes
        may arrive in any order, so the last chunk's is not enough)."""
        r = self._remotes.get(request_id)
        return r is not None and r.got_last and len(r.received) == len(r.seq.page_table) - r.cached_pages

    def activate(
        self, request_id: str, generation: int, final_state: torch.Tensor | None, model_state: dict[str, Any] | None
    ) -> None:
        if not self.check_generation(request_id, generation):
            raise StaleGeneration(f"{request_id!r}: no live reservation with generation {generation}")
        r = self._remotes[request_id]
        seq = r.seq
        missing = sorted(set(range(r.cached_pages, len(seq.page_table))) - r.received)
        if missing:
            raise ValueError(f"{request_id!r}: pages {missing[:8]} of the prompt were never committed")
        _apply_model_state(seq, model_state or {})
        state = self.state_buffer[r.slot] if final_state is None else final_state
        state = state.reshape(1, -1).to(self.engine.device, self.engine.dtype).clone()
        del self._remotes[request_id]
        self._free_slot(r.slot)
        eng = self.engine
        seq.num_computed = seq.num_prompt_tokens
        if eng.block_manager.enable_prefix_caching:
            eng.scheduler.register_full_pages(seq)  # received pages are valid in every plane
        eng._seqs[request_id] = seq
        self._first.append((seq, state))

    @torch.inference_mode()
    def sample_first_tokens(self) -> list[RequestOutput]:
        """The first token of each activated request, from its shipped state and own generator."""
        live = [(s, h) for s, h in self._first if not s.status.finished]  # an abort may have come first
        self._first.clear()
        if not live:
            return []
        eng = self.engine
        seqs = [s for s, _ in live]
        logits = eng.runner.model.compute_logits(torch.cat([h for _, h in live]))
        outputs = []
        for seq, sample in zip(seqs, eng.sampler(logits, seqs)):
            eng._stats.num_generation_tokens += 1
            status = eng.output_processor.process_token(seq, sample)
            if status is not None:
                eng.scheduler.finish(seq, status)
                outputs.append(eng._retire(seq))
            else:
                eng.scheduler.add(seq)  # admitted like a resumed request: its pages are in place
                outputs.append(eng.output_processor.make_output(seq))
        return outputs

    # -- both -----------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """End a PD request held here (exactly once); False if this module does not hold it."""
        pf = self._prefills.get(request_id)
        if pf is not None:
            self._drop_prefill(pf)
            return True
        r = self._remotes.pop(request_id, None)
        if r is not None:
            self._free_slot(r.slot)
            self.engine.scheduler.finish(r.seq, SequenceStatus.FINISHED_ABORTED)  # releases its pages
            self.engine._aborted.append(r.seq)  # the request ends with an abort output
            return True
        return False


def _model_state(seq: Sequence) -> dict[str, Any]:
    """What besides KV a family keeps per request (see `LoopedModel.prepare_sequence`)."""
    state: dict[str, Any] = {"cache_salt": seq.cache_salt.hex()}
    if seq.exit_depths is not None:
        state["exit_depths"] = list(seq.exit_depths)
    return state


def _apply_model_state(seq: Sequence, state: dict[str, Any]) -> None:
    unknown = set(state) - {"cache_salt", "exit_depths"}
    if unknown:
        raise ValueError(f"{seq.request_id!r}: unknown model state {sorted(unknown)}")
    if "cache_salt" in state and bytes.fromhex(state["cache_salt"]) != seq.cache_salt:
        raise ValueError(f"{seq.request_id!r}: the prefill ran with a different seed than the reservation's "
                         "(pass seed=Reservation.seed to add_prefill_request)")
    if "exit_depths" in state:
        if seq.exit_depths is None:
            raise ValueError(f"{seq.request_id!r}: exit records were sent for a request without an exit criterion")
        seq.exit_depths = list(state["exit_depths"])
