#include "cpu_kernels.h"
#include "simd.h"

// Every decoder layer of a step of a float32 Llama-family decoder in one call: the kernels the per-op paths
// call (torchengine.model's layers through cpu_kernels.torch_ops, jaxengine's scan through its custom calls), in
// their order on the same data, so the hidden states are bit-identical to theirs: every kernel computes a row
// the same way whatever split of the work runs it. RMSNorm (the residual add fused in), the q/k/v linear, its
// bias, the q/k norms (Qwen3), RoPE, the new K and V into the cache, decode attention of the decode rows and
// prefill attention of the others, the o linear, RMSNorm, gate/up, SiLU and down. What this saves is the
// dispatch between the kernels (~15 calls a layer, ~150 us a layer at one token on a 2-core VM for torch's
// Python) and, for XLA, waking its threads for each.
//
// One implementation for both backends (run_layers): the work is split into phases of parts that a
// layers_team runs, OpenMP's threads for the torch backend (step_layers, decode_layers below), a team of XLA's
// intra-op threads held for the call for the jax backend (xla_ffi.cc's XlaserveCpuLayers), and the cache is
// read and written through strides: torch's separate K and V caches and jax's interleaved one are both just
// strides.

// multiply-adds of a phase below which one thread does it all: waking another costs more (simd.h)
#define ROWS_SPLIT (4 * PARALLEL_WORK)

long layers_workspace(int T, int H, int Hq, int Hkv, int D, int I) {
    return (long)T * (3L * H + (long)(Hq + 2 * Hkv) * D + (long)Hq * D + 3L * I);
}

// One call's state, shared by the phases' tasks
typedef struct {
    const decode_layer *ly;
    const layers_step *s;
    const layers_team *team;
    float *residual, *h, *y, *qkv, *att, *gu, *act;  // [T, H] x 3, [T, QKV], [T, Hq D], [T, 2 I], [T, I]
    int QKV, hs, split, rc;
    long d_tasks;  // decode attention's tasks of phase 0 (decode_split) or of its only phase
    void *split_buf;
    uint32_t *xb;  // QX_BDOT's activations rounded to bfloat16 (allocated at the first such linear)
    long xb_size;
} layers_call;

// ---- the parallel phases: fn over [0, n) split by the team -------------------------------------------------

static void team_run(const layers_team *t, long n, long per, layers_task fn, void *arg) {
    if (n <= 0) return;
    if (t->threads <= 1 || per >= n) {  // the caller's alone: not worth publishing
        fn(arg, 0, n, n);
        return;
    }
    t->run(t->ctx, n, per, fn, arg);
}

// rows [0, M) of `row_work` floats each: split between the threads when there is enough work
static void team_rows(const layers_team *t, long M, long row_work, layers_task fn, void *arg) {
    const int split = M * row_work >= ROWS_SPLIT;
    const long per = M / ((long)t->threads * 4);
    team_run(t, M, split ? (per > 1 ? per : 1) : M, fn, arg);
}

// ---- the row-wise glue -----------------------------------------------------------------------------------

typedef struct {
    const float *x;
    float *residual, *out;
    const float *w;
    int K;
    float eps;
} norm_arg;

static void norm_task(void *p, long a, long b, long pe) {
    const norm_arg *n = (const norm_arg *)p;
    (void)pe;
    rms_norm(n->x + a * n->K, (int)(b - a), n->K, n->K, n->residual == NULL ? NULL : n->residual + a * n->K, n->w,
             n->eps, n->out + a * n->K);
}

static void norm_rows(layers_call *c, long M, const float *x, float *residual, const float *w, float *out) {
    norm_arg n = {x, residual, out, w, c->s->H, c->s->eps};
    team_rows(c->team, M, c->s->H, norm_task, &n);
}

typedef struct {
    const float *gu;
    float *out;
    int I;
} silu_arg;

