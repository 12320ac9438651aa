// jaxengine's CPU kernels as XLA FFI custom calls (float32), the machine code of cpu_kernels/csrc
// (linked into this library):
//
// - XlaserveCpuPanelLinear: y [T, N] = x [T, K] . W_l^T, every layer's W packed in panel_gemm's panels and
//   stacked [L, NP, K, 16], l a device scalar. In the scan over layers XLA:CPU hands a dot its layer's weight
//   through a dynamic-slice, and a dynamic-slice is a copy: every decode step copied all the weights before
//   reading them (about 40% of a batch-1 step of the embedded model). This reads W_l where it lies, with the
//   torch backend's panel_gemm: every output one FMA chain over k in order, so a row's result depends neither
//   on the other rows nor on the split, and equals the torch backend's bit for bit. Only x's first `live` rows
//   (a device scalar) are multiplied, the others' outputs zeros: the LM head skips a request bucket's padding.
// - XlaserveCpuPanelArgmax: each row's argmax of PanelLinear's product, without writing it (greedy sampling;
//   the torch backend's greedy_tokens).
// - XlaserveCpuQxLinear, XlaserveCpuQxArgmax: the same from the weights as stored (qx_gemm's panels of a GGUF
//   file's blocks or a bfloat16 checkpoint's halves, cpu_kernels/layout.py), the same bits from fewer bytes.
// - XlaserveCpuDecodeAttention: the decode rows of a ragged step over the paged cache, read in place
//   (decode_attention_tasks with the interleaved cache's strides, or decode_split_phase's two phases for rows too
//   few for XLA's threads).
// - XlaserveCpuRmsNorm, XlaserveCpuSiluMul, XlaserveCpuRope: RMSNorm of each row (XLA's reduction order
//   depends on the row count), the MLP's activation and RoPE as the torch backend computes them, so the
//   two backends' logits have the same bits on a CPU.
// - XlaserveCpuKvWrite: a step's new K and V into the paged cache, in place (XLA:CPU's scatter into a 16-bit
//   float cache converts the whole cache to float32 and back).
// - XlaserveCpuPrefillAttention: its prefill and mixed rows, each query with decode attention's arithmetic
//   (prefill_attention_tasks): a token's attention is the same decoded, prefilled or recomputed, and the
//   same as the torch backend's on a CPU.
//
// - XlaserveCpuZeros: a zero buffer (the KV cache) whose whole pages are handed back to the OS instead of written:
//   memory is committed page by page as steps first write it, not all at start.
//
// - XlaserveCpuLayers: every decoder layer of a ragged step in one call, the kernels above in the order the
//   scan over layers calls them (the same bits): layers.c's run_layers, the torch backend's one-call layers
//   too, run by a Team of XLA's threads held for the whole call (`model.forward` on a CPU by default;
//   compilation_config={"cpu_layers": False} goes back to the scan).
//
// All split their work between XLA's own intra-op threads (no second thread pool competing with XLA's
// for the cores). Built by cpu_kernels/jax_ops.py with the system C and C++ compilers against
// jax.ffi.include_dir().

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"

#include "cpu_kernels.h"

namespace ffi = xla::ffi;


namespace {

constexpr int64_t kParallelWork = 1 << 15;  // multiply-adds below which one thread does it all

// the cache's element type as cpu_kernels.h numbers them (KV_F32, KV_F16, KV_BF16); -1: another
int KvType(ffi::DataType t) {
    return t == ffi::DataType::F32 ? KV_F32 : t == ffi::DataType::F16 ? KV_F16 : t == ffi::DataType::BF16 ? KV_BF16 : -1;
}
int64_t KvBytes(int kv_type) { return kv_type == 0 ? 4 : 2; }

// One token's K and V, k and v [Hkv, D], into row `slot` of jaxengine's cache [NB * bs, 2 Hkv, D] of kv_type at c
// (kv head h's K at 2h, V at 2h + 1), rounded to the cache's type by kv_write (as XLA's astype rounds)
void TokenKv(const float *k, const float *v, int64_t slot, int64_t Hkv, int64_t D, char *c, int kv_type) {
    for (int64_t h = 0; h < Hkv; h++) {
        const int64_t at = slot * 2 * Hkv + 2 * h;
        kv_write(k + h * D, v + h * D, 0, 0, 1, &at, c, c + D * KvBytes(kv_type), (int)D, kv_type);
    }
}

// Runs fn(t0, t1) over [0, n) in slices of `per` on the calling thread and up to `tasks - 1` of XLA's
// intra-op threads; returns when every slice is done. A thread that starts after the work is gone does
// nothing (the state it holds is shared, so it outlives this call).
template <typename F>
void parallel_for(ffi::ThreadPool &pool, int64_t n, int64_t tasks, int64_t per, F fn) {
    struct State {
        std::atomic<int64_t> next{0}, done{0};
        F fn;
        int64_t n, per;
        explicit State(F f, int64_t n_, int64_t p) : fn(std::move(f)), n(n_), per(p) {}
        void run() {
            for (;;) {
                const int64_t a = next.fetch_add(per);
                if (a >= n) return;
                const int64_t b = std::min(a + per, n);
                fn(a, b);
                done.fetch_add(b - a, std::memory_order_release);
            }
        }
    };
    auto st = std::make_shared<State>(std::move(fn), n, per);
    for (int64_t t = 1; t < tasks; t++) pool.Schedule([st] { st->run(); });
    st->run();
    // wait for slices other threads have started; after a short spin, yield (on an oversubscribed machine
    // the thread we wait for may need this core)
    for (int spins = 0; st->done.load(std::memory_order_acquire) < n; spins++) {
        if (spins < 1024) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        } else {
            std::this_thread::yield();
        }
    }
}

// A team of XLA's intra-op threads held for a whole call of many phases (`Layers`: ~9 a layer). The caller
// publishes phase after phase and waits for each; the helpers, scheduled once a call, spin between phases
// instead of going back to XLA's pool. Split into one custom call a phase (what the scan over layers did),
// every phase woke its helpers anew, and they came late or found their core taken: the caller did ~60% of the
// slices, the process switched context ~5x as often as with the team, and the whole offline run of 32
// requests was 1.01-1.18x slower (docs/design-notes.md; the torch backend's OpenMP threads spin between
// kernels the same way). A helper that starts late joins whatever phase is current; the caller alone can do all the
// work, so nothing ever waits for a helper that does not come (XLA's threads may be busy elsewhere).
class Team {
  public:
    int64_t threads() const { return threads_; }

    // fn(a, b) over [0, n) in slices of `per` by the caller and whichever helpers are in; returns when done
    void run(int64_t n, int64_t per, std::function<void(int64_t, int64_t)> fn) {
        if (n <= 0) return;
        if (threads_ == 1 || per >= n) {  // the caller's alone: not worth publishing
            fn(0, n);
            return;
        }
        publish(n, per, 0, 0, [fn = std::move(fn)](int64_t a, int64_t b, int64_t) { fn(a, b); });
    }
    // fn(a, b, pe) over [0, n) in the parts shares_claim hands out, at least `min` a claim (pe: the end of the
    // range the thread's next claim likely continues in): `shares` shares, share 0 the caller's and share i the
    // i-th helper's to join (helpers past them only take from the others). The linears' panels, split evenly
    // however fast the threads go.
    void run_shared(int64_t n, int shares, int min, std::function<void(int64_t, int64_t, int64_t)> fn) {
        if (n <= 0) return;
        if (threads_ == 1 || shares <= 1 || n <= min) {
            fn(0, n, n);
            return;
        }
        publish(n, n, shares, min, std::move(fn));
    }
    // the helpers go back to the pool (call once, after the last phase)
    void finish() { current_.store(&finished_, std::memory_order_release); }

