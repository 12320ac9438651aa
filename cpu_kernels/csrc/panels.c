#include "cpu_kernels.h"
#include "simd.h"

// y [M, N] = x [M, K] . w [N, K]^T in float32, any M, on [out, in] weights (the model packs its weights for
// panel_gemm below at load; this one serves weights that are not packed, and bench_dense).
//
// Every output is one 8-lane FMA chain over k in ascending order, then hsum8, then the scalar tail: the
// same arithmetic whatever tile computes it, so a row's result does not depend on how many rows share the
// call (a token's hidden state is the same in a decode step, a mixed step or a recompute after
// preemption). Tiles are R rows x C weight rows (4 x 3 for throughput: 12 chains in registers; 1 x 1
// for a single row, which is memory-bound and reads one weight row at a time, the access the hardware
// prefetcher follows best). Threads split the weight rows; each walks its share in panels that stay in
// L2 while all activation rows pass over them, in blocks that stay in L2 too.
// On a 2-core AVX2 machine: 1.6-2.5x MKL's sgemm (on [N, K] weights) at 1-32 rows, about even at 64,
// 0.8-0.95x from 128 rows on (prefill) (benchmarks/bench_dense.py).
static inline __attribute__((always_inline)) void f32_tile(
    const int R, const int C, const float *x, int K, const float *w, float *y, int N) {
    __m256 acc[4][3];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[3];
        for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + (size_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum8(acc[r][c]);
            for (int j = k; j < K; j++) s += w[(size_t)c * K + j] * x[(size_t)r * K + j];
            y[(size_t)r * N + c] = s;
        }
}

// rows m0..m1 (R = m1 - m0 <= 4) times weight rows n0..n1, C columns at a time
static inline __attribute__((always_inline)) void f32_rows(
    const int R, const int C, const float *x, int m0, int K, const float *w, int N, float *y, int n0, int n1) {
    const float *xm = x + (size_t)m0 * K;
    float *ym = y + (size_t)m0 * N;
    int n = n0;
    for (; n + C <= n1; n += C) f32_tile(R, C, xm, K, w + (size_t)n * K, ym + n, N);
    for (; n < n1; n++) f32_tile(R, 1, xm, K, w + (size_t)n * K, ym + n, N);
}

// Output columns [a, b) of f32_gemm on the calling thread (any split gives the same bits, see above).
static int f32_gemm_part(const float *x, int M, int K, const float *w, int N, float *y, int a, int b) {
    if (M < 1 || K <= 0 || N <= 0 || a < 0 || b > N || a > b) return -1;
    // a panel of 256 KiB of weights in L2, activation blocks of 32 KiB (L1): measured best of 16-128 KiB
    // blocks and 64-256 KiB panels at prefill sizes
    int NB = (int)(65536 / K), MB = (int)(8192 / K) & ~3;
    if (NB < 3) NB = 3;
    if (MB < 4) MB = 4;
    for (int n0 = a; n0 < b; n0 += NB) {
        const int n1 = n0 + NB < b ? n0 + NB : b;
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int m1 = m0 + MB < M ? m0 + MB : M;
            int m = m0;
            for (; m + 4 <= m1; m += 4) f32_rows(4, 3, x, m, K, w, N, y, n0, n1);
            switch (m1 - m) {
                case 3: f32_rows(3, 3, x, m, K, w, N, y, n0, n1); break;
                case 2: f32_rows(2, 2, x, m, K, w, N, y, n0, n1); break;
                case 1: f32_rows(1, 1, x, m, K, w, N, y, n0, n1); break;
            }
        }
    }
    return 0;
}

int f32_gemm(const float *x, int M, int K, const float *w, int N, float *y, int nthreads) {
    if (M < 1 || K <= 0 || N <= 0) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    const int chunks = (N + 23) / 24;
    const int nt = gemm_threads(M, K, N, nthreads, chunks);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int a = (int)((long)chunks * t / T) * 24, be = (int)((long)chunks * (t + 1) / T) * 24;
        f32_gemm_part(x, M, K, w, N, y, a, be < N ? be : N);
    }
    return 0;
}

