// The CPU kernels' C interface: every function the ctypes bindings (cpu_kernels/torch_ops.py) and the XLA FFI
// shim (xla_ffi.cc) call, and the types they share. One declaration each, so a caller and its definition
// cannot drift apart unseen (the C sources include this header too).
//
// x86-64 with AVX2, FMA and F16C; the AVX-512 paths are built by target attributes and chosen at run time.
// Topics: gguf_linear.c (Q4 / Q8 blocks), glue.c (norm, RoPE, SiLU, KV writes), attention.c (paged decode and
// prefill attention), sampler.c (the samplers' rows), panels.c (float32 panels, the greedy head), qx.c (weights
// as stored: GGUF blocks, 16-bit halves, bfloat16 products), layers.c (every decoder layer of a step).
#ifndef XLASERVE_CPU_KERNELS_H
#define XLASERVE_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MAX_ROWS 32  // the 4- and 8-bit GGUF kernels' row limit (q4_gemm, q8_gemm)

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

// Panels of 16 output rows as panel_gemm's, each K / 32 groups: the 16 rows' d (float16), for Q4_1 their m
// (float16; zeros for Q4_0), then per k the 16 rows' q: Q4 in 8 bytes, byte j holding row j's q in its low
// nibble and row j + 8's in its high one; Q8 in 16 bytes (cpu_kernels.torch_ops.pack_q4x / pack_q8x).
// QX_BF16: a float32 weight that is bfloat16-exact (a bfloat16 checkpoint served in float32: its low 16 bits are
// zero) as its high halves, per k the 16 rows' in 32 bytes, no scales (cpu_kernels.layout.bf16_panels): rebuilt by a
// shift, exactly, half the bytes.
// QX_Q4_K: Q4_1's form with float32 d and m, for a GGUF file's Q4_K: per group of 32 its weights are
// (d * sc) * q - dmin * mn (the gguf package's dequantization, which the loader runs), d * sc (11 significant bits
// times 6) and dmin * mn exact in float32, so a group's d = d * sc and m = -(dmin * mn) rebuild it as Q4_1's
// (d * q) + m, one rounding, the same bits; they take 17 bits, more than a float16's 11. 0.75 bytes a weight.
#define QX_Q4_0 0
#define QX_Q4_1 1
#define QX_Q8_0 2
#define QX_BF16 3
#define QX_Q4_K 4
// QX_I8: any of them (and a GGUF file's Q5_K, Q6_K, Q3_K, Q2_K and Q5_1, whose groups are 16 wide or whose q has
// five bits) in one form, for a linear whose fused parts or layers are stored in several types (QX_IQ4's too,
// their values as int8): per group of 32 k and row, a float32 scale and offset for
// k 0-15 and another pair for k 16-31, then per k the 16 rows' q as int8; w = (q * d) + m, one rounding of an
// exact product (m -0.0 for the forms without one: x + -0.0 is x, a zero's sign kept). 1.5 bytes a weight.
#define QX_I8 5
// QX_F16: QX_BF16's layout for a float16-exact weight (a float16 checkpoint, or a GGUF file's F16 tensor, served in
// float32) as float16s: rebuilt by the exact conversion.
#define QX_F16 6
// QX_IQ4: a GGUF file's IQ4_NL (d * value, d a float16) and IQ4_XS ((d * (sc - 32)) * value, sc six bits a
// sub-block of 32), value one of 16 int8s a nibble indexes: per group of 32 k the 16 rows' float32 scales, then
// Q4's nibbles; w = value * scale, an exact product (at most 11 + 6 + 7 = 24 significant bits), the gguf
// package's. 0.625 bytes a weight.
#define QX_IQ4 7
// QX_BDOT: not a form of the float32 weights but bfloat16 arithmetic (--dtype bfloat16 on a CPU with
// AVX512-BF16): the weights rounded to bfloat16, per pair of k the 16 rows' two values (k even in the low half),
// 1024 bytes a group of 32 k, multiplied by the activations rounded to bfloat16 (bdot_panels below), for every
// row count. 2 bytes a weight, and twice float32's multiply-adds a cycle.
#define QX_BDOT 8


// A row's running maxima over the greedy head's columns (panel_gemm's argmax, qx_gemm's): lane j holds the
// largest value of its columns and the lowest such column.
typedef struct {
    float v[8];
    int32_t i[8];
    int32_t nan;  // first NaN column seen, INT32_MAX if none
} head_best;