    // shared by the helpers, so a helper that starts after the call returned finds a valid (finished) team
    static std::shared_ptr<Team> make(ffi::ThreadPool &pool, int64_t threads) {
        auto t = std::shared_ptr<Team>(new Team(threads));
        for (int64_t i = 1; i < t->threads_; i++) pool.Schedule([t] { t->help(); });
        return t;
    }

  private:
    using Fn = std::function<void(int64_t, int64_t, int64_t)>;
    struct Phase {
        std::atomic<int64_t> next{0}, done{0};
        std::atomic<int> joined{0};
        const int64_t n, per;
        const int min;
        std::vector<uint64_t> shares;  // shares_claim's; none: slices of `per`
        const Fn fn;
        Phase(int64_t n_, int64_t per_, int nshares, int min_, Fn f)
            : n(n_), per(per_), min(min_), shares(nshares), fn(std::move(f)) {
            if (nshares > 0) shares_init(shares.data(), (int)n, nshares);
        }
        // work until none is left (a helper late for a phase the caller has finished finds none): thread t's
        // share and then the others', or slices
        void work(int t) {
            if (!shares.empty()) {
                int a, b, pe;
                while (shares_claim(shares.data(), (int)shares.size(), t, min, &a, &b, &pe)) {
                    fn(a, b, pe);
                    done.fetch_add(b - a, std::memory_order_release);
                }
                return;
            }
            for (;;) {
                const int64_t a = next.fetch_add(per, std::memory_order_relaxed);
                if (a >= n) return;
                const int64_t b = std::min(a + per, n);
                fn(a, b, b);
                done.fetch_add(b - a, std::memory_order_release);
            }
        }
    };
    explicit Team(int64_t threads) : threads_(std::max<int64_t>(1, threads)) {}

    void publish(int64_t n, int64_t per, int nshares, int min, Fn fn) {
        phases_.emplace_back(n, per, nshares, min, std::move(fn));
        Phase *p = &phases_.back();  // deque: earlier phases stay where they are (a late helper may read one)
        current_.store(p, std::memory_order_release);
        p->work(0);
        for (int spins = 0; p->done.load(std::memory_order_acquire) < n; spins++) pause(spins);
    }

    static void pause(int spins) {
        // after ~a millisecond of spinning, yield: on a busy machine the thread we wait for may need this core
        if (spins < (1 << 14)) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        } else {
            std::this_thread::yield();
        }
    }
    void help() {
        Phase *seen = nullptr;
        for (int spins = 0;;) {
            Phase *p = current_.load(std::memory_order_acquire);
            if (p == &finished_) return;
            if (p != seen && p != nullptr) {
                seen = p;
                p->work(p->joined.fetch_add(1, std::memory_order_relaxed) + 1);
                spins = 0;
            } else {
                pause(spins++);
            }
        }
    }

    const int64_t threads_;
    std::deque<Phase> phases_;
    std::atomic<Phase *> current_{nullptr};
    Phase finished_{0, 1, 0, 1, nullptr};
};

// a Team as run_layers' layers_team: its phases' parts on the Team's threads
void TeamRun(void *ctx, long n, long per, layers_task fn, void *arg) {
    static_cast<Team *>(ctx)->run(n, per, [fn, arg](int64_t a, int64_t b) { fn(arg, a, b, b); });
}
void TeamRunShared(void *ctx, long n, int shares, int min, layers_task fn, void *arg) {
    static_cast<Team *>(ctx)->run_shared(n, shares, min, [fn, arg](int64_t a, int64_t b, int64_t pe) {
        fn(arg, a, b, pe);
    });
}

// The rows of x [T, ...] a call computes: the first `live` (one int32, traced: a step's request bucket pads the
// rows its LM head samples from, which the torch backend does not compute), clamped to [0, T]; the outputs of
// the other rows are zeros (zero_past). -1: live is not one value.
static int64_t live_rows(ffi::Buffer<ffi::S32> &live, int64_t T) {
    return live.element_count() != 1 ? -1 : std::clamp<int64_t>(live.typed_data()[0], 0, T);
}

// out [T, width]'s rows from `live` on: zeros
template <typename E>
static void zero_past(E *out, int64_t live, int64_t T, int64_t width) {
    std::fill(out + live * width, out + T * width, E(0));
}

// x [T, K] times layer l of w [L, NP, K, 16] (panel_gemm's panels, stacked; NP = ceil(N / 16), zero rows padding
// the last panel) for N output columns, of x's first T rows (live_rows: the buffers may have more): the
// operands checked, and panel_gemm_part's parts split between XLA's threads, as PanelLinear and
// PanelArgmax both run them.
struct PanelCall {
    int64_t T = 0, K = 0, N = 0, parts = 0, per = 1;
    const float *x = nullptr, *w = nullptr;
    int unit = 4, nt = 1, claim = 0;  // claim: panel_gemm_plan's (RunPanelCall claims when > 0 and nt > 1)
};

// Parts a slice of panel_gemm_plan's split where its parts are not claimed (parts of 4 panels, below
// panel_gemm's blocked_rows() rows), for XLA's threads: one contiguous slice of ceil(parts / nt) a thread, much
// as the torch backend's OpenMP threads split them (a thread that finds its slice taken takes the next, so one that
// starts late leaves its slice to the others). Four slices a thread ran a decode step of 12-16 rows ~10% slower
// (each slice's first panel is not prefetched, head_rows prefetching within its range, and a thread's panels
// were not contiguous). All of them where one thread runs the call.
static int64_t slice_parts(int64_t parts, int nt) {
    return nt <= 1 ? parts : (parts + nt - 1) / nt;
}

ffi::Error PlanPanelCall(ffi::ThreadPool &pool, ffi::Buffer<ffi::F32> &x, ffi::Buffer<ffi::F32> &w,
                         ffi::Buffer<ffi::S32> &layer, ffi::Buffer<ffi::S32> &live, int64_t rows_out, int64_t N,
                         PanelCall &c) {
    const auto xd = x.dimensions(), wd = w.dimensions();
    if (xd.size() != 2 || wd.size() != 4) return ffi::Error::InvalidArgument("x [T, K] and w [L, NP, K, 16] expected");
    const int64_t T = xd[0], K = xd[1], L = wd[0], NP = wd[1];
    if (wd[2] != K || wd[3] != 16 || K == 0 || rows_out != T || N < 0 || N > NP * 16 || N <= (NP - 1) * 16)
        return ffi::Error::InvalidArgument("x, w and the output disagree (K, the panels, or N)");
    const int32_t l = layer.typed_data()[0];
    if (l < 0 || l >= L) return ffi::Error::InvalidArgument("layer index out of range");
    c.T = live_rows(live, T), c.K = K, c.N = N, c.x = x.typed_data(), c.w = w.typed_data() + (size_t)l * NP * K * 16;
    if (c.T < 0) return ffi::Error::InvalidArgument("live: one int32 (the rows to compute) expected");
    if (c.T == 0 || N == 0) return ffi::Error::Success();
    c.parts = panel_gemm_plan((int)c.T, (int)K, (int)N, std::max<int64_t>(1, pool.num_threads()), &c.unit, &c.nt,
                              &c.claim);
    c.per = slice_parts(c.parts, c.nt);
    return ffi::Error::Success();
}

// fn(lo, hi, pe, set) over PanelCall's parts on the calling thread and XLA's: where panel_gemm_plan claims them
// (from blocked_rows() rows), nt tasks each work from a share of their own (shares_claim: a task XLA starts
// late finds its share taken from the back, or empty), set = the task; else slices of c.per parts, set = the
// slice. pe: where the thread's next parts likely start (panel_gemm_part's prefetch past hi).
bool Claims(const PanelCall &c) { return c.claim > 0 && c.nt > 1; }
int64_t Sets(const PanelCall &c) { return Claims(c) ? c.nt : (c.parts + c.per - 1) / c.per; }

