"""CUDA graphs for decode steps: one captured forward per (padded tokens, padded requests) bucket.

A pure-decode step of R requests always lands in the same bucket
(Tp, Rp) = (token bucket of R, request bucket of R), so capturing one graph
per distinct bucket for R in the capture sizes covers every decode step up to
the largest size. A graph runs on static device buffers sized for the largest
bucket; the batch's arrays are copied into their leading slices before
`replay()`. The block-table buffer always has the widest block bucket's
columns (the kernel reads only the columns a request's kv length needs, so the
columns past the batch's own bucket may hold anything). The graph ends with the LM
head at `logits_indices`, so replay returns logits [Rp, V]; sampling stays
eager.

Only attention backends that read lengths on the device can be captured
(`AttentionBackend.supports_cuda_graphs`: the Triton one).
"""

from __future__ import annotations

import torch

from enginecore.batch import InputBatch, StepBatch, pick_bucket
from torchengine.attention import AttentionBackend, AttentionMetadata, PagedAttention
from torchengine.model import Transformer


def capture_pairs(input_batch: InputBatch, sizes: list[int] | None = None) -> list[tuple[int, int]]:
    """The (Tp, Rp) buckets of pure-decode steps with R in `sizes` requests (default 1..max_num_seqs), largest first."""
    max_reqs = input_batch.max_num_seqs
    sizes = list(sizes) if sizes else list(range(1, max_reqs + 1))
    bad = [s for s in sizes if not isinstance(s, int) or not 1 <= s <= max_reqs]
    if bad:
        raise ValueError(f"cudagraph_capture_sizes {bad} must be integers in [1, --max-num-seqs={max_reqs}]")
    pairs = {(pick_bucket(input_batch.token_buckets, r), pick_bucket(input_batch.req_buckets, r)) for r in sizes}
    return sorted(pairs, reverse=True)


class CUDAGraphs:
    """Captured decode forwards, keyed by bucket, replayed on static input buffers."""

    def __init__(
        self,
        model: Transformer,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        input_batch: InputBatch,
        pairs: list[tuple[int, int]],
        device: torch.device,
    ):
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} attention cannot be captured in a CUDA graph")
        self.model, self.backend, self.kv_caches, self.device = model, backend, kv_caches, device
        self.pairs = sorted(pairs, reverse=True)
        max_tokens = max(t for t, _ in pairs)
        max_reqs = max(r for _, r in pairs)
        z = dict(device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, **z)  # [Tmax]
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, **z)  # [Tmax]
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, **z)  # [Tmax]
        self.cu_q_lens = torch.zeros(max_reqs + 1, dtype=torch.int32, **z)  # [Rmax+1]
        self.kv_lens = torch.zeros(max_reqs, dtype=torch.int32, **z)  # [Rmax]
        self.block_tables = torch.zeros(max_reqs, input_batch.block_buckets[-1], dtype=torch.int32, **z)
        self.logits_indices = torch.zeros(max_reqs, dtype=torch.int64, **z)  # [Rmax]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

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
        """Capture every bucket, largest first, into one memory pool; returns the number of graphs."""
        pool = self._new_pool()
        for num_tokens, num_reqs in self.pairs:
            self._fill_dummy(num_tokens, num_reqs)
            for _ in range(2):  # compile the kernels and settle the allocator outside the capture
                self._forward(num_tokens, num_reqs)
            self._synchronize()
            self.graphs[(num_tokens, num_reqs)] = self._capture_one(
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
        """Pure decode (one token per request) in a captured bucket."""
        return batch.num_tokens == batch.num_reqs and batch.bucket[:2] in self.graphs

    def replay(
        self,
        batch: StepBatch,
        input_ids: torch.Tensor,  # [Tp]
        positions: torch.Tensor,  # [Tp]
        logits_indices: torch.Tensor,  # [Rp]
        meta: AttentionMetadata,  # the batch's tensors, padded to its buckets
    ) -> torch.Tensor:  # [Rp, V]; valid until the next replay
        num_tokens, num_reqs, num_block_cols = batch.bucket
        graph, logits = self.graphs[(num_tokens, num_reqs)]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.cu_q_lens[: num_reqs + 1].copy_(meta.cu_q_lens)
        self.kv_lens[:num_reqs].copy_(meta.kv_lens)
        self.block_tables[:num_reqs, :num_block_cols].copy_(meta.block_tables)
        self.logits_indices[:num_reqs].copy_(logits_indices)
        graph.replay()
        return logits
