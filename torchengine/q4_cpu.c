// 4-bit GGUF linears on an x86 CPU with AVX2: y[M, N] = x[M, K] . w[N, K]^T, w in Q4 blocks.
//
// Built and loaded by torchengine/q4_cpu.py (gcc -O3 -mavx2 -mfma -mf16c -fopenmp); the OpenMP runtime is
// the one torch already loaded (same soname), so the threads are torch's.
//
// A block is 32 weights of one output row: w[j] = q[j] * d + m with q in 0..15, stored as llama.cpp's
// Q4_1 is: {f16 d, f16 m, 16 bytes}, byte j holding q[j] (low nibble) and q[j + 16] (high nibble).
// Blocks are row-major: row n's K / 32 blocks are contiguous.
//
// The activations are quantized like llama.cpp's Q8 activations: per row and block of 32,
// xq[j] = rint(x[j] / dx) in -127..127 with dx = max|x| / 127. A block's dot product is then one integer
// multiply-add chain (vpmaddubsw + vpmaddwd: 32 weights in a few instructions), scaled once:
//     sum_j w[j] x[j] ~= d * dx * sum_j q[j] xq[j]  +  m * sum_j x[j]
// (the sum of x is exact, in float32). That is 3-4x fewer instructions than converting every weight to
// float, which is what bounds torch's own int4 CPU kernel at one or a few rows.

#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define MAX_ROWS 32

typedef struct {
    uint16_t d;  // float16
    uint16_t m;  // float16
    uint8_t qs[QK / 2];
} block_q4;

_Static_assert(sizeof(block_q4) == 20, "block layout");

int q4_block_bytes(void) { return (int)sizeof(block_q4); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// x [M, K] float32 -> xq [M, K / 32, 32] int8, dx and xs [M, K / 32] (scale and exact sum of each block)
static void quantize_rows(const float *x, int M, int K, int8_t *xq, float *dx, float *xs) {
    const int G = K / QK;
    for (int i = 0; i < M * G; i++) {
        const float *p = x + (size_t)i * QK;  // rows are contiguous, K a multiple of 32: block i of all rows
        float amax = 0.f, sum = 0.f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(p[j]);
            amax = a > amax ? a : amax;
            sum += p[j];
        }
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QK; j++) xq[(size_t)i * QK + j] = (int8_t)nearbyintf(p[j] * id);
        dx[i] = d;
        xs[i] = sum;
    }
}

// 32 unsigned 4-bit weights of a block, in the order of the activations (low nibbles 0..15, high 16..31)
static inline __m256i unpack(const block_q4 *b) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)b->qs);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
}

// sum_j q[j] * a[j] as 8 int32 lanes -> float: unsigned q (<= 15) times signed a (|.| <= 127), so the
// pair sums of vpmaddubsw fit int16 (<= 3810)
static inline __m256 dot_block(__m256i q, const int8_t *a) {
    const __m256i s16 = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)a));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
}

// Output rows [n0, n1) for R activation rows starting at r0. R is a compile-time constant at every call,
// so the accumulators stay in registers; one row goes two blocks at a time on two chains (an FMA's latency,
// not its throughput, bounds a single chain).
static inline __attribute__((always_inline)) void rows_pass(
    const int R, int r0, int G, int N, const block_q4 *w, const int8_t *xq, const float *dx, const float *xs,
    float *y, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        const block_q4 *b = w + (size_t)n * G;
        __m256 acc[4], acc2 = _mm256_setzero_ps();
        float off[4] = {0.f, 0.f, 0.f, 0.f}, off2 = 0.f;
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        int g = 0;
        if (R == 1) {
            const int8_t *a = xq + (size_t)r0 * G * QK;
            const float *d1 = dx + (size_t)r0 * G, *s1 = xs + (size_t)r0 * G;
            for (; g + 1 < G; g += 2) {
                const __m256 p0 = dot_block(unpack(b + g), a + (size_t)g * QK);
                const __m256 p1 = dot_block(unpack(b + g + 1), a + (size_t)(g + 1) * QK);
                acc[0] = _mm256_fmadd_ps(p0, _mm256_set1_ps(_cvtsh_ss(b[g].d) * d1[g]), acc[0]);
                acc2 = _mm256_fmadd_ps(p1, _mm256_set1_ps(_cvtsh_ss(b[g + 1].d) * d1[g + 1]), acc2);
                off[0] += _cvtsh_ss(b[g].m) * s1[g];
                off2 += _cvtsh_ss(b[g + 1].m) * s1[g + 1];
            }
        }
        for (; g < G; g++) {
            const __m256i q = unpack(b + g);
            const float d = _cvtsh_ss(b[g].d), m = _cvtsh_ss(b[g].m);
            for (int r = 0; r < R; r++) {
                const size_t i = (size_t)(r0 + r) * G + g;
                acc[r] = _mm256_fmadd_ps(dot_block(q, xq + i * QK), _mm256_set1_ps(d * dx[i]), acc[r]);
                off[r] += m * xs[i];
            }
        }
        if (R == 1) acc[0] = _mm256_add_ps(acc[0], acc2), off[0] += off2;
        for (int r = 0; r < R; r++) y[(size_t)(r0 + r) * N + n] = hsum8(acc[r]) + off[r];
    }
}

// y [M, N] = x [M, K] . W^T; w: N * K / 32 blocks; M <= MAX_ROWS; nthreads <= 0: OpenMP's default
int q4_gemm(const float *x, int M, int K, const block_q4 *w, int N, float *y, int nthreads) {
    if (M < 1 || M > MAX_ROWS || K % QK != 0 || K <= 0 || N <= 0) return -1;
    const int G = K / QK;
    int8_t *xq = (int8_t *)aligned_alloc(32, ((size_t)M * K + 31) / 32 * 32);
    float *dx = (float *)malloc(sizeof(float) * (size_t)M * G);
    float *xs = (float *)malloc(sizeof(float) * (size_t)M * G);
    if (!xq || !dx || !xs) {
        free(xq), free(dx), free(xs);
        return -2;
    }
    quantize_rows(x, M, K, xq, dx, xs);
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    // each thread a contiguous share of the output rows (in whole 16-row chunks), all activation rows
    const int chunks = (N + 15) / 16;
    const int nt = N >= 64 ? (nthreads < chunks ? nthreads : chunks) : 1;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int n0 = (int)((long)chunks * t / T) * 16, n1e = (int)((long)chunks * (t + 1) / T) * 16;
        const int n1 = n1e < N ? n1e : N;
        int r = 0;
        for (; r + 4 <= M; r += 4) rows_pass(4, r, G, N, w, xq, dx, xs, y, n0, n1);
        if (M - r == 3) rows_pass(3, r, G, N, w, xq, dx, xs, y, n0, n1);
        else if (M - r == 2) rows_pass(2, r, G, N, w, xq, dx, xs, y, n0, n1);
        else if (M - r == 1) rows_pass(1, r, G, N, w, xq, dx, xs, y, n0, n1);
    }
    free(xq), free(dx), free(xs);
    return 0;
}