template <typename F>
void RunPanelCall(ffi::ThreadPool &pool, const PanelCall &c, F fn) {
    if (Claims(c)) {
        std::vector<uint64_t> shares(c.nt);
        uint64_t *sh = shares.data();
        shares_init(sh, (int)c.parts, c.nt);
        parallel_for(pool, c.nt, c.nt, 1, [=](int64_t a, int64_t b) {
            for (int64_t t = a; t < b; t++) {
                int lo, hi, pe;
                while (shares_claim(sh, c.nt, (int)t, c.claim, &lo, &hi, &pe)) fn(lo, hi, pe, t);
            }
        });
        return;
    }
    const int64_t per = c.per;
    parallel_for(pool, c.parts, c.nt, per, [=](int64_t a, int64_t b) { fn((int)a, (int)b, (int)b, a / per); });
}

// y [T, N] = x [T, K] . W_l^T (PanelCall's operands): the torch backend's float32 linears and LM head (the same
// machine code and the same split into parts, which XLA's threads share). Every output is one FMA chain over k
// in order, so a row's result depends neither on the other rows nor on the split.
ffi::Error PanelLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y) {
    const auto yd = y->dimensions();
    if (yd.size() != 2) return ffi::Error::InvalidArgument("y [T, N] expected");
    PanelCall c;
    if (auto err = PlanPanelCall(pool, x, w, layer, live, yd[0], yd[1], c); !err.success()) return err;
    float *yp = y->typed_data();
    zero_past(yp, c.T, yd[0], c.N);
    if (c.parts == 0) return ffi::Error::Success();
    RunPanelCall(pool, c, [=](int lo, int hi, int pe, int64_t) {
        panel_gemm_part(c.x, (int)c.T, (int)c.K, c.w, (int)c.N, yp, nullptr, c.unit, lo, hi, pe);
    });
    return ffi::Error::Success();
}

// `sets` sets of T rows' running maxima (head_best, opaque here), each set folded by one task or slice, then
// merged into each row's argmax. Set s at bp + s * stride, each set on cache lines of its own: maxima sharing a
// line with another thread's would move it between cores at every fold.
class Maxima {
  public:
    Maxima(int64_t T, int64_t sets)
        : T_(T), sets_(sets), bytes_((size_t)head_best_bytes()), stride_((bytes_ * (size_t)T + 63) / 64 * 64),
          buf_(stride_ * (size_t)sets + 64) {
        bp_ = buf_.data() + (64 - (uintptr_t)buf_.data() % 64) % 64;
        for (int64_t s = 0; s < sets; s++) head_best_init(set(s), (size_t)T);
    }
    head_best *set(int64_t s) { return reinterpret_cast<head_best *>(bp_ + stride_ * (size_t)s); }
    void argmax(int32_t *out) const {
        for (int64_t m = 0; m < T_; m++) out[m] = head_best_argmax(reinterpret_cast<const head_best *>(bp_ + bytes_ * m), (int)sets_, stride_);
    }

  private:
    int64_t T_, sets_;
    size_t bytes_, stride_;
    std::vector<char> buf_;
    char *bp_;
};

// out [T] = the first index of each row's maximum of x [T, K] . W_l^T over W's first n rows (NaN counting as
// the largest: torch.argmax's), PanelCall's operands: greedy sampling without writing and re-reading the
// [T, n] logits, PanelLinear's products folded into running maxima per row, one set a task or slice
// (RunPanelCall), the sets merged (folds and merge alike do not depend on the order the panels come in). The
// torch backend's greedy_tokens, the same tokens.
ffi::Error PanelArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::S32> out,
                       int32_t n) {
    const auto od = out->dimensions();
    if (od.size() != 1 || n <= 0) return ffi::Error::InvalidArgument("out [T] and n > 0 expected");
    PanelCall c;
    if (auto err = PlanPanelCall(pool, x, w, layer, live, od[0], n, c); !err.success()) return err;
    zero_past(out->typed_data(), c.T, od[0], 1);
    if (c.parts == 0) return ffi::Error::Success();
    Maxima best(c.T, Sets(c));
    RunPanelCall(pool, c, [=, &best](int lo, int hi, int pe, int64_t set) {
        panel_gemm_part(c.x, (int)c.T, (int)c.K, c.w, (int)c.N, nullptr, best.set(set), c.unit, lo, hi, pe);
    });
    best.argmax(out->typed_data());
    return ffi::Error::Success();
}

// Panels a slice of a qx call over NP panels of T x K x N multiply-adds: all of them where one thread does it all
// (little work), else two slices a thread (a thread that starts late leaves less to wait for; qx_panels
// prefetches the next panel within a slice).
static int64_t qx_slice(int64_t NP, int64_t T, int64_t K, int64_t N, int64_t threads) {
    return T * K * N < kParallelWork || threads <= 1 ? NP : std::max<int64_t>(1, (NP + 2 * threads - 1) / (2 * threads));
}

// The activations of a qx call: for QX_BDOT (qx.c; bfloat16 products) x rounded to bfloat16 once a call
// (bdot_round), which every slice then multiplies (bdot_gemm_part); for the other kinds x itself (qx_gemm_part).
struct QxInput {
    int kind = -1;
    const float *x = nullptr;
    std::vector<uint32_t> xb;

    // false where the kind cannot run here (QX_BDOT without AVX512-BF16)
    bool set(int k, const float *in, int64_t M, int64_t K) {
        kind = k, x = in;
        if (kind != QX_BDOT) return true;
        xb.resize((size_t)(M * K / 2));
        return bdot_round(in, (int)M, (int)K, xb.data()) == 0;
    }
    void part(int M, int K, const void *w, int N, float *y, void *best, int p0, int p1) const {
        if (kind == QX_BDOT)
            bdot_gemm_part(xb.data(), M, K, w, N, y, best, p0, p1);
        else
            qx_gemm_part(x, M, K, w, N, y, best, kind, p0, p1);
    }
};

// x [T, K] times layer l of w [L, NP, K / 32, group bytes] (qx_gemm's panels of `kind`, stacked) for N output
// columns: the operands checked; then fn(p0, p1, set) over slices of the panels on the calling thread and XLA's
// (set: the slice), `sets` of them.
struct QxCall {
    int64_t T = 0, K = 0, N = 0, NP = 0, per = 1, sets = 0;
    const float *x = nullptr;
    const uint8_t *w = nullptr;
};

ffi::Error PlanQxCall(ffi::ThreadPool &pool, ffi::Buffer<ffi::F32> &x, ffi::Buffer<ffi::U8> &w,
                      ffi::Buffer<ffi::S32> &layer, ffi::Buffer<ffi::S32> &live, int64_t rows_out, int64_t N,
                      int32_t kind, QxCall &c) {
    const auto xd = x.dimensions(), wd = w.dimensions();
    if (xd.size() != 2 || wd.size() != 4) return ffi::Error::InvalidArgument("x [T, K] and w [L, NP, G, B] expected");
    const int64_t T = xd[0], K = xd[1], L = wd[0], NP = wd[1], pb = qx_panel_bytes(kind, (int)K);
    if (pb < 0 || wd[2] * wd[3] != pb || rows_out != T || N <= 0 || N > NP * 16 || N <= (NP - 1) * 16)
        return ffi::Error::InvalidArgument("x, the qx panels (their kind) and the output disagree");
    const int32_t l = layer.typed_data()[0];
    if (l < 0 || l >= L) return ffi::Error::InvalidArgument("layer index out of range");
    c.T = live_rows(live, T), c.K = K, c.N = N, c.NP = NP, c.x = x.typed_data();
    c.w = w.typed_data() + (size_t)l * NP * pb;
    if (c.T < 0) return ffi::Error::InvalidArgument("live: one int32 (the rows to compute) expected");
    c.per = qx_slice(NP, c.T, K, N, pool.num_threads());
    c.sets = c.T == 0 ? 0 : (NP + c.per - 1) / c.per;
    return ffi::Error::Success();
}