typedef struct {  // *_w: panel_gemm's panels
    const float *attn_norm, *qkv_w, *qkv_b, *o_w, *mlp_norm, *gate_up_w, *down_w;
    void *key_cache, *value_cache;  // of decode_layers' kv_type
    // --quantization gguf: a linear's 4-bit blocks (NULL: none) for steps of at most *_rows tokens (<= MAX_ROWS),
    // as torchengine.quant.Int4Linear chooses between them and the float32 weight
    const void *qkv_q4, *o_q4, *gate_up_q4, *down_q4;
    int qkv_rows, o_rows, gate_up_rows, down_rows;
    // the float32 weights as stored (a GGUF file's 4-bit blocks, a bfloat16 checkpoint's halves: qx_gemm's
    // panels, NULL: none), the same bits as them, for steps of at most qx_rows tokens; *_qx_kind: their QX_*
    const void *qkv_qx, *o_qx, *gate_up_qx, *down_qx;
    int qx_rows, qkv_qx_kind, o_qx_kind, gate_up_qx_kind, down_qx_kind;
    const float *q_norm, *k_norm;  // [D] each: RMSNorm of each head's q and k before RoPE (Qwen3); NULL: none
} decode_layer;

// run_layers' threads: fn(arg, a, b, pe) over the parts [0, n) of a phase, returning when every part is done
// (pe: where the thread's next part likely starts, for panel_gemm_part's prefetch; b where unknown)
typedef void (*layers_task)(void *arg, long a, long b, long pe);
typedef struct {
    void *ctx;
    int threads;  // the threads a phase may run on, the caller's included
    // slices of `per` parts, taken one at a time by the caller and up to threads - 1 others (pe = b)
    void (*run)(void *ctx, long n, long per, layers_task fn, void *arg);
    // the parts shares_claim hands out from `shares` shares (share 0 the caller's), at least `min` a claim
    void (*run_shared)(void *ctx, long n, int shares, int min, layers_task fn, void *arg);
} layers_team;

// One step of run_layers: T tokens, each one request's decode row or one of a prefill request's rows.
typedef struct {
    int T;
    const float *x;           // [T, H] the embeddings
    const float *cos, *sin;   // [T, D] each token's RoPE tables (rope's form)
    const int64_t *slots;     // [T] each token's row in a layer's cache (< 0: not written)
    long kv_row, kv_head;     // a cache row's and a kv head's stride, in elements, of K and V alike
    int n_dec;                // decode rows: their token rows, kv_lens [n_dec], tables [n_dec, dec_stride]
    const int64_t *dec_tokens;
    const int32_t *dec_kv_lens, *dec_tables;
    int dec_stride;
    int n_pre;                // prefill requests: first token, tokens, kv_lens [n_pre], tables [n_pre, pre_stride]
    const int32_t *pre_start, *pre_lens, *pre_kv_lens, *pre_tables;
    int pre_stride;
    // the rows wanted from the last layer (NULL: all T; else S of them, distinct, which alone run its o linear
    // and MLP): out [S, H] in keep's order, or (keep_in_place) out [T, H] with row keep[i] the i-th and the others
    // the residual stream before the last layer's attention
    const int64_t *keep;
    int S, keep_in_place;
    int block_size, H, Hq, Hkv, D, I;
    float eps, scale;
    int window, kv_type;
} layers_step;

// gguf_linear.c
int q4_block_bytes(void);
int q8_block_bytes(void);
int max_rows(void);
int q4_gemm(const float *x, int M, int K, const void *w, int N, float *y, int nthreads);
int q8_gemm(const float *x, int M, int K, const void *w, int N, float *y, int nthreads);

// glue.c
int rms_norm(const float *x, int M, int K, long x_stride, float *residual, const float *w, float eps, float *out);
int rope(float *x, int T, int H, int D, long x_stride, const float *cos, const float *sin);
int kv_write(const float *k, const float *v, long k_stride, long v_stride, int T, const int64_t *slots, void *kcache,
    void *vcache, int W, int kv_type);
int silu_mul(const float *gu, int M, int I, float *out);

// attention.c
int decode_heads_per_task(int n, int Hq, int Hkv, int nthreads);
int decode_split(int n, int Hkv, int nthreads);
long decode_split_tasks(int phase, int n, const int32_t *kv_lens, int window, int Hq, int Hkv, int D, long *bytes);
int decode_split_phase(int phase, const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens, const
    int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache, long kv_row, long kv_head, int
    block_size, int Hq, int Hkv, int D, float scale, int window, void *buf, float *out, int n, int t0, int t1, int
    kv_type);
int decode_attention_tasks(const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens, const int32_t
    *block_tables, int bt_stride, const void *kcache, const void *vcache, long kv_row, long kv_head, int block_size,
    int Hq, int Hkv, int D, float scale, int window, float *out, int hs, int t0, int t1, int kv_type);