static void silu_task(void *p, long a, long b, long pe) {
    const silu_arg *s = (const silu_arg *)p;
    (void)pe;
    silu_mul(s->gu + a * 2 * s->I, (int)(b - a), s->I, s->out + a * s->I);
}

typedef struct {
    const float *x;
    uint32_t *xb;
    int K;
    int *rc;
} round_arg;

static void round_task(void *p, long a, long b, long pe) {
    const round_arg *r = (const round_arg *)p;
    (void)pe;
    if (bdot_round(r->x + a * r->K, (int)(b - a), r->K, r->xb + a * r->K / 2))
        __atomic_store_n(r->rc, -1, __ATOMIC_RELAXED);
}

// token t's K and V rows (Hkv heads of D floats each) into row `slot` of the caches, rounded to their type
static void token_kv(const layers_step *s, const float *k, const float *v, int64_t slot, char *kc, char *vc) {
    const int es = KV_BYTES(s->kv_type);
    if (s->kv_head == s->D) {  // the heads contiguous: one run of Hkv D each
        kv_store(s->kv_type, kc + (size_t)slot * s->kv_row * es, k, s->Hkv * s->D);
        kv_store(s->kv_type, vc + (size_t)slot * s->kv_row * es, v, s->Hkv * s->D);
        return;
    }
    for (int h = 0; h < s->Hkv; h++) {
        const size_t at = ((size_t)slot * s->kv_row + (size_t)h * s->kv_head) * es;
        kv_store(s->kv_type, kc + at, k + (size_t)h * s->D, s->D);
        kv_store(s->kv_type, vc + at, v + (size_t)h * s->D, s->D);
    }
}

// the bias, the q/k norms, RoPE and the cache write, token by token
static void qkv_task(void *p, long a, long b, long pe) {
    const layers_call *c = (const layers_call *)p;
    const layers_step *s = c->s;
    const decode_layer *ly = c->ly;
    const int QKV = c->QKV, Hq = s->Hq, Hkv = s->Hkv, D = s->D;
    (void)pe;
    for (long t = a; t < b; t++) {
        float *row = c->qkv + t * QKV;
        if (ly->qkv_b != NULL)
            for (int j = 0; j < QKV; j++) row[j] += ly->qkv_b[j];
        if (ly->q_norm != NULL) {  // RMSNorm over each head's D (in place: a row is read before it is written)
            rms_norm(row, Hq, D, D, NULL, ly->q_norm, s->eps, row);
            rms_norm(row + (size_t)Hq * D, Hkv, D, D, NULL, ly->k_norm, s->eps, row + (size_t)Hq * D);
        }
        rope(row, 1, Hq + Hkv, D, QKV, s->cos + t * D, s->sin + t * D);
        if (s->slots[t] >= 0)
            token_kv(s, row + (size_t)Hq * D, row + (size_t)(Hq + Hkv) * D, s->slots[t], (char *)ly->key_cache,
                     (char *)ly->value_cache);
    }
}

// ---- the linears -----------------------------------------------------------------------------------------

typedef struct {
    const float *x;
    const uint32_t *xb;  // QX_BDOT's rounded x
    int M, K, N, unit, kind;
    const void *w;
    float *y;
    int *rc;  // set where a part refuses its arguments
} linear_arg;

static void panel_task(void *p, long a, long b, long pe) {
    const linear_arg *l = (const linear_arg *)p;
    panel_gemm_part(l->x, l->M, l->K, (const float *)l->w, l->N, l->y, NULL, l->unit, (int)a, (int)b, (int)pe);
}

static void qx_task(void *p, long a, long b, long pe) {
    const linear_arg *l = (const linear_arg *)p;
    (void)pe;
    const int e = l->kind == QX_BDOT ? bdot_gemm_part(l->xb, l->M, l->K, l->w, l->N, l->y, NULL, (int)a, (int)b)
                                     : qx_gemm_part(l->x, l->M, l->K, l->w, l->N, l->y, NULL, l->kind, (int)a, (int)b);
    if (e) __atomic_store_n(l->rc, -1, __ATOMIC_RELAXED);
}