// Every float32 linear of a CPU step and the LM head, y[M, V] = x[M, K] . w[V, K]^T, from weights packed in
// panels of 16 output rows, k-major: wp[(p * K + k) * 16 + j] = w[16 p + j][k] (zero rows pad V to a multiple
// of 16; cpu_kernels.pack_panels). A tile is R activation rows x P panels: per k, 2P weight loads, R
// broadcasts, 2RP FMAs, and no horizontal sum, which costs as much as the FMAs themselves at small hidden
// sizes (K = 64: f32_gemm's 8-lane chains are 8 FMAs long). Every output is one scalar FMA chain over k in
// ascending order (its lane of an accumulator), whatever the tile, the panel block or the thread: a row's
// outputs do not depend on the row count. With `argmax` (not NULL) the tile's outputs are not stored but
// folded into each row's running maximum (the first index of the maximum, NaN counting as the largest as in
// torch.argmax): greedy sampling without writing and re-reading [M, V] logits (12.6 MB at 64 rows of
// SmolLM2's vocabulary).
#define HEAD_ROWS 6


// One k of a tile of R rows x P panels: every accumulator a[r * 2P + j] += x[r][k] * (panel's 8 lanes j at k).
// The only arithmetic of panel_gemm: both its loop orders (head_tile, kblock_tile) step through it.
static inline __attribute__((always_inline)) void panel_k_step(const int R, const int P, const float *x, int K,
                                                             const float *w, int k, __m256 *a) {
    __m256 wv[8];
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        wv[2 * p] = _mm256_loadu_ps(w + ((size_t)p * K + k) * 16);
        wv[2 * p + 1] = _mm256_loadu_ps(w + ((size_t)p * K + k) * 16 + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++) a[r * 2 * P + j] = _mm256_fmadd_ps(xv, wv[j], a[r * 2 * P + j]);
    }
}

// pf_lines cache lines from pf are prefetched, evenly over the k loop (head_rows): with P > 1, pf_run of a
// panel, then as many from pf_stride lines on (the next panel's)
static inline __attribute__((always_inline)) void head_tile(
    const int R, const int P, const float *x, int K, const float *wp, int p0, int V, float *y, head_best *best,
    const char *pf, int pf_lines, int pf_run, int pf_stride) {
    __m256 a[HEAD_ROWS * 2];  // R * 2P <= 12 accumulators
#pragma GCC unroll 12
    for (int i = 0; i < R * 2 * P; i++) a[i] = _mm256_setzero_ps();
    const float *w = wp + (size_t)p0 * K * 16;
    int acc = 0, left = pf_run;
    for (int k = 0; k < K; k++) {
        if (P == 1) {  // (at most K lines, one panel's: the loop's only extra work is this counter)
            acc += pf_lines;
            if (acc >= K) {
                acc -= K;
                _mm_prefetch(pf, _MM_HINT_T1);  // (head_rows: into L2)
                pf += 64;
            }
        } else {  // pf_run lines of each of several panels, pf_stride lines apart: up to P * pf_run
            for (acc += pf_lines; acc >= K; acc -= K) {
                _mm_prefetch(pf, _MM_HINT_T1);
                pf += 64;
                if (--left == 0) pf += (size_t)(pf_stride - pf_run) * 64, left = pf_run;
            }
        }
        panel_k_step(R, P, x, K, w, k, a);
    }
    float o[HEAD_ROWS * 2 * 8];  // the tile's logits, row r's at o[r * 16 P ...]
#pragma GCC unroll 12
    for (int i = 0; i < R * 2 * P; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2 * P; j++) {
            const int col0 = p0 * 16 + j * 8;
            const float *t = o + 8 * (r * 2 * P + j);
            if (best != NULL) {
                head_fold(_mm256_loadu_ps(t), col0, V, best + r);
            } else {
                for (int c = 0; c < 8 && col0 + c < V; c++) y[(size_t)r * V + col0 + c] = t[c];
            }
        }
}

