"""LLMEngine: add requests, step, read token deltas. Step = schedule -> run -> postprocess."""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any, Sequence as Seq

import torch

from compute_service.adapter_cache.backends import lora_backend_for
from compute_service.adapter_cache.paged_slots import PagedAdapterSlots
from compute_service.engine.block_manager import BlockManager
from compute_service.engine.config import EngineConfig
from compute_service.engine.cuda_graphs import DecodeGraphs, host_tables_width
from compute_service.engine.errors import InvalidRequestError
from compute_service.engine.kv_cache import allocate_kv_cache, cuda_kv_budget, num_blocks_for_budget
from compute_service.engine.loader import LoadedModel, load_model, load_tokenizer
from compute_service.engine.lora_backend import AdapterSlots, LoraBackend
from compute_service.engine.model_runner import ModelRunner
from compute_service.engine.outputs import EngineStats, RequestOutput
from compute_service.engine.readback import PendingRead, TokenReadback
from compute_service.engine.sampler import sample_tokens
from compute_service.engine.sampling_params import SamplingParams
from compute_service.engine.scheduler import Scheduler, SchedulerConfig
from compute_service.engine.sequence import Sequence, SequenceStatus
from compute_service.engine.spec import ModelSpec
from compute_service.engine.stop import check_stop
from loraplex.formats.adapter import Adapter

CPU_KV_BYTES = 256 * 2**20


