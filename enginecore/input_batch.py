"""The runner's persistent copy of every running request: one row each, updated incrementally.

A row holds the request's token ids, block table and sampling parameters as
numpy arrays. The scheduler sends a request whole once (`NewRequestData`) and
afterwards only new blocks and computed-token counts; the runner appends the
tokens it samples itself. With asynchronous scheduling the next step is built
before the previous step's tokens reach the host: a row's newest token may
still be on the device (`num_tokens > num_known`), and the step reads it from
there (`StepBatch.input_from_row`). Results are recorded in step order;
a row reused by another request in between has a new generation, so a late
result for its old request is dropped.

Sampling state that needs the generated tokens' values (repetition penalties,
bad words) lives per row in `TokenState`, updated incrementally as tokens
arrive: no per-step rebuild of [rows, vocab] arrays from Python lists.
"""

from __future__ import annotations

import numpy as np

from enginecore.outputs import SchedulerOutput
from enginecore.sampling_params import SamplingParams


class TokenState:
    """Dense per-row state of the rare sampling features (penalties, token masks), kept up to date.

    `static_bias` [V]: logit_bias and the allowed-token mask (fixed for the request);
    `counts` [V]: how often each token occurs in the output (penalties);
    `prompt_mask` [V]: tokens of the prompt (repetition penalty).
    """

    def __init__(self, params: SamplingParams, vocab_size: int, prompt: np.ndarray, output: np.ndarray):
        V = vocab_size
        self.params = params
        self.static_bias: np.ndarray | None = None
        if params.logit_bias or params.allowed_token_ids:
            b = np.zeros(V, np.float32)
            for t, v in (params.logit_bias or {}).items():
                if 0 <= t < V:
                    b[t] += v
            if params.allowed_token_ids:
                keep = np.zeros(V, bool)
                keep[[t for t in params.allowed_token_ids if 0 <= t < V]] = True
                b[~keep] = -np.inf
            self.static_bias = b
        self.counts: np.ndarray | None = None
        self.prompt_mask: np.ndarray | None = None
        if params.uses_penalties:
            self.counts = np.bincount(output, minlength=V).astype(np.float32)[:V]
            self.prompt_mask = np.zeros(V, bool)
            self.prompt_mask[prompt[(prompt >= 0) & (prompt < V)]] = True
        self.bad_words = [list(w) for w in params._bad_words_token_ids]
        self.stop_ids = np.array(sorted(t for t in params._all_stop_token_ids if 0 <= t < V), np.int64)

    @property
    def needs_token_values(self) -> bool:
        """Whether building a step needs the values of the tokens generated so far."""
        return self.counts is not None or bool(self.bad_words)

    @property
    def has_bias(self) -> bool:
        return self.static_bias is not None or bool(self.bad_words) or self.params.min_tokens > 0

    def add_token(self, token: int) -> None:
        if self.counts is not None and 0 <= token < len(self.counts):
            self.counts[token] += 1.0

    def bias(self, out: np.ndarray, output_ids: np.ndarray) -> None:
        """Write this step's additive mask [V] into `out` (zeros on entry). `output_ids`: generated so far."""
        if self.static_bias is not None:
            out += self.static_bias
        for word in self.bad_words:
            # ban a bad word's last token when the output already ends with the rest of it
            prefix = word[:-1]
            if len(prefix) <= len(output_ids) and (not prefix or output_ids[len(output_ids) - len(prefix):].tolist()
                                                   == prefix):
                if 0 <= word[-1] < len(out):
                    out[word[-1]] = -np.inf
        if len(output_ids) < self.params.min_tokens and len(self.stop_ids):
            out[self.stop_ids] = -np.inf