// rows m0..m0+R-1 over panels p0..p1, P panels a tile (single panels at the end). Each tile also prefetches
// slice mi of nm of the P panels it will meet in the next block (p1.. < pe), spread over its k loop: the rows'
// first tile of a block then finds its weights in cache instead of waiting on memory while later tiles, which
// read them from L2, leave the memory idle (5-12% faster linears at 32-64 rows). Into L2 (T1), not L1: a
// block's 7 panels (252 KiB at K = 576) only pass through L1, and there they evicted the tile's own; T1 ran a
// decode step's linears 1.11-1.34x as fast at 8-16 rows (T0 kept for kblock_part, whose panels' k blocks fit
// L1: T1 ran 0.98x there). With one row block (up to 6 rows at K >= 342: a block is 4096 / K rows) only the
// one-panel tiles (4-6 rows) prefetch:
// 1.13-1.22x at 5-6 rows; the 1-3-row tiles, 2-4 panels wide, leave it to the hardware's streams (prefetching
// their next block ran 0.92-0.97x). After whole blocks of 6 rows (nm: the row blocks that prefetch, counted by
// panel_gemm_part), a last one of 2-3 rows fetches its slice of all its tiles' panels (it fetched only the first
// panel's, leaving the rest of the block to the hardware: 1.04-1.12x at 8, 9 and 13-15 rows), one of
// a single row none (the others' slices widen: 1.10-1.17x at 7 rows).
static inline __attribute__((always_inline)) void head_rows(
    const int R, const int P, const float *x, int m0, int K, const float *wp, int p0, int p1, int V, float *y,
    head_best *best, int pe, int mi, int nm) {
    const float *xm = x + (size_t)m0 * K;
    float *ym = y == NULL ? NULL : y + (size_t)m0 * V;
    head_best *bm = best == NULL ? NULL : best + m0;
    const int l0 = nm > 0 ? (int)((long)K * mi / nm) : 0, l1 = nm > 0 ? (int)((long)K * (mi + 1) / nm) : 0;
    const int run = mi < nm && (R >= 4 || (R >= 2 && nm > 1)) ? l1 - l0 : 0;  // lines of each panel
    for (int p = p0; p < p1;) {
        const int w = p + P <= p1 ? P : 1, q = p1 + (p - p0), nq = pe - q < w ? pe - q : w;
        const char *pf = (const char *)(wp + ((size_t)q * K + l0) * 16);
        const int lines = nq > 0 ? nq * run : 0;
        if (w == P)
            head_tile(R, P, xm, K, wp, p, V, ym, bm, pf, lines, run, K);
        else
            head_tile(R, 1, xm, K, wp, p, V, ym, bm, pf, lines, run, K);
        p += w;
    }
}

