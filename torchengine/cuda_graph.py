"""CUDA graphs for decode steps: one captured forward per (padded tokens, padded requests) shape.

A pure-decode step of R requests always lands in the same shape
(`enginecore.buckets.Buckets.decode_shapes`), so capturing one graph per
distinct shape covers every decode step up to the largest size. A graph runs
on static device buffers sized for the largest shape; the batch's arrays are
copied into their leading slices before `replay()`. The block-table buffer is
as wide as a request's whole table (the kernel reads only the columns a
request's kv length needs, so the columns past the batch's own may hold
anything). The graph ends with the LM head at `logits_indices`, so replay
returns logits [Rp, V]; sampling stays eager.

Only attention backends that read lengths on the device can be captured
(`AttentionBackend.supports_cuda_graphs`: the Triton one).
"""

from __future__ import annotations

import torch

from enginecore.buckets import StepShape
from enginecore.step_batch import StepBatch
from torchengine.attention import AttentionBackend, AttentionMetadata, PagedAttention
from torchengine.model import Transformer


class CUDAGraphs:
    """Captured decode forwards, keyed by step shape, replayed on static input buffers."""

    def __init__(
        self,
        model: Transformer,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_blocks_per_req: int,
        shapes: list[StepShape],
        device: torch.device,
    ):
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} attention cannot be captured in a CUDA graph")
        self.model, self.backend, self.kv_caches, self.device = model, backend, kv_caches, device
        self.shapes = sorted(shapes, reverse=True)
        max_tokens = max(s.tokens for s in shapes)
        max_reqs = max(s.reqs for s in shapes)
        z = dict(device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, **z)  # [Tmax]
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, **z)  # [Tmax]
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, **z)  # [Tmax]
        self.cu_q_lens = torch.zeros(max_reqs + 1, dtype=torch.int32, **z)  # [Rmax+1]
        self.kv_lens = torch.zeros(max_reqs, dtype=torch.int32, **z)  # [Rmax]
        self.block_tables = torch.zeros(max_reqs, max_blocks_per_req, dtype=torch.int32, **z)
        self.logits_indices = torch.zeros(max_reqs, dtype=torch.int64, **z)  # [Rmax]
        self.graphs: dict[StepShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, num_tokens: int, num_reqs: int) -> torch.Tensor:  # [Rp, V]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            cu_q_lens=self.cu_q_lens[: num_reqs + 1],
            kv_lens=self.kv_lens[:num_reqs],
            block_tables=self.block_tables[:num_reqs],
            num_reqs=num_reqs,  # padded requests have q_len 0: the kernels skip them on the device
            num_tokens=num_tokens,
        )
        attn = PagedAttention(self.backend, self.kv_caches, meta)
        hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], attn)
        return self.model.compute_logits(hidden[self.logits_indices[:num_reqs]])

    def _fill_dummy(self, num_tokens: int, num_reqs: int) -> None:
        """Every request decodes one token at position 0 of the null block (nothing is written)."""
        n = min(num_tokens, num_reqs)
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.cu_q_lens[: num_reqs + 1] = torch.arange(num_reqs + 1, device=self.device).clamp(max=n)
        self.kv_lens.zero_()
        self.kv_lens[:n] = 1
        self.block_tables.zero_()
        self.logits_indices.zero_()

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every shape, largest first, into one memory pool; returns the number of graphs."""
        pool = self._new_pool()
        for num_tokens, num_reqs in self.shapes:
            self._fill_dummy(num_tokens, num_reqs)
            for _ in range(2):  # compile the kernels and settle the allocator outside the capture
                self._forward(num_tokens, num_reqs)
            self._synchronize()
            self.graphs[StepShape(num_tokens, num_reqs)] = self._capture_one(
                lambda t=num_tokens, r=num_reqs: self._forward(t, r), pool)
        self._synchronize()
        return len(self.graphs)

    # The three CUDA calls of a capture. Tests on CPU override them with an eager stand-in that re-runs the
    # forward on the same static buffers at replay, which checks everything here except the graph itself.

    def _new_pool(self):
        return torch.cuda.graph_pool_handle()

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _capture_one(self, forward, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record `forward()` into a graph; returns (something with .replay(), its static output)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = forward()
        return graph, logits

    def can_replay(self, batch: StepBatch) -> bool:
        """Pure decode (one token per request) in a captured shape."""
        return batch.num_tokens == batch.num_reqs and self._shape(batch) in self.graphs

    @staticmethod
    def _shape(batch: StepBatch) -> StepShape:
        return StepShape(batch.padded_num_tokens, batch.padded_num_reqs)

    def replay(
        self,
        batch: StepBatch,
        input_ids: torch.Tensor,  # [Tp]
        positions: torch.Tensor,  # [Tp]
        logits_indices: torch.Tensor,  # [Rp]
        meta: AttentionMetadata,  # the batch's tensors, padded to its buckets
    ) -> torch.Tensor:  # [Rp, V]; valid until the next replay
        num_tokens, num_reqs = shape = self._shape(batch)
        num_block_cols = meta.block_tables.shape[1]
        graph, logits = self.graphs[shape]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.cu_q_lens[: num_reqs + 1].copy_(meta.cu_q_lens)
        self.kv_lens[:num_reqs].copy_(meta.kv_lens)
        self.block_tables[:num_reqs, :num_block_cols].copy_(meta.block_tables)
        self.logits_indices[:num_reqs].copy_(logits_indices)
        graph.replay()
        return logits
