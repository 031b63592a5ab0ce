"""Turns a scheduled step into model inputs, runs the model, returns logits of the rows that sample.

Three paths: mixed or prefill steps attend with the paged prefill kernel on
CUDA (padded tiles and SDPA on CPU), replayed on CUDA with graphs on from one
graph of the step's token-count bucket (`prefill_graphs.py`); decode-only
steps on CUDA use the paged-attention decode kernel, replayed from a CUDA
graph of the batch's size bucket when graphs are on (and eagerly otherwise,
or when the LoRA backend is not graph-safe).

A prefill or mixed step that runs eagerly while graphs are on (more tokens than
the largest prefill graph) is padded to a multiple of `EAGER_PAD` tokens with
one extra sequence of padding tokens (token 0, no adapter, never sampled) whose
K/V go to the scratch block no sequence owns. Triton specialises the kernels'
integer arguments on divisibility by 16, and the LoRA kernels choose their
launch from the token count, so the start-up's plan (`warmup_plan.py`) must
dry-run every count a step can launch with: padded, those are the multiples
of 16 (96 counts up to 2,048 instead of 1,536; 2.6-4.1 s of dry runs instead
of 9 s on an H200 host). The cost: at most 15 tokens of extra work on a step
of more than `prefill_graph_tokens` (2,048 by default, so with the default batch of 2,048 tokens
no step runs eagerly on CUDA), under 3 %.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compute_service.engine.attention import DecodeMetadata, StepMetadata, step_metadata
from compute_service.engine.cuda_graphs import DecodeGraphs
from compute_service.engine.host_lists import to_device
from compute_service.engine.lora_backend import NO_ADAPTER, AdapterSlots, LoraBackend
from compute_service.engine.model import LlamaModel
from compute_service.engine.pending import PendingTokens, fill_pending
from compute_service.engine.scheduler import SchedulerOutput
from compute_service.engine.sequence import Sequence

EAGER_PAD = 16      # eager prefill/mixed steps (graphs on) are padded to a multiple of this many tokens


def eager_tokens(num_tokens: int) -> int:
    """The token count an eager prefill/mixed step launches with while graphs are on: padded up to a
    multiple of `EAGER_PAD` (the count the warm-up plan dry-runs, through `launched_tokens`)."""
    return -(-num_tokens // EAGER_PAD) * EAGER_PAD


@dataclass
class StepInputs:
    """One step's inputs: flat tokens of all scheduled sequences, and per sequence its adapter,
    query and context lengths and block table; `sample_rows` are the tokens whose logits are wanted.
    `pending_rows`: rows whose token the step in flight sampled and the host has not read yet (0 in
    `input_ids`), filled on the device from that step's tokens; `pending_seqs` their sequences."""

    input_ids: list[int]
    positions: list[int]
    adapter_keys: list[str | None]
    query_lens: list[int]
    context_lens: list[int]
    tables: list[list[int]]
    sample_rows: list[int]
    pending_rows: list[int] = field(default_factory=list)
    pending_seqs: list[Sequence] = field(default_factory=list, repr=False)