// From blocked_rows() rows on (a prefill's linears, and a decode step's from batch 19, or 6: below),
// panel_gemm_part changes its loop order, where the unblocked one leans on L3 and memory: with threads split by
// panels (panel_gemm_plan), each thread would stream all the activations past every block of its panels, and a
// long k (K > 1024: the down projection's panel, K * 64 bytes, is 96 KiB) pushes the 6-row activation tile out of
// L1 too. kblock_part takes blocks of ROW_BLOCK rows (110 KiB of activations at K = 576: L2) past one panel's
// KBLOCK k values at a time (36 KiB). In this machine's fast minutes both orders run gate / up and down at its
// peak (~175 GFLOP/s at 2048 rows); when its shared caches and memory are busy, the blocked one holds up better:
// 1.13-1.37x at 512-2048 rows.
// A tile's accumulators start at zero (k0 == 0) or at the partial sums the previous k block left in y, and
// go back to y (the next tile's prefetched meanwhile): each output is still one FMA chain over k in
// ascending order (a float32 store and load in between change nothing), so the bits are those of the
// unblocked tiles. Where the blocked order starts was measured on two 2-core machines (`bench_kernels_ab --what
// linears|layers`, benchmarks/README.md and HISTORY.md): from 19 rows on a Zen 4 with AVX-512 (18 rows are three
// whole tiles of 6), from 6 on a Zen 3 without it; so the start goes by what tells them apart, avx512f.
#define COMPUTE_BOUND_ROWS 19  // with AVX-512 (the Zen 4s)
#define COMPUTE_BOUND_ROWS_AVX2 6  // without (the Zen 3s)
static int blocked_rows_state;  // 0: not yet chosen (panel_blocked_rows)

static int blocked_rows_default(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? COMPUTE_BOUND_ROWS : COMPUTE_BOUND_ROWS_AVX2;
}

static inline int blocked_rows(void) {
    if (blocked_rows_state == 0) blocked_rows_state = blocked_rows_default();
    return blocked_rows_state;
}

// The rows from which panel_gemm blocks k (see COMPUTE_BOUND_ROWS): `set` > 0 makes it that, 0 this CPU's own
// again, -1 only asks; returns the value before. For the tests (each order's bits on any CPU); not for calls in
// flight.
int panel_blocked_rows(int set) {
    const int before = blocked_rows();
    if (set >= 0) blocked_rows_state = set > 0 ? set : blocked_rows_default();
    return before;
}
#define KBLOCK 576
#define ROW_BLOCK 48  // a multiple of HEAD_ROWS

// rows x[0..R), y[0..R) (x starting at column k0), P panels from p0, k in [k0, k1). With `best` (argmax mode,
// one k block: k0 == 0, k1 == K) the sums are folded into rows best[0..R) instead of stored. pf_lines cache lines
// from pf are prefetched, evenly over the k loop.
static inline __attribute__((always_inline)) void kblock_tile(
    const int R, const int P, const float *x, int K, const float *wp, int p0, int k0, int k1, int V, float *y,
    head_best *best, const float *ynext, const char *pf, int pf_lines) {
    __m256 a[HEAD_ROWS * 2];
    float *yt = y == NULL ? NULL : y + (size_t)p0 * 16;
    if (ynext != NULL)  // the next tile's partial sums (6 rows of 16), while this one computes
        for (int r = 0; r < HEAD_ROWS; r++) _mm_prefetch((const char *)(ynext + (size_t)r * V), _MM_HINT_T0);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++)
            a[r * 2 * P + j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yt + (size_t)r * V + 8 * j);
    const float *w = wp + ((size_t)p0 * K + k0) * 16;
    if (pf_lines == 0) {  // (the loop without the prefetch's counter: 6-20% faster at 1024 rows)
        for (int k = 0; k < k1 - k0; k++) panel_k_step(R, P, x, K, w, k, a);
    } else {
        int acc = 0;
        for (int k = 0; k < k1 - k0; k++) {
            acc += pf_lines;
            if (acc >= k1 - k0) {
                acc -= k1 - k0;
                _mm_prefetch(pf, _MM_HINT_T0);
                pf += 64;
            }
            panel_k_step(R, P, x, K, w, k, a);
        }
    }
    if (best != NULL) {  // (unrolled, as every loop over `a`: an indexed one would keep `a` in memory)
#pragma GCC unroll 6
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int j = 0; j < 2 * P; j++) head_fold(a[r * 2 * P + j], p0 * 16 + j * 8, V, best + r);
        return;
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++) _mm256_storeu_ps(yt + (size_t)r * V + 8 * j, a[r * 2 * P + j]);
}

