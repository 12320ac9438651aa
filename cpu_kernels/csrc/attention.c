#include "cpu_kernels.h"
#include "simd.h"

// out[i] += p * x[i], x: n elements of type T (one FMA a float, in order)
static inline __attribute__((always_inline)) void axpy(const int T, float *out, float p, const char *x, int n) {
    const __m256 vp = _mm256_set1_ps(p);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(out + j, _mm256_fmadd_ps(vp, kv_load8(T, x + (size_t)j * KV_BYTES(T)), _mm256_loadu_ps(out + j)));
    for (; j < n; j++) out[j] += p * kv_load1(T, x + (size_t)j * KV_BYTES(T));
}

// y[r][c] = dot(a[r], b[c], n) * scale for r < R, c < C (R * C <= 12 chains in registers); b: rows of type T
static inline __attribute__((always_inline)) void dots_tile(const int T, const int R, const int C, const float *const *a,
                                                          const char *const *b, int n, float scale, float *y,
                                                          long y_stride) {
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 bv[4];
        for (int c = 0; c < C; c++) bv[c] = kv_load8(T, b[c] + (size_t)j * KV_BYTES(T));
        for (int r = 0; r < R; r++) {
            const __m256 av = _mm256_loadu_ps(a[r] + j);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(av, bv[c], acc[r][c]);
        }
    }
    if (C == 4 && j == n) {
        for (int r = 0; r < R; r++)
            _mm_storeu_ps(y + r * y_stride, _mm_mul_ps(hsum8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]),
                                                       _mm_set1_ps(scale)));
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum8(acc[r][c]);
            for (int t = j; t < n; t++) s += a[r][t] * kv_load1(T, b[c] + (size_t)t * KV_BYTES(T));
            y[r * y_stride + c] = s * scale;
        }
}