class ModelRunner:
    """Owns the KV cache tensors; the only part of the engine that runs the model."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 slots: AdapterSlots | None, lora: LoraBackend | None, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.slots = slots
        self.lora = lora
        self.graphs = graphs
        self.num_graph_steps = 0       # decode steps replayed from a graph (for tests and stats)
        self.num_lora_graph_steps = 0  # of which with adapters
        self.num_prefill_graph_steps = 0   # prefill / mixed steps replayed from a prefill graph
        self.num_padded_steps = 0      # eager prefill / mixed steps padded to a multiple of EAGER_PAD
        # Paged-attention decode kernel for decode-only steps: Triton, so CUDA (or the interpreter in tests).
        self.decode_kernel = model.device.type == "cuda"

    def run(self, out: SchedulerOutput, in_flight: tuple[torch.Tensor, dict[Sequence, int]] | None = None
            ) -> torch.Tensor:
        """Logits [N, V] float32 for each scheduled sequence with `sample`, in schedule order.
        `in_flight`: the sampled tokens of the step still on the device, and each of its sequences' row
        there, for sequences whose newest token is pending."""
        step = self.inputs(out)
        pending = None
        if step.pending_rows:
            if in_flight is None:
                raise RuntimeError("a scheduled token is pending but no step is in flight")
            tokens, rows = in_flight
            pending = PendingTokens(step.pending_rows, [rows[seq] for seq in step.pending_seqs], tokens)
        return self.run_inputs(step, pending)

    def inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step as plain host lists (what tensor-parallel followers receive)."""
        step = StepInputs([], [], [], [], [], [], [])
        ids, positions, sample_rows = step.input_ids, step.positions, step.sample_rows
        add_key, add_qlen, add_ctx, add_table = (step.adapter_keys.append, step.query_lens.append,
                                                 step.context_lens.append, step.tables.append)
        # Bound methods and a one-token branch: at 128-256 decoding sequences this loop is a step's
        # largest Python loop after the graphs' fill, run on the engine thread while it holds the GIL.
        for s in out.scheduled:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            tokens = seq.token_ids
            if n == 1:
                if len(tokens) > start:
                    ids.append(tokens[start])
                else:                                   # its newest token is still on the device
                    step.pending_rows.append(len(ids))
                    step.pending_seqs.append(seq)
                    ids.append(0)
                positions.append(start)
            else:
                chunk = tokens[start:start + n]
                if len(chunk) < n:
                    step.pending_rows.append(len(ids) + len(chunk))
                    step.pending_seqs.append(seq)
                    chunk.append(0)
                ids.extend(chunk)
                positions.extend(range(start, start + n))
            add_key(seq.adapter_key)
            add_qlen(n)
            add_ctx(start + n)
            add_table(seq.block_table[:])
            if s.sample:
                sample_rows.append(len(ids) - 1)
        return step

    def launched_tokens(self, num_tokens: int) -> int:
        """The token count a prefill/mixed step of `num_tokens` tokens launches its kernels with: its prefill
        graph bucket where a graph runs it, else padded to a multiple of `EAGER_PAD` where graphs are on (the
        scratch block takes the padding's K/V), else `num_tokens`."""
        if self.graphs is None:
            return num_tokens
        return self.graphs.prefill.bucket_for(num_tokens) or eager_tokens(num_tokens)

    def _padded(self, step: StepInputs) -> StepInputs:
        """`step` with one more sequence of padding tokens up to `launched_tokens` (eager prefill/mixed steps
        with graphs on; see the module's docstring), or `step` itself when no padding is due."""
        n = len(step.input_ids)
        pad = eager_tokens(n) - n
        if self.graphs is None or pad == 0:
            return step
        table = [self.graphs.scratch_block] * -(-pad // self.block_size)
        self.num_padded_steps += 1
        return StepInputs(step.input_ids + [0] * pad, step.positions + list(range(pad)),
                          step.adapter_keys + [None], step.query_lens + [pad], step.context_lens + [pad],
                          step.tables + [table], step.sample_rows, step.pending_rows, step.pending_seqs)

    def run_inputs(self, step: StepInputs, pending: PendingTokens | None = None) -> torch.Tensor:
        """Runs one step's inputs; adapter keys resolve to this process's slots."""
        dev = self.model.device
        decode = self.decode_kernel and len(step.sample_rows) == len(step.input_ids) == len(step.query_lens)
        graphs = self.graphs if dev.type == "cuda" else None
        if not decode and graphs is not None and not (
                pending is None and graphs.prefill.fits(len(step.input_ids), len(step.tables),
                                                        max(len(t) for t in step.tables))):
            step = self._padded(step)       # runs eagerly: padded so its launches are the planned ones
        input_ids, positions, query_lens = step.input_ids, step.positions, step.query_lens
        context_lens, tables, sample_rows = step.context_lens, step.tables, step.sample_rows
        token_slots: list[int] = []
        for key, n in zip(step.adapter_keys, query_lens):
            slot = NO_ADAPTER if key is None else self.slots.slot_of(key)  # type: ignore[union-attr]
            token_slots.extend([slot] * n)
        has_lora = self.lora is not None and any(t != NO_ADAPTER for t in token_slots)
        graph_safe = not has_lora or getattr(self.lora, "graph_safe", False)
        graphs = self.graphs if dev.type == "cuda" and graph_safe else None     # decode and prefill graphs
        if decode and graphs is not None and graphs.bucket_for(len(input_ids)) is not None:
            self.num_graph_steps += 1
            self.num_lora_graph_steps += int(has_lora)
            return graphs.run(input_ids, positions, tables, token_slots, self.lora if has_lora else None, pending)
        if pending is None and not decode and graphs is not None \
                and graphs.prefill.fits(len(input_ids), len(tables), max(len(t) for t in tables)):
            self.num_prefill_graph_steps += 1
            hidden = graphs.prefill.run(input_ids, positions, query_lens, context_lens, tables, token_slots,
                                        self.lora if has_lora else None)
        else:
            meta: StepMetadata
            if decode:
                meta = DecodeMetadata.build(context_lens, tables, self.block_size, dev)
            else:
                meta = step_metadata(query_lens, context_lens, tables, self.block_size, dev)
            lora = None
            if has_lora:
                groups = self.lora.groups_of(token_slots)  # type: ignore[union-attr]
                self.lora.prepare(torch.tensor(token_slots, dtype=torch.int32), groups)  # type: ignore[union-attr]
                lora = self.lora
            ids = torch.tensor(input_ids, device=dev)
            if pending is not None:
                fill_pending(ids, pending)
            hidden = self.model.forward(ids, torch.tensor(positions, device=dev), meta, self.kv_caches, lora)
        if decode:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[to_device(sample_rows, torch.int64, dev)])