// the last R < HEAD_ROWS rows of a row block over panels [p0, p1), P panels a tile (single ones at the end)
static inline __attribute__((always_inline)) void kblock_tail(
    const int R, const int P, const float *x, int K, const float *wp, int p0, int p1, int k0, int k1, int V, float *y,
    head_best *best) {
    for (int p = p0; p < p1;) {
        if (p + P <= p1) {
            kblock_tile(R, P, x, K, wp, p, k0, k1, V, y, best, NULL, NULL, 0);
            p += P;
        } else {
            kblock_tile(R, 1, x, K, wp, p, k0, k1, V, y, best, NULL, NULL, 0);
            p++;
        }
    }
}

// rows [0, M) times panels [a, b) (the partial last panel, if among them, unblocked by head_tile); with `best` (argmax
// mode, K <= KBLOCK) into the rows' running maxima instead of y. In the first row block, each row tile of a panel also
// prefetches a share of the next panel's k block, so the panel's first tile finds it in cache instead of waiting on
// memory (later row blocks find the panels in L3; prefetching there too made 256-1024 rows 6-15% slower). When b < pe
// the last panel prefetches panel b's first k block in the last k block: the caller's next range starts there
// (shares_claim).
static __attribute__((noinline)) void kblock_part(const float *x, int M, int K, const float *wp, int V, float *y,
                                                  head_best *best, int a, int b, int pe) {
    const int whole = V / 16 < b ? V / 16 : b, pf_end = V / 16 < pe ? V / 16 : pe;
    for (int k0 = 0; k0 < K; k0 += KBLOCK) {
        const int k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
            for (int p0 = a; p0 < whole; p0 += 4) {  // groups of 4 panels: a tail of one row takes 4 at a time
                const int p1 = p0 + 4 < whole ? p0 + 4 : whole;
                const int m = m0 + (m1 - m0) / HEAD_ROWS * HEAD_ROWS;  // the tail's first row
                const int nr = (m - m0) / HEAD_ROWS;
                for (int p = p0; p < p1; p++) {
                    // whether this panel's tiles prefetch the next panel: its k block k0 within the range; past
                    // the range (where the caller's next one starts), its first k block, during the last one
                    const int pf = m0 == 0 && (p + 1 < whole || (p + 1 < pf_end && k1 == K));
                    const char *next = !pf ? NULL
                                       : (const char *)(wp + ((size_t)(p + 1) * K + (p + 1 < whole ? k0 : 0)) * 16);
                    for (int r = m0, i = 0; r < m; r += HEAD_ROWS, i++) {
                        const int l0 = (k1 - k0) * i / nr, l1 = (k1 - k0) * (i + 1) / nr;
                        kblock_tile(6, 1, x + (size_t)r * K + k0, K, wp, p, k0, k1, V,
                                    y == NULL ? NULL : y + (size_t)r * V, best == NULL ? NULL : best + r,
                                    y == NULL ? NULL
                                    : r + HEAD_ROWS < m ? y + (size_t)(r + HEAD_ROWS) * V + p * 16
                                                        : y + (size_t)m0 * V + (p + 1) * 16,
                                    pf ? next + (size_t)l0 * 64 : NULL, pf ? l1 - l0 : 0);
                    }
                }
                const float *xm = x + (size_t)m * K + k0;
                float *ym = y == NULL ? NULL : y + (size_t)m * V;
                head_best *bm = best == NULL ? NULL : best + m;
                switch (m1 - m) {
                    case 5: kblock_tail(5, 1, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 4: kblock_tail(4, 1, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 3: kblock_tail(3, 2, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 2: kblock_tail(2, 3, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 1: kblock_tail(1, 4, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                }
            }
        }
    }
    if (whole < b && whole >= a) {  // head_tile stores (or folds) only the columns < V
        int m = 0;
        for (; m + HEAD_ROWS <= M; m += HEAD_ROWS)
            head_tile(6, 1, x + (size_t)m * K, K, wp, whole, V, y == NULL ? NULL : y + (size_t)m * V,
                      best == NULL ? NULL : best + m, NULL, 0, 0, 0);
        for (; m < M; m++)
            head_tile(1, 1, x + (size_t)m * K, K, wp, whole, V, y == NULL ? NULL : y + (size_t)m * V,
                      best == NULL ? NULL : best + m, NULL, 0, 0, 0);
    }
}

// w [V, K] float32, rows `ld` floats apart -> out [ceil(V / 16), K, 16], panel_gemm's layout (row v at
// [v / 16, :, v % 16]; zero rows pad the last panel): how both backends pack their weights at load. A panel's
// 16 rows are read in blocks of 64 k (4 KiB of output, in L1), ~10x a strided tensor copy's speed.
int pack_panels_f32(const float *w, int V, int K, long ld, float *out) {
    if (V <= 0 || K <= 0 || ld < K) return -1;
    for (int p = 0; p < (V + 15) / 16; p++) {
        float *o = out + (size_t)p * K * 16;
        const int rows = V - p * 16 < 16 ? V - p * 16 : 16;
        for (int k0 = 0; k0 < K; k0 += 64) {
            const int k1 = k0 + 64 < K ? k0 + 64 : K;
            for (int j = 0; j < 16; j++) {
                const float *src = w + (size_t)(p * 16 + j) * ld;
                for (int k = k0; k < k1; k++) o[(size_t)k * 16 + j] = j < rows ? src[k] : 0.f;
            }
        }
    }
    return 0;
}

// How panel_gemm splits its work between threads: parts of 4 panels, or, from blocked_rows() rows on
// (kblock_part: each share streams all the rows past its panels), parts of one panel, so the threads' shares are
// even (a prefill's q/k/v linear, 60 panels, is 8 / 7 chunks of 4 between 2 threads, 30 / 30 panels). Tiles of
// rows split between the threads, the other way to balance, ran the narrow linears (K = 576: q/k/v, o)
// 0.72-0.96x as fast as even panel shares at 256-2048 rows (benchmarks/README.md).
// The single panels are claimed (shares_claim, at least *claim of them a claim: kblock_part's tail rows' tiles
// cover up to 4 panels); parts of 4 panels are split once (*claim = 0: head_rows prefetches within its range, and
// claims there ran 0.96x).
// Returns the number of parts, sets *unit (panels a part) and *nt (the threads worth waking, <= nthreads, <= the
// parts). jaxengine's custom call splits the same parts between XLA's threads.
int panel_gemm_plan(int M, int K, int V, int nthreads, int *unit, int *nt, int *claim) {
    const int NP = (V + 15) / 16;
    *unit = M >= blocked_rows() ? 1 : 4;
    *claim = *unit == 1 ? 4 : 0;
    const int parts = (NP + *unit - 1) / *unit;
    *nt = gemm_threads(M, K, V, nthreads, parts);
    return parts;
}

// Parts [lo, hi) of panel_gemm_plan's split (`unit` panels each): panels in blocks of 256 KiB (L2) times
// activation blocks of 16 KiB (L1), or blocked in k too (kblock_part, above), whose last panel prefetches the
// first of part hi when hi < pf_hi (the caller's next parts; pf_hi = hi: none). `best` (argmax mode) is the
// caller's M running maxima, or NULL.
void panel_gemm_part(const float *x, int M, int K, const float *wp, int V, float *y, head_best *best, int unit,
                     int lo, int hi, int pf_hi) {
    const int NP = (V + 15) / 16, a = lo * unit, b = hi * unit < NP ? hi * unit : NP;
    if (M >= blocked_rows() && (best == NULL || K <= KBLOCK)) {  // see COMPUTE_BOUND_ROWS
        kblock_part(x, M, K, wp, V, y, best, a, b, pf_hi * unit);
        return;
    }
    int NB = (int)(4096 / K), MB = (int)(4096 / K) / HEAD_ROWS * HEAD_ROWS;
    if (NB < 4) NB = 4;
    if (MB < HEAD_ROWS) MB = HEAD_ROWS;
    for (int p0 = a; p0 < b; p0 += NB) {
        const int p1 = p0 + NB < b ? p0 + NB : b;
        // the row blocks that prefetch (head_rows): all but a last one of a single row, or a lone one of 1-3 rows
        const int pe = p1 + NB < b ? p1 + NB : b, nm = M / MB + (M % MB >= (M < MB ? 4 : 2));
        for (int m0 = 0, mi = 0; m0 < M; m0 += MB, mi++) {
            const int m1 = m0 + MB < M ? m0 + MB : M;
            int m = m0;
            for (; m + HEAD_ROWS <= m1; m += HEAD_ROWS) head_rows(6, 1, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm);
            switch (m1 - m) {
                case 5: head_rows(5, 1, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 4: head_rows(4, 1, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 3: head_rows(3, 2, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 2: head_rows(2, 3, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 1: head_rows(1, 4, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
            }
        }
    }
}

// The argmax mode's running maxima, for callers that split panel_gemm_part's parts themselves (the jax
// backend's custom call): `head_best_bytes` each, `head_best_init` before the parts fold into them, and
// `head_best_argmax` to merge a row's n sets (`stride_bytes` apart: one a thread, or a slice of parts) into its
// token.
int head_best_bytes(void) { return (int)sizeof(head_best); }

void head_best_init(head_best *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        for (int j = 0; j < 8; j++) {
            b[i].v[j] = -INFINITY;
            b[i].i[j] = 0;
        }
        b[i].nan = INT32_MAX;
    }
}

// the first index of the maximum over the sets' lanes, NaN first: the same whatever order the sets come in
int32_t head_best_argmax(const head_best *b, int n, size_t stride_bytes) {
    float bv = -INFINITY;
    int32_t bi = 0, nan = INT32_MAX;
    for (int t = 0; t < n; t++) {
        const head_best *h = (const head_best *)((const char *)b + stride_bytes * t);
        if (h->nan < nan) nan = h->nan;
        for (int j = 0; j < 8; j++)
            if (h->v[j] > bv || (h->v[j] == bv && h->i[j] < bi)) {
                bv = h->v[j];
                bi = h->i[j];
            }
    }
    return nan != INT32_MAX ? nan : bi;
}

// Parts [0, n) of a phase shared out between nt threads, whatever their speed: thread t starts on its share
// [n t / nt, n (t + 1) / nt) and takes it from the front, half of what is left at a time (at least `min` parts),
// so its claims follow each other (kblock_part's prefetch runs on into the next) and what it has not claimed yet
// stays free; with its share empty, it takes half of what is left of the fullest other share, from the back. A
// thread slowed down (by a busy core, or a helper that starts late or not at all) has its unclaimed parts taken,
// and the threads end a phase within about one claim of each other. With a static split the first one to finish
// waited for the other: 4-11% of a decode step's linears on this 2-core VM (docs/design-notes.md).
// A share is one 64-bit word, lo | hi << 32, changed by compare-and-swap only: its owner moves lo, others hi
// (lo only grows and hi only shrinks, so a word never comes back to an earlier value). A claim publishes no
// data (the phase's end does: OpenMP's barrier, the team's `done`), so the atomics are relaxed.
static inline uint64_t share_word(int lo, int hi) { return (uint64_t)(uint32_t)lo | (uint64_t)(uint32_t)hi << 32; }
static inline int share_lo(uint64_t w) { return (int)(uint32_t)w; }
static inline int share_hi(uint64_t w) { return (int)(uint32_t)(w >> 32); }

void shares_init(uint64_t *s, int n, int nt) {
    if (n < 0) n = 0;
    for (int t = 0; t < nt; t++)
        __atomic_store_n(s + t, share_word((int)((long)n * t / nt), (int)((long)n * (t + 1) / nt)), __ATOMIC_RELAXED);
}

// Thread t's next parts [*a, *b), or 0 when all are claimed (t outside [0, nt): only from others' shares); *pe
// bounds panel_gemm_part's prefetch past *b: the end of t's share, where its next claim continues, or *b for
// parts taken from another.
int shares_claim(uint64_t *s, int nt, int t, int min, int *a, int *b, int *pe) {
    if (min < 1) min = 1;
    if (t >= 0 && t < nt) {
        uint64_t w = __atomic_load_n(s + t, __ATOMIC_RELAXED);
        for (;;) {
            const int lo = share_lo(w), hi = share_hi(w), left = hi - lo;
            if (left <= 0) break;
            int c = (left + 1) / 2 > min ? (left + 1) / 2 : min;
            if (c > left) c = left;
            if (__atomic_compare_exchange_n(s + t, &w, share_word(lo + c, hi), 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *a = lo, *b = lo + c, *pe = hi;
                return 1;
            }
        }
    }
    for (;;) {
        int v = -1, most = 0;
        uint64_t w = 0;
        for (int u = 0; u < nt; u++) {
            const uint64_t x = __atomic_load_n(s + u, __ATOMIC_RELAXED);
            const int left = share_hi(x) - share_lo(x);
            if (left > most) v = u, most = left, w = x;
        }
        if (v < 0) return 0;
        const int lo = share_lo(w), hi = share_hi(w);
        int c = most / 2 > min ? most / 2 : min;
        if (c > most) c = most;
        if (__atomic_compare_exchange_n(s + v, &w, share_word(lo, hi - c), 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *a = hi - c, *b = hi, *pe = hi;
            return 1;
        }
    }
}

// For the tests only: every part of [0, n) claimed from nt (<= 64) shares by nthreads OpenMP threads at once
// (thread t as share t's owner; those past nt only take), claims back to back: counts[i] += 1 each time part i
// is handed out (shares_claim under contention; anything but all ones is a bug).
int shares_count(int n, int nt, int min, int nthreads, int32_t *counts) {
    if (n < 0 || nt < 1 || nt > 64 || nthreads < 1) return -1;
    uint64_t sh[nt];
    shares_init(sh, n, nt);
#pragma omp parallel num_threads(nthreads)
    {
        int a, b, pe;
        while (shares_claim(sh, nt, omp_get_thread_num(), min, &a, &b, &pe))
            for (int i = a; i < b; i++) __atomic_fetch_add(counts + i, 1, __ATOMIC_RELAXED);
    }
    return 0;
}


int panel_gemm(const float *x, int M, int K, const float *wp, int V, float *y, int64_t *argmax, int nthreads) {
    if (M < 1 || K <= 0 || V <= 0 || (y == NULL) == (argmax == NULL)) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    int unit, nt, claim;
    const int parts = panel_gemm_plan(M, K, V, nthreads, &unit, &nt, &claim);
    head_best *best = argmax == NULL ? NULL : maxima_new(M, nt);
    if (argmax != NULL && best == NULL) return -2;
    uint64_t sh[nt];
    if (claim) shares_init(sh, parts, nt);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        head_best *own = best == NULL ? NULL : best + (size_t)M * t;  // this thread's running maxima
        if (!claim) {
            const int lo = (int)((long)parts * t / T), hi = (int)((long)parts * (t + 1) / T);
            panel_gemm_part(x, M, K, wp, V, y, own, unit, lo, hi, hi);
        } else {
            int a, b, pe;
            while (shares_claim(sh, nt, t, claim, &a, &b, &pe)) panel_gemm_part(x, M, K, wp, V, y, own, unit, a, b, pe);
        }
    }
    if (argmax != NULL) maxima_merge(best, M, nt, argmax);
    return 0;
}