template <typename F>
void RunQxCall(ffi::ThreadPool &pool, const QxCall &c, F fn) {
    parallel_for(pool, c.NP, std::min<int64_t>(c.sets, std::max<int64_t>(1, pool.num_threads())), c.per,
                 [=](int64_t a, int64_t b) { fn((int)a, (int)b, a / c.per); });
}

// y [T, N] = x [T, K] . W_l^T from W_l's qx panels: PanelLinear's bits (qx_gemm)
ffi::Error QxLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                    ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> y, int32_t kind) {
    const auto yd = y->dimensions();
    if (yd.size() != 2) return ffi::Error::InvalidArgument("y [T, N] expected");
    QxCall c;
    if (auto err = PlanQxCall(pool, x, w, layer, live, yd[0], yd[1], kind, c); !err.success()) return err;
    float *yp = y->typed_data();
    zero_past(yp, c.T, yd[0], c.N);
    if (c.sets == 0) return ffi::Error::Success();
    QxInput in;
    if (!in.set(kind, c.x, c.T, c.K)) return ffi::Error::InvalidArgument("this qx kind does not run on this CPU");
    RunQxCall(pool, c, [=, &in](int p0, int p1, int64_t) {
        in.part((int)c.T, (int)c.K, c.w, (int)c.N, yp, nullptr, p0, p1);
    });
    return ffi::Error::Success();
}

// out [T]: PanelArgmax's tokens from W_l's qx panels (qx_gemm's greedy head; each slice's maxima merged)
ffi::Error QxArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                    ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::S32> out, int32_t n, int32_t kind) {
    const auto od = out->dimensions();
    if (od.size() != 1 || n <= 0) return ffi::Error::InvalidArgument("out [T] and n > 0 expected");
    QxCall c;
    if (auto err = PlanQxCall(pool, x, w, layer, live, od[0], n, kind, c); !err.success()) return err;
    zero_past(out->typed_data(), c.T, od[0], 1);
    if (c.sets == 0) return ffi::Error::Success();
    QxInput in;
    if (!in.set(kind, c.x, c.T, c.K)) return ffi::Error::InvalidArgument("this qx kind does not run on this CPU");
    Maxima best(c.T, c.sets);
    RunQxCall(pool, c, [=, &best, &in](int p0, int p1, int64_t set) {
        in.part((int)c.T, (int)c.K, c.w, (int)c.N, nullptr, best.set(set), p0, p1);
    });
    best.argmax(out->typed_data());
    return ffi::Error::Success();
}

// fn(a, b) over rows [0, M) of `row_work` floats each: on XLA's threads when there is enough work
template <typename F>
void parallel_rows(ffi::ThreadPool &pool, int64_t M, int64_t row_work, F fn) {
    const int64_t tasks =
        M * row_work >= 4 * kParallelWork ? std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), M) : 1;
    parallel_for(pool, M, tasks, std::max<int64_t>(1, M / (tasks * 4)), std::move(fn));
}

// out [M, K] = RMSNorm of x [M, K]'s rows times w [K]: the torch backend's rms_norm (each row's sum of squares
// one 8-lane FMA chain), so a row's result does not depend on the other rows. XLA's own reduction vectorises
// across rows from 8 rows up and along the row below, so a token's norm changed with the step's size.
ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> out, float eps) {
    const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
    if (xd.size() != 2 || wd.size() != 1 || od.size() != 2 || xd[1] == 0 || wd[0] != xd[1] || od[0] != xd[0] ||
        od[1] != xd[1])
        return ffi::Error::InvalidArgument("x [M, K], w [K] and out [M, K] expected");
    const int64_t M = xd[0], K = xd[1];
    if (M == 0) return ffi::Error::Success();
    const float *xp = x.typed_data(), *wp = w.typed_data();
    float *op = out->typed_data();
    parallel_rows(pool, M, K, [=](int64_t a, int64_t b) {
        rms_norm(xp + a * K, (int)(b - a), (int)K, K, nullptr, wp, eps, op + a * K);
    });
    return ffi::Error::Success();
}

// out [M, I] = silu(gu[:, :I]) * gu[:, I:]: the torch backend's silu_mul (XLA's logistic differs in the last
// bits, so the two backends' MLPs did).
ffi::Error SiluMul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gu, ffi::ResultBuffer<ffi::F32> out) {
    const auto gd = gu.dimensions(), od = out->dimensions();
    if (gd.size() != 2 || od.size() != 2 || od[0] != gd[0] || gd[1] != 2 * od[1] || od[1] == 0)
        return ffi::Error::InvalidArgument("gu [M, 2I] and out [M, I] expected");
    const int64_t M = gd[0], I = od[1];
    if (M == 0) return ffi::Error::Success();
    const float *gp = gu.typed_data();
    float *op = out->typed_data();
    parallel_rows(pool, M, I, [=](int64_t a, int64_t b) {
        silu_mul(gp + a * 2 * I, (int)(b - a), (int)I, op + a * I);
    });
    return ffi::Error::Success();
}

// out [T, H, D] = x rotated by each token's angles, rotate-half convention: the torch backend's rope (XLA would
// compute it with fused multiply-adds: other bits). cos, sin [T, D]: the kernel's tables, (cos, cos) and
// (-sin, sin) of each token's angles, built once a step (`cpu_kernels.rope_tables`) for every layer's q and k.
ffi::Error Rope(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                ffi::ResultBuffer<ffi::F32> out) {
    const auto xd = x.dimensions(), cd = cos.dimensions(), sd = sin.dimensions(), od = out->dimensions();
    if (xd.size() != 3 || cd.size() != 2 || sd.size() != 2 || od.size() != 3 || xd[2] % 2 || xd[2] == 0 ||
        xd[2] > 1024 || cd[0] != xd[0] || cd[1] != xd[2] || sd[0] != cd[0] || sd[1] != cd[1] ||
        od[0] != xd[0] || od[1] != xd[1] || od[2] != xd[2])
        return ffi::Error::InvalidArgument("x [T, H, D], cos and sin [T, D], out [T, H, D] expected");
    const int64_t T = xd[0], H = xd[1], D = xd[2];
    if (T == 0 || H == 0) return ffi::Error::Success();
    float *op = out->typed_data();
    std::copy(x.typed_data(), x.typed_data() + T * H * D, op);
    rope(op, (int)T, (int)H, (int)D, H * D, cos.typed_data(), sin.typed_data());
    return ffi::Error::Success();
}

// Why the blocks of a row with kv_len `len` (its table row `row`, W columns) would lie outside a cache of NB
// blocks of bs tokens, or nullptr if they do not
const char *BlocksOutside(const int32_t *row, int64_t len, int64_t W, int64_t bs, int64_t NB) {
    if (len < 0 || len > W * bs) return "kv_len past the block table";
    for (int64_t j = 0; j < (len + bs - 1) / bs; j++)
        if (row[j] < 0 || row[j] >= NB) return "block id out of range";
    return nullptr;
}

// ... and for a request row r of a ragged step: its tokens cu[r] .. cu[r + 1] within the T tokens and no more
// of them than its kv_len, then its blocks
const char *RowOutside(const int32_t *cu, const int32_t *lens, const int32_t *bt, int64_t r, int64_t T, int64_t W,
                       int64_t bs, int64_t NB) {
    const int32_t s0 = cu[r], s1 = cu[r + 1], len = lens[r];
    if (s0 < 0 || s1 < s0 || s1 > T) return "cu_q_lens outside the tokens";
    if (len < s1 - s0 || len > W * bs) return "kv_len shorter than q_len or past the table";
    return BlocksOutside(bt + r * W, len, W, bs, NB);
}