// o[r][d0 .. d0 + 32) (+)= sum over keys k in [k0, k1) of p[r][k] v[k][d0 ..], R rows, one FMA chain per
// output over the keys in order; v: rows of type T. While k - k0 < pfn it also prefetches pf_bytes of pf[k - k0].
// A key's V vectors are loaded one at a time, after its R weights are broadcast: 12 accumulators, 3 weights and
// one V vector fill AVX2's 16 registers. Loading all 4 V vectors first needed 17, and gcc kept one accumulator
// on the stack, a store and a reload in every key's chain (prefill attention 1.23x without it).
static inline __attribute__((always_inline)) void pv_tile(const int T, const int R, float *const *o,
                                                        const float *const *p, const char *const *v, int k0, int k1,
                                                        int d0, const char *const *pf, int pfn, int pf_bytes) {
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_loadu_ps(o[r] + d0 + 8 * c);
    for (int k = k0; k < k1; k++) {
        if (k - k0 < pfn)
            for (int b = 0; b < pf_bytes; b += 64) _mm_prefetch(pf[k - k0] + b, _MM_HINT_T0);
        __m256 pr[3];
        for (int r = 0; r < R; r++) pr[r] = _mm256_set1_ps(p[r][k]);
        for (int c = 0; c < 4; c++) {
            const __m256 vv = kv_load8(T, v[k] + (size_t)(d0 + 8 * c) * KV_BYTES(T));
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(pr[r], vv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(o[r] + d0 + 8 * c, acc[r][c]);
}

// a tile's call for R rows (R <= 3, known at run time) with R a compile-time constant, as the tiles need it
#define TILE_R(R, call3, call2, call1) \
    do {                               \
        if ((R) == 3) call3;           \
        else if ((R) == 2) call2;      \
        else call1;                    \
    } while (0)

// Decode attention over the paged cache: request i's one query (token tokens[i] of q [T, Hq, D], rows
// `q_stride` floats apart) attends its kv_lens[i] cached tokens (the last `window` only if window > 0),
// whose blocks are block_tables[i, :], from caches [blocks, block_size, Hkv, D]; query head h reads kv head
// h / (Hq / Hkv). out [T, Hq, D] (contiguous) gets the rows of those tokens. Exact softmax in float32.
// A task is one request's query heads or one kv head's; it reads each cached row once for all of its heads
// (decode_tasks). When there are too few of those tasks to keep the threads busy, the split order below splits a
// request's keys and dims between the threads instead (decode_split).
// Every head gets dot()'s and axpy's arithmetic, in tiles (each tile's chains are theirs), so the same bits
// for the same values however the tasks and tiles fall.

// The paged cache's rows are a few hundred bytes in blocks scattered over the cache: the hardware prefetchers,
// which follow streams within a 4 KiB page, lose them at every block, and a decode step's attention ran at
// ~6 GB/s, a third of this memory's bandwidth (benchmarks/bench_kernels_ab.py --what attention). So the
// kernels fetch the rows KV_PREFETCH keys ahead of the scores (and the next DECODE_KEYS of V) while they work.
// The scores' fetches go to L2 (T1): a key's K and V rows of all heads are 24 lines at float32, 8 keys ahead
// ~200 in flight, more than L1's miss buffers hold; into L2 they ran a step's attention 1.2-1.6x as fast at 4-32
// rows (170 and 1024 tokens, both cache layouts, a Zen 4), even at 1-2 rows. 16 keys ahead ran
// 0.94-0.96x, 4 keys 1.02-1.07x at 170 tokens but 0.91x at 1024.
#define KV_PREFETCH 8
#define DECODE_KEYS 16  // keys a block of the output loop (their V rows stay in L1)

// query heads per task for n requests on nthreads threads: all of a request's (its token rows read whole, in
// order) on one thread or with requests enough to share out, else one KV head's group (fewer requests still:
// decode_split's order instead)
int decode_heads_per_task(int n, int Hq, int Hkv, int nthreads) {
    return nthreads <= 1 || n >= 2 * nthreads ? Hq : Hq / Hkv;
}

// the first of the L cached tokens a query at position L - 1 attends (the last `window` only if window > 0)
static inline int window_start(int L, int window) { return window > 0 && L > window ? L - window : 0; }

// bytes [0, nbytes) from p into L2
static inline __attribute__((always_inline)) void prefetch_bytes(const char *p, int nbytes) {
    for (int b = 0; b < nbytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// the heads in the tile from head h0 + g on, g < hs: those of its kv head (G query heads a kv head), at most 3
static inline void head_tiles(int h0, int hs, int G, int *tile) {
    for (int g = 0; g < hs; g++) {
        const int left = ((h0 + g) / G + 1) * G - (h0 + g);
        tile[g] = left < 3 ? left : 3;
        if (tile[g] > hs - g) tile[g] = hs - g;
    }
}

// a request's keys [j0, j1) of its kv_len - start: their rows' byte offsets in the caches (each key's block
// looked up once, not five times with a division each)
static inline void key_offsets(size_t *ro, const int32_t *bt, int start, int j0, int j1, int block_size, long row) {
    for (int j = j0, b = (start + j0) / block_size, o = (start + j0) % block_size; j < j1; j++) {
        ro[j - j0] = ((size_t)bt[b] * block_size + o) * row;
        if (++o == block_size) o = 0, b++;
    }
}

// Scores of keys 0 .. nkeys of ro (row offsets, nro of them) for the hs query heads from h0 (queries qr, tiles
// `tile`): S[g * s_stride + j] = dot(qr[g], K_j) * scale, KS keys a tile (KS is 4 over a 16-bit cache: prefill
// attention's tiles, its conversions make the loop compute-bound; 1 over a float32 one: 4 keys'
// tiles ask for 4 rows at once and ran 0.86-1.0x from memory there, 1.5-1.7x with the rows in cache
// (docs/design-notes.md)). Each key `ahead` keys on is fetched into L2 meanwhile, pf_bytes of its
// K row from pf_off and (pf_v) of its V row.
static inline __attribute__((always_inline)) void decode_scores(
    const int T, const size_t *ro, int nkeys, int nro, const char *kcache, const char *vcache, int pf_v,
    long pf_off, int pf_bytes, int ahead, const float *const *qr, const int *tile, int hs, int h0, int G,
    long head_bytes, int D, float scale, float *S, long s_stride) {
    const int KS = T == KV_F32 ? 1 : 4;  // keys a score tile
    for (int j = 0; j < nkeys; j += KS) {
        const int nk = nkeys - j < KS ? nkeys - j : KS;
        for (int c = ahead; c < ahead + KS && j + c < nro; c++) {
            prefetch_bytes(kcache + ro[j + c] + pf_off, pf_bytes);
            if (pf_v) prefetch_bytes(vcache + ro[j + c] + pf_off, pf_bytes);
        }
        const char *kp[4];
        for (int c = 0; c < nk; c++) kp[c] = kcache + ro[j + c];
        for (int g = 0; g < hs; g += tile[g]) {
            const long off = (long)((h0 + g) / G) * head_bytes;
            const char *kb[4];
            for (int c = 0; c < nk; c++) kb[c] = kp[c] + off;
            float *y = S + (size_t)g * s_stride + j;
            if (nk == 4)
                TILE_R(tile[g], dots_tile(T, 3, 4, qr + g, kb, D, scale, y, s_stride),
                       dots_tile(T, 2, 4, qr + g, kb, D, scale, y, s_stride),
                       dots_tile(T, 1, 4, qr + g, kb, D, scale, y, s_stride));
            else
                for (int c = 0; c < nk; c++)
                    TILE_R(tile[g], dots_tile(T, 3, 1, qr + g, kb + c, D, scale, y + c, s_stride),
                           dots_tile(T, 2, 1, qr + g, kb + c, D, scale, y + c, s_stride),
                           dots_tile(T, 1, 1, qr + g, kb + c, D, scale, y + c, s_stride));
        }
    }
}

// the softmax of hs rows of scores (row g at S + g * s_stride, len of them) in place, without the division:
// exp(s - max) and inv[g] = 1 / their sum (0 for an empty row: zeros, not NaN)
static inline void softmax_rows(float *S, long s_stride, int hs, int len, float *inv) {
    for (int g = 0; g < hs; g++) {
        float *sr = S + (size_t)g * s_stride;
        const float sum = exp_shift_sum(sr, len, row_max(sr, len));
        inv[g] = sum > 0.f ? 1.f / sum : 0.f;
    }
}

// Outputs [d_lo, d_hi) of the hs heads from h0 (rows orow, weights P [hs, p_stride] from softmax_rows):
// orow[g][d] = inv[g] * sum over the len keys of ro, in order, of P[g][j] V_j[d], DECODE_KEYS keys at a time in
// tiles of 3 heads x 32 dims held in registers (D % 32 == 0, d_lo and d_hi multiples of 32), else one axpy a
// head and key (all of D). The first tile of a block fetches the rows of the DECODE_KEYS keys `ahead` keys on,
// pf_bytes from pf_off.
static inline __attribute__((always_inline)) void decode_outputs(
    const int T, const size_t *ro, int len, const char *vcache, long pf_off, int pf_bytes, int ahead,
    const float *P, long p_stride, const float *inv, float *const *orow, const int *tile, int hs, int h0, int G,
    long head_bytes, int D, int d_lo, int d_hi) {
    for (int g = 0; g < hs; g++) memset(orow[g] + d_lo, 0, sizeof(float) * (d_hi - d_lo));
    for (int j0 = 0; j0 < len; j0 += DECODE_KEYS) {
        const int nkeys = len - j0 < DECODE_KEYS ? len - j0 : DECODE_KEYS;
        const int pfn = len - j0 - ahead < DECODE_KEYS ? len - j0 - ahead : DECODE_KEYS;
        const char *vp[DECODE_KEYS], *pfr[DECODE_KEYS];  // this block's rows, the next ones' parts
        for (int c = 0; c < nkeys; c++) vp[c] = vcache + ro[j0 + c];
        for (int c = 0; c < pfn; c++) pfr[c] = vcache + ro[j0 + ahead + c] + pf_off;
        for (int g = 0; g < hs; g += tile[g]) {
            const long off = (long)((h0 + g) / G) * head_bytes;
            const char *vb[DECODE_KEYS];
            const float *pg[3];
            for (int c = 0; c < nkeys; c++) vb[c] = vp[c] + off;
            for (int r = 0; r < tile[g]; r++) pg[r] = P + (size_t)(g + r) * p_stride + j0;
            if (D % 32 == 0) {
                for (int d0 = d_lo; d0 < d_hi; d0 += 32) {
                    const int n = g == 0 && d0 == d_lo ? pfn : 0;  // the first tile fetches
                    TILE_R(tile[g], pv_tile(T, 3, orow + g, pg, vb, 0, nkeys, d0, pfr, n, pf_bytes),
                           pv_tile(T, 2, orow + g, pg, vb, 0, nkeys, d0, pfr, n, pf_bytes),
                           pv_tile(T, 1, orow + g, pg, vb, 0, nkeys, d0, pfr, n, pf_bytes));
                }
            } else {
                for (int r = 0; r < tile[g]; r++)
                    for (int c = 0; c < nkeys; c++) axpy(T, orow[g + r], pg[r][c], vb[c], D);
            }
        }
    }
    for (int g = 0; g < hs; g++)
        for (int d = d_lo; d < d_hi; d++) orow[g][d] *= inv[g];
}

// The tasks over a cache of type T, each key's row read once for the task's heads in the score pass (its V
// part fetched with it, KV_PREFETCH keys ahead: on a Zen 3 the V rows then come from L3, its victim cache, in
// the output pass even where they outgrow L2; not fetching them there ran 0.78-0.94x at 1024 tokens) and once
// in the output pass (the next DECODE_KEYS keys' V rows fetched by a block's first tile).
static inline __attribute__((always_inline)) int decode_tasks(
    const int T, const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
    const int32_t *block_tables, int bt_stride, const char *kcache, const char *vcache, long kv_row, long kv_head,
    int block_size, int Hq, int Hkv, int D, float scale, int window, float *out, int hs, int t0, int t1) {
    const int G = Hq / Hkv, per_req = Hq / hs, es = KV_BYTES(T);
    const long row = kv_row * es, head_bytes = kv_head * es;  // bytes
    int rc = 0;
    for (int task = t0; task < t1; task++) {
        const int i = task / per_req, h0 = task % per_req * hs, hk0 = h0 / G, hk1 = (h0 + hs - 1) / G;
        const long pf_off = hk0 * head_bytes;  // the task's part of a row: bytes [pf_off, + pf_bytes)
        const int pf_bytes = (int)((hk1 - hk0) * head_bytes + D * es);
        const int64_t tok = tokens ? tokens[i] : i;
        const int L = kv_lens[i], start = window_start(L, window), len = L - start;
        // the keys' row offsets, then scores [hs, len] and the inverse sums
        size_t *ro = (size_t *)malloc(sizeof(size_t) * (size_t)len + sizeof(float) * (size_t)hs * (len + 1));
        if (!ro) {
            rc = -2;
            continue;
        }
        float *S = (float *)(ro + len), *inv = S + (size_t)hs * len;
        key_offsets(ro, block_tables + (size_t)i * bt_stride, start, 0, len, block_size, row);
        const float *qr[hs];
        float *orow[hs];
        int tile[hs];
        for (int g = 0; g < hs; g++) {
            qr[g] = q + tok * q_stride + (size_t)(h0 + g) * D;
            orow[g] = out + (size_t)tok * Hq * D + (size_t)(h0 + g) * D;
        }
        head_tiles(h0, hs, G, tile);
        decode_scores(T, ro, len, len, kcache, vcache, 1, pf_off, pf_bytes, KV_PREFETCH, qr, tile, hs, h0, G,
                      head_bytes, D, scale, S, len);
        softmax_rows(S, len, hs, len, inv);
        decode_outputs(T, ro, len, vcache, pf_off, pf_bytes, DECODE_KEYS, S, len, inv, orow, tile, hs, h0, G,
                       head_bytes, D, 0, D);
        free(ro);
    }
    return rc;
}

// ---- decode attention in the split order: too few requests for the threads ----
// With fewer requests than the threads can share out by kv head (n * Hkv < 2 * nthreads: batch 1 on 2 threads,
// batch <= 10 of SmolLM2's 3 kv heads on 16), the tasks above take one query head each: the G query heads of a
// kv head read its rows G times (from L2 or L3 after the first) in parts of a quarter row, and a row's keys
// stay on one thread. Batch 1 at 1024 tokens read ~7-9 GB/s. The split order reads each row once, whole, with
// every thread busy, in two phases: phase 0, tasks of (request, split_keys keys), writes every query head's
// scores of those keys and the keys' row offsets into a buffer the phases share (fetching each key's K and V rows SPLIT_AHEAD keys
// ahead, whole: V then comes from L2 or L3 in phase 1), and the task that finishes a request's last keys takes
// its softmax (an atomic count of the finished chunks); phase 1, tasks of (request, kv head, 32 dims), sums its
// dims of the kv head's G outputs over every key's V row, in order. A head gets decode_tasks' arithmetic (dot's
// chains a score, exp_shift_sum over the whole row, one FMA chain a dim over the keys in order, the same final
// scale), so the same bits; the tests hold the two orders to each other. Batch 1 (bench_kernels_ab --what
// attention, a Zen 3): 1.6x at 170 tokens, 1.6-1.9x at 1024, 1.8x at 4096 (17.7 GB/s). Chunks of 32
// or 128 keys and 8 or 32 ahead ran within 10% of these; phase 0 by (request, kv head, keys), reading a third of
// each row, 0.8x.
#define SPLIT_KEYS 64  // keys a phase-0 task
#define SPLIT_AHEAD 16  // keys the split order fetches ahead

int decode_split(int n, int Hkv, int nthreads) { return nthreads > 1 && n * Hkv < 2 * nthreads; }

// keys a phase-0 task of a row of len: SPLIT_KEYS, or a quarter of a short row (at least 16)
static inline int split_keys(int len) {
    const int quarter = (len / 4 + 15) & ~15;
    return quarter < 16 ? 16 : quarter < SPLIT_KEYS ? quarter : SPLIT_KEYS;
}

// phase 0's tasks of a row of len: one for an empty row too (its softmax writes its inverse sums, zeros)
static inline int split_chunks(int len) { return len > 0 ? (len + split_keys(len) - 1) / split_keys(len) : 1; }

// The split order's tasks of phase 0 or 1 for n requests, and (bytes != NULL) the bytes of the buffer its
// phases share (zeroed when allocated: it holds the counts, which every call leaves at zero again)
long decode_split_tasks(int phase, int n, const int32_t *kv_lens, int window, int Hq, int Hkv, int D, long *bytes) {
    long t = 0, keys = 0;
    for (int i = 0; i < n; i++) {
        const int len = kv_lens[i] - window_start(kv_lens[i], window);
        keys += len;
        t += phase == 0 ? split_chunks(len) : (long)Hkv * (D % 32 ? 1 : D / 32);
    }
    if (bytes) *bytes = sizeof(size_t) * keys + sizeof(int) * (long)n + sizeof(float) * ((long)n * Hq + keys * Hq);
    return t;
}

// Tasks [t0, t1) of phase 0 or 1 of the split order on the calling thread (request by request, then its keys,
// or its kv heads and dims), buf: decode_split_tasks' (each request's keys' row offsets [len], counts [n], inverse
// sums [n, Hq], then each request's scores [Hq, len]).
static inline __attribute__((always_inline)) int decode_split_run(
    const int T, int phase, const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
    const int32_t *block_tables, int bt_stride, const char *kcache, const char *vcache, long kv_row, long kv_head,
    int block_size, int Hq, int Hkv, int D, float scale, int window, void *buf, float *out, int n, int t0, int t1) {
    const int G = Hq / Hkv, es = KV_BYTES(T), parts = D % 32 ? 1 : D / 32;
    const long row = kv_row * es, head_bytes = kv_head * es, row_bytes = Hkv * head_bytes;  // a token's K (V) bytes
    long keys = 0;
    for (int i = 0; i < n; i++) keys += kv_lens[i] - window_start(kv_lens[i], window);
    size_t *ro = (size_t *)buf;  // request i's keys' offsets from ro, its scores from S
    int *count = (int *)(ro + keys);
    float *inv = (float *)(count + n), *S = inv + (size_t)n * Hq;
    int task = 0;
    for (int i = 0, len; i < n && task < t1; S += (size_t)Hq * len, ro += len, i++) {
        const int L = kv_lens[i], start = window_start(L, window);
        len = L - start;
        const int K = split_keys(len), chunks = split_chunks(len), ntasks = phase == 0 ? chunks : Hkv * parts;
        if (task + ntasks <= t0) {
            task += ntasks;
            continue;
        }
        const int32_t *bt = block_tables + (size_t)i * bt_stride;
        const int64_t tok = tokens ? tokens[i] : i;
        for (int c = 0; c < ntasks; c++, task++) {
            if (task < t0 || task >= t1) continue;
            if (phase == 0) {  // keys [j0, j0 + nk) of every head
                const int j0 = c * K, nk = len - j0 < K ? len - j0 : K;
                const int nro = len - j0 < K + SPLIT_AHEAD ? len - j0 : K + SPLIT_AHEAD;
                size_t kro[SPLIT_KEYS + SPLIT_AHEAD];  // (and the keys fetched ahead: the next task writes theirs)
                key_offsets(kro, bt, start, j0, j0 + nro, block_size, row);
                memcpy(ro + j0, kro, sizeof(size_t) * nk);  // for phase 1
                for (int k = 0; k < nk && k < SPLIT_AHEAD; k++) {  // the first keys, not fetched ahead
                    prefetch_bytes(kcache + kro[k], row_bytes);
                    prefetch_bytes(vcache + kro[k], row_bytes);
                }
                const float *qr[Hq];
                int tile[Hq];
                for (int g = 0; g < Hq; g++) qr[g] = q + tok * q_stride + (size_t)g * D;
                head_tiles(0, Hq, G, tile);
                decode_scores(T, kro, nk, nro, kcache, vcache, 1, 0, row_bytes, SPLIT_AHEAD, qr, tile, Hq, 0, G,
                              head_bytes, D, scale, S + j0, len);
                // the request's last chunk takes the softmax (acq_rel: it sees the others' scores; phase 1, after
                // the caller's barrier, sees its results) and puts the count back to zero for the next call
                if (__atomic_add_fetch(count + i, 1, __ATOMIC_ACQ_REL) == chunks) {
                    softmax_rows(S, len, Hq, len, inv + (size_t)i * Hq);
                    __atomic_store_n(count + i, 0, __ATOMIC_RELAXED);
                }
                continue;
            }
            const int hk = c / parts, h0 = hk * G;  // kv head hk's query heads, dims [d_lo, d_hi)
            const int d_lo = parts == 1 ? 0 : 32 * (c % parts), d_hi = parts == 1 ? D : d_lo + 32;
            const long pf_off = hk * head_bytes + (long)d_lo * es;
            const int pf_bytes = (d_hi - d_lo) * es;
            for (int k = 0; k < len && k < SPLIT_AHEAD; k++) prefetch_bytes(vcache + ro[k] + pf_off, pf_bytes);
            float *orow[G];
            int tile[G];
            for (int g = 0; g < G; g++) orow[g] = out + (size_t)tok * Hq * D + (size_t)(h0 + g) * D;
            head_tiles(h0, G, G, tile);
            decode_outputs(T, ro, len, vcache, pf_off, pf_bytes, SPLIT_AHEAD, S + (size_t)h0 * len, len,
                           inv + (size_t)i * Hq + h0, orow, tile, G, h0, G, head_bytes, D, d_lo, d_hi);
        }
    }
    return 0;
}

// Tasks [t0, t1) of phase `phase` of decode attention's split order (decode_split_tasks) on the calling thread:
// decode_attention_tasks' arguments and the phases' buffer. Returns 0, or -1 for an unknown kv_type.
int decode_split_phase(int phase, const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
                       const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache,
                       long kv_row, long kv_head, int block_size, int Hq, int Hkv, int D, float scale, int window,
                       void *buf, float *out, int n, int t0, int t1, int kv_type) {
#define SPLIT_RUN(T)                                                                                              \
    decode_split_run(T, phase, q, q_stride, tokens, kv_lens, block_tables, bt_stride, (const char *)kcache,     \
                     (const char *)vcache, kv_row, kv_head, block_size, Hq, Hkv, D, scale, window, buf, out, n, t0, t1)
    switch (kv_type) {
        case KV_F32: return SPLIT_RUN(KV_F32);
        case KV_F16: return SPLIT_RUN(KV_F16);
        case KV_BF16: return SPLIT_RUN(KV_BF16);
    }
#undef SPLIT_RUN
    return -1;
}

// Tasks [t0, t1) of decode attention on the calling thread (task t: request t / (Hq / hs), query heads from
// t % (Hq / hs) * hs, each with its own KV head; every head's scores, sums and output are computed the same way
// whatever hs). A cached token's row of a cache is `kv_row` elements long, kv head hk at hk * kv_head:
// torch's separate K and V caches [blocks, block_size, Hkv, D] are kv_row = Hkv * D, kv_head = D; jaxengine's
// one cache [blocks, block_size, 2 * Hkv, D] with K and V of head hk at 2hk and 2hk + 1 is kcache = cache,
// vcache = cache + D elements, kv_row = 2 * Hkv * D, kv_head = 2 * D. tokens == NULL: request i's query is row
// i of q and of out. Returns 0, -1 for an unknown kv_type, or -2 if a task's scores could not be allocated.
int decode_attention_tasks(const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
                           const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache,
                           long kv_row, long kv_head, int block_size, int Hq, int Hkv, int D, float scale,
                           int window, float *out, int hs, int t0, int t1, int kv_type) {
#define DECODE_TASKS(T)                                                                                         \
    decode_tasks(T, q, q_stride, tokens, kv_lens, block_tables, bt_stride, (const char *)kcache,              \
                 (const char *)vcache, kv_row, kv_head, block_size, Hq, Hkv, D, scale, window, out, hs, t0, t1)
    switch (kv_type) {
        case KV_F32: return DECODE_TASKS(KV_F32);
        case KV_F16: return DECODE_TASKS(KV_F16);
        case KV_BF16: return DECODE_TASKS(KV_BF16);
    }
#undef DECODE_TASKS
    return -1;
}

int decode_attention(const float *q, long q_stride, int n, const int64_t *tokens, const int32_t *kv_lens,
                     const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache,
                     int block_size, int Hq, int Hkv, int D, float scale, int window, float *out, int nthreads,
                     int kv_type) {
    if (n < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || block_size <= 0) return -1;
    if (kv_type < KV_F32 || kv_type > KV_BF16) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    long work = 0;  // multiply-adds of the scores
    for (int i = 0; i < n; i++) work += (long)kv_lens[i] * Hq * D;
    if (work < PARALLEL_WORK) nthreads = 1;  // less than waking a sleeping thread costs
    const long W = (long)Hkv * D;  // elements per cached token
    int rc = 0;
    if (decode_split(n, Hkv, nthreads)) {
        long bytes, ntasks[2];  // each phase's
        for (int phase = 0; phase < 2; phase++)
            ntasks[phase] = decode_split_tasks(phase, n, kv_lens, window, Hq, Hkv, D, &bytes);
        void *buf = calloc(1, bytes);
        if (!buf) return -2;
#pragma omp parallel num_threads(nthreads)
        for (int phase = 0; phase < 2; phase++) {
#pragma omp for schedule(dynamic, 1)
            for (long task = 0; task < ntasks[phase]; task++)
                if (decode_split_phase(phase, q, q_stride, tokens, kv_lens, block_tables, bt_stride, kcache, vcache, W,
                                       D, block_size, Hq, Hkv, D, scale, window, buf, out, n, (int)task,
                                       (int)task + 1, kv_type))
                    rc = -2;
        }
        free(buf);
        return rc;
    }
    const int hs = decode_heads_per_task(n, Hq, Hkv, nthreads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int task = 0; task < n * (Hq / hs); task++)
        if (decode_attention_tasks(q, q_stride, tokens, kv_lens, block_tables, bt_stride, kcache, vcache, W, D,
                                   block_size, Hq, Hkv, D, scale, window, out, hs, task, task + 1, kv_type))
            rc = -2;
    return rc;
}

// Attention of prefill (and mixed) rows: request i's q_lens[i] queries (tokens q_start[i] ... of q, rows
// q_stride floats apart, positions kv_lens[i] - q_lens[i] ...) over its cached tokens, causal (and the last
// `window` only when window > 0). Every query row gets decode_attention's arithmetic for a query at its
// position, bit for bit: each score the same dot() (one 8-lane FMA chain over d, hsum8) times scale, the
// same exact two-pass softmax on the same contiguous run of scores (exp_shift_sum), the same FMA chain over
// the keys in order for each output (axpy's), the same final scale. So a token's attention does not depend
// on whether it was decoded, prefilled, prefilled in chunks or recomputed, nor on the backend. The work is
// organized in tiles instead of one query at a time: a task is (request, block of bq queries, kv head); its
// G * nq rows (query, head) score the union of their key ranges in 3-row x 4-key tiles (four horizontal sums
// at a time), 64 keys for all rows before the next 64 (their K rows stay in L1); each query's G heads, which
// share its key range, sum V in tiles of 3 heads x 32 dims, again 64 keys for all queries at a time (the
// output chains go back to memory between key blocks; their order stays). Tasks are numbered request by
// request, then query block,
// then kv head; t0..t1 picks a range (prefill_attention splits them between threads, jaxengine's custom
// call between XLA's). Returns -2 if a buffer cannot be allocated (those rows are left unwritten).
#define PREFILL_BQ 32  // queries a task (prefill_attention)
#define PREFILL_KEYS 64  // keys a block of a task's score and output loops

int prefill_attention_num_tasks(int n, const int32_t *q_lens, int Hkv, int bq) {
    long t = 0;
    for (int i = 0; i < n; i++) t += (long)(q_lens[i] > 0 ? (q_lens[i] + bq - 1) / bq : 0) * Hkv;
    return t > INT32_MAX ? -1 : (int)t;
}

// n elements of type T at src -> float32 (exact)
static inline __attribute__((always_inline)) void to_f32(const int T, const char *src, float *dst, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, kv_load8(T, src + (size_t)j * KV_BYTES(T)));
    for (; j < n; j++) dst[j] = kv_load1(T, src + (size_t)j * KV_BYTES(T));
}

int prefill_attention_tasks(const float *q, long q_stride, const int32_t *q_start, const int32_t *q_lens,
                            const int32_t *kv_lens, const int32_t *block_tables, int bt_stride, const void *kcache,
                            const void *vcache, long kv_row, long kv_head, int block_size, int Hq, int Hkv, int D,
                            float scale, int window, float *out, long out_stride, int n, int bq, int t0, int t1,
                            int kv_type) {
    if (kv_type < KV_F32 || kv_type > KV_BF16) return -1;
    const int G = Hq / Hkv, es = KV_BYTES(kv_type);
    int rc = 0, task = 0;
    for (int i = 0; i < n && task < t1; i++) {
        const int ql = q_lens[i], nblk = ql > 0 ? (ql + bq - 1) / bq : 0;
        if (task + nblk * Hkv <= t0) {
            task += nblk * Hkv;
            continue;
        }
        const int32_t *bt = block_tables + (size_t)i * bt_stride;
        const int first = kv_lens[i] - ql;  // position of query 0
        for (int qb = 0; qb < nblk; qb++)
            for (int hk = 0; hk < Hkv; hk++, task++) {
                if (task < t0 || task >= t1) continue;
                const int q0 = qb * bq, nq = ql - q0 < bq ? ql - q0 : bq, M = nq * G;
                const int p_lo = first + q0, p_hi = first + q0 + nq - 1;  // positions of the block's queries
                const int k_lo = window_start(p_lo + 1, window), nk = p_hi + 1 - k_lo;
                // scores [M, nk] (row m: query m / G, head hk * G + m % G), then M query, M output and nk key
                // and value row pointers, then (a 16-bit cache) the task's K and V rows in float32: each row
                // converted once, not once for every tile of queries that reads it
                const size_t conv = kv_type == KV_F32 ? 0 : 2 * (size_t)nk * D;
                char *buf = (char *)malloc(sizeof(float) * ((size_t)M * nk + M) + sizeof(void *) * (3 * (size_t)M + 2 * nk)
                                           + sizeof(float) * conv);
                if (!buf) {
                    rc = -2;
                    continue;
                }
                float *S = (float *)buf, *inv = S + (size_t)M * nk;
                const float **qr = (const float **)(buf + sizeof(float) * ((size_t)M * nk + M));
                float **orow = (float **)(qr + M);
                const float **prow = (const float **)(orow + M);
                const char **kr = (const char **)(prow + M), **vr = kr + nk;
                for (int m = 0; m < M; m++) {
                    const size_t tok = (size_t)q_start[i] + q0 + m / G, h = (size_t)hk * G + m % G;
                    qr[m] = q + tok * q_stride + h * D;
                    orow[m] = out + tok * out_stride + h * D;
                    prow[m] = S + (size_t)m * nk;
                }
                for (int k = 0; k < nk; k++) {
                    const int pos = k_lo + k;
                    const size_t slot = (size_t)bt[pos / block_size] * block_size + pos % block_size;
                    kr[k] = (const char *)kcache + (slot * kv_row + hk * kv_head) * es;
                    vr[k] = (const char *)vcache + (slot * kv_row + hk * kv_head) * es;
                }
                if (conv) {
                    float *f = (float *)(vr + nk);
                    for (int k = 0; k < 2 * nk; k++, f += D) {
                        if (kv_type == KV_F16) to_f32(KV_F16, kr[k], f, D);  // kr[nk + k] is vr[k]
                        else to_f32(KV_BF16, kr[k], f, D);
                        kr[k] = (const char *)f;
                    }
                }
                // scores: each row needs keys [its window start, its position]; the tiles score the union up to
                // their last row's position, 64 keys (16 KiB of K at D = 64, in L1) for every row tile at a time
                for (int c0 = 0; c0 < nk; c0 += PREFILL_KEYS) {
                    const int c1 = c0 + PREFILL_KEYS < nk ? c0 + PREFILL_KEYS : nk;
                    int m = 0;
                    for (; m < M; m += 3) {
                        const int R = M - m < 3 ? M - m : 3, last = p_lo + (m + R - 1) / G - k_lo + 1;
                        const int e = c1 < last ? c1 : last;
                        int k = c0;
                        if (R == 3) {
                            // a last tile of 4 keys past e while the keys exist (their scores go unread): a tile
                            // of 1 key has 3 chains, and ran ~3x as long a score
                            for (; k < e && k + 4 <= nk; k += 4)
                                dots_tile(KV_F32, 3, 4, qr + m, kr + k, D, scale, S + (size_t)m * nk + k, nk);
                            for (; k < e; k++) dots_tile(KV_F32, 3, 1, qr + m, kr + k, D, scale, S + (size_t)m * nk + k, nk);
                        } else {
                            for (int r = m; r < m + R; r++) {
                                int kk = c0;
                                for (; kk < e && kk + 4 <= nk; kk += 4)  // (past e as above)
                                    dots_tile(KV_F32, 1, 4, qr + r, kr + kk, D, scale, S + (size_t)r * nk + kk, nk);
                                for (; kk < e; kk++) dots_tile(KV_F32, 1, 1, qr + r, kr + kk, D, scale, S + (size_t)r * nk + kk, nk);
                            }
                        }
                    }
                }
                // per query: its G rows' softmax over its own run of keys
                for (int qi = 0; qi < nq; qi++) {
                    const int pos = p_lo + qi, start = window_start(pos + 1, window);
                    const int a = start - k_lo, len = pos + 1 - start;
                    for (int g = 0; g < G; g++) {
                        float *sr = S + (size_t)(qi * G + g) * nk;
                        const float mx = row_max(sr + a, len);
                        const float sum = exp_shift_sum(sr + a, len, mx);
                        inv[qi * G + g] = sum > 0.f ? 1.f / sum : 0.f;
                        memset(orow[qi * G + g], 0, sizeof(float) * D);
                    }
                }
                // outputs: every query's G heads share its run of keys; 64 keys of V (in L1) for every query
                // at a time, each output one FMA chain over its keys in order (the accumulators go back to
                // memory between key blocks, the order stays)
                for (int c0 = 0; c0 < nk; c0 += PREFILL_KEYS) {
                    const int c1 = c0 + PREFILL_KEYS < nk ? c0 + PREFILL_KEYS : nk;
                    for (int qi = 0; qi < nq; qi++) {
                        const int pos = p_lo + qi, start = window_start(pos + 1, window);
                        const int a = (start - k_lo > c0 ? start - k_lo : c0), b = pos + 1 - k_lo < c1 ? pos + 1 - k_lo : c1;
                        if (a >= b) continue;
                        float *const *og = orow + (size_t)qi * G;
                        const float **pg = (const float **)prow + (size_t)qi * G;
                        if (D % 32 == 0) {
                            int g = 0;
                            for (; g + 3 <= G; g += 3)
                                for (int d0 = 0; d0 < D; d0 += 32) pv_tile(KV_F32, 3, og + g, pg + g, vr, a, b, d0, NULL, 0, 0);
                            for (; g < G; g++)
                                for (int d0 = 0; d0 < D; d0 += 32) pv_tile(KV_F32, 1, og + g, pg + g, vr, a, b, d0, NULL, 0, 0);
                        } else {
                            for (int g = 0; g < G; g++)
                                for (int k = a; k < b; k++) axpy(KV_F32, og[g], pg[g][k], vr[k], D);
                        }
                    }
                }
                for (int m = 0; m < M; m++)
                    for (int d = 0; d < D; d++) orow[m][d] *= inv[m];
                free(buf);
            }
    }
    return rc;
}

// prefill_attention_tasks over all tasks, split between OpenMP threads (heaviest-first is not needed: tasks
// are small and taken one at a time). Checks the arguments it can: -1 on a bad one.
int prefill_attention(const float *q, long q_stride, int n, const int32_t *q_start, const int32_t *q_lens,
                      const int32_t *kv_lens, const int32_t *block_tables, int bt_stride, const void *kcache,
                      const void *vcache, int block_size, int Hq, int Hkv, int D, float scale, int window,
                      float *out, long out_stride, int nthreads, int kv_type) {
    if (n < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || block_size <= 0 || kv_type < KV_F32 || kv_type > KV_BF16)
        return -1;
    for (int i = 0; i < n; i++)
        if (q_lens[i] < 0 || kv_lens[i] < q_lens[i]) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    const int ntasks = prefill_attention_num_tasks(n, q_lens, Hkv, PREFILL_BQ);
    if (ntasks < 0) return -1;
    const long W = (long)Hkv * D;  // elements per cached token
    int rc = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (ntasks > 1)
    for (int task = 0; task < ntasks; task++)
        if (prefill_attention_tasks(q, q_stride, q_start, q_lens, kv_lens, block_tables, bt_stride, kcache, vcache, W,
                                    D, block_size, Hq, Hkv, D, scale, window, out, out_stride, n, PREFILL_BQ, task,
                                    task + 1, kv_type))
            rc = -2;
    return rc;
}

int prefill_attention_bq(void) { return PREFILL_BQ; }