int decode_attention(const float *q, long q_stride, int n, const int64_t *tokens, const int32_t *kv_lens, const
    int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache, int block_size, int Hq, int Hkv, int
    D, float scale, int window, float *out, int nthreads, int kv_type);
int prefill_attention_num_tasks(int n, const int32_t *q_lens, int Hkv, int bq);
int prefill_attention_tasks(const float *q, long q_stride, const int32_t *q_start, const int32_t *q_lens, const
    int32_t *kv_lens, const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache, long kv_row,
    long kv_head, int block_size, int Hq, int Hkv, int D, float scale, int window, float *out, long out_stride, int n,
    int bq, int t0, int t1, int kv_type);
int prefill_attention(const float *q, long q_stride, int n, const int32_t *q_start, const int32_t *q_lens, const
    int32_t *kv_lens, const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache, int
    block_size, int Hq, int Hkv, int D, float scale, int window, float *out, long out_stride, int nthreads, int
    kv_type);
int prefill_attention_bq(void);

// sampler.c
int log_softmax_rows(const float *x, int M, int V, long x_stride, float *out, int probs);
int top_n_rows(const float *x, int M, int V, long x_stride, int n, int64_t *ids, float *vals);
int inverse_cdf_rows(const float *probs, int M, int V, long p_stride, const float *u, int64_t *out);
int top_p_thresholds(const float *probs, int M, int V, long p_stride, const float *top_p, float *out);

// panels.c
int f32_gemm(const float *x, int M, int K, const float *w, int N, float *y, int nthreads);
int panel_blocked_rows(int set);
int pack_panels_f32(const float *w, int V, int K, long ld, float *out);
int panel_gemm_plan(int M, int K, int V, int nthreads, int *unit, int *nt, int *claim);
void panel_gemm_part(const float *x, int M, int K, const float *wp, int V, float *y, head_best *best, int unit, int
    lo, int hi, int pf_hi);
int head_best_bytes(void);
void head_best_init(head_best *b, size_t n);
int32_t head_best_argmax(const head_best *b, int n, size_t stride_bytes);
void shares_init(uint64_t *s, int n, int nt);
int shares_claim(uint64_t *s, int nt, int t, int min, int *a, int *b, int *pe);
int shares_count(int n, int nt, int min, int nthreads, int32_t *counts);
int panel_gemm(const float *x, int M, int K, const float *wp, int V, float *y, int64_t *argmax, int nthreads);

// qx.c
long qx_panel_bytes(int kind, int K);
long qx_mismatches(const void *w, int kind, int K, int N, const float *f);
int pack_bdot_panels(const float *panels, long npanels, int K, uint16_t *out);
int bdot_supported(void);
int bdot_round(const float *x, int M, int K, uint32_t *xb);
int bdot_gemm_part(const uint32_t *xb, int M, int K, const void *w, int N, float *y, void *best, int p0, int p1);
int qx512_use(int set);
int qx_gemm_part(const float *x, int M, int K, const void *w, int N, float *y, void *best, int kind, int p0, int p1);
int qx_gemm(const float *x, int M, int K, const void *w, int N, float *y, int64_t *argmax, int kind, int nthreads);

// layers.c
long layers_workspace(int T, int H, int Hq, int Hkv, int D, int I);
int run_layers(const decode_layer *layers, int L, const layers_step *s, float *ws, float *out,
    const layers_team *team);
long decode_workspace(int T, int H, int Hq, int Hkv, int D, int I);
int step_layers(const decode_layer *layers, int L, const float *x, int T, const int64_t *positions, int n_positions,
    const float *rope_cos, const float *rope_sin, const int64_t *slots, int n_dec, const int64_t *dec_tokens, const
    int32_t *dec_kv_lens, const int32_t *dec_tables, int dec_stride, int n_pre, const int32_t *pre_start, const
    int32_t *pre_lens, const int32_t *pre_kv_lens, const int32_t *pre_tables, int pre_stride, const int64_t *keep, int
    S, int block_size, int H, int Hq, int Hkv, int D, int I, float eps, float scale, int window, float *ws, float
    *out, int nthreads, int kv_type);
int decode_layers(const decode_layer *layers, int L, const float *x, int T, const int64_t *positions, int n_positions,
    const float *rope_cos, const float *rope_sin, const int64_t *slots, const int32_t *kv_lens, const int32_t
    *block_tables, int bt_stride, int block_size, int H, int Hq, int Hkv, int D, int I, float eps, float scale, int
    window, float *ws, float *out, int nthreads, int kv_type);

#ifdef __cplusplus
}
#endif

#endif