// Panels a slice of a qx linear of NP panels: all of them where one thread does it all (little work), else two
// slices a thread (a thread that starts late leaves less to wait for; qx_panels prefetches the next panel within
// a slice)
static long qx_slice(long NP, long M, long K, long N, int threads) {
    if (M * K * N < PARALLEL_WORK || threads <= 1) return NP;
    const long per = (NP + 2L * threads - 1) / (2L * threads);
    return per > 1 ? per : 1;
}

// y [M, N] = x [M, K] . W^T: the 4-bit blocks (q4) for steps of at most q4_rows rows, as Int4Linear chooses (its
// own OpenMP threads: the torch backend's alone), else the qx panels (of qx_kind) for steps of at most qx_rows
// rows, else the float32 panels w; the qx panels and w are the same bits
static void linear(layers_call *c, const float *x, int M, int K, const float *w, const void *q4, int q4_rows,
                   const void *qx, int qx_kind, int N, float *y) {
    const layers_team *t = c->team;
    if (q4 != NULL && M <= q4_rows) {
        c->rc |= q4_gemm(x, M, K, q4, N, y, t->threads);
        return;
    }
    linear_arg l = {x, NULL, M, K, N, 0, qx_kind, NULL, y, &c->rc};
    if (qx != NULL && M <= c->ly->qx_rows) {
        const long NP = (N + 15) / 16;
        l.w = qx;
        if (qx_kind == QX_BDOT) {  // the activations rounded once, for every slice's panels
            const long need = (long)M * K / 2;
            if (need > c->xb_size) {
                free(c->xb);
                c->xb = (uint32_t *)aligned_alloc(64, ((size_t)need * 4 + 63) / 64 * 64);
                c->xb_size = c->xb == NULL ? 0 : need;
            }
            if (c->xb == NULL) {
                c->rc |= -2;
                return;
            }
            round_arg r = {x, c->xb, K, &c->rc};
            team_rows(t, M, K, round_task, &r);
            l.xb = c->xb;
        }
        team_run(t, NP, qx_slice(NP, M, K, N, t->threads), qx_task, &l);
        return;
    }
    if (w == NULL) {  // no float32 panels (QX_BDOT's) for a step its qx panels do not take
        c->rc |= -1;
        return;
    }
    int nt = 1, claim = 0;
    const long parts = panel_gemm_plan(M, K, N, t->threads, &l.unit, &nt, &claim);
    l.w = w;
    if (claim == 0 || nt <= 1) {
        // parts not to be claimed (see panel_gemm_plan): one contiguous slice of ceil(parts / nt) a thread, a
        // thread that finds its slice taken taking the next (one that starts late leaves its slice to the others).
        // Four slices a thread ran a decode step of 12-16 rows ~10% slower: each slice's first panel is not
        // prefetched, head_rows prefetching within its range, and a thread's panels were not contiguous.
        team_run(t, parts, nt <= 1 ? parts : (parts + nt - 1) / nt, panel_task, &l);
        return;
    }
    if (t->threads <= 1) {
        panel_task(&l, 0, parts, parts);
        return;
    }
    t->run_shared(t->ctx, parts, nt, claim, panel_task, &l);
}

// ---- attention -------------------------------------------------------------------------------------------