// Decode attention of rows [0, num_decode) of q [R, Hq, D] (one query each, kv_lens[i] cached tokens
// including its own, blocks table[i, :]) over jaxengine's cache [blocks, block_size, 2 * Hkv, D]; out
// [R, Hq, D], rows from num_decode on zero. attention.c's decode_attention_tasks: exact softmax in
// float32, a task per request and kv head (or query head), spread over XLA's threads.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> num_decode, ffi::ResultBuffer<ffi::F32> out, float scale,
                           int32_t window) {
    const auto qd = q.dimensions(), cd = cache.dimensions(), td = table.dimensions();
    if (qd.size() != 3 || cd.size() != 4 || td.size() != 2 || kv_lens.dimensions().size() != 1)
        return ffi::Error::InvalidArgument("q [R, Hq, D], cache [NB, bs, 2 Hkv, D], table [R, W], kv_lens [R]");
    const int64_t R = qd[0], Hq = qd[1], D = qd[2], NB = cd[0], bs = cd[1], Hkv = cd[2] / 2, W = td[1];
    if (cd[3] != D || cd[2] % 2 || Hkv == 0 || Hq % Hkv || td[0] != R || kv_lens.dimensions()[0] != R)
        return ffi::Error::InvalidArgument("decode attention: shapes disagree");
    const int kv = KvType(cache.element_type());
    if (kv < 0) return ffi::Error::InvalidArgument("decode attention: the cache is not float32, float16 or bfloat16");
    const int64_t n = std::min<int64_t>(std::max<int32_t>(num_decode.typed_data()[0], 0), R);
    const int32_t *lens = kv_lens.typed_data(), *bt = table.typed_data();
    for (int64_t i = 0; i < n; i++)  // every block a row reads lies in the cache
        if (const char *why = BlocksOutside(bt + i * W, lens[i], W, bs, NB)) return ffi::Error::InvalidArgument(why);
    float *o = out->typed_data();
    std::fill(o + n * Hq * D, o + R * Hq * D, 0.f);
    if (n == 0) return ffi::Error::Success();
    int64_t work = 0;  // multiply-adds of the scores
    for (int64_t i = 0; i < n; i++) work += (int64_t)lens[i] * Hq * D;
    const int64_t threads = work < kParallelWork ? 1 : std::max<int64_t>(1, pool.num_threads());
    std::atomic<int> rc{0};
    const char *c = static_cast<const char *>(cache.untyped_data());
    if (decode_split((int)n, (int)Hkv, (int)threads)) {  // two phases, the buffer they share zeroed once
        long bytes = 0;
        std::vector<char> buf;
        for (int phase = 0; phase < 2; phase++) {
            const int64_t ntasks = decode_split_tasks(phase, (int)n, lens, window, (int)Hq, (int)Hkv, (int)D, &bytes);
            if (phase == 0) buf.assign((size_t)bytes, 0);
            char *b0 = buf.data();
            parallel_for(pool, ntasks, std::min(threads, ntasks), 1, [&, c, o, b0, phase](int64_t a, int64_t b) {
                if (decode_split_phase(phase, q.typed_data(), Hq * D, nullptr, lens, bt, (int)W, c, c + D * KvBytes(kv),
                                       2 * Hkv * D, 2 * D, (int)bs, (int)Hq, (int)Hkv, (int)D, scale, window, b0, o,
                                       (int)n, (int)a, (int)b, kv))
                    rc.store(1);
            });
        }
        if (rc.load()) return ffi::Error::Internal("decode attention: out of memory");
        return ffi::Error::Success();
    }
    const int hs = decode_heads_per_task((int)n, (int)Hq, (int)Hkv, (int)threads);
    const int64_t ntasks = n * (Hq / hs);
    parallel_for(pool, ntasks, std::min(threads, ntasks), 1, [&, c, o](int64_t a, int64_t b) {
        if (decode_attention_tasks(q.typed_data(), Hq * D, nullptr, lens, bt, (int)W, c, c + D * KvBytes(kv),
                                   2 * Hkv * D, 2 * D, (int)bs, (int)Hq, (int)Hkv, (int)D, scale, window, o, hs,
                                   (int)a, (int)b, kv))
            rc.store(1);
    });
    if (rc.load()) return ffi::Error::Internal("decode attention: out of memory");
    return ffi::Error::Success();
}

// The new K and V of a step's tokens, k and v [T, Hkv, D] (float32), written into the cache [NB, bs, 2 Hkv, D]
// (aliased to `out`) at row slots[t] (block * bs + offset; < 0: padding, skipped), by TokenKv. XLA:CPU has no
// 16-bit float scatter: attention.write_kv's `.at[].set` into a bfloat16 or float16 cache became a conversion of
// the whole cache to float32 and back, every layer of every step.
ffi::Error KvWrite(ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::AnyBuffer cache,
                   ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> out) {
    const auto kd = k.dimensions(), cd = cache.dimensions();
    if (kd.size() != 3 || cd.size() != 4 || v.dimensions().size() != 3 || slots.dimensions().size() != 1)
        return ffi::Error::InvalidArgument("k, v [T, Hkv, D], cache [NB, bs, 2 Hkv, D], slots [T]");
    const int64_t T = kd[0], Hkv = kd[1], D = kd[2], rows = cd[0] * cd[1];
    if (cd[2] != 2 * Hkv || cd[3] != D || (int64_t)v.element_count() != T * Hkv * D || slots.dimensions()[0] != T)
        return ffi::Error::InvalidArgument("kv write: shapes disagree");
    const int kv = KvType(cache.element_type());
    if (kv < 0 || out->element_type() != cache.element_type())
        return ffi::Error::InvalidArgument("kv write: the cache is not float32, float16 or bfloat16");
    char *c = static_cast<char *>(out->untyped_data());
    if (cache.untyped_data() != c) std::memcpy(c, cache.untyped_data(), cache.size_bytes());
    const int32_t *sl = slots.typed_data();
    for (int64_t t = 0; t < T; t++)
        if (sl[t] >= rows) return ffi::Error::InvalidArgument("kv write: a slot outside the cache");
    for (int64_t t = 0; t < T; t++)
        if (sl[t] >= 0) TokenKv(k.typed_data() + t * Hkv * D, v.typed_data() + t * Hkv * D, sl[t], Hkv, D, c, kv);
    return ffi::Error::Success();
}

