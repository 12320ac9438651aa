"""The persistent input batch and the padded ragged step batch both runners consume.

Runners hold one `InputBatch`: per-request rows (token ids, block table,
sampling parameters) that are updated incrementally from each
`SchedulerOutput`, never rebuilt from Python lists. `InputBatch.prepare()`
turns the scheduled rows into one `StepBatch`: numpy arrays padded to buckets
(tokens: powers of two from 16 to max_num_batched_tokens; requests: powers of
two from 8 to max_num_seqs; block-table columns: powers of two from 8 to
max_blocks_per_req) with requests sorted decode-only, prefill-only, mixed.
Everything a runner must do is math on these arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from enginecore.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from enginecore.sampling_params import SamplingParams
from enginecore.sampling_ref import GREEDY_EPS, seeded_uniform


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to hi; hi itself closes the list if it is not one."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return sorted(set(out))


def pick_bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class SamplingBatch:
    """Per request row (padded rows are greedy and ignored)."""

    temperature: np.ndarray  # [Rp] f32; rows < 1e-5 are greedy
    top_k: np.ndarray  # [Rp] i32; 0 = off
    top_p: np.ndarray  # [Rp] f32
    min_p: np.ndarray  # [Rp] f32
    uniform: np.ndarray  # [Rp] f32 the seeded draw for this step
    all_greedy: bool
    # None unless some row uses them (a separate compiled variant):
    bias: np.ndarray | None = None  # [Rp, V] f32 additive token masks
    output_counts: np.ndarray | None = None  # [Rp, V] f32
    prompt_mask: np.ndarray | None = None  # [Rp, V] bool
    presence: np.ndarray | None = None  # [Rp] f32
    frequency: np.ndarray | None = None  # [Rp] f32
    repetition: np.ndarray | None = None  # [Rp] f32
    num_logprobs: int = 0  # top-N to return (0: only when some row asked; then max_logprobs)
    needs_filtering: bool = False  # any row uses top-k/top-p/min-p


@dataclass
class PromptLogprobsSlice:
    req_id: str
    token_start: int  # flat index of the first scheduled token of the request
    num_tokens: int  # positions to score (prompt positions p with p + 1 < num_prompt)
    target_ids: np.ndarray  # [num_tokens] the prompt tokens that follow
    num_logprobs: int


@dataclass
class StepBatch:
    """One ragged, padded batch. Padded tokens have slot -1; padded requests q_len 0, kv_len 0."""

    req_ids: list[str]  # real requests in batch order
    num_reqs: int
    num_tokens: int
    input_ids: np.ndarray  # [Tp] i32
    positions: np.ndarray  # [Tp] i32
    slot_mapping: np.ndarray  # [Tp] i32 (-1 for padding)
    cu_q_lens: np.ndarray  # [Rp+1] i32
    kv_lens: np.ndarray  # [Rp] i32 tokens in cache after this step
    block_tables: np.ndarray  # [Rp, Bp] i32
    distribution: np.ndarray  # [3] i32 (decode_end, prefill_end, mixed_end)
    logits_indices: np.ndarray  # [Rp] i32 last scheduled token of each request
    sample_mask: np.ndarray  # [R] bool: request produces a token this step
    token_req_idx: np.ndarray  # [Tp] i32 request row of each token (padding: Rp-1 ... unused)
    sampling: SamplingBatch
    prompt_logprobs: list[PromptLogprobsSlice] = field(default_factory=list)

    @property
    def padded_num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def padded_num_reqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def bucket(self) -> tuple[int, int, int]:
        return (self.padded_num_tokens, self.padded_num_reqs, self.block_tables.shape[1])


class InputBatch:
    """Persistent per-request rows, owned by a runner."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        vocab_size: int,
        max_logprobs: int = 20,
        min_token_bucket: int = 16,
        min_req_bucket: int = 8,
    ):
        """`min_token_bucket` / `min_req_bucket`: the smallest padded sizes. 16 / 8 suit TPU tiles and GPUs; on a
        CPU every padded row costs its full share of the matmuls, so the jax runner starts its buckets lower."""
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.token_buckets = pow2_buckets(min_token_bucket, max(min_token_bucket, max_num_batched_tokens))
        self.req_buckets = pow2_buckets(min_req_bucket, max(min_req_bucket, max_num_seqs))
        self.block_buckets = pow2_buckets(8, max(8, self.max_blocks_per_req))

        S = max_num_seqs
        self.row_req_id: list[str | None] = [None] * S
        self.req_row: dict[str, int] = {}
        self.free_rows = list(range(S - 1, -1, -1))
        self.token_ids = np.zeros((S, max_model_len), np.int32)
        self.num_tokens = np.zeros(S, np.int32)
        self.num_prompt = np.zeros(S, np.int32)
        self.num_computed = np.zeros(S, np.int32)
        self.block_table = np.zeros((S, self.max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(S, np.int32)
        self.temperature = np.ones(S, np.float32)
        self.top_k = np.zeros(S, np.int32)
        self.top_p = np.ones(S, np.float32)
        self.min_p = np.zeros(S, np.float32)
        self.seed = np.zeros(S, np.uint64)
        self.sample_index = np.zeros(S, np.int64)
        self.params: list[SamplingParams | None] = [None] * S

    # -- incremental updates ------------------------------------------------------

    def __len__(self) -> int:
        return len(self.req_row)

    def remove(self, req_id: str) -> None:
        row = self.req_row.pop(req_id, None)
        if row is None:
            return
        self.row_req_id[row] = None
        self.params[row] = None
        self.num_blocks[row] = 0
        self.free_rows.append(row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        n, k = int(self.num_blocks[row]), len(block_ids)
        if n + k > self.max_blocks_per_req:
            raise ValueError(f"request needs {n + k} blocks, more than max {self.max_blocks_per_req}")
        self.block_table[row, n : n + k] = block_ids
        self.num_blocks[row] = n + k

    def update(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.remove(rid)
        for rid in so.preempted_req_ids:
            self.remove(rid)
        for new in so.scheduled_new_reqs:
            self.remove(new.req_id)  # resumed after preemption
            row = self.free_rows.pop()
            self.req_row[new.req_id] = row
            self.row_req_id[row] = new.req_id
            toks = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.token_ids[row, : len(toks)] = toks
            self.num_tokens[row] = len(toks)
            self.num_prompt[row] = len(new.prompt_token_ids)
            self.num_computed[row] = new.num_computed_tokens
            self.num_blocks[row] = 0
            self._append_blocks(row, new.block_ids)
            sp = new.sampling_params
            self.params[row] = sp
            self.temperature[row] = sp.temperature
            self.top_k[row] = sp.top_k if 0 < sp.top_k < self.vocab_size else 0
            self.top_p[row] = sp.top_p
            self.min_p[row] = sp.min_p
            self.seed[row] = np.uint64(new.seed % (1 << 64))
            self.sample_index[row] = new.sample_index
        for c in so.scheduled_cached_reqs:
            row = self.req_row[c.req_id]
            n = int(self.num_tokens[row])
            k = len(c.new_token_ids)
            if k:
                self.token_ids[row, n : n + k] = c.new_token_ids
                self.num_tokens[row] = n + k
            self.num_computed[row] = c.num_computed_tokens
            if c.new_block_ids:
                self._append_blocks(row, c.new_block_ids)

    # -- the step batch ---------------------------------------------------------------

    def prepare(self, so: SchedulerOutput) -> StepBatch:
        sched = so.num_scheduled_tokens
        ids = list(sched)
        rows = np.array([self.req_row[r] for r in ids], np.int64)
        q = np.array([sched[r] for r in ids], np.int32)
        comp = self.num_computed[rows]
        # decode-only (q == 1), prefill-only (no cached context), mixed
        cls = np.where(q == 1, 0, np.where(comp == 0, 1, 2))
        order = np.argsort(cls, kind="stable")
        rows, q, comp, cls = rows[order], q[order], comp[order], cls[order]
        ids = [ids[i] for i in order]
        R, T = len(ids), int(q.sum())
        Rp = pick_bucket(self.req_buckets, R)
        Tp = pick_bucket(self.token_buckets, T)
        kv = comp + q
        nb_needed = int(-(-kv.max() // self.block_size)) if R else 1
        Bp = pick_bucket(self.block_buckets, max(nb_needed, 1))

        cu = np.zeros(Rp + 1, np.int32)
        cu[1 : R + 1] = np.cumsum(q)
        cu[R + 1 :] = T
        kv_lens = np.zeros(Rp, np.int32)
        kv_lens[:R] = kv
        # flat token -> (request row, position)
        tok_req = np.repeat(np.arange(R, dtype=np.int32), q)
        pos = (np.arange(T, dtype=np.int32) - cu[tok_req] + comp[tok_req]).astype(np.int32)
        input_ids = np.zeros(Tp, np.int32)
        input_ids[:T] = self.token_ids[rows[tok_req], pos]
        positions = np.zeros(Tp, np.int32)
        positions[:T] = pos
        block_tables = np.zeros((Rp, Bp), np.int32)
        # the smallest bucket (8 columns) can be wider than max_blocks_per_req: pad with the null block
        block_tables[:R, : min(Bp, self.max_blocks_per_req)] = self.block_table[rows, :Bp]
        slot = np.full(Tp, -1, np.int32)
        blk = block_tables[tok_req, pos // self.block_size]
        slot[:T] = blk * self.block_size + pos % self.block_size
        token_req_idx = np.full(Tp, max(Rp - 1, 0), np.int32)
        token_req_idx[:T] = tok_req
        logits_indices = np.zeros(Rp, np.int32)
        logits_indices[:R] = cu[1 : R + 1] - 1
        sample_mask = kv >= self.num_tokens[rows]
        dist = np.array(
            [int((cls == 0).sum()), int((cls <= 1).sum()), R], np.int32
        )
        sampling = self._sampling_batch(rows, kv, Rp)
        plp = []
        for i, (rid, row) in enumerate(zip(ids, rows)):
            sp = self.params[row]
            if sp.prompt_logprobs is None:
                continue
            P = int(self.num_prompt[row])
            start = int(comp[i])
            end = min(int(kv[i]), P - 1)  # positions that predict a prompt token
            if end <= start:
                continue
            plp.append(
                PromptLogprobsSlice(
                    req_id=rid,
                    token_start=int(cu[i]),
                    num_tokens=end - start,
                    target_ids=self.token_ids[row, start + 1 : end + 1].copy(),
                    num_logprobs=sp.prompt_logprobs,
                )
            )
        return StepBatch(
            req_ids=ids,
            num_reqs=R,
            num_tokens=T,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot,
            cu_q_lens=cu,
            kv_lens=kv_lens,
            block_tables=block_tables,
            distribution=dist,
            logits_indices=logits_indices,
            sample_mask=sample_mask,
            token_req_idx=token_req_idx,
            sampling=sampling,
            prompt_logprobs=plp,
        )

    def _sampling_batch(self, rows: np.ndarray, kv: np.ndarray, Rp: int) -> SamplingBatch:
        R, V = len(rows), self.vocab_size

        def pad(a, fill, dtype):
            out = np.full(Rp, fill, dtype)
            out[:R] = a
            return out

        temp = pad(self.temperature[rows], 0.0, np.float32)
        # the token being generated sits at position kv (= number of tokens before it)
        u = pad(seeded_uniform(self.seed[rows], self.sample_index[rows], kv), 0.5, np.float32)
        params = [self.params[r] for r in rows]
        sb = SamplingBatch(
            temperature=temp,
            top_k=pad(self.top_k[rows], 0, np.int32),
            top_p=pad(self.top_p[rows], 1.0, np.float32),
            min_p=pad(self.min_p[rows], 0.0, np.float32),
            uniform=u,
            all_greedy=bool(np.all(temp[:R] < GREEDY_EPS)),
        )
        sb.needs_filtering = bool(
            np.any((sb.top_k[:R] > 0) | (sb.top_p[:R] < 1.0) | (sb.min_p[:R] > 0.0))
        )
        if any(p.logprobs is not None for p in params):
            sb.num_logprobs = self.max_logprobs
        if any(p.uses_penalties for p in params):
            counts = np.zeros((Rp, V), np.float32)
            pmask = np.zeros((Rp, V), bool)
            sb.presence = np.zeros(Rp, np.float32)
            sb.frequency = np.zeros(Rp, np.float32)
            sb.repetition = np.ones(Rp, np.float32)
            for i, (row, p) in enumerate(zip(rows, params)):
                if not p.uses_penalties:
                    continue
                P, N = int(self.num_prompt[row]), int(self.num_tokens[row])
                np.add.at(counts[i], self.token_ids[row, P:N], 1.0)
                pmask[i, self.token_ids[row, :P]] = True
                sb.presence[i], sb.frequency[i] = p.presence_penalty, p.frequency_penalty
                sb.repetition[i] = p.repetition_penalty
            sb.output_counts, sb.prompt_mask = counts, pmask
        if any(p.uses_token_masks for p in params):
            bias = np.zeros((Rp, V), np.float32)
            for i, (row, p) in enumerate(zip(rows, params)):
                if p.uses_token_masks:
                    self._fill_bias(bias[i], row, p)
            sb.bias = bias
        return sb

    def _fill_bias(self, b: np.ndarray, row: int, p: SamplingParams) -> None:
        if p.logit_bias:
            for t, v in p.logit_bias.items():
                if 0 <= t < len(b):
                    b[t] += v
        if p.allowed_token_ids:
            keep = np.zeros(len(b), bool)
            keep[[t for t in p.allowed_token_ids if 0 <= t < len(b)]] = True
            b[~keep] = -np.inf
        P, N = int(self.num_prompt[row]), int(self.num_tokens[row])
        out = self.token_ids[row, P:N]
        for seq in p._bad_words_token_ids:
            # ban the last token of a bad word when the output ends with the rest of it
            prefix = seq[:-1]
            if len(prefix) <= len(out) and (not prefix or list(out[len(out) - len(prefix):]) == list(prefix)):
                if 0 <= seq[-1] < len(b):
                    b[seq[-1]] = -np.inf
        if N - P < p.min_tokens:
            for t in p._all_stop_token_ids:
                if 0 <= t < len(b):
                    b[t] = -np.inf


def make_runner_output(
    batch: StepBatch,
    sampled: np.ndarray,  # [>=R] i32 sampled token per request row
    topk_ids: np.ndarray | None = None,  # [>=R, N]
    topk_logprobs: np.ndarray | None = None,  # [>=R, N]
    sampled_logprobs: np.ndarray | None = None,  # [>=R]
    sampled_ranks: np.ndarray | None = None,  # [>=R]
    prompt_logprobs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] | None = None,
) -> ModelRunnerOutput:
    """Shared post-processing: numpy results of a step -> ModelRunnerOutput.

    prompt_logprobs maps req_id -> (target_logprobs [n], target_ranks [n],
    topk_ids [n, k], topk_logprobs [n, k]) for the slice in `batch.prompt_logprobs`.
    """
    R = batch.num_reqs
    sampled_lists = [[int(sampled[i])] if batch.sample_mask[i] else [] for i in range(R)]
    lps = None
    if topk_ids is not None and batch.sampling.num_logprobs > 0:
        lps = []
        for i in range(R):
            if not batch.sample_mask[i]:
                lps.append(None)
                continue
            lps.append(
                LogprobsLists(
                    token_ids=[int(sampled[i])] + [int(t) for t in topk_ids[i]],
                    logprobs=[float(sampled_logprobs[i])] + [float(v) for v in topk_logprobs[i]],
                    rank=int(sampled_ranks[i]),
                )
            )
    plp_out: dict[str, list[LogprobsLists | None]] = {}
    for sl in batch.prompt_logprobs:
        tgt_lp, tgt_rank, ids, vals = prompt_logprobs[sl.req_id]
        k = sl.num_logprobs
        plp_out[sl.req_id] = [
            LogprobsLists(
                token_ids=[int(sl.target_ids[j])] + [int(t) for t in ids[j, :k]],
                logprobs=[float(tgt_lp[j])] + [float(v) for v in vals[j, :k]],
                rank=int(tgt_rank[j]),
            )
            for j in range(sl.num_tokens)
        ]
    return ModelRunnerOutput(req_ids=list(batch.req_ids), sampled_token_ids=sampled_lists, logprobs=lps,
                             prompt_logprobs=plp_out)


def prompt_logprobs_np(
    logprobs: np.ndarray,  # [n, V] log-softmax of the positions' logits
    targets: np.ndarray,  # [n]
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Host-side helper for the rare prompt_logprobs path (shared by runners)."""
    n = len(targets)
    tgt = logprobs[np.arange(n), targets]
    ranks = (logprobs > tgt[:, None]).sum(-1) + 1
    if k > 0:
        ids = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
        vals = np.take_along_axis(logprobs, ids, -1)
    else:
        ids = np.zeros((n, 0), np.int64)
        vals = np.zeros((n, 0), np.float32)
    return tgt, ranks, ids, vals