// the decode rows' tasks [0, d_tasks) (decode_split's phase 0, or decode_attention_tasks), then the prefill
// rows' (prefill_attention_tasks), in one phase
static void attention_task(void *p, long a, long b, long pe) {
    layers_call *c = (layers_call *)p;
    const layers_step *s = c->s;
    const decode_layer *ly = c->ly;
    const long dt = c->d_tasks, e0 = b < dt ? b : dt;
    int e = 0;
    (void)pe;
    if (a < dt && c->split)
        e |= decode_split_phase(0, c->qkv, c->QKV, s->dec_tokens, s->dec_kv_lens, s->dec_tables, s->dec_stride,
                                ly->key_cache, ly->value_cache, s->kv_row, s->kv_head, s->block_size, s->Hq, s->Hkv,
                                s->D, s->scale, s->window, c->split_buf, c->att, s->n_dec, (int)a, (int)e0,
                                s->kv_type);
    else if (a < dt)
        e |= decode_attention_tasks(c->qkv, c->QKV, s->dec_tokens, s->dec_kv_lens, s->dec_tables, s->dec_stride,
                                    ly->key_cache, ly->value_cache, s->kv_row, s->kv_head, s->block_size, s->Hq,
                                    s->Hkv, s->D, s->scale, s->window, c->att, c->hs, (int)a, (int)e0, s->kv_type);
    if (b > dt)
        e |= prefill_attention_tasks(c->qkv, c->QKV, s->pre_start, s->pre_lens, s->pre_kv_lens, s->pre_tables,
                                     s->pre_stride, ly->key_cache, ly->value_cache, s->kv_row, s->kv_head,
                                     s->block_size, s->Hq, s->Hkv, s->D, s->scale, s->window, c->att,
                                     (long)s->Hq * s->D, s->n_pre, prefill_attention_bq(), (int)(a > dt ? a - dt : 0),
                                     (int)(b - dt), s->kv_type);
    if (e) __atomic_store_n(&c->rc, -2, __ATOMIC_RELAXED);
}

static void split1_task(void *p, long a, long b, long pe) {
    layers_call *c = (layers_call *)p;
    const layers_step *s = c->s;
    const decode_layer *ly = c->ly;
    (void)pe;
    if (decode_split_phase(1, c->qkv, c->QKV, s->dec_tokens, s->dec_kv_lens, s->dec_tables, s->dec_stride,
                           ly->key_cache, ly->value_cache, s->kv_row, s->kv_head, s->block_size, s->Hq, s->Hkv, s->D,
                           s->scale, s->window, c->split_buf, c->att, s->n_dec, (int)a, (int)b, s->kv_type))
        __atomic_store_n(&c->rc, -2, __ATOMIC_RELAXED);
}

// ---- the kept rows -----------------------------------------------------------------------------------------

typedef struct {
    const float *src;
    float *dst;
    const int64_t *rows;  // NULL: row i is row i
    const float *att;
    float *at;
    int H, HqD;
} copy_arg;

// dst's rows [a, b) = src's rows (rows[i]), and at's = att's where given
static void copy_task(void *p, long a, long b, long pe) {
    const copy_arg *g = (const copy_arg *)p;
    (void)pe;
    for (long i = a; i < b; i++) {
        const long r = g->rows == NULL ? i : g->rows[i];
        memcpy(g->dst + i * g->H, g->src + r * g->H, sizeof(float) * g->H);
        if (g->at != NULL) memcpy(g->at + i * g->HqD, g->att + r * g->HqD, sizeof(float) * g->HqD);
    }
}

typedef struct {
    const float *residual, *y;
    float *out;
    const int64_t *rows;  // out's row of row i (NULL: i)
    int H;
} sum_arg;

static void sum_task(void *p, long a, long b, long pe) {
    const sum_arg *s = (const sum_arg *)p;
    (void)pe;
    for (long i = a; i < b; i++) {
        float *o = s->out + (s->rows == NULL ? i : s->rows[i]) * s->H;
        for (int j = 0; j < s->H; j++) o[j] = s->residual[i * s->H + j] + s->y[i * s->H + j];
    }
}

// ---- a step ------------------------------------------------------------------------------------------------