// Attention of the prefill and mixed rows of a ragged step (requests [decode_end, mixed_end) of
// distribution), every query with decode attention's arithmetic (attention.c's prefill_attention_tasks):
// written into `out` (aliased to `base`, whose other rows it keeps), tasks spread over XLA's threads.
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                            ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> kv_lens,
                            ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> distribution,
                            ffi::Buffer<ffi::F32> base, ffi::ResultBuffer<ffi::F32> out, float scale,
                            int32_t window) {
    const auto qd = q.dimensions(), cd = cache.dimensions(), td = table.dimensions();
    if (qd.size() != 3 || cd.size() != 4 || td.size() != 2 || kv_lens.dimensions().size() != 1 ||
        cu_q_lens.dimensions().size() != 1 || distribution.dimensions().size() != 1 ||
        distribution.dimensions()[0] != 3)
        return ffi::Error::InvalidArgument(
            "q [T, Hq, D], cache [NB, bs, 2 Hkv, D], table [R, W], kv_lens [R], cu_q_lens [R + 1], distribution [3]");
    const int64_t T = qd[0], Hq = qd[1], D = qd[2], NB = cd[0], bs = cd[1], Hkv = cd[2] / 2, R = td[0], W = td[1];
    if (cd[3] != D || cd[2] % 2 || Hkv == 0 || Hq % Hkv || kv_lens.dimensions()[0] != R ||
        cu_q_lens.dimensions()[0] != R + 1 || (int64_t)base.element_count() != T * Hq * D ||
        (int64_t)out->element_count() != T * Hq * D)
        return ffi::Error::InvalidArgument("prefill attention: shapes disagree");
    const int kv = KvType(cache.element_type());
    if (kv < 0) return ffi::Error::InvalidArgument("prefill attention: the cache is not float32, float16 or bfloat16");
    float *o = out->typed_data();
    if (base.typed_data() != o) std::copy(base.typed_data(), base.typed_data() + T * Hq * D, o);
    const int32_t *dist = distribution.typed_data(), *cu = cu_q_lens.typed_data(), *lens = kv_lens.typed_data();
    const int32_t *bt = table.typed_data();
    const int64_t a = std::clamp<int64_t>(dist[0], 0, R), b = std::clamp<int64_t>(dist[2], a, R);
    std::vector<int32_t> qs, ql, kl;
    for (int64_t r = a; r < b; r++) {  // every row it reads lies in q and every block in the cache
        if (const char *why = RowOutside(cu, lens, bt, r, T, W, bs, NB)) return ffi::Error::InvalidArgument(why);
        qs.push_back(cu[r]);
        ql.push_back(cu[r + 1] - cu[r]);
        kl.push_back(lens[r]);
    }
    const int n = (int)qs.size(), bq = prefill_attention_bq();
    const int ntasks = prefill_attention_num_tasks(n, ql.data(), (int)Hkv, bq);
    if (ntasks < 0) return ffi::Error::InvalidArgument("prefill attention: too many tasks");
    if (ntasks == 0) return ffi::Error::Success();
    std::atomic<int> rc{0};
    const char *c = static_cast<const char *>(cache.untyped_data());
    const int64_t threads = std::max<int64_t>(1, pool.num_threads());
    parallel_for(pool, ntasks, std::min<int64_t>(threads, ntasks), 1, [&, c, o](int64_t t0, int64_t t1) {
        if (prefill_attention_tasks(q.typed_data(), Hq * D, qs.data(), ql.data(), kl.data(), bt + a * W, (int)W, c,
                                    c + D * KvBytes(kv), 2 * Hkv * D, 2 * D, (int)bs, (int)Hq, (int)Hkv, (int)D, scale,
                                    window, o, Hq * D, n, bq, (int)t0, (int)t1, kv))
            rc.store(1);
    });
    if (rc.load()) return ffi::Error::Internal("prefill attention: out of memory");
    return ffi::Error::Success();
}

// A step's activations, reused between calls (it only grows: ~36 KiB a token for the embedded model) so a
// step does not fault in fresh pages; a second call running at the same time gets its own.
struct Workspace {
    std::mutex mu;
    std::vector<float> buf;
};
Workspace g_workspace;

