"""`LLMEngine`: the loop that ties scheduler, model runner, sampler and output processor.

Requests arrive with token ids (tokenising is the caller's job, as in the router), are added and
aborted between steps, and each `step()` is one core call. Every request ends exactly once and
its final `RequestOutput` (finish_reason stop, length or abort) is returned by exactly one step.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import torch

from rlt_serve.config import HUGINN, ConfigError, EngineConfig, ModelConfig, check_model_engine, parse_dtype
from dataclasses import dataclass, field

from rlt_serve.engine.async_step import AsyncStep
from rlt_serve.engine.block_manager import BlockManager
from rlt_serve.engine.handoff import Handoff, KVChunk, Reservation
from rlt_serve.engine.model_runner import ModelRunner, RunnerOutput
from rlt_serve.engine.output_processor import OutputProcessor
from rlt_serve.engine.sampler import SampleResult, Sampler, top_logprobs
from rlt_serve.engine.scheduler import Scheduler, SchedulerOutput
from rlt_serve.engine.spec_controller import SpecController
from rlt_serve.engine.swap import SwapSpace
from rlt_serve.engine.sequence import Sequence, SequenceStatus
from rlt_serve.loader import load_generation_config
from rlt_serve.models import get_model_class
from rlt_serve.outputs import RequestOutput
from rlt_serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters a worker exports as metrics; cumulative unless named `last_*`."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_pages: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    swap_used_bytes: int = 0
    num_core_calls: int = 0  # core passes over a batch; a fused decode step counts each of its loops
    num_row_tokens: int = 0  # tokens over all rows of all core calls (one per token per depth)
    num_prompt_tokens: int = 0  # prompt tokens that finished their last depth
    num_generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count
    num_spec_drafts: int = 0  # verify rounds
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    exit_depth_counts: dict[int, int] = field(default_factory=dict)  # depth a token left the core -> tokens
    num_fused_decode_steps: int = 0  # decode batches that ran every loop in one step
    num_cuda_graph_replays: int = 0  # ... of which replayed a captured CUDA graph
    num_loop_calls: int = 0  # one-loop core calls (prompt chunks, drafts, early-exit rows)
    num_loop_graph_replays: int = 0  # ... of which replayed a graph
    # Depth of the state each plainly sampled token's logits came from (its decode row's exit
    # depth; speculative tokens are full depth by construction and are not counted here).
    sample_depth_counts: dict[int, int] = field(default_factory=dict)
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # rounds whose draft i was accepted
    spec_draft_depth_counts: dict[int, int] = field(default_factory=dict)  # verify rounds per draft depth
    last_num_rows: int = 0
    last_num_depths: int = 0  # distinct depths in the last core call
    last_num_tokens: int = 0


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use cpu, cuda or auto")
    return dev


class LLMEngine:
    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        skip_tokenizer_init: bool = False,
        hf_overrides: dict[str, Any] | None = None,
        **engine_args: Any,
    ) -> None:
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.model_dir = model
        self.model_config = ModelConfig.from_pretrained(model, hf_overrides)
        cfg = EngineConfig(**engine_args)
        cfg.validate()
        check_model_engine(self.model_config, cfg)
        self.engine_config = cfg
        self.device = resolve_device(device)
        self.dtype = parse_dtype(dtype, default=self.model_config.checkpoint_dtype)
        self.generation_config = load_generation_config(model)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from rlt_serve.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_pretrained(model)
        if cfg.max_loops is not None and cfg.max_loops < self.model_config.num_loops:
            raise ConfigError(f"max_loops={cfg.max_loops} is below the checkpoint's {self.model_config.num_loops} loops")
        self.runner = ModelRunner(model, self.model_config, cfg, self.dtype, self.device)
        self._check_speculation(cfg)
        num_pages = self.runner.kv.num_pages
        capacity = num_pages * cfg.page_size
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings, capacity)
        if cfg.max_model_len is not None and cfg.max_model_len > capacity:
            raise ConfigError(f"max_model_len={cfg.max_model_len} needs more KV than the pool holds ({capacity} tokens)")
        self.block_manager = BlockManager(num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.swap_space = SwapSpace(self.runner.kv, cfg.swap_space_bytes) if cfg.swap_space_bytes else None
        # Pages are shared only between requests computed the same way.
        r = self.runner
        salt = f"{os.path.realpath(model)}|{self.dtype}|{r.kv.dtype}|{cfg.kv_layout}|{cfg.huginn_cache}|{r.max_loops}"
        salt = salt.encode()
        self.scheduler = Scheduler(cfg, self.block_manager, self.swap_space, salt, self.max_model_len)
        if cfg.num_speculative_tokens:
            self.scheduler.spec = SpecController(
                self.model_config.num_loops, cfg.num_speculative_tokens, cfg.speculative_draft_depth,
                adaptive=cfg.speculative_adaptive, fused_plain=cfg.fuse_decode_loops,
            )
        self.output_processor = OutputProcessor(self._eos_token_ids(), self.max_model_len, self.tokenizer)
        self.sampler = Sampler(self.output_processor.stop_ids)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._rng = random.Random(cfg.seed)
        self._stats = EngineStats(num_pages=num_pages)
        self.handoff = Handoff(self)
        self.async_step = AsyncStep(self) if cfg.async_scheduling else None
        logger.info("%s", self.kv_capacity_report())

    def kv_capacity_report(self) -> str:
        """How many tokens of KV fit, for the layout chosen: what a user sizes concurrency by."""
        kv, r = self.runner.kv, self.runner
        mc = self.model_config
        per_token = kv.bytes_per_token(kv.num_planes, mc.num_key_value_heads, mc.head_dim, kv.dtype)
        layout = self.engine_config.huginn_cache or self.engine_config.kv_layout
        lg, loops = r.loop_graphs, ""
        if lg is not None:
            upto = f" (prompt chunks up to {lg.prompt_tokens[-1]} tokens)" if lg.prompt_tokens else ""
            loops = f", {len(lg.graphs)} one-loop graphs{upto} in {lg.capture_seconds:.1f} s"
        graphs = (f"CUDA graphs for decode batch sizes {r.graphs.sizes} ({r.graphs.capture_seconds:.1f} s to capture{loops})"
                  if r.graphs is not None else f"no CUDA graphs ({r.graphs_disabled})")
        return (
            f"KV cache: {kv.num_pages} pages x {kv.page_size} = {kv.num_pages * kv.page_size} tokens "
            f"({per_token} bytes/token over {kv.num_planes} planes of {str(kv.dtype).removeprefix('torch.')}, "
            f"layout {layout}, "
            f"{kv.num_pages * kv.page_size * per_token / 2**30:.2f} GiB); max_model_len {self.max_model_len}; {graphs}"
        )

    def _check_speculation(self, cfg: EngineConfig) -> None:
        if not cfg.num_speculative_tokens:
            return
        loops = self.model_config.num_loops
        if cfg.speculative_draft_depth >= loops:
            raise ConfigError(
                f"speculative_draft_depth={cfg.speculative_draft_depth} must be below the model's {loops} loops"
            )
        if cfg.kv_layout == "shared":
            raise ConfigError("self-speculative decoding cannot run with kv_layout='shared' (drafts would "
                              "overwrite the slot later tokens read)")
        if self.runner.ring:
            raise ConfigError(f"self-speculative decoding cannot run with huginn_cache={cfg.huginn_cache!r} (a ring "
                              "slot holds one step per position; drafts would overwrite what later tokens read)")
        # Huginn's coda attends too: a draft's coda K/V (from its shallow state) is overwritten by
        # the verify row's full-depth coda at the same positions before any committed token reads it.

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        ids |= set([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])
        if self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                ids.add(self.tokenizer.eos_token_id)
            for tok in get_model_class(self.model_config).extra_stop_tokens:
                tid = self.tokenizer.token_to_id(tok)
                if tid is not None:
                    ids.add(tid)
        return ids

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
    ) -> None:
        seq = self._new_sequence(request_id, prompt_token_ids, params, prompt, priority)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _new_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        priority: int = 0, seed: int | None = None,
    ) -> Sequence:
        if request_id in self._seqs or self.handoff.holds(request_id):
            raise ValueError(f"request_id {request_id!r} is already running")
        self._validate(prompt_token_ids, params)
        num_loops = params.num_loops or self.model_config.num_loops
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        seq = Sequence(request_id, list(prompt_token_ids), params, num_loops, gen, prompt=prompt, priority=priority)
        if self.tokenizer is not None and params.detokenize:
            from rlt_serve.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.runner.model.prepare_sequence(seq)
        return seq

    # -- prefill/decode disaggregation (see rlt_serve.engine.handoff) ----------------------
    def add_prefill_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, skip_tokens: int = 0,
        seed: int | None = None, priority: int = 0,
    ) -> None:
        """Compute the prompt through every depth without sampling; its KV comes out of
        `pop_kv_chunks()` as it becomes final. `seed`: the decode side's (Reservation.seed)."""
        self.handoff.add_prefill(request_id, prompt_token_ids, params, skip_tokens, seed, priority)

    def pop_kv_chunks(self) -> list[KVChunk]:
        """Chunks that became final since the last call, in order per request."""
        return self.handoff.pop_chunks()

    def release_prefill(self, request_id: str) -> bool:
        """Free a finished prefill's pages (every transfer from them is done); False if already gone."""
        return self.handoff.release_prefill(request_id)

    def reserve_remote_prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        priority: int = 0,
    ) -> Reservation:
        """Allocate the pages a remotely computed prompt lands in (prefix-cache hits reused)."""
        return self.handoff.reserve(request_id, prompt_token_ids, params, prompt, priority)

    def commit_kv_chunk(
        self, request_id: str, generation: int, first_page: int, num_pages: int, last: bool = False
    ) -> bool:
        """Record that pages [first_page, first_page + num_pages) of a reservation (and, with
        `last`, the final state) have landed; False for a stale generation (nothing recorded)."""
        return self.handoff.commit(request_id, generation, first_page, num_pages, last)

    def remote_prefill_ready(self, request_id: str) -> bool:
        """Every page and the final state of a reservation have been committed: activate it."""
        return self.handoff.ready(request_id)

    def check_generation(self, request_id: str, generation: int) -> bool:
        """Whether a transfer tagged (request_id, generation) may land: the reservation is live."""
        return self.handoff.check_generation(request_id, generation)

    def activate_remote_prefill(
        self, request_id: str, generation: int, final_state: torch.Tensor | None = None,
        model_state: dict[str, Any] | None = None,
    ) -> None:
        """Turn a fully received reservation into a decoding request; its first token is sampled
        by the next `step()` with the request's own generator."""
        self.handoff.activate(request_id, generation, final_state, model_state)

    def _validate(self, ids: list[int], p: SamplingParams) -> None:
        mc, vocab = self.model_config, self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt: the prompt must contain at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        if p.num_loops is not None:
            if not mc.variable_depth and p.num_loops != mc.num_loops:
                raise ValueError(f"num_loops: {mc.model_type} runs a fixed {mc.num_loops} loops, got {p.num_loops}")
            if p.num_loops > self.runner.max_loops:
                raise ValueError(
                    f"num_loops: {p.num_loops} exceeds the engine's max_loops={self.runner.max_loops} depth slots"
                )
        if p.exit_criterion is not None:
            if self.engine_config.delayed_exit:
                raise ValueError("exit_criterion: delayed_exit applies to Ouro's Q-exit only; use async_exit "
                                 "(the exact policy) with Huginn's criteria")
            self._validate_criterion(p)
        elif p.exit_threshold is not None and p.exit_threshold < 1.0:
            if mc.model_type == HUGINN:
                raise ValueError("exit_threshold: Huginn has no exit gate; set exit_criterion to use a threshold")
            if not mc.exit_gate:
                raise ValueError(f"exit_threshold: {mc.model_type} has no exit gate; adaptive depth needs Ouro")
            if self.engine_config.kv_layout != "last_exited":
                raise ValueError(
                    "exit_threshold: early exit needs kv_layout='last_exited' (later tokens read an exited "
                    f"token's deeper KV from its exit depth); the engine runs kv_layout={self.engine_config.kv_layout!r}"
                )
        elif p.min_loops is not None:
            raise ValueError("min_loops: only meaningful with exit_threshold < 1 or an exit_criterion (adaptive depth)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and k > self.engine_config.max_logprobs:
                raise ValueError(f"{name}: {k} exceeds max_logprobs={self.engine_config.max_logprobs}")
        if any(t < 0 or t >= vocab for t in p.stop_token_ids):
            raise ValueError("stop_token_ids: ids must be inside the vocabulary")
        if p.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need the tokenizer (skip_tokenizer_init=True was set)")

    def _validate_criterion(self, p: SamplingParams) -> None:
        mc = self.model_config
        if mc.model_type != HUGINN:
            raise ValueError(
                f"exit_criterion: the training-free criteria are Huginn's; {mc.model_type} "
                + ("exits by its learned gate (exit_threshold)" if mc.exit_gate else "has no early exit")
            )
        if self.engine_config.huginn_cache != "latest-m4":
            raise ValueError(
                "exit_criterion: early exit needs huginn_cache='latest-m4' (later tokens read an exited "
                f"token's deeper K/V at its exit step); the engine runs huginn_cache={self.engine_config.huginn_cache!r}"
            )
        loops = p.num_loops or mc.num_loops
        if p.min_loops is not None and p.min_loops > loops:
            raise ValueError(f"min_loops: {p.min_loops} exceeds the request's {loops} loops")

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self.handoff.abort(rid):
                continue
            seq = self._seqs.get(rid)
            if seq is not None and not seq.status.finished:
                if self.async_step is not None:
                    self.async_step.discard(seq)  # a token still in flight was never seen: drop it
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.async_step is not None:
            return self.async_step.step()
        return self._sync_step()

    def _begin_step(self, in_flight: bool = False) -> tuple[list[RequestOutput], SchedulerOutput | None]:
        """Outputs of aborted requests and first tokens, and the next call's rows (None: no rows).
        `in_flight`: an async step is unread, so finishing requests may still free room."""
        outputs = [self._retire(seq) for seq in self._aborted]
        self._aborted.clear()
        outputs += self.handoff.sample_first_tokens()
        if not self.scheduler.has_unfinished():
            return outputs, None
        sched = self.scheduler.schedule()
        if not sched.rows:
            # Pages held for PD transfers come back by release/abort from outside: wait for them.
            if (self.scheduler.running or self.scheduler.waiting) and not self.handoff.num_held and not in_flight:
                raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting request")
            return outputs, None
        return outputs, sched

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One core call and its bookkeeping: stats, rows advanced, prompt logprobs recorded."""
        result = self.runner.execute(sched)
        st = self._stats
        st.num_core_calls += result.num_core_calls
        st.last_num_rows = len(sched.rows)
        st.last_num_depths = len({span.depth for _, span in sched.rows})
        st.last_num_tokens = sched.num_tokens
        st.num_row_tokens += result.num_core_tokens
        st.num_fused_decode_steps += result.num_fused_decode
        st.num_cuda_graph_replays += result.num_graph_replays
        st.num_loop_calls += result.num_loop_calls
        st.num_loop_graph_replays += result.num_loop_graph_replays
        for seq, span in self.scheduler.advance(sched):
            st.num_prompt_tokens += max(0, min(span.end, seq.num_prompt_tokens) - span.start)
        self.handoff.after_step(result.final_states)
        for d in result.exit_depths:
            st.exit_depth_counts[d] = st.exit_depth_counts.get(d, 0) + 1
        for d in result.sample_depths:
            st.sample_depth_counts[d] = st.sample_depth_counts.get(d, 0) + 1
        for seq, start, logits in result.prompt_logits:
            self._record_prompt_logprobs(seq, start, logits)
        return result

    def _process_sample(self, seq: Sequence, sample: SampleResult) -> RequestOutput:
        status = self.output_processor.process_token(seq, sample)
        if status is not None:
            self.scheduler.finish(seq, status)
            return self._retire(seq)
        return self.output_processor.make_output(seq)

    def _sync_step(self) -> list[RequestOutput]:
        spec = self.scheduler.spec
        started = spec.clock() if spec is not None else 0.0
        outputs, sched = self._begin_step()
        if sched is None:
            return outputs
        if spec is not None:
            spec.start_step(sched.rows, started)
        result = self._execute(sched)
        st = self._stats
        for seq, logits in result.draft_logits:  # drafts are drawn from the shallow distribution
            if not seq.drafts:
                seq.spec_rng_state = seq.generator.get_state()
            q = self.sampler.probs(logits[0], seq, extra_outputs=len(seq.drafts))
            seq.drafts.append(self.sampler.race(q, seq))
            seq.draft_probs.append(q)
        for seq, logits in result.verify_logits:
            outputs.extend(self._accept_drafts(seq, logits))
        if result.sample_seqs:
            samples = self.sampler(result.sample_logits, result.sample_seqs)
            st.num_generation_tokens += len(samples)
            outputs += [self._process_sample(seq, sample) for seq, sample in zip(result.sample_seqs, samples)]
        if spec is not None:
            spec.end_step()
        return outputs

    def _accept_drafts(self, seq: Sequence, logits: torch.Tensor) -> list[RequestOutput]:
        """Speculative rejection sampling over the verify row's full-depth distributions.

        Draft y (drawn from the shallow q) is kept with probability min(1, p(y)/q(y)); the first
        rejected position draws from norm(max(0, p - q)), so every committed token is distributed
        as plain sampling would draw it (greedy: kept while the argmax agrees). Rejected positions
        lie past `num_computed`, so their KV in every plane is simply overwritten later."""
        drafts, qs, start = list(seq.drafts), list(seq.draft_probs), seq.num_computed
        depth = seq.spec_round[1]
        seq.drafts.clear()
        seq.draft_probs.clear()
        seq.spec_round = None
        accepted = 0
        st, sampler = self._stats, self.sampler
        st.num_spec_drafts += 1
        st.num_spec_draft_tokens += len(drafts)
        committed, status = 0, None
        for i, (draft, q) in enumerate(zip(drafts, qs)):
            p = sampler.probs(logits[i], seq)
            if sampler.accept(float(p[draft]), float(q[draft]), seq):
                token = draft
                accepted += 1
            else:
                residual = (p - q).clamp_min(0.0)
                token = sampler.race(residual if residual.sum() > 0 else p, seq)
            status = self.output_processor.process_token(seq, sampler(logits[i : i + 1], [seq], tokens=[token])[0])
            committed = i + 1
            st.num_generation_tokens += 1
            if token != draft or status is not None:
                break
        st.num_spec_accepted_tokens += accepted
        st.spec_draft_depth_counts[depth] = st.spec_draft_depth_counts.get(depth, 0) + 1
        if len(st.spec_accepted_per_pos) < len(drafts):
            st.spec_accepted_per_pos += [0] * (len(drafts) - len(st.spec_accepted_per_pos))
        for i in range(accepted):
            st.spec_accepted_per_pos[i] += 1
        # Positions after the first rejection were never tested; count only what was.
        self.scheduler.spec.record(depth, committed, accepted)
        seq.num_computed = start + committed
        if self.block_manager.enable_prefix_caching:
            self.scheduler.register_full_pages(seq)
        if status is not None:
            self.scheduler.finish(seq, status)
            return [self._retire(seq)]
        return [self.output_processor.make_output(seq)]

    def _retire(self, seq: Sequence) -> RequestOutput:
        self._seqs.pop(seq.request_id, None)
        reason = seq.status.value
        self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1
        return self.output_processor.make_output(seq)

    def _record_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        next_tokens = seq.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        tables = top_logprobs(torch.log_softmax(logits, dim=-1), next_tokens, seq.params.prompt_logprobs)
        if self.tokenizer is not None:
            for table in tables:
                for tok, lp in table.items():
                    lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
        seq.prompt_logprobs.extend(tables)

    # -- introspection for tests and metrics ---------------------------------------------
    def stats(self) -> EngineStats:
        st = self._stats
        st.num_running = len(self.scheduler.running)
        st.num_waiting = len(self.scheduler.waiting)
        st.num_free_pages = self.block_manager.num_free_pages
        st.num_preemptions = self.scheduler.num_preemptions
        st.num_swap_preemptions = self.scheduler.num_swap_preemptions
        st.num_recompute_preemptions = self.scheduler.num_recompute_preemptions
        st.prefix_cache_queries = self.block_manager.prefix_queries
        st.prefix_cache_hits = self.block_manager.prefix_hits
        st.swap_used_bytes = self.swap_space.used_bytes if self.swap_space else 0
        return st

    @property
    def num_free_pages(self) -> int:
        return self.block_manager.num_free_pages

    @property
    def num_pages(self) -> int:
        return self.block_manager.num_pages