int run_layers(const decode_layer *layers, int L, const layers_step *s, float *ws, float *out,
               const layers_team *team) {
    const int T = s->T, H = s->H, Hq = s->Hq, Hkv = s->Hkv, D = s->D, I = s->I, QKV = (Hq + 2 * Hkv) * D;
    if (L <= 0 || T <= 0 || H <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || D % 2 || D > 1024 || I <= 0 ||
        s->block_size <= 0 || s->kv_type < KV_F32 || s->kv_type > KV_BF16 || s->n_dec < 0 || s->n_pre < 0 ||
        team->threads < 1 || (s->keep != NULL && (s->S < 1 || s->S > T)))
        return -1;
    layers_call c = {0};
    c.s = s, c.team = team, c.QKV = QKV;
    c.residual = ws, c.h = ws + (size_t)T * H, c.y = c.h + (size_t)T * H, c.qkv = c.y + (size_t)T * H;
    c.att = c.qkv + (size_t)T * QKV, c.gu = c.att + (size_t)T * Hq * D, c.act = c.gu + (size_t)T * 2 * I;
    long covered = s->n_dec;  // attention writes these rows of att; any other is zeros
    for (int i = 0; i < s->n_pre; i++) covered += s->pre_lens[i];
    if (covered < T) memset(c.att, 0, sizeof(float) * (size_t)T * Hq * D);
    memcpy(c.residual, s->x, sizeof(float) * (size_t)T * H);

    long dec_work = 0;  // multiply-adds of the decode rows' scores
    for (int i = 0; i < s->n_dec; i++) dec_work += (long)s->dec_kv_lens[i] * Hq * D;
    const int dec_threads = dec_work < PARALLEL_WORK ? 1 : team->threads;
    c.hs = decode_heads_per_task(s->n_dec, Hq, Hkv, dec_threads);
    // the decode rows in attention.c's split order (few of them for the threads): its phase 0 with the prefill
    // tasks, then its phase 1, a layer, in a buffer zeroed once (each layer leaves its counts at zero)
    c.split = s->n_dec > 0 && decode_split(s->n_dec, Hkv, dec_threads);
    long split_bytes = 0, split1 = 0;
    if (c.split) {
        c.d_tasks = decode_split_tasks(0, s->n_dec, s->dec_kv_lens, s->window, Hq, Hkv, D, &split_bytes);
        split1 = decode_split_tasks(1, s->n_dec, s->dec_kv_lens, s->window, Hq, Hkv, D, NULL);
        c.split_buf = calloc(1, (size_t)split_bytes);
        if (c.split_buf == NULL) return -2;
    } else {
        c.d_tasks = (long)s->n_dec * (Hq / c.hs);
    }
    const int p_tasks =
        s->n_pre > 0 ? prefill_attention_num_tasks(s->n_pre, s->pre_lens, Hkv, prefill_attention_bq()) : 0;
    if (p_tasks < 0) {
        free(c.split_buf);
        return -1;
    }
    const long a_tasks = c.d_tasks + p_tasks;
    const int att_alone = p_tasks == 0 && dec_work < PARALLEL_WORK;

    int M = T;
    for (int l = 0; l < L && c.rc == 0; l++) {
        const decode_layer *ly = c.ly = layers + l;
        // the first layer normalises the embeddings; later ones add the last MLP's output to the stream first
        norm_rows(&c, T, l == 0 ? c.residual : c.y, l == 0 ? NULL : c.residual, ly->attn_norm, c.h);
        linear(&c, c.h, T, H, ly->qkv_w, ly->qkv_q4, ly->qkv_rows, ly->qkv_qx, ly->qkv_qx_kind, QKV, c.qkv);
        team_rows(team, T, 4L * QKV, qkv_task, &c);
        team_run(team, a_tasks, att_alone ? a_tasks : 1, attention_task, &c);
        if (c.split) team_run(team, split1, 1, split1_task, &c);
        float *at = c.att;
        if (l == L - 1 && s->keep != NULL) {
            // the kept rows' stream and attention, in keep's order (qkv is not read after attention and holds
            // S Hq D <= T QKV floats); in place, out first gets every row's stream (the rows not kept are
            // returned so)
            M = s->S, at = c.qkv;
            copy_arg g = {c.residual, s->keep_in_place ? out : c.h, s->keep, c.att, at, H, Hq * D};
            if (s->keep_in_place) {
                copy_arg all = {c.residual, out, NULL, NULL, NULL, H, 0};
                team_rows(team, T, H, copy_task, &all);
                g.src = out, g.dst = c.residual;
            }
            team_rows(team, M, H + Hq * D, copy_task, &g);
            if (!s->keep_in_place) memcpy(c.residual, c.h, sizeof(float) * (size_t)M * H);
        }
        linear(&c, at, M, Hq * D, ly->o_w, ly->o_q4, ly->o_rows, ly->o_qx, ly->o_qx_kind, H, c.y);
        norm_rows(&c, M, c.y, c.residual, ly->mlp_norm, c.h);
        linear(&c, c.h, M, H, ly->gate_up_w, ly->gate_up_q4, ly->gate_up_rows, ly->gate_up_qx, ly->gate_up_qx_kind,
               2 * I, c.gu);
        silu_arg sa = {c.gu, c.act, I};
        team_rows(team, M, I, silu_task, &sa);
        linear(&c, c.act, M, I, ly->down_w, ly->down_q4, ly->down_rows, ly->down_qx, ly->down_qx_kind, H, c.y);
    }
    sum_arg sum = {c.residual, c.y, out, s->keep != NULL && s->keep_in_place ? s->keep : NULL, H};
    if (c.rc == 0) team_rows(team, M, H, sum_task, &sum);
    free(c.split_buf);
    free(c.xb);
    return c.rc;
}

