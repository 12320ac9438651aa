#include "cpu_kernels.h"
#include "simd.h"

// ---- the samplers' rows (both backends on a CPU) ----------------------------------------------------------
//
// log_softmax, softmax and the inverse-CDF draw of `enginecore.sampling_ref`, one row on one thread in a fixed
// order: a row's result depends neither on the other rows nor on the thread count, and the jax backend's
// custom calls run this same code, so on a CPU both backends give the same logprobs and the same seeded draws,
// bit for bit (their own exp / sum orders differed by an ulp or so, which could move a draw at a boundary).

// exp8 with sampling_ref's infinities: e^-inf = 0 (a masked token has probability 0, not exp8's tiny
// normal) and e^+inf = +inf
static inline __m256 exp8_inf(__m256 x) {
    const __m256 inf = _mm256_set1_ps(INFINITY);
    const __m256 e = _mm256_blendv_ps(exp8(x), _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), inf), _CMP_EQ_OQ));
    return _mm256_blendv_ps(e, inf, _mm256_cmp_ps(x, inf, _CMP_EQ_OQ));
}

// 8 floats from x[j..j+n) (n < 8), the rest `fill`
static inline __m256 load_tail(const float *x, int n, float fill) {
    float buf[8];
    for (int i = 0; i < 8; i++) buf[i] = i < n ? x[i] : fill;
    return _mm256_loadu_ps(buf);
}

static inline void store_tail(float *x, int n, __m256 v) {
    float buf[8];
    _mm256_storeu_ps(buf, v);
    memcpy(x, buf, sizeof(float) * n);
}

// One row: out = x - m - log(sum(e^(x - m))) (m the row's maximum, 0 when that is not finite), or, with
// probs, e^ of that (sampling_ref.softmax). The sum: four 8-lane accumulators over blocks of 32 columns, the
// tail as a padded vector, then a fixed tree. NaN anywhere makes the row NaN, as in the reference.
static void log_softmax_row(const float *x, int V, float *out, int probs) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= V; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + j));
    if (j < V) mx = _mm256_max_ps(mx, load_tail(x + j, V - j, -INFINITY));
    float m = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    if (!isfinite(m)) m = 0.f;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    j = 0;
    for (; j + 32 <= V; j += 32) {
        a0 = _mm256_add_ps(a0, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
        a1 = _mm256_add_ps(a1, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vm)));
        a2 = _mm256_add_ps(a2, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j + 16), vm)));
        a3 = _mm256_add_ps(a3, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j + 24), vm)));
    }
    for (; j + 8 <= V; j += 8) a0 = _mm256_add_ps(a0, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
    if (j < V) a1 = _mm256_add_ps(a1, exp8_inf(_mm256_sub_ps(load_tail(x + j, V - j, -INFINITY), vm)));
    const float lse = logf(hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))));
    const __m256 vl = _mm256_set1_ps(lse);
    j = 0;
    for (; j + 8 <= V; j += 8) {
        __m256 v = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vl);
        _mm256_storeu_ps(out + j, probs ? exp8_inf(v) : v);
    }
    if (j < V) {
        __m256 v = _mm256_sub_ps(_mm256_sub_ps(load_tail(x + j, V - j, 0.f), vm), vl);
        store_tail(out + j, V - j, probs ? exp8_inf(v) : v);
    }
}

// out [M, V] = log_softmax (probs = 0) or softmax (probs = 1) of each row of x [M, V] (rows x_stride floats
// apart; out contiguous)
int log_softmax_rows(const float *x, int M, int V, long x_stride, float *out, int probs) {
    if (M < 0 || V <= 0 || x_stride < V) return -1;
#pragma omp parallel for if ((long)M * V >= 65536) schedule(static)
    for (int i = 0; i < M; i++) log_softmax_row(x + (size_t)i * x_stride, V, out + (size_t)i * V, probs);
    return 0;
}

// The n largest of each row of x [M, V] (rows x_stride floats apart), in descending order, ties by lower
// index first (a stable descending sort's first n; lax.top_k's order): one pass keeping a sorted list of n.
int top_n_rows(const float *x, int M, int V, long x_stride, int n, int64_t *ids, float *vals) {
    if (M < 0 || V <= 0 || x_stride < V || n < 0 || n > V) return -1;
    if (n == 0) return 0;
#pragma omp parallel for if ((long)M * V >= 65536) schedule(static)
    for (int i = 0; i < M; i++) {
        const float *r = x + (size_t)i * x_stride;
        float *v = vals + (size_t)i * n;
        int64_t *d = ids + (size_t)i * n;
        int c = 0;
        for (int j = 0; j < V; j++) {
            const float y = r[j];
            if (c == n && !(y > v[n - 1])) continue;  // the common case: not among the n largest
            int at = c < n ? c : n - 1;  // the slot it takes before shifting: after every value >= it
            while (at > 0 && v[at - 1] < y) {
                v[at] = v[at - 1];
                d[at] = d[at - 1];
                at--;
            }
            v[at] = y;
            d[at] = j;
            if (c < n) c++;
        }
    }
    return 0;
}

#define CDF_BLOCK 256