// Every decoder layer of a ragged step in one call (a float32 Llama-family decoder whose linears are packed
// in panel_gemm's panels, `model.forward`'s CPU path): the kernels of the per-layer custom calls, in their
// order on the same data, so the hidden states are the same bits as through them (and as the torch
// backend's): RMSNorm (the residual add fused in), the q/k/v linear, the q/k/v bias and the q/k norms where
// the model has them, RoPE, the new K/V written into layer l's blocks of the cache ([L * NB, bs, 2 Hkv, D],
// layer l's block b at row l * NB + b), decode attention of the decode rows and prefill attention of the
// others, the o linear, RMSNorm, gate/up, SiLU and down. x [T, H] (the embeddings) -> out [T, H] (the residual
// stream after the last layer, before the final norm). The operands are checked here; layers.c's run_layers
// computes them (the torch backend's one-call layers, the same code), its phases on one Team of XLA's threads,
// the interleaved cache read and written through its strides.
// keep [R] and all_rows [1]: unless all_rows[0], only rows keep[0 .. requests) of out are wanted (the rows the
// step samples from: `logits_indices`, distinct), and the last layer runs its o linear and MLP for those rows alone,
// gathered; every row's K and V are still written. Those rows get the same bits (each row's arithmetic does not
// depend on the others); the others get the residual stream before the last layer's attention.
ffi::Error Layers(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> attn_norm,
                  ffi::Buffer<ffi::F32> mlp_norm, ffi::Buffer<ffi::F32> qkv_w, ffi::Buffer<ffi::F32> o_w,
                  ffi::Buffer<ffi::F32> gate_up_w, ffi::Buffer<ffi::F32> down_w, ffi::Buffer<ffi::F32> qkv_b,
                  ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos,
                  ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> table,
                  ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> distribution,
                  ffi::Buffer<ffi::S32> keep, ffi::Buffer<ffi::S32> all_rows, ffi::Buffer<ffi::U8> qkv_qx,
                  ffi::Buffer<ffi::U8> o_qx, ffi::Buffer<ffi::U8> gate_up_qx, ffi::Buffer<ffi::U8> down_qx,
                  ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> cache_out, float eps, float scale,
                  int32_t window, int32_t num_heads, int32_t qx_kinds, int32_t qx_rows) {
    const auto xd = x.dimensions(), cd = cache.dimensions(), td = table.dimensions();
    if (xd.size() != 2 || cd.size() != 4 || td.size() != 2 || kv_lens.dimensions().size() != 1 ||
        cu_q_lens.dimensions().size() != 1 || distribution.element_count() != 3 || all_rows.element_count() != 1)
        return ffi::Error::InvalidArgument("layers: x [T, H], cache [L NB, bs, 2 Hkv, D], table [R, W], kv_lens [R], "
                                           "cu_q_lens [R + 1], distribution [3], keep [R], all_rows [1]");
    // linear i's weights (qkv, o, gate_up, down): float32 panels [L, NP, K, 16] and/or qx panels [L, NP, K / 32,
    // group bytes] of kind byte i of qx_kinds, which steps of up to qx_rows tokens (not counting padding) multiply
    // instead; the float32 ones empty where the qx ones take every step (QX_BDOT's: --dtype bfloat16)
    const ffi::Buffer<ffi::F32> *f32_b[4] = {&qkv_w, &o_w, &gate_up_w, &down_w};
    ffi::Buffer<ffi::U8> *qx_b[4] = {&qkv_qx, &o_qx, &gate_up_qx, &down_qx};
    int64_t pl[4], pnp[4], pk[4];  // each linear's L, NP, K (-1: neither panels of a known shape)
    for (int i = 0; i < 4; i++) {
        const bool f = f32_b[i]->element_count() != 0;
        const auto d = f ? f32_b[i]->dimensions() : qx_b[i]->dimensions();
        const bool ok = d.size() == 4 && (f ? d[3] == 16 : qx_b[i]->element_count() != 0);
        pl[i] = ok ? d[0] : -1, pnp[i] = ok ? d[1] : 0, pk[i] = ok ? (f ? d[2] : d[2] * 32) : 0;
    }
    const int64_t T = xd[0], H = xd[1], L = pl[0], bs = cd[1], Hkv = cd[2] / 2, D = cd[3], Hq = num_heads;
    const int64_t R = td[0], W = td[1], I = pk[3], QKV = (Hq + 2 * Hkv) * D;
    const int64_t lin_k[4] = {H, Hq * D, H, I}, lin_n[4] = {QKV, H, 2 * I, H};
    bool fit = true;
    for (int i = 0; i < 4; i++)
        fit = fit && pl[i] == L && pk[i] == lin_k[i] && lin_n[i] <= pnp[i] * 16 && lin_n[i] > (pnp[i] - 1) * 16;
    if (L <= 0 || H <= 0 || cd[2] % 2 || Hkv == 0 || Hq <= 0 || Hq % Hkv || D <= 0 || D % 2 || D > 1024 ||
        cd[0] % L || !fit || attn_norm.element_count() != (size_t)(L * H) ||
        mlp_norm.element_count() != (size_t)(L * H) || (qkv_b.element_count() != 0 && qkv_b.element_count() != (size_t)(L * QKV)) ||
        (q_norm.element_count() != 0 && q_norm.element_count() != (size_t)(L * D)) ||
        k_norm.element_count() != q_norm.element_count() || cos.element_count() != (size_t)(T * D) ||
        sin.element_count() != (size_t)(T * D) || kv_lens.dimensions()[0] != R || cu_q_lens.dimensions()[0] != R + 1 ||
        keep.element_count() != (size_t)R ||
        out->element_count() != (size_t)(T * H) || cache_out->element_count() != cache.element_count())
        return ffi::Error::InvalidArgument("layers: shapes disagree");
    const uint8_t *qx_w[4] = {nullptr, nullptr, nullptr, nullptr};
    int qx_kind[4];
    for (int i = 0; i < 4; i++) {
        qx_kind[i] = (int)(((uint32_t)qx_kinds >> (8 * i)) & 0xFF);
        if (qx_b[i]->element_count() == 0) continue;
        const long pb = qx_panel_bytes(qx_kind[i], (int)lin_k[i]);
        if (pb <= 0 || qx_b[i]->element_count() != (size_t)(L * pnp[i] * pb))
            return ffi::Error::InvalidArgument("layers: qx panels of another shape or kind");
        if (qx_kind[i] == QX_BDOT && !bdot_supported())
            return ffi::Error::InvalidArgument("layers: bfloat16 products (QX_BDOT) do not run on this CPU");
        qx_w[i] = qx_b[i]->typed_data();
    }
    for (int i = 0; i < 4; i++)
        if (f32_b[i]->element_count() == 0 && T > qx_rows)
            return ffi::Error::InvalidArgument("layers: a linear without float32 panels in a step its qx panels "
                                               "do not take");
    const int kv_type = KvType(cache.element_type());
    if (kv_type < 0 || cache_out->element_type() != cache.element_type())
        return ffi::Error::InvalidArgument("layers: the cache must be float32, float16 or bfloat16");
    const int64_t es = KvBytes(kv_type), NB = cd[0] / L, layer_bytes = NB * bs * 2 * Hkv * D * es;
    char *c = static_cast<char *>(cache_out->untyped_data());
    if (cache.untyped_data() != c) std::memcpy(c, cache.untyped_data(), cache.size_bytes());
    if (T == 0) return ffi::Error::Success();

    // the requests' tokens: every row they read lies in x and every block in the cache
    const int32_t *dist = distribution.typed_data(), *cu = cu_q_lens.typed_data(), *lens = kv_lens.typed_data();
    const int32_t *bt = table.typed_data();
    const int64_t d0 = std::clamp<int64_t>(dist[0], 0, R), d2 = std::clamp<int64_t>(dist[2], d0, R);
    std::vector<int64_t> slot(T, -1), dec_tok(d0);  // each token's cache row in a layer's blocks (-1: padding)
    std::vector<int32_t> qs, ql, kl;
    for (int64_t r = 0; r < d2; r++) {
        if (const char *why = RowOutside(cu, lens, bt, r, T, W, bs, NB))
            return ffi::Error::InvalidArgument(std::string("layers: ") + why);
        const int32_t s0 = cu[r], s1 = cu[r + 1], len = lens[r];
        if ((r > 0 && s0 < cu[r - 1]) || (r < d0 && s1 - s0 != 1))
            return ffi::Error::InvalidArgument("layers: cu_q_lens out of order (or a decode row's not one token)");
        for (int32_t t = s0; t < s1; t++) {
            const int64_t pos = len - (s1 - s0) + (t - s0);
            slot[t] = (int64_t)bt[r * W + pos / bs] * bs + pos % bs;
        }
        if (r < d0) {
            dec_tok[r] = s0;
        } else {
            qs.push_back(s0);
            ql.push_back(s1 - s0);
            kl.push_back(len);
        }
    }
    // the real tokens: rows [Tr, T) are padding (the bucket's), not computed; out gets zeros there
    const int64_t Tr = d2 > 0 ? cu[d2] : 0;
    if (Tr < T) std::fill(out->typed_data() + Tr * H, out->typed_data() + T * H, 0.f);
    if (Tr == 0) return ffi::Error::Success();
    const int np = (int)qs.size(), bq = prefill_attention_bq();
    const int p_tasks = prefill_attention_num_tasks(np, ql.data(), (int)Hkv, bq);
    if (p_tasks < 0) return ffi::Error::InvalidArgument("layers: too many prefill attention tasks");
    // the rows wanted from the last layer, when fewer than all (then its o linear and MLP run on them alone)
    const int32_t *kp = keep.typed_data();
    const int64_t S = all_rows.typed_data()[0] || d2 >= Tr ? Tr : d2;
    if (S < Tr)
        for (int64_t i = 0; i < S; i++)
            if (kp[i] < 0 || kp[i] >= Tr) return ffi::Error::InvalidArgument("layers: a kept row outside the tokens");

    // the kept rows, when fewer than all (the last layer runs its o linear and MLP on them alone)
    std::vector<int64_t> kept(S < Tr ? S : 0);
    for (int64_t i = 0; i < (int64_t)kept.size(); i++) kept[i] = kp[i];

    // layer l's weights and cache as run_layers reads them: linear i's float32 panels, and its qx panels where
    // given (steps of up to qx_rows tokens multiply those instead); layer l's blocks of the interleaved cache,
    // kv head h's K at 2h and V at 2h + 1 of a row
    std::vector<decode_layer> lys((size_t)L);
    for (int64_t l = 0; l < L; l++) {
        decode_layer &ly = lys[(size_t)l];
        std::memset(&ly, 0, sizeof ly);
        const float *f32_l[4];
        const void *qx_l[4];
        for (int i = 0; i < 4; i++) {
            f32_l[i] = f32_b[i]->element_count() == 0 ? nullptr : f32_b[i]->typed_data() + l * pnp[i] * lin_k[i] * 16;
            qx_l[i] = qx_w[i] == nullptr ? nullptr : qx_w[i] + l * pnp[i] * qx_panel_bytes(qx_kind[i], (int)lin_k[i]);
        }
        ly.attn_norm = attn_norm.typed_data() + l * H, ly.mlp_norm = mlp_norm.typed_data() + l * H;
        ly.qkv_w = f32_l[0], ly.o_w = f32_l[1], ly.gate_up_w = f32_l[2], ly.down_w = f32_l[3];
        ly.qkv_qx = qx_l[0], ly.o_qx = qx_l[1], ly.gate_up_qx = qx_l[2], ly.down_qx = qx_l[3];
        ly.qkv_qx_kind = qx_kind[0], ly.o_qx_kind = qx_kind[1], ly.gate_up_qx_kind = qx_kind[2];
        ly.down_qx_kind = qx_kind[3], ly.qx_rows = qx_rows;
        ly.qkv_b = qkv_b.element_count() == 0 ? nullptr : qkv_b.typed_data() + l * QKV;
        if (q_norm.element_count() != 0)
            ly.q_norm = q_norm.typed_data() + l * D, ly.k_norm = k_norm.typed_data() + l * D;
        ly.key_cache = c + l * layer_bytes, ly.value_cache = c + l * layer_bytes + D * es;
    }
    layers_step st{};
    st.T = (int)Tr, st.x = x.typed_data(), st.cos = cos.typed_data(), st.sin = sin.typed_data();
    st.slots = slot.data(), st.kv_row = 2 * Hkv * D, st.kv_head = 2 * D;
    st.n_dec = (int)d0, st.dec_tokens = dec_tok.data(), st.dec_kv_lens = lens, st.dec_tables = bt;
    st.dec_stride = (int)W;
    st.n_pre = np, st.pre_start = qs.data(), st.pre_lens = ql.data(), st.pre_kv_lens = kl.data();
    st.pre_tables = bt + d0 * W, st.pre_stride = (int)W;
    st.keep = kept.empty() ? nullptr : kept.data(), st.S = (int)S, st.keep_in_place = 1;
    st.block_size = (int)bs, st.H = (int)H, st.Hq = (int)Hq, st.Hkv = (int)Hkv, st.D = (int)D, st.I = (int)I;
    st.eps = eps, st.scale = scale, st.window = window, st.kv_type = kv_type;

    // the activations, reused between calls (layers_workspace)
    std::unique_lock<std::mutex> lock(g_workspace.mu, std::try_to_lock);
    std::vector<float> own;
    std::vector<float> &ws = lock.owns_lock() ? g_workspace.buf : own;
    const size_t need = (size_t)layers_workspace((int)Tr, (int)H, (int)Hq, (int)Hkv, (int)D, (int)I);
    if (ws.size() < need) ws.resize(need);

    auto team = Team::make(pool, std::max<int64_t>(1, pool.num_threads()));
    const layers_team lt = {team.get(), (int)team->threads(), TeamRun, TeamRunShared};
    const int rc = run_layers(lys.data(), (int)L, &st, ws.data(), out->typed_data(), &lt);
    team->finish();
    if (rc == -2) return ffi::Error::Internal("layers: out of memory");
    if (rc) return ffi::Error::InvalidArgument("layers: run_layers refused its arguments");
    return ffi::Error::Success();
}

}  // namespace