// ---- the torch backend's entry points: OpenMP's threads as the team -----------------------------------------

static void omp_run(void *ctx, long n, long per, layers_task fn, void *arg) {
    const int threads = *(const int *)ctx;
    const long slices = (n + per - 1) / per;
    const int nt = slices < threads ? (int)slices : threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (long i = 0; i < slices; i++) {
        const long a = i * per, b = a + per < n ? a + per : n;
        fn(arg, a, b, b);
    }
}

static void omp_run_shared(void *ctx, long n, int shares, int min, layers_task fn, void *arg) {
    (void)ctx;
    uint64_t sh[shares];
    shares_init(sh, (int)n, shares);
#pragma omp parallel num_threads(shares)
    {
        int a, b, pe;
        while (shares_claim(sh, shares, omp_get_thread_num(), min, &a, &b, &pe)) fn(arg, a, b, pe);
    }
}

// Any step's layers in one call (the torch backend's on a CPU, but a step with prompt logprobs): n_dec decode
// rows (dec_tokens their token rows, dec_kv_lens, dec_tables [n_dec, dec_stride]) by decode attention, n_pre
// prefill requests (pre_start, pre_lens, pre_kv_lens, pre_tables [n_pre, pre_stride]) by prefill attention,
// which between them hold each of the T tokens once, over the layers' caches [blocks, block_size, Hkv, D] (K and
// V apart). keep [S] (NULL: all T rows): the rows wanted (distinct); the last layer runs its o linear and MLP on
// them alone (every row's K and V are still written), and out [S, H] holds them in keep's order, as
// Transformer.forward's `keep` gives them. x [T, H] (the embeddings) -> out [T or S, H] (residual + the last
// MLP's output, before the final norm). cos / sin are the model's tables [positions, D]; ws: decode_workspace(T)
// floats. The same bits as the Python layers.
int step_layers(const decode_layer *layers, int L, const float *x, int T, const int64_t *positions, int n_positions,
                const float *rope_cos, const float *rope_sin, const int64_t *slots, int n_dec,
                const int64_t *dec_tokens, const int32_t *dec_kv_lens, const int32_t *dec_tables, int dec_stride,
                int n_pre, const int32_t *pre_start, const int32_t *pre_lens, const int32_t *pre_kv_lens,
                const int32_t *pre_tables, int pre_stride, const int64_t *keep, int S, int block_size, int H, int Hq,
                int Hkv, int D, int I, float eps, float scale, int window, float *ws, float *out, int nthreads,
                int kv_type) {
    if (L <= 0 || T <= 0 || H <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D % 2 || I <= 0 || n_dec < 0 || n_pre < 0 ||
        kv_type < KV_F32 || kv_type > KV_BF16)
        return -1;
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= n_positions) return -1;  // past the RoPE tables
    long covered = n_dec;  // every token is one group's query, once (then every attention row is written)
    for (int i = 0; i < n_dec; i++)
        if (dec_tokens[i] < 0 || dec_tokens[i] >= T) return -1;
    for (int i = 0; i < n_pre; i++) {
        if (pre_start[i] < 0 || pre_lens[i] < 1 || pre_start[i] + pre_lens[i] > T || pre_kv_lens[i] < pre_lens[i])
            return -1;
        covered += pre_lens[i];
    }
    if (covered != T || (keep != NULL && (S < 1 || S > T))) return -1;
    if (keep != NULL)
        for (int i = 0; i < S; i++)
            if (keep[i] < 0 || keep[i] >= T) return -1;
    // (the first 2T floats: decode_layers' token rows; then each token's RoPE tables, then run_layers')
    float *cos = ws + 2L * T, *sin = cos + (size_t)T * D;
    for (int t = 0; t < T; t++) {
        memcpy(cos + (size_t)t * D, rope_cos + positions[t] * D, sizeof(float) * D);
        memcpy(sin + (size_t)t * D, rope_sin + positions[t] * D, sizeof(float) * D);
    }
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    const layers_team team = {.ctx = &nthreads, .threads = nthreads, .run = omp_run, .run_shared = omp_run_shared};
    const layers_step s = {
        .T = T, .x = x, .cos = cos, .sin = sin, .slots = slots, .kv_row = (long)Hkv * D, .kv_head = D,
        .n_dec = n_dec, .dec_tokens = dec_tokens, .dec_kv_lens = dec_kv_lens, .dec_tables = dec_tables,
        .dec_stride = dec_stride, .n_pre = n_pre, .pre_start = pre_start, .pre_lens = pre_lens,
        .pre_kv_lens = pre_kv_lens, .pre_tables = pre_tables, .pre_stride = pre_stride, .keep = keep, .S = S,
        .keep_in_place = 0, .block_size = block_size, .H = H, .Hq = Hq, .Hkv = Hkv, .D = D, .I = I, .eps = eps,
        .scale = scale, .window = window, .kv_type = kv_type};
    return run_layers(layers, L, &s, sin + (size_t)T * D, out, &team);
}