// p[a, b) summed in double: four 4-lane accumulators, then a fixed tree (b - a a multiple of 16 but the tail)
static inline double block_sum(const float *p, int a, int b) {
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
    int j = a;
    for (; j + 16 <= b; j += 16) {
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm_loadu_ps(p + j)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm_loadu_ps(p + j + 4)));
        s2 = _mm256_add_pd(s2, _mm256_cvtps_pd(_mm_loadu_ps(p + j + 8)));
        s3 = _mm256_add_pd(s3, _mm256_cvtps_pd(_mm_loadu_ps(p + j + 12)));
    }
    double l[4];
    _mm256_storeu_pd(l, _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
    double s = (l[0] + l[1]) + (l[2] + l[3]);
    for (; j < b; j++) s += p[j];
    return s;
}

// One row's draw (sampling_ref.inverse_cdf): the first token whose cumulative probability exceeds u * total,
// in double. The cumulative sum is taken over blocks of CDF_BLOCK tokens (each block's sum by block_sum), then
// token by token inside the block that crosses; if rounding lets that block's running sum fall short, or no
// block crosses, the last token with a nonzero probability up to there (V - 1 if none) is drawn, never a
// token of probability 0.
static int64_t inverse_cdf_row(const float *p, int V, float u) {
    const int nb = (V + CDF_BLOCK - 1) / CDF_BLOCK;
    double sums[nb];  // each block's sum, taken once
    double total = 0.0;
    for (int b = 0; b < nb; b++) {
        const int a = b * CDF_BLOCK;
        total += sums[b] = block_sum(p, a, a + CDF_BLOCK < V ? a + CDF_BLOCK : V);
    }
    const double target = (double)u * total;
    double cum = 0.0;
    int end = V;  // the fallback searches below it
    for (int b = 0; b < nb; b++) {
        if (cum + sums[b] > target) {
            const int a = b * CDF_BLOCK, e = a + CDF_BLOCK < V ? a + CDF_BLOCK : V;
            double r = cum;
            for (int j = a; j < e; j++)
                if ((r += p[j]) > target && p[j] > 0.f) return j;
            end = e;
            break;
        }
        cum += sums[b];
    }
    for (int j = end - 1; j >= 0; j--)
        if (p[j] > 0.f) return j;
    return V - 1;
}

// out[i] = the token drawn from row i of probs [M, V] (rows p_stride floats apart) with uniform u[i] in [0, 1)
int inverse_cdf_rows(const float *probs, int M, int V, long p_stride, const float *u, int64_t *out) {
    if (M < 0 || V <= 0 || p_stride < V) return -1;
#pragma omp parallel for if ((long)M * V >= 65536) schedule(static)
    for (int i = 0; i < M; i++) out[i] = inverse_cdf_row(probs + (size_t)i * p_stride, V, u[i]);
    return 0;
}

static int desc_floats(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

// One row's top-p cut (sampling_ref.filter_logits): the probabilities sorted in descending order, their running
// sum in double, the first position where it reaches top_p (the last if none does); the token's probability
// there is the threshold (keep p >= it). Only the head of the order is sorted: the tokens with p >= t, for t a
// bucket edge of a histogram of the probabilities' float bits (exponent and 3 mantissa bits) where the
// buckets' mass reaches top_p (lowered a bucket at a time if the sorted sum falls short by rounding). Below t
// every token is smaller than all those above, so their sorted running sum is the full order's first terms,
// whatever t. `buf` holds V floats.
#define TOP_P_BUCKET_SHIFT 20
static float top_p_threshold_row(const float *p, int V, float top_p, float *buf) {
    double mass[1 << (31 - TOP_P_BUCKET_SHIFT)] = {0};
    int hi = -1;
    for (int j = 0; j < V; j++) {
        if (!(p[j] > 0.f)) continue;  // 0 and NaN
        uint32_t bits;
        memcpy(&bits, &p[j], 4);
        const int k = (int)(bits >> TOP_P_BUCKET_SHIFT);  // p > 0: sign bit clear
        mass[k] += p[j];
        hi = k > hi ? k : hi;
    }
    if (hi < 0) return 0.f;
    double acc = 0.0;
    int k = hi;
    for (; k > 0 && (acc += mass[k]) < top_p; k--) {}
    for (;; k--) {
        uint32_t edge = (uint32_t)(k > 0 ? k : 0) << TOP_P_BUCKET_SHIFT;
        float t;
        memcpy(&t, &edge, 4);
        int n = 0;
        for (int j = 0; j < V; j++)
            if (p[j] >= t && p[j] > 0.f) buf[n++] = p[j];
        qsort(buf, n, sizeof(float), desc_floats);
        double cum = 0.0;
        for (int i = 0; i < n; i++)
            if ((cum += buf[i]) >= top_p) return buf[i];
        if (k <= 0) return n < V ? 0.f : buf[n - 1];  // never reached: the last of the order, 0 if any is 0
    }
}

// out[i] = row i's top-p threshold (probs [M, V], rows p_stride floats apart); 0 (keep all) where top_p[i] >= 1
int top_p_thresholds(const float *probs, int M, int V, long p_stride, const float *top_p, float *out) {
    if (M < 0 || V <= 0 || p_stride < V) return -1;
    int rc = 0;
#pragma omp parallel if ((long)M * V >= 65536)
    {
        float *buf = malloc(sizeof(float) * V);
        if (!buf) {
#pragma omp atomic write
            rc = -2;
        }
#pragma omp for schedule(static)
        for (int i = 0; i < M; i++)
            out[i] = buf && top_p[i] < 1.f ? top_p_threshold_row(probs + (size_t)i * p_stride, V, top_p[i], buf) : 0.f;
        free(buf);
    }
    return rc;
}