// The sampler's rows (torch backend's log_softmax_rows, inverse_cdf_rows, top_p_thresholds): each row on one
// thread in a fixed order, so a row's logprobs and draw depend neither on the other rows nor on the backend.
ffi::Error LogSoftmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out,
                      int32_t probs) {
    const auto xd = x.dimensions(), od = out->dimensions();
    if (xd.size() != 2 || od.size() != 2 || xd[1] == 0 || od[0] != xd[0] || od[1] != xd[1])
        return ffi::Error::InvalidArgument("x [M, V] and out [M, V] expected");
    const int64_t M = xd[0], V = xd[1];
    const float *xp = x.typed_data();
    float *op = out->typed_data();
    parallel_rows(pool, M, V, [=](int64_t a, int64_t b) {
        log_softmax_rows(xp + a * V, (int)(b - a), (int)V, V, op + a * V, probs);
    });
    return ffi::Error::Success();
}

ffi::Error InverseCdf(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> u,
                      ffi::ResultBuffer<ffi::S32> out) {
    const auto pd = p.dimensions(), ud = u.dimensions(), od = out->dimensions();
    if (pd.size() != 2 || ud.size() != 1 || od.size() != 1 || pd[1] == 0 || ud[0] != pd[0] || od[0] != pd[0])
        return ffi::Error::InvalidArgument("probs [M, V], u [M] and out [M] expected");
    const int64_t M = pd[0], V = pd[1];
    const float *pp = p.typed_data(), *up = u.typed_data();
    int32_t *op = out->typed_data();
    parallel_rows(pool, M, V, [=](int64_t a, int64_t b) {
        for (int64_t i = a; i < b; i++) {
            int64_t tok = 0;
            inverse_cdf_rows(pp + i * V, 1, (int)V, V, up + i, &tok);
            op[i] = (int32_t)tok;
        }
    });
    return ffi::Error::Success();
}

ffi::Error TopPThresholds(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> top_p,
                          ffi::ResultBuffer<ffi::F32> out) {
    const auto pd = p.dimensions(), td = top_p.dimensions(), od = out->dimensions();
    if (pd.size() != 2 || td.size() != 1 || od.size() != 1 || pd[1] == 0 || td[0] != pd[0] || od[0] != pd[0])
        return ffi::Error::InvalidArgument("probs [M, V], top_p [M] and out [M] expected");
    const int64_t M = pd[0], V = pd[1];
    const float *pp = p.typed_data(), *tp = top_p.typed_data();
    float *op = out->typed_data();
    std::atomic<int> rc{0};
    parallel_rows(pool, M, V, [=, &rc](int64_t a, int64_t b) {
        if (top_p_thresholds(pp + a * V, (int)(b - a), (int)V, V, tp + a, op + a) != 0) rc.store(1);
    });
    if (rc.load()) return ffi::Error::Internal("top_p_thresholds: out of memory");
    return ffi::Error::Success();
}

// whether [lo, hi) lies in private anonymous mappings (/proc/self/maps: 'p', no device, no inode), whose pages
// read as zero after MADV_DONTNEED (a shared or file-backed page would read its old contents again)
static bool private_anonymous(uintptr_t lo, uintptr_t hi) {
    FILE *f = std::fopen("/proc/self/maps", "r");
    if (f == nullptr) return false;
    char line[4096];
    uintptr_t covered = lo;
    bool ok = true, line_start = true;
    while (ok && covered < hi && std::fgets(line, sizeof line, f)) {
        const bool starts = line_start;  // (not the rest of a line longer than the buffer)
        line_start = std::strchr(line, '\n') != nullptr;
        unsigned long a, b, off, inode;
        unsigned dev_major, dev_minor;
        char perms[8];
        if (!starts ||
            std::sscanf(line, "%lx-%lx %7s %lx %x:%x %lu", &a, &b, perms, &off, &dev_major, &dev_minor, &inode) != 7)
            continue;
        if (b <= covered) continue;  // a mapping below (the lines are in address order)
        ok = a <= covered && perms[3] == 'p' && inode == 0 && dev_major == 0 && dev_minor == 0;
        covered = b;
    }
    std::fclose(f);
    return ok && covered >= hi;
}

// n bytes at p set to zero without writing most of them: the pages wholly inside go back to the OS (MADV_DONTNEED:
// a private anonymous page, which is what malloc and XLA's allocator hand out, then reads as zero and takes
// memory only once written), the partial pages at the two ends are memset. Memory of another kind, or a refused
// advice: all n bytes are memset. Returns 1 if the pages were handed back, 0 if everything was written.
extern "C" int zero_pages(void *ptr, size_t n) {
    if (n == 0) return 0;
    char *p = static_cast<char *>(ptr);
    const long ps = sysconf(_SC_PAGESIZE);
    const uintptr_t page = ps > 0 ? (uintptr_t)ps : 4096, a = (uintptr_t)p;
    const uintptr_t lo = (a + page - 1) / page * page, hi = (a + n) / page * page;
    if (hi <= lo || !private_anonymous(lo, hi) || madvise(reinterpret_cast<void *>(lo), hi - lo, MADV_DONTNEED)) {
        std::memset(p, 0, n);
        return 0;
    }
    std::memset(p, 0, lo - a);
    std::memset(reinterpret_cast<char *>(hi), 0, a + n - hi);
    return 1;
}

// out = zeros, by zero_pages (cpu_kernels.jax_ops.zeros: the CPU KV cache)
ffi::Error Zeros(ffi::Result<ffi::AnyBuffer> out) {
    zero_pages(out->untyped_data(), out->size_bytes());
    return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuKvWrite, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuPrefillAttention, PrefillAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuPanelLinear, PanelLinear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuPanelArgmax, PanelArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("n"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuQxLinear, QxLinear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuQxArgmax, QxArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("n")
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuSiluMul, SiluMul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuRope, Rope,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuLogSoftmax, LogSoftmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("probs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuInverseCdf, InverseCdf,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuTopPThresholds, TopPThresholds,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuLayers, Layers,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // attn_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mlp_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // o
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Arg<ffi::AnyBuffer>()         // the cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // distribution
                                  .Arg<ffi::Buffer<ffi::S32>>()  // keep
                                  .Arg<ffi::Buffer<ffi::S32>>()  // all_rows
                                  .Arg<ffi::Buffer<ffi::U8>>()   // qkv qx panels (empty: none)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // o
                                  .Arg<ffi::Buffer<ffi::U8>>()   // gate_up
                                  .Arg<ffi::Buffer<ffi::U8>>()   // down
                                  .Ret<ffi::Buffer<ffi::F32>>()  // hidden
                                  .Ret<ffi::AnyBuffer>()         // the cache (aliased)
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window")
                                  .Attr<int32_t>("num_heads")
                                  .Attr<int32_t>("qx_kinds")
                                  .Attr<int32_t>("qx_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveCpuZeros, Zeros, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