long decode_workspace(int T, int H, int Hq, int Hkv, int D, int I) {
    return layers_workspace(T, H, Hq, Hkv, D, I) + T * 2L * D + T * 2L;
}

// A decode step (each of the T tokens its request's only query: kv_lens [T], block_tables [T, bt_stride]):
// step_layers with T decode rows and every row kept.
int decode_layers(const decode_layer *layers, int L, const float *x, int T, const int64_t *positions,
                  int n_positions, const float *rope_cos, const float *rope_sin, const int64_t *slots,
                  const int32_t *kv_lens, const int32_t *block_tables, int bt_stride, int block_size, int H, int Hq,
                  int Hkv, int D, int I, float eps, float scale, int window, float *ws, float *out, int nthreads,
                  int kv_type) {
    if (T <= 0) return -1;
    int64_t *tokens = (int64_t *)ws;  // T int64 = 2T floats, first: aligned as the workspace is
    for (int t = 0; t < T; t++) tokens[t] = t;
    return step_layers(layers, L, x, T, positions, n_positions, rope_cos, rope_sin, slots, T, tokens, kv_lens,
                       block_tables, bt_stride, 0, NULL, NULL, NULL, NULL, 0, NULL, T, block_size, H, Hq, Hkv, D, I,
                       eps, scale, window, ws, out, nthreads, kv_type);
}