class LLMEngine:
    """One base model, many adapters, one continuously batched step loop (not thread-safe)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, tokenizer: Any | None = None,
                 slots: AdapterSlots | None = None, lora_backend: LoraBackend | None = None) -> None:
        self.config = config
        dev, dtype = config.torch_device, config.torch_dtype
        if loaded is None:
            loaded = load_model(config.model, dtype=dtype, device=dev, quantization=config.quantization)
        self.loaded = loaded
        self.spec: ModelSpec = loaded.spec
        self.fingerprint: str = loaded.fingerprint
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or min(self.spec.max_position_embeddings, 8192),
                                 self.spec.max_position_embeddings)
        if loaded.model.rope.max_positions < self.max_model_len:
            raise ValueError(f"model RoPE table covers {loaded.model.rope.max_positions} positions, "
                             f"max_model_len is {self.max_model_len}")
        if (slots is None) != (lora_backend is None):
            raise ValueError("pass both slots and lora_backend (the backend reads the slots' weights), or neither")
        if slots is None:
            slots, lora_backend = _default_lora(config, self.spec, dev, loaded.model.dtype)
        self.slots = slots
        layers = loaded.model.weights.layers
        if any(lw.mlp_order is not None for lw in layers):
            slots.follow_orders(layers)     # adapters packed in the MLP's order (`mlp_order.py`)
        budget = config.kv_cache_bytes
        if budget is None:
            budget = (cuda_kv_budget(dev, config.gpu_memory_fraction, config.kv_reserve_bytes)
                      if dev.type == "cuda" else CPU_KV_BYTES)
        kv_dtype = loaded.model.dtype
        num_blocks = num_blocks_for_budget(self.spec, config.block_size, kv_dtype, budget, self.max_model_len)
        graphs_on = dev.type == "cuda" and not config.enforce_eager
        # With graphs, one extra block (never handed to the block manager) takes the padding rows' K/V.
        kv = allocate_kv_cache(self.spec, num_blocks + int(graphs_on), config.block_size, kv_dtype, dev)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
            BlockManager(num_blocks, config.block_size), slots)
        graphs = None
        if graphs_on:
            graphs = DecodeGraphs(loaded.model, kv, config.block_size, config.max_num_seqs,
                                  host_tables_width(self.max_model_len, config.block_size), scratch_block=num_blocks,
                                  prefill_tokens=min(config.prefill_graph_tokens, config.max_num_batched_tokens))
        self.runner = ModelRunner(loaded.model, kv, config.block_size, slots, lora_backend, graphs)
        self._rng = random.Random(config.seed)
        self._seeds: dict[str, int] = {}              # each request's sampling seed (compute_service/engine/sampler.py)
        self._arrivals = 0
        self._aborted: list[Sequence] = []
        # Overlapped steps: a decode step whose sampled tokens are still on the device.
        self.overlap = config.async_scheduling if config.async_scheduling is not None else dev.type == "cuda"
        self._in_flight: _Flight | None = None
        self._readback = TokenReadback(config.max_num_seqs, dev)
        self._num_preemptions = 0
        # The last step sampled some request's first token (a prompt's last chunk ran): its outputs are a
        # time to first token, which a server hands out at once rather than with the next step.
        self.sampled_first = False
        # Called once per step right after its GPU work is queued, before the host waits for it: a caller
        # with host work of its own (a server handing out the previous step's tokens) does it then, while
        # the GPU runs, instead of between two steps where it would hold up the next step's launch.
        self.on_launched: Callable[[], None] | None = None
        # Called right before the host blocks reading a step's tokens back (its sampling is queued too):
        # host work done then overlaps only the GPU, not this thread's own sampling and bookkeeping.
        self.on_reading: Callable[[], None] | None = None
        # The last step's sequences with a `route` that got one token and did not finish: their deltas
        # are not in the step's outputs (the token is `seq.token_ids[-1]`, already counted as emitted).
        # A server routes them without an object per sequence per step; a new list every step.
        self.routed: list[Sequence] = []

    @classmethod
    def from_config(cls, config: EngineConfig, with_tokenizer: bool = True) -> "LLMEngine":
        """Loads the model (and, for GGUF files and folders that have one, its tokenizer)."""
        loaded = load_model(config.model, dtype=config.torch_dtype, device=config.torch_device,
                            quantization=config.quantization)
        tokenizer = None
        has_tok = loaded.path.suffix == ".gguf" or (loaded.path / "tokenizer_config.json").is_file() \
            or (loaded.path / "tokenizer.json").is_file()
        if with_tokenizer and has_tok:
            tokenizer = load_tokenizer(loaded.path)
        return cls(config, loaded, tokenizer)

    # -- adapters --------------------------------------------------------------
    def add_adapter(self, key: str, adapter: Adapter) -> int:
        """Validates `adapter` against the base model and makes it resident; returns its slot."""
        return self.slots.load(key, adapter)

    # -- requests --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams,
                    adapter_key: str | None = None, route: Any = None) -> None:
        """Queues a request; raises InvalidRequestError before it touches the batch. `route`: the caller's
        (see `routed`); None: every delta of the request comes as a `RequestOutput`."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequestError("prompt_token_ids is empty: send at least one token")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}, which leaves no room "
                f"to generate: shorten the prompt to at most {self.max_model_len - 1} tokens")
        bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        if sampling_params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer and this engine has none; use stop_token_ids")
        if adapter_key is not None and not isinstance(adapter_key, str):
            raise InvalidRequestError(f"adapter_key must be a string, got {type(adapter_key).__name__}")
        if self.scheduler.get(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already running; use a new id")
        seed = sampling_params.seed if sampling_params.seed is not None else self._rng.randrange(2**63)
        seq = Sequence(request_id, prompt, len(prompt), sampling_params, adapter_key, self._arrivals)
        seq.route = route
        self._arrivals += 1
        self.scheduler.add(seq)
        self._seeds[request_id] = seed

    def abort_request(self, request_id: str) -> bool:
        """Cancels a request; its blocks and adapter pin are released now, its final delta comes next step."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._seeds.pop(request_id, None)
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self._in_flight is not None

    @property
    def in_flight(self) -> bool:
        """A decode step is queued on the device and its tokens not read yet (overlapped steps)."""
        return self._in_flight is not None

    # -- the step ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self._step(False)[0]

    def step_with_logits(self) -> tuple[list[RequestOutput], dict[str, torch.Tensor]]:
        """One engine step; also returns each sampling request's logits row [V] (for tests and tools)."""
        return self._step(True)

    def _step(self, want_logits: bool) -> tuple[list[RequestOutput], dict[str, torch.Tensor]]:
        """Schedule, launch, sample, then read the tokens back. With `async_scheduling`, a decode-only
        step's tokens stay on the device: the next step is scheduled and queued first (its rows take
        those tokens on the device), and they are read back while it runs, so the host's work between
        two steps overlaps the GPU's. A step that must admit, preempt or prefill reads the step in flight
        back first; so do `step_with_logits` callers."""
        # The logits rows are views made one per sequence: a serving step skips them (at 64 sequences on
        # an H100 their making was an eighth of the engine thread's Python time).
        outputs = [self._delta(seq, []) for seq in self._aborted]
        self._aborted.clear()
        self.routed = []
        prev, sched = self._in_flight, None
        if prev is not None:
            sched = None if want_logits else self.scheduler.schedule_decode()
            if sched is None or sched.is_empty:
                self._in_flight = None
                outputs.extend(self._land(prev))
                prev, sched = None, None
        if sched is None:
            sched = self.scheduler.schedule()
            self._num_preemptions += len(sched.preempted)
            if sched.is_empty:
                return outputs, {}
        logits = (self.runner.run(sched, (prev.tokens, prev.rows)) if prev is not None
                  else self.runner.run(sched))
        if self.on_launched is not None:
            self.on_launched()
        sampling = self.scheduler.advance(sched)
        # each row draws the token at its sequence's next position (its computed count after `advance`)
        tokens = sample_tokens(logits, [s.params for s in sampling], [self._seeds[s.request_id] for s in sampling],
                               [s.num_computed_tokens for s in sampling])
        logits_by_id = {s.request_id: logits[i] for i, s in enumerate(sampling)} if want_logits else {}
        flight = _Flight(sampling, tokens, self._readback.start(tokens))
        if prev is not None:
            outputs.extend(self._land(prev))        # read back while this step runs
        if self.overlap and not want_logits and all(s.num_new_tokens == 1 and s.sample for s in sched.scheduled):
            self._in_flight = flight
            self.sampled_first = False
        else:
            self._in_flight = None
            self.sampled_first = any(s.sample and s.start < s.seq.num_prompt_tokens for s in sched.scheduled)
            outputs.extend(self._land(flight))
        return outputs, logits_by_id

    def _land(self, flight: "_Flight") -> list[RequestOutput]:
        """Reads a launched step's tokens back (waiting for it) and reports them, checking stops."""
        if self.on_reading is not None:
            self.on_reading()
        tokens = flight.host.read()
        detok = self.tokenizer.decode if self.tokenizer is not None else None
        outputs = []
        routed = self.routed
        for seq in self.scheduler.land(flight.sampling, tokens):
            reason = check_stop(seq, self.spec.eos_token_ids, self.max_model_len, detok)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seeds.pop(seq.request_id, None)
            elif seq.route is not None and \
                    len(seq.token_ids) - seq.num_prompt_tokens - seq.num_emitted_tokens == 1:
                seq.num_emitted_tokens += 1
                routed.append(seq)
                continue
            outputs.append(self._delta(seq, seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens:]))
        return outputs

    def _delta(self, seq: Sequence, new: list[int]) -> RequestOutput:
        """`new`: a list of its own (a slice), kept by the output as it is."""
        seq.num_emitted_tokens += len(new)
        # The fields read directly, not through Sequence's properties: one output per sequence per step.
        finish = seq.finish_reason
        return RequestOutput(seq.request_id, new, seq.status is SequenceStatus.FINISHED,
                             finish.value if finish is not None else None, seq.num_prompt_tokens,
                             len(seq.token_ids) - seq.num_prompt_tokens)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_kv_blocks_used=s.blocks.num_used_blocks, num_kv_blocks_total=s.blocks.num_blocks,
            num_preemptions=self._num_preemptions,
            running_per_adapter=dict(Counter(q.adapter_key or "" for q in s.running)),
            waiting_per_adapter=dict(Counter(q.adapter_key or "" for q in s.waiting)))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 adapter_keys: list[str | None] | None = None) -> list[list[int]]:
        """Runs prompts to completion in one batch; returns output token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        keys = adapter_keys or [None] * len(prompts)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for rid, prompt, p, key in zip(ids, prompts, plist, keys):
            self.add_request(rid, prompt, p, key)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(self.scheduler.get(r) is not None for r in ids):
            for delta in self.step():
                if delta.request_id in out:
                    out[delta.request_id].extend(delta.new_token_ids)
        return [out[r] for r in ids]


class _Flight:
    """A launched step's sampling sequences and their tokens [N] on the device; `rows`: each sequence's
    row there (the next step's pending inputs are read from it)."""

    __slots__ = ("sampling", "tokens", "host", "_rows")

    def __init__(self, sampling: list[Sequence], tokens: torch.Tensor, host: PendingRead) -> None:
        self.sampling = sampling
        self.tokens = tokens
        self.host = host              # their copy to the host, queued right after sampling
        self._rows: dict[Sequence, int] | None = None

    @property
    def rows(self) -> dict[Sequence, int]:
        if self._rows is None:
            self._rows = {seq: i for i, seq in enumerate(self.sampling)}
        return self._rows


def _default_lora(config: EngineConfig, spec: ModelSpec, device: torch.device,
                  dtype: torch.dtype) -> tuple[AdapterSlots, LoraBackend]:
    """The one adapter pool, sized for `max_loras` adapters of `max_lora_rank` on every module, and the
    backend of its device (Triton kernels on CUDA, batched torch matmuls on CPU; `lora_backend` forces one)."""
    slots = PagedAdapterSlots(spec, config.max_lora_rank, device, dtype)
    slots.allocate_for(config.max_loras)
    backend = lora_backend_for(slots, config.max_num_batched_tokens, config.lora_backend)
    backend.allocate()
    return slots, backend