class InputBatch:
    """Persistent per-request rows, owned by a runner (shared by both backends)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        S = max_num_seqs
        self.req_row: dict[str, int] = {}
        self.row_req_id: list[str | None] = [None] * S
        self.free_rows = list(range(S - 1, -1, -1))
        self.generation = np.zeros(S, np.int64)  # bumped each time a row is given to a request
        self.token_ids = np.zeros((S, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(S, np.int32)  # tokens of the sequence, a sampled one still on the device included
        self.num_known = np.zeros(S, np.int32)  # tokens whose values are on the host
        self.num_prompt = np.zeros(S, np.int32)
        self.num_computed = np.zeros(S, np.int32)  # tokens in the KV cache before the next step
        self.block_table = np.zeros((S, self.max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(S, np.int32)
        # sampling parameters, one entry per row
        self.temperature = np.ones(S, np.float32)
        self.top_k = np.zeros(S, np.int32)
        self.top_p = np.ones(S, np.float32)
        self.min_p = np.zeros(S, np.float32)
        self.seed = np.zeros(S, np.uint64)
        self.sample_index = np.zeros(S, np.int64)
        self.wants_logprobs = np.zeros(S, bool)
        self.params: list[SamplingParams | None] = [None] * S
        self.token_state: dict[int, TokenState] = {}  # rows using penalties or token masks
        self.prompt_logprob_rows: set[int] = set()  # rows asking for prompt logprobs

    def __len__(self) -> int:
        return len(self.req_row)

    # -- the scheduler's decisions ----------------------------------------------------

    def update(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.remove(rid)
        for rid in so.preempted_req_ids:
            self.remove(rid)
        for new in so.scheduled_new_reqs:
            self.remove(new.req_id)  # resumed after preemption
            self._add(new)
        c = so.scheduled_cached_reqs
        req_row = self.req_row
        for rid, blocks, comp in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            row = req_row[rid]
            self.num_computed[row] = comp
            if blocks:
                self._append_blocks(row, blocks)

    def remove(self, req_id: str) -> None:
        row = self.req_row.pop(req_id, None)
        if row is None:
            return
        self.row_req_id[row] = None
        self.params[row] = None
        self.token_state.pop(row, None)
        self.prompt_logprob_rows.discard(row)
        self.free_rows.append(row)

    def _add(self, new) -> None:
        row = self.free_rows.pop()
        self.req_row[new.req_id] = row
        self.row_req_id[row] = new.req_id
        self.generation[row] += 1
        prompt = np.asarray(new.prompt_token_ids, np.int32)
        output = np.asarray(new.output_token_ids, np.int32)
        P, n = len(prompt), len(prompt) + len(output)
        self.token_ids[row, :P] = prompt
        self.token_ids[row, P:n] = output
        self.num_tokens[row] = self.num_known[row] = n
        self.num_prompt[row] = P
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
        self.wants_logprobs[row] = sp.logprobs is not None
        if sp.uses_penalties or sp.uses_token_masks:
            self.token_state[row] = TokenState(sp, self.vocab_size, prompt, output)
        if sp.prompt_logprobs is not None:
            self.prompt_logprob_rows.add(row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        n, k = int(self.num_blocks[row]), len(block_ids)
        if n + k > self.max_blocks_per_req:
            raise ValueError(f"request needs {n + k} blocks, more than max {self.max_blocks_per_req}")
        self.block_table[row, n : n + k] = block_ids
        self.num_blocks[row] = n + k

    # -- sampled tokens -------------------------------------------------------------------

    def rows_need_token_values(self, so: SchedulerOutput) -> bool:
        """Whether a scheduled row needs the values of tokens that may still be on the device."""
        if not self.token_state:
            return False
        rows = [self.req_row[r] for r in so.num_scheduled_tokens if r in self.req_row]
        return any(self.token_state[r].needs_token_values and self.num_known[r] < self.num_tokens[r]
                   for r in rows if r in self.token_state)

    def record_sampled(self, rows: np.ndarray, generations: np.ndarray, positions: np.ndarray,
                       tokens: np.ndarray) -> None:
        """A finished step's tokens: token `tokens[i]` sits at `positions[i]` of row `rows[i]` (if still ours)."""
        live = self.generation[rows] == generations
        if not live.all():
            rows, positions, tokens = rows[live], positions[live], tokens[live]
        self.token_ids[rows, positions] = tokens
        self.num_known[rows] = positions + 1
        if self.token_state:
            for row, tok in zip(rows.tolist(), tokens.tolist()):
                st = self.token_state.get(row)
                if st is not None:
                    st.add_token(tok)
