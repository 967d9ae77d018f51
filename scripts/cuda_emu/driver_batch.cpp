// The references and the driver of scripts/cuda_emu/run_batch.sh (its emu.cpp includes this after
// shim_decode.h, common.cuh's helpers, decode.cu and attention.cu's split-KV decode kernels).
// Argument: gemv | gemv_x8 | mma | split | lean | moe | moe_q8 | moe_x8x2 | moe_grouped | moe_bulk | dn | attn | attn_int8 (attn and
// attn_int8 in bf16 builds: the tensor-core kernels' mode).
//
//   gemv: dec_gemv_rows (Decode::project_rows's launches, its split into launches of at most
//         rows_per_launch rows ported below) against an f64 dequantise-and-dot of MLX affine
//         weights (w = scale · q + bias per 64-column group, bf16 scale and bias, element j of a
//         u32 at bits · j), every store mode, 4- and 8-bit; and for one row against the one-row
//         kernels (dec_gemv4, dec_gemv4w, dec_gemv8), which sum in another order: compared to a
//         tolerance, since the GPU tests claim no bit equality there.
//   mma:  dec_mma_rows (the batched 4-bit projections on the tensor cores) against the same f64
//         product and against dec_gemv_rows (mma_case).
//   split: dec_gemv_rows_split (the router's launch over more lanes, router_rows_split) against
//         the f64 product and against dec_gemv_rows (another summation order: a tolerance).
//   lean: batch_lean_glue's kernels: rms_norm_rows bit for bit against rms_norm (and near an f64
//         norm), rows of 64 to 4,096 columns, strided; dec_gemv_rows_split_lean bit for bit
//         against dec_gemv_rows_split (and near the f64 product) on split's cases, 1 to 11 rows;
//         router_async_stage's dec_gemv_rows_split_async (x by cp.async) bit for bit against
//         dec_gemv_rows_split_lean on the same cases.
//   moe:  dec_glu4_rows + dec_down_combine_rows against an f64 MoE (softmax over 256 logits, top 8
//         with ties to the lower id, renormalised; SwiGLU; down; shared expert gated by
//         sigmoid; residual add), and bit for bit against dec_glu4 + dec_down_combine one token
//         at a time (the claim of tests/gpu/decode.rs).
//   moe_q8: dec_glu4_q8_rows + dec_down_combine_q8_rows (moe_int8) against an f64 MoE of the same
//         int8 rows (only f32 rounding apart), against the unquantised f64 within the bound of the
//         quantisation step, the routing bit for bit dec_glu4_rows', and bit for bit against
//         dec_glu4_q8 + dec_down_combine_q8 a token at a time.
//   moe_x8x2: moe_q8's checks for dec_glu4_x8x2_rows + dec_down_combine_x8x2_rows and their
//         one-token forms (moe_int8_pairs), the rows rounded to int8 pairs.
//   moe_grouped: dec_glu4_x8x2_grouped + dec_down_combine_x8x2_grouped (moe_grouped_rows) and the
//         down kernel's 16-warp block (dec_down_combine_x8x2_grouped_wide, grouped_down_wide) and
//         the rings of grouped_moe_stream (dec_glu4_x8x2_grouped_ring into NaN-filled outputs,
//         dec_down_combine_x8x2_grouped_ring) bit
//         for bit against dec_glu4_x8x2 + dec_down_combine_x8x2 a row at a time, 1, 3, 4 and 8 rows
//         with overlapping picks, on the full shape, the small checkpoint's (256 / 32 experts /
//         top 4 / 128) and tiny's (128 / 16 experts / top 4 / 64).
//   moe_bulk: dec_glu4_x8x2_bulk (moe_bulk: a block's tiles bulk-copied into shared memory, one
//         mbarrier each, before any is summed) bit for bit against dec_glu4_x8x2 on the launcher's
//         grid: the full shape on 132 SMs (3 tiles a block) and on 16 (the grid widened to 192
//         blocks of 3), routed experts of 516 rows beside a shared expert of 1,024 (a last tile of 4
//         rows, tiles past an item's rows copying nothing), and 512 columns (4 rows a warp, a
//         shared expert of 96 rows) on 132 SMs (a tile a block) and on 4 (3 a block).
//   gemv_x8: dec_gemv4_x8x2 + dec_gemv4w_x8x2 (gemv_int8: one-token 4-bit projections on int8
//         pairs of x) against an f64 product of the same pair-rounded x (only f32 rounding
//         apart), against the unrounded f64 within the pairs' bound element by element, and
//         beside dec_gemv4 / dec_gemv4w on the same row; with the RMSNorm and gated-norm prologues.
//   dn:   dec_dn_conv_rows + dec_dn_step_rows (per-sequence state tables) against an f64 conv +
//         gated delta rule (MODEL.md §2.5), two steps, and bit for bit against dec_dn_conv +
//         dec_dn_step one sequence at a time on copies of the states.
//   attn: attn_split_mma_prep_rows / _long_rows + attn_split_combine_rows (see run_attn_shape).
//   attn_int8: the same kernels, attn_qk_prep and kv_int8_dequant built with LILY_KV_INT8 (in
//         namespace kv8; `kv_cache int8`) on int8-row caches (see run_attn8_shape).
//
// Inputs are random, never zero; outputs are poisoned with NaN and followed by a guard band that
// must stay untouched. What this cannot show: races a GPU's real scheduling could expose (here a
// block's threads run as OS threads and blocks one after another, so a missing barrier is only
// caught when the OS happens to interleave the threads badly), memory ordering between blocks
// and kernels, programmatic dependent launch (griddepcontrol is a no-op: kernels run in order),
// NVRTC's FMA contraction (off here) and CUDA's approximate rsqrtf (see shim_decode.h).
#include <csignal>
#include <unistd.h>
#include <cinttypes>
#include <random>
#include <set>

#ifdef LILY_BF16_ACT
static const bool BF16 = true;
#else
static const bool BF16 = false;
#endif
static const int SM_COUNT = 132;  // the H200's: the launchers' persistent grids as on the device
static int g_fail = 0;
static std::mt19937_64 g_rng(20261205);

// Uniform in ±[0.05, 1) · scale: never zero (the GPU tests' Rng::val).
static float val(float scale) {
    double u = (g_rng() >> 11) * (1.0 / 9007199254740992.0);
    return (g_rng() & 1 ? 1.0f : -1.0f) * (float)(0.05 + 0.95 * u) * scale;
}
static std::vector<float> vec(size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& x : v) x = val(scale);
    return v;
}
// bf16 here: our own round-to-nearest-even (the reference does not borrow common.cuh's).
static uint16_t bf16_of(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static double f_of_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static double rb(double v) { return BF16 ? f_of_bf16(bf16_of((float)v)) : v; }  // act() of the reference

// A buffer with NaN bits in the guard band after its n elements.
static const size_t GUARD = 64;
template <class T>
struct Buf {
    std::vector<T> v;
    size_t n;
    explicit Buf(size_t n_) : v(n_ + GUARD), n(n_) { poison(); }
    void poison() { uint32_t p = 0x7fc00000u; for (auto& x : v) memcpy(&x, &p, 4); }
    T* p() { return v.data(); }
    T& operator[](size_t i) { return v[i]; }
    bool guard_ok() const {
        for (size_t i = n; i < v.size(); i++) { uint32_t u; memcpy(&u, &v[i], 4); if (u != 0x7fc00000u) return false; }
        return true;
    }
};

static void verdict(const char* what, bool ok, const char* fmt = "", double a = 0, double b = 0) {
    printf("  %-64s %s", what, ok ? "ok  " : "FAIL");
    printf(fmt, a, b);
    printf("\n");
    fflush(stdout);
    if (!ok) g_fail = 1;
}

// rel L2 of got against want; non-finite values count as failure (returned as 1e9).
static double rel_l2(const float* got, const double* want, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!std::isfinite(got[i])) return 1e9;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
}
static bool same_bits(const void* a, const void* b, size_t n4) { return memcmp(a, b, 4 * n4) == 0; }

// An MLX affine stack of `experts` [rows, cols] matrices, random codes, scales and biases.
struct QW {
    int bits, rows, cols, experts;
    std::vector<u32> q;
    std::vector<uint16_t> s, b;
    QW(int bits_, int experts_, int rows_, int cols_) : bits(bits_), rows(rows_), cols(cols_), experts(experts_) {
        size_t words = (size_t)experts * rows * cols * bits / 32, groups = (size_t)experts * rows * (cols / 64);
        q.resize(words);
        for (auto& w : q) w = (u32)g_rng();
        s.resize(groups); b.resize(groups);
        // w = s·q + b spans about ±(scale of the row), codes centred by the bias.
        float range = bits == 4 ? 15.0f : 255.0f;
        for (size_t g = 0; g < groups; g++) {
            float sc = std::fabs(val(0.08f)) / range;
            if (g_rng() % 5 == 0) sc = -sc;  // MLX may write negative scales
            s[g] = bf16_of(sc);
            b[g] = bf16_of(-0.5f * range * sc + val(0.01f));
        }
    }
    QWeight view() const {
        QWeight w;
        w.q = q.data(); w.scales = (const u16*)s.data(); w.biases = (const u16*)b.data();
        w.bits = bits; w.rows = rows; w.cols = cols; w.group = 64;
        return w;
    }
    int code(int e, int r, int c) const {
        size_t per = 32 / bits, row0 = ((size_t)e * rows + r) * (cols / per);
        u32 word = q[row0 + c / per];
        return (word >> (bits * (c % per))) & ((1u << bits) - 1);
    }
    double weight(int e, int r, int c) const {
        size_t g = ((size_t)e * rows + r) * (cols / 64) + c / 64;
        return f_of_bf16(s[g]) * code(e, r, c) + f_of_bf16(b[g]);
    }
    // f64 row · x
    double dot(int e, int r, const double* x) const {
        double acc = 0;
        for (int c = 0; c < cols; c++) acc += weight(e, r, c) * x[c];
        return acc;
    }
};

// ---- gemv ---------------------------------------------------------------------------------------

// Decode::project_rows's launch geometry (crates/lily-cuda/src/kernels/decode.rs).
static int rows_lanes_rpw(int cols) { int g = cols / 64, l = g >= 8 ? 8 : g >= 4 ? 4 : g >= 2 ? 2 : 1; return 32 / l; }
static size_t rows_smem_floats(int cols, int rows) { return (size_t)rows * (cols / 64) * (DEC_XPAD + 1); }
static int rows_per_launch(int cols) {
    for (int r = DEC_B_MAX; r >= 1; r--) if (rows_smem_floats(cols, r) * 4 <= 96 * 1024) return r;
    return 1;
}
struct Seg { const QW* w; int mode; };
static DecSegs make_segs(const std::vector<Seg>& segs, std::vector<float*> ys, int rows_per_tile) {
    DecSegs d{};
    int total = 0;
    for (int i = 0; i < DEC_MAX_SEGS; i++) d.s[i].tile0 = 0x7fffffff;
    for (size_t i = 0; i < segs.size(); i++) {
        d.s[i].w = segs[i].w->view(); d.s[i].y = ys[i]; d.s[i].mode = segs[i].mode; d.s[i].tile0 = total;
        total += (segs[i].w->rows + rows_per_tile - 1) / rows_per_tile;
    }
    d.n = (int)segs.size(); d.tiles = total;
    return d;
}
// Decode::project_rows' split of `rows` input rows into launches of at most `per`: launch(at, xb,
// nb) with the segments' outputs and the input at the launch's first row.
template <class Launch>
static void per_launch(const std::vector<Seg>& segs, const DecSegs& base, const float* x, int cols, int rows, int per,
                       Launch launch) {
    for (int b0 = 0; b0 < rows; b0 += per) {
        int nb = std::min(per, rows - b0);
        DecSegs at = base;
        for (size_t i = 0; i < segs.size(); i++) at.s[i].y += (size_t)b0 * segs[i].w->rows;
        launch(at, x + (size_t)b0 * cols, nb);
    }
}
static void project_rows(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols, int rows) {
    int warps = DEC_ROWS_WARPS;
    int rows_per_tile = warps * rows_lanes_rpw(cols);
    DecSegs base = make_segs(segs, ys, rows_per_tile);
    int grid = std::min(base.tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT);
    per_launch(segs, base, x, cols, rows, rows_per_launch(cols), [&](DecSegs at, const float* xb, int nb) {
        launch_k({grid, 1, 1}, warps * 32, rows_smem_floats(cols, nb), [&] { dec_gemv_rows(at, xb, nb, cols); });
    });
}
// Decode::project's one-row launch: dec_gemv4 / dec_gemv4w / dec_gemv8 (no prologue).
static void project_one(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols) {
    int G = cols / 64, lpr = std::min(32, G), spw = 32 / lpr;
    bool all4 = true, all8 = true;
    for (auto& s : segs) { all4 &= s.w->bits == 4; all8 &= s.w->bits == 8; }
    int R = all4 && G <= 32 ? DEC_R4 : 1;
    DecSegs d = make_segs(segs, ys, DEC_WARPS * spw * R);
    int grid = std::min(d.tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT);
    auto k = all4 && G <= 32 ? dec_gemv4 : all4 && G == 64 ? dec_gemv4w : all8 && G <= 32 ? dec_gemv8 : dec_gemv;
    launch_k({grid, 1, 1}, DEC_WARPS * 32, 0, [&] { k(d, x, nullptr, 0.0f, nullptr, 1, nullptr, cols); });
}

static void gemv_case(const char* name, int cols, std::vector<QW*> ws, std::vector<int> modes, std::vector<int> nbs) {
    std::vector<Seg> segs;
    for (size_t i = 0; i < ws.size(); i++) segs.push_back({ws[i], modes[i]});
    for (int nb : nbs) {
        std::vector<float> x = vec((size_t)nb * cols, 1.0f);
        if (BF16) for (auto& v : x) v = (float)f_of_bf16(bf16_of(v));
        std::vector<Buf<float>> outs;
        std::vector<std::vector<float>> resid;
        std::vector<float*> ys;
        for (size_t i = 0; i < ws.size(); i++) {
            outs.emplace_back((size_t)nb * ws[i]->rows);
            resid.push_back(vec((size_t)nb * ws[i]->rows, 1.0f));
            if (BF16) for (auto& v : resid.back()) v = (float)f_of_bf16(bf16_of(v));
        }
        for (size_t i = 0; i < ws.size(); i++) {
            if (modes[i] == DEC_RESIDUAL) std::copy(resid[i].begin(), resid[i].end(), outs[i].v.begin());
            ys.push_back(outs[i].p());
        }
        project_rows(segs, ys, x.data(), cols, nb);
        for (size_t i = 0; i < ws.size(); i++) {
            const QW& w = *ws[i];
            std::vector<double> want((size_t)nb * w.rows);
            double worst = 0;  // per element: |err| / Σ_j |w_j x_j|
            for (int b = 0; b < nb; b++) {
                std::vector<double> xd(x.begin() + (size_t)b * cols, x.begin() + (size_t)(b + 1) * cols);
                for (int r = 0; r < w.rows; r++) {
                    double y = 0, mag = 0;
                    for (int c = 0; c < cols; c++) { double t = w.weight(0, r, c) * xd[c]; y += t; mag += std::fabs(t); }
                    size_t at = (size_t)b * w.rows + r;
                    double want_v = modes[i] == DEC_RESIDUAL ? rb(resid[i][at] + rb(y)) : modes[i] == DEC_EXACT ? y : rb(y);
                    want[at] = want_v;
                    double got = outs[i][at];
                    double scale = mag + (modes[i] == DEC_RESIDUAL ? std::fabs(resid[i][at]) : 0);
                    double e = std::isfinite(got) ? std::fabs(got - want_v) / scale : 1e9;
                    worst = std::max(worst, e);
                }
            }
            double e = rel_l2(outs[i].p(), want.data(), want.size());
            const char* mode = modes[i] == DEC_STORE ? "store" : modes[i] == DEC_RESIDUAL ? "residual" : "exact";
            char what[160];
            snprintf(what, sizeof what, "%s: %d rows, %d cols, %d-bit x %d, %s", name, nb, cols, w.bits, w.rows, mode);
            // fp32: the GPU test's 1e-5; bf16: a stored value within a bf16 step of the f64 one.
            double tol = BF16 ? 1e-2 : 1e-5, tol_el = BF16 ? 8e-3 : 2e-6;
            verdict(what, e < tol && worst < tol_el && outs[i].guard_ok(), "  rel_l2 %.2e, worst element %.2e of Σ|w x|", e, worst);
        }
        if (nb == 1) {
            // The one-row kernels on the same row: another summation order, so a tolerance.
            std::vector<Buf<float>> one;
            std::vector<float*> ys1;
            for (size_t i = 0; i < ws.size(); i++) {
                one.emplace_back(ws[i]->rows);
                if (modes[i] == DEC_RESIDUAL) std::copy(resid[i].begin(), resid[i].end(), one.back().v.begin());
            }
            for (auto& o : one) ys1.push_back(o.p());
            // The one-row kernels are chosen by width: 4-bit and 8-bit weights go to separate launches.
            for (int bits : {4, 8}) {
                std::vector<Seg> sub; std::vector<float*> ysub;
                for (size_t i = 0; i < ws.size(); i++) if (ws[i]->bits == bits) { sub.push_back(segs[i]); ysub.push_back(ys1[i]); }
                if (!sub.empty()) project_one(sub, ysub, x.data(), cols);
            }
            for (size_t i = 0; i < ws.size(); i++) {
                double num = 0, den = 0; size_t differ = 0;
                for (int r = 0; r < ws[i]->rows; r++) {
                    double a = outs[i][r], b = one[i][r];
                    num += (a - b) * (a - b); den += b * b;
                    differ += memcmp(&outs[i][r], &one[i][r], 4) != 0;
                }
                double e = std::sqrt(num / std::max(den, 1e-300));
                char what[160];
                snprintf(what, sizeof what, "%s: 1 row vs the one-row kernel, %d-bit x %d", name, ws[i]->bits, ws[i]->rows);
                bool ok = std::isfinite(e) && e < (BF16 ? 1e-2 : 1e-6);
                printf("  %-64s %s  rel %.2e, %zu of %d values not bit-equal\n", what, ok ? "ok  " : "FAIL", e, differ, ws[i]->rows);
                if (!ok) g_fail = 1;
            }
        }
    }
}

static void run_gemv() {
    printf("dec_gemv_rows (activations %s)\n", BF16 ? "bf16" : "fp32");
    // DeltaNet's in_proj at the model's width: qkv 8192 and z 4096 rows (4-bit), b and a 32 rows
    // (8-bit here, to take the 8-bit path beside the 4-bit one), all four in one launch.
    QW qkv(4, 1, 8192, 2048), z(4, 1, 4096, 2048), bw(8, 1, 32, 2048), aw(8, 1, 32, 2048);
    gemv_case("in_proj", 2048, {&qkv, &z, &bw, &aw}, {DEC_STORE, DEC_RESIDUAL, DEC_EXACT, DEC_STORE}, {1, 3, 8});
    // Rows that end mid-tile, and more rows than a launch takes (11 = 8 + 3).
    QW w300(4, 1, 300, 2048), w77(8, 1, 77, 2048), w16(4, 1, 16, 2048), w1(8, 1, 1, 2048);
    gemv_case("ragged", 2048, {&w300, &w77, &w16, &w1}, {DEC_STORE, DEC_RESIDUAL, DEC_EXACT, DEC_STORE}, {2, 11});
    // out_proj / o_proj: 4096 → 2048 added into the residual; 8 rows take two launches (5 + 3).
    QW out(4, 1, 2048, 4096);
    gemv_case("out_proj", 4096, {&out}, {DEC_RESIDUAL}, {1, 8});
    // The router (exact logits) beside the shared expert's gate (one row), 8-bit as MLX stores them.
    QW router(8, 1, 256, 2048), sgate(8, 1, 1, 2048);
    gemv_case("router", 2048, {&router, &sgate}, {DEC_EXACT, DEC_STORE}, {1, 8});
    // The shared expert's down projection: 512 columns (8 groups, one a lane).
    QW sdown(4, 1, 2048, 512);
    gemv_case("shared down", 512, {&sdown}, {DEC_STORE}, {1, 3, 8});
    // Narrow inputs: 256 columns (4 lanes a weight row) and 64 (one).
    QW n256(4, 1, 77, 256), n64(8, 1, 300, 64);
    gemv_case("narrow", 256, {&n256}, {DEC_STORE}, {3});
    gemv_case("narrow", 64, {&n64}, {DEC_STORE}, {3});
}

// ---- split --------------------------------------------------------------------------------------

// Decode::project_rows's launches for RowsKernel::GemvSplit (decode.rs: tiles of
// SPLIT_WARPS rows, a persistent grid of at most 4 · BLOCKS_PER_SM blocks an SM, dec_gemv_rows'
// shared memory and rows a launch).
static void project_rows_split(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols, int rows) {
    DecSegs base = make_segs(segs, ys, DEC_SPLIT_WARPS);
    int grid = std::min(base.tiles, 4 * LAUNCH_BLOCKS_PER_SM * SM_COUNT);
    per_launch(segs, base, x, cols, rows, rows_per_launch(cols), [&](DecSegs at, const float* xb, int nb) {
        launch_k({grid, 1, 1}, DEC_SPLIT_WARPS * 32, rows_smem_floats(cols, nb),
                 [&] { dec_gemv_rows_split(at, xb, nb, cols); });
    });
}

// f64 W · x[b] for each weight against `got`, and `got` against `other` (another kernel's
// outputs on the same inputs); store modes as gemv_case's.
static void check_rows(const char* name, const char* other_name, int cols, const std::vector<QW*>& ws,
                       const std::vector<int>& modes, int nb, const std::vector<float>& x,
                       const std::vector<std::vector<float>>& resid, std::vector<Buf<float>>& got,
                       std::vector<Buf<float>>& other) {
    for (size_t i = 0; i < ws.size(); i++) {
        const QW& w = *ws[i];
        std::vector<double> want((size_t)nb * w.rows);
        for (int b = 0; b < nb; b++) {
            std::vector<double> xd(x.begin() + (size_t)b * cols, x.begin() + (size_t)(b + 1) * cols);
            for (int r = 0; r < w.rows; r++) {
                double y = w.dot(0, r, xd.data());
                size_t at = (size_t)b * w.rows + r;
                want[at] = modes[i] == DEC_RESIDUAL ? rb(resid[i][at] + rb(y)) : modes[i] == DEC_EXACT ? y : rb(y);
            }
        }
        double e = rel_l2(got[i].p(), want.data(), want.size());
        std::vector<double> od(other[i].p(), other[i].p() + want.size());
        double eo = rel_l2(got[i].p(), od.data(), want.size());
        const char* mode = modes[i] == DEC_STORE ? "store" : modes[i] == DEC_RESIDUAL ? "residual" : "exact";
        char what[160];
        snprintf(what, sizeof what, "%s: %d rows, %d cols, %d-bit x %d, %s", name, nb, cols, w.bits, w.rows, mode);
        char fmt[96];
        snprintf(fmt, sizeof fmt, "  rel_l2 %%.2e, vs %s %%.2e", other_name);
        double tol = BF16 ? 1e-2 : 1e-5;
        verdict(what, e < tol && eo < tol && got[i].guard_ok(), fmt, e, eo);
    }
}

// Fresh outputs for `ws` (residual ones holding `resid`), and their pointers.
static std::vector<Buf<float>> outputs(const std::vector<QW*>& ws, const std::vector<int>& modes, int nb,
                                       const std::vector<std::vector<float>>& resid, std::vector<float*>& ys) {
    std::vector<Buf<float>> outs;
    for (size_t i = 0; i < ws.size(); i++) {
        outs.emplace_back((size_t)nb * ws[i]->rows);
        if (modes[i] == DEC_RESIDUAL) std::copy(resid[i].begin(), resid[i].end(), outs.back().v.begin());
    }
    ys.clear();
    for (auto& o : outs) ys.push_back(o.p());
    return outs;
}

static std::vector<std::vector<float>> residuals(const std::vector<QW*>& ws, int nb) {
    std::vector<std::vector<float>> resid;
    for (auto* w : ws) {
        resid.push_back(vec((size_t)nb * w->rows, 1.0f));
        if (BF16) for (auto& v : resid.back()) v = (float)f_of_bf16(bf16_of(v));
    }
    return resid;
}

static void split_case(const char* name, int cols, std::vector<QW*> ws, std::vector<int> modes, std::vector<int> nbs) {
    std::vector<Seg> segs;
    for (size_t i = 0; i < ws.size(); i++) segs.push_back({ws[i], modes[i]});
    for (int nb : nbs) {
        std::vector<float> x = vec((size_t)nb * cols, 1.0f);
        if (BF16) for (auto& v : x) v = (float)f_of_bf16(bf16_of(v));
        auto resid = residuals(ws, nb);
        std::vector<float*> ys;
        auto got = outputs(ws, modes, nb, resid, ys);
        project_rows_split(segs, ys, x.data(), cols, nb);
        auto gemv = outputs(ws, modes, nb, resid, ys);
        project_rows(segs, ys, x.data(), cols, nb);
        check_rows(name, "dec_gemv_rows", cols, ws, modes, nb, x, resid, got, gemv);
    }
}

static void run_split() {
    printf("dec_gemv_rows_split (activations %s)\n", BF16 ? "bf16" : "fp32");
    // The router (exact logits) with the shared expert's gate, 8-bit as MLX stores them: 257 rows.
    QW router(8, 1, 256, 2048), sgate(8, 1, 1, 2048);
    split_case("router", 2048, {&router, &sgate}, {DEC_EXACT, DEC_STORE}, {1, 3, 8, 11});
    // 4- and 8-bit in one launch, rows ending mid-tile, every store mode.
    QW w77(4, 1, 77, 2048), w5(8, 1, 5, 2048), w30(4, 1, 30, 2048);
    split_case("ragged", 2048, {&w77, &w5, &w30}, {DEC_STORE, DEC_RESIDUAL, DEC_EXACT}, {2, 8});
    // 4,096 columns (two groups a lane; 5 rows a launch) and 256 (4 groups: most lanes idle).
    QW wide(4, 1, 41, 4096), n256(8, 1, 19, 256);
    split_case("wide", 4096, {&wide}, {DEC_RESIDUAL}, {8});
    split_case("narrow", 256, {&n256}, {DEC_EXACT}, {3});
}

// ---- lean ---------------------------------------------------------------------------------------

// batch_lean_glue: rms_norm_rows (Norm::rms_norm_rows: a block of RMS_ROWS_THREADS a row) bit for
// bit against rms_norm (Norm::rms_norm: 256 threads a row) and within a tolerance of an f64 norm;
// dec_gemv_rows_split_lean bit for bit against dec_gemv_rows_split on project_rows_split's
// launches (the same grid, rows a launch and shared memory).
static void norm_case(int cols, int rows, int x_stride, int y_stride) {
    std::vector<float> x = vec((size_t)rows * x_stride, 1.5f), w = vec(cols, 1.0f);
    for (int r = 0; r < rows; r++)  // rows of different scales, some far from 1
        for (int c = 0; c < cols; c++) x[(size_t)r * x_stride + c] *= (float)(r + 1) * (r % 2 ? 7.0f : 0.05f);
    const float eps = 1e-6f;
    Buf<float> a((size_t)rows * y_stride), b((size_t)rows * y_stride);
    launch_k({rows, 1, 1}, 256, 0, [&] { rms_norm(x.data(), x_stride, w.data(), a.p(), y_stride, cols, eps, rows); });
    launch_k({rows, 1, 1}, RMS_ROWS_THREADS, 0,
             [&] { rms_norm_rows(x.data(), x_stride, w.data(), b.p(), y_stride, cols, eps, rows); });
    bool same = true;
    std::vector<double> want((size_t)rows * cols);
    std::vector<float> got((size_t)rows * cols);
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int c = 0; c < cols; c++) ss += (double)x[(size_t)r * x_stride + c] * x[(size_t)r * x_stride + c];
        double inv = 1.0 / std::sqrt(ss / cols + eps);
        same = same && same_bits(a.p() + (size_t)r * y_stride, b.p() + (size_t)r * y_stride, cols);
        for (int c = 0; c < cols; c++) {
            want[(size_t)r * cols + c] = rb(x[(size_t)r * x_stride + c] * inv * w[c]);
            got[(size_t)r * cols + c] = b.p()[(size_t)r * y_stride + c];
        }
    }
    double e = rel_l2(got.data(), want.data(), want.size());
    char what[160];
    snprintf(what, sizeof what, "rms_norm_rows: %d rows of %d cols (strides %d, %d)", rows, cols, x_stride, y_stride);
    verdict(what, same && e < (BF16 ? 1e-2 : 1e-5) && b.guard_ok(), same ? "  rms_norm's bits, rel_l2 %.2e" : "  differs from rms_norm, rel_l2 %.2e", e);
}

static void project_rows_split_lean(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols, int rows) {
    DecSegs base = make_segs(segs, ys, DEC_SPLIT_WARPS);
    int grid = std::min(base.tiles, 4 * LAUNCH_BLOCKS_PER_SM * SM_COUNT);
    per_launch(segs, base, x, cols, rows, rows_per_launch(cols), [&](DecSegs at, const float* xb, int nb) {
        launch_k({grid, 1, 1}, DEC_SPLIT_WARPS * 32, rows_smem_floats(cols, nb),
                 [&] { dec_gemv_rows_split_lean(at, xb, nb, cols); });
    });
}

// router_async_stage: dec_gemv_rows_split_async on the same launches (rows_stage_async: x by cp.async).
static void project_rows_split_async(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols, int rows) {
    DecSegs base = make_segs(segs, ys, DEC_SPLIT_WARPS);
    int grid = std::min(base.tiles, 4 * LAUNCH_BLOCKS_PER_SM * SM_COUNT);
    per_launch(segs, base, x, cols, rows, rows_per_launch(cols), [&](DecSegs at, const float* xb, int nb) {
        launch_k({grid, 1, 1}, DEC_SPLIT_WARPS * 32, rows_smem_floats(cols, nb),
                 [&] { dec_gemv_rows_split_async(at, xb, nb, cols); });
    });
}

static void split_lean_case(const char* name, int cols, std::vector<QW*> ws, std::vector<int> modes, std::vector<int> nbs) {
    std::vector<Seg> segs;
    for (size_t i = 0; i < ws.size(); i++) segs.push_back({ws[i], modes[i]});
    for (int nb : nbs) {
        std::vector<float> x = vec((size_t)nb * cols, 1.0f);
        if (BF16) for (auto& v : x) v = (float)f_of_bf16(bf16_of(v));
        auto resid = residuals(ws, nb);
        std::vector<float*> ys;
        auto lean = outputs(ws, modes, nb, resid, ys);
        project_rows_split_lean(segs, ys, x.data(), cols, nb);
        auto split = outputs(ws, modes, nb, resid, ys);
        project_rows_split(segs, ys, x.data(), cols, nb);
        auto async = outputs(ws, modes, nb, resid, ys);
        project_rows_split_async(segs, ys, x.data(), cols, nb);
        for (size_t i = 0; i < ws.size(); i++) {
            size_t n = (size_t)nb * ws[i]->rows;
            bool a_same = same_bits(async[i].p(), lean[i].p(), n) && async[i].guard_ok();
            char a_what[160];
            snprintf(a_what, sizeof a_what, "dec_gemv_rows_split_async %s: %d rows, %d cols, %d-bit x %d", name, nb,
                     cols, ws[i]->bits, ws[i]->rows);
            verdict(a_what, a_same, a_same ? "  dec_gemv_rows_split_lean's bits" : "  differs from dec_gemv_rows_split_lean");
            bool same = same_bits(lean[i].p(), split[i].p(), n) && lean[i].guard_ok();
            bool finite = true;
            for (size_t j = 0; j < n; j++) finite = finite && std::isfinite(lean[i].p()[j]);
            char what[160];
            snprintf(what, sizeof what, "dec_gemv_rows_split_lean %s: %d rows, %d cols, %d-bit x %d", name, nb, cols,
                     ws[i]->bits, ws[i]->rows);
            verdict(what, same && finite, same ? "  dec_gemv_rows_split's bits" : "  differs from dec_gemv_rows_split");
        }
        // and against the f64 product (check_rows: the lean outputs, dec_gemv_rows_split's beside)
        check_rows(name, "dec_gemv_rows_split", cols, ws, modes, nb, x, resid, lean, split);
    }
}

static void run_lean() {
    printf("batch_lean_glue: rms_norm_rows, dec_gemv_rows_split_lean (activations %s)\n", BF16 ? "bf16" : "fp32");
    norm_case(2048, 8, 2048, 2048);
    norm_case(2048, 3, 2048 + 64, 2048 + 128);
    norm_case(4096, 2, 4096, 4096);  // RMS_ROWS_REG · 256: every register a thread
    norm_case(1000, 5, 1000, 1024);  // a ragged last column step
    norm_case(64, 1, 64, 64);        // most threads idle
    QW router(8, 1, 256, 2048), sgate(8, 1, 1, 2048);
    split_lean_case("router", 2048, {&router, &sgate}, {DEC_EXACT, DEC_STORE}, {1, 2, 3, 4, 8, 11});
    QW w77(4, 1, 77, 2048), w5(8, 1, 5, 2048), w30(4, 1, 30, 2048);
    split_lean_case("ragged", 2048, {&w77, &w5, &w30}, {DEC_STORE, DEC_RESIDUAL, DEC_EXACT}, {3, 8});
    QW wide(4, 1, 41, 4096), n256(8, 1, 19, 256);
    split_lean_case("wide", 4096, {&wide}, {DEC_RESIDUAL}, {8});
    split_lean_case("narrow", 256, {&n256}, {DEC_EXACT}, {3});
}

// ---- mma ----------------------------------------------------------------------------------------

// Decode::project_rows' launch geometry for RowsKernel::Mma (crates/lily-cuda/src/kernels/decode.rs
// mma_smem, mma_split), on a device of `sms` SMs (the H200's, or a few so that every block loops
// over several tiles and a warp's chunks cross tile boundaries).
static size_t mma_smem_floats(int cols, int nb) {
    int G = cols / 64;
    return (size_t)nb * (G * 32 + 4) + (size_t)G * DEC_B_MAX + 2 * DEC_MMA_WARPS * 128;
}
static void project_rows_mma(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols, int rows,
                             int sms, int split) {
    DecSegs base = make_segs(segs, ys, 16);
    int per_block = split ? 1 : DEC_MMA_WARPS;
    int grid = std::min((base.tiles + per_block - 1) / per_block, DEC_MMA_BLOCKS * sms);
    per_launch(segs, base, x, cols, rows, DEC_B_MAX, [&](DecSegs at, const float* xb, int nb) {
        launch_k({grid, 1, 1}, DEC_MMA_WARPS * 32, mma_smem_floats(cols, nb),
                 [&] { dec_mma_rows(at, xb, nb, cols, split); });
    });
}

// RowsKernel::MmaDeep (decode.rs mma_deep_stages, blocks_by_smem): dec_mma_rows' smem and its
// MMA_STAGES (3) chunk stages a warp, 2 where 3 would pass BATCH_SMEM_MAX (96 KB); the grid as many
// blocks an SM as the H200's shared memory (232,448 bytes a block + 1 KB reserved) holds.
static int mma_deep_stages(int cols, int nb) {
    size_t stage = 16 * (DEC_MMA_CHUNK * 32 + 32);
    return mma_smem_floats(cols, nb) * 4 + DEC_MMA_WARPS * 3 * stage <= 96 * 1024 ? 3 : 2;
}
static size_t mma_deep_smem_floats(int cols, int nb) {
    return mma_smem_floats(cols, nb) + (size_t)DEC_MMA_WARPS * mma_deep_stages(cols, nb) * 16 * (DEC_MMA_CHUNK * 32 + 32) / 4;
}
// rounds: dec_mma_rows_deep_rounds (`mma_stage_rounds`) instead of dec_mma_rows_deep.
static void project_rows_mma_deep(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols,
                                  int rows, int sms, int split, bool rounds = false) {
    DecSegs base = make_segs(segs, ys, 16);
    int per_block = split ? 1 : DEC_MMA_WARPS;
    int first = std::min(rows, DEC_B_MAX);
    int per_sm = std::clamp((232448 + 1024) / ((int)mma_deep_smem_floats(cols, first) * 4 + 1024), 1, DEC_MMA_BLOCKS);
    int grid = std::min((base.tiles + per_block - 1) / per_block, per_sm * sms);
    per_launch(segs, base, x, cols, rows, DEC_B_MAX, [&](DecSegs at, const float* xb, int nb) {
        int stages = mma_deep_stages(cols, nb);
        launch_k({grid, 1, 1}, DEC_MMA_WARPS * 32, mma_deep_smem_floats(cols, nb),
                 [&] {
                     if (rounds) dec_mma_rows_deep_rounds(at, xb, nb, cols, split, stages);
                     else dec_mma_rows_deep(at, xb, nb, cols, split, stages);
                 });
    });
}

// dec_mma_rows (4-bit weights; x bf16 values, as bf16 mode gives it) against the f64 product,
// every store mode, whole tiles a warp and tiles split over the block's warps, on the H200's
// grid and on a 2-SM one; and against dec_gemv_rows on the same inputs (another summation
// order: a tolerance); dec_mma_rows_deep likewise, and bit for bit against dec_mma_rows for whole
// tiles a warp (split tiles: within the tolerance; another order of groups).
static void mma_case(const char* name, int cols, std::vector<QW*> ws, std::vector<int> modes, std::vector<int> nbs) {
    std::vector<Seg> segs;
    for (size_t i = 0; i < ws.size(); i++) segs.push_back({ws[i], modes[i]});
    for (int nb : nbs) {
        std::vector<float> x = vec((size_t)nb * cols, 1.0f);
        for (auto& v : x) v = (float)f_of_bf16(bf16_of(v));
        std::vector<std::vector<float>> resid;
        std::vector<std::vector<double>> want;
        for (size_t i = 0; i < ws.size(); i++) {
            const QW& w = *ws[i];
            resid.push_back(vec((size_t)nb * w.rows, 1.0f));
            for (auto& v : resid.back()) v = (float)f_of_bf16(bf16_of(v));
            want.emplace_back((size_t)nb * w.rows);
            for (int b = 0; b < nb; b++) {
                std::vector<double> xd(x.begin() + (size_t)b * cols, x.begin() + (size_t)(b + 1) * cols);
                for (int r = 0; r < w.rows; r++) {
                    double y = w.dot(0, r, xd.data());
                    size_t at = (size_t)b * w.rows + r;
                    want[i][at] = modes[i] == DEC_RESIDUAL ? rb(resid[i][at] + rb(y)) : modes[i] == DEC_EXACT ? y : rb(y);
                }
            }
        }
        auto run = [&](int kernel, int sms, int split) {  // 0: dec_gemv_rows, 1: dec_mma_rows, 2: _deep, 3: _deep_rounds
            std::vector<Buf<float>> outs;
            std::vector<float*> ys;
            for (size_t i = 0; i < ws.size(); i++) {
                outs.emplace_back((size_t)nb * ws[i]->rows);
                if (modes[i] == DEC_RESIDUAL) std::copy(resid[i].begin(), resid[i].end(), outs.back().v.begin());
            }
            for (auto& o : outs) ys.push_back(o.p());
            if (kernel >= 2) project_rows_mma_deep(segs, ys, x.data(), cols, nb, sms, split, kernel == 3);
            else if (kernel) project_rows_mma(segs, ys, x.data(), cols, nb, sms, split);
            else project_rows(segs, ys, x.data(), cols, nb);
            return outs;
        };
        auto gemv = run(0, SM_COUNT, 0);
        for (int sms : {SM_COUNT, 2}) {
            for (int split : {0, 1}) {
                auto got = run(1, sms, split);
                auto deep = run(2, sms, split);
                auto rounds = run(3, sms, split);
                for (size_t i = 0; i < ws.size(); i++) {
                    const QW& w = *ws[i];
                    double e = rel_l2(got[i].p(), want[i].data(), want[i].size());
                    double num = 0, den = 0;
                    for (size_t k = 0; k < want[i].size(); k++) {
                        double d = (double)got[i][k] - gemv[i][k];
                        num += d * d;
                        den += (double)gemv[i][k] * gemv[i][k];
                    }
                    double eg = std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-300)) : 1e9;
                    const char* mode = modes[i] == DEC_STORE ? "store" : modes[i] == DEC_RESIDUAL ? "residual" : "exact";
                    char what[160];
                    snprintf(what, sizeof what, "%s: %d rows, %d cols, 4-bit x %d, %s, %d SMs%s", name, nb, cols, w.rows,
                             mode, sms, split ? ", split" : "");
                    // fp32 stores: the sums' own rounding (1e-5, as the GPU tests' fp32 bound); bf16
                    // stores: a bf16 step.
                    double tol = BF16 ? 1e-2 : 1e-5;
                    verdict(what, e < tol && eg < tol && got[i].guard_ok(), "  rel_l2 %.2e, vs dec_gemv_rows %.2e", e, eg);
                    double ed = rel_l2(deep[i].p(), want[i].data(), want[i].size());
                    size_t same = 0;
                    for (size_t k = 0; k < want[i].size(); k++)
                        same += memcmp(&deep[i].v[k], &got[i].v[k], sizeof(float)) == 0;
                    char dwhat[200];
                    snprintf(dwhat, sizeof dwhat, "%s [deep, %d stages]", what, mma_deep_stages(cols, std::min(nb, DEC_B_MAX)));
                    // Whole tiles: dec_mma_rows' sums bit for bit; split tiles: its groups a warp in
                    // another order (mma_deep_gi), within the tolerance of it.
                    double em = rel_l2(deep[i].p(), std::vector<double>(got[i].v.begin(), got[i].v.begin() + want[i].size()).data(),
                                       want[i].size());
                    bool near = split ? em < tol : same == want[i].size();
                    verdict(dwhat, ed < tol && near && deep[i].guard_ok(),
                            "  rel_l2 %.2e, differing from dec_mma_rows %.0f", ed, (double)(want[i].size() - same));
                    // dec_mma_rows_deep_rounds (`mma_stage_rounds`): the deep kernel's bits, always.
                    size_t same_r = 0;
                    for (size_t k = 0; k < want[i].size(); k++)
                        same_r += memcmp(&rounds[i].v[k], &deep[i].v[k], sizeof(float)) == 0;
                    char rwhat[220];
                    snprintf(rwhat, sizeof rwhat, "%s [deep, staged in rounds]", what);
                    verdict(rwhat, same_r == want[i].size() && rounds[i].guard_ok(), "  differing from dec_mma_rows_deep %.0f",
                            (double)(want[i].size() - same_r));
                }
            }
        }
    }
}

static void run_mma() {
    printf("dec_mma_rows and dec_mma_rows_deep (activations %s)\n", BF16 ? "bf16" : "fp32");
    // DeltaNet's in_proj shape (narrower: qkv 1024, z 512, b and a 32 rows), four weights a launch.
    QW qkv(4, 1, 1024, 2048), z(4, 1, 512, 2048), bw(4, 1, 32, 2048), aw(4, 1, 32, 2048);
    mma_case("in_proj", 2048, {&qkv, &z, &bw, &aw}, {DEC_STORE, DEC_RESIDUAL, DEC_EXACT, DEC_STORE},
             {1, 2, 3, 4, 5, 6, 7, 8, 11});
    // Rows that end mid-tile, and more rows than a launch takes (11 = 8 + 3).
    QW w300(4, 1, 300, 2048), w77(4, 1, 77, 2048), w16(4, 1, 16, 2048), w1(4, 1, 1, 2048);
    mma_case("ragged", 2048, {&w300, &w77, &w16, &w1}, {DEC_STORE, DEC_RESIDUAL, DEC_EXACT, DEC_STORE}, {2, 11});
    // o_proj / out_proj's width: 4096 → (fewer) rows added into the residual.
    QW out(4, 1, 272, 4096);
    mma_case("out_proj", 4096, {&out}, {DEC_RESIDUAL}, {1, 3, 4, 8, 11});
    // 512 columns in (the shared expert's down width), and narrow ones (one or two groups).
    QW sdown(4, 1, 520, 512);
    mma_case("512 in", 512, {&sdown}, {DEC_STORE}, {1, 5, 8});
    QW n128(4, 1, 77, 128), n64(4, 1, 40, 64);
    mma_case("narrow", 128, {&n128}, {DEC_STORE}, {6});
    mma_case("narrow", 64, {&n64}, {DEC_EXACT}, {7});
}

// ---- moe ----------------------------------------------------------------------------------------

// The full shape by default; Moe(256, 32, 4, 128, 128) is the small synthetic checkpoint's.
struct Moe {
    int hidden, n_exp, top_k, inter, sinter;
    QW gate, up, sgate, sup;
    QW down, sdown;
    explicit Moe(int hidden_ = 2048, int n_exp_ = 256, int top_k_ = 8, int inter_ = 512, int sinter_ = 512)
        : hidden(hidden_), n_exp(n_exp_), top_k(top_k_), inter(inter_), sinter(sinter_),
          gate{4, n_exp_, inter_, hidden_}, up{4, n_exp_, inter_, hidden_}, sgate{4, 1, sinter_, hidden_},
          sup{4, 1, sinter_, hidden_}, down{4, n_exp_, hidden_, inter_}, sdown{4, 1, hidden_, sinter_} {}
};

struct MoeIo {
    int B, tk, h, inter, n_exp;
    std::vector<float> logits, xn, s_gate, x0;
    Buf<int> ids; Buf<float> rw, eh, sh, x;
    MoeIo(const Moe& m, int B_)
        : B(B_), tk(m.top_k), h(m.hidden), inter(m.inter), n_exp(m.n_exp),
          ids((size_t)B_ * m.top_k), rw((size_t)B_ * m.top_k), eh((size_t)B_ * m.top_k * m.inter),
          sh((size_t)B_ * m.sinter), x((size_t)B_ * m.hidden) {}
};

static int glu_per_item(const Moe& m) {
    int lpr = std::min(32, m.hidden / 64), spw = 32 / lpr, rows_per_tile = DEC_WARPS * spw * DEC_GLU_R4;
    int rows = std::max(m.gate.rows, m.sgate.rows);
    return (rows + rows_per_tile - 1) / rows_per_tile;
}
// Decode::glu_launch / down_combine_launch's geometry.
static void moe_rows(const Moe& m, MoeIo& io) {
    int per_item = glu_per_item(m), tiles = per_item * (m.top_k + 1);
    int per_token = (LAUNCH_BLOCKS_PER_SM * SM_COUNT + io.B - 1) / io.B;
    QWeight g = m.gate.view(), u = m.up.view(), sg = m.sgate.view(), su = m.sup.view();
    launch_k({std::min(tiles, per_token), io.B, 1}, DEC_WARPS * 32, 0, [&] {
        dec_glu4_rows(g, u, io.logits.data(), m.n_exp, m.top_k, io.ids.p(), io.rw.p(), sg, su, io.xn.data(),
                      io.eh.p(), m.inter, io.sh.p(), per_item);
    });
    int G = m.inter / 64, lpr = std::min(32, G), spw = 32 / lpr;
    int grid = (m.hidden + DEC_DOWN_WARPS * spw - 1) / (DEC_DOWN_WARPS * spw);
    size_t smem = (size_t)(m.top_k + 1) * G * (DEC_XPAD + 1) + (DEC_DOWN_KSPLIT + 1) * DEC_DOWN_WARPS * spw;
    QWeight d = m.down.view(), sd = m.sdown.view();
    launch_k({grid, io.B, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, smem, [&] {
        dec_down_combine_rows(d, sd, io.ids.p(), io.rw.p(), m.top_k, io.eh.p(), m.inter, io.sh.p(), io.s_gate.data(), io.x.p());
    });
}
static void moe_one_at_a_time(const Moe& m, MoeIo& io) {
    int per_item = glu_per_item(m), tiles = per_item * (m.top_k + 1);
    QWeight g = m.gate.view(), u = m.up.view(), sg = m.sgate.view(), su = m.sup.view();
    QWeight d = m.down.view(), sd = m.sdown.view();
    int G = m.inter / 64, lpr = std::min(32, G), spw = 32 / lpr;
    int grid = (m.hidden + DEC_DOWN_WARPS * spw - 1) / (DEC_DOWN_WARPS * spw);
    size_t smem = (size_t)(m.top_k + 1) * G * (DEC_XPAD + 1) + (DEC_DOWN_KSPLIT + 1) * DEC_DOWN_WARPS * spw;
    for (int t = 0; t < io.B; t++) {
        int* ids = io.ids.p() + t * m.top_k; float* rw = io.rw.p() + t * m.top_k;
        float* eh = io.eh.p() + (size_t)t * m.top_k * m.inter; float* sh = io.sh.p() + (size_t)t * m.sinter;
        launch_k({std::min(tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT), 1, 1}, DEC_WARPS * 32, 0, [&] {
            dec_glu4(g, u, io.logits.data() + t * m.n_exp, m.n_exp, m.top_k, ids, rw, sg, su,
                     io.xn.data() + (size_t)t * m.hidden, eh, m.inter, sh, per_item);
        });
        launch_k({grid, 1, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, smem, [&] {
            dec_down_combine(d, sd, ids, rw, m.top_k, eh, m.inter, sh, io.s_gate.data() + t, io.x.p() + (size_t)t * m.hidden);
        });
    }
}

static double silu(double v) { return v / (1 + std::exp(-v)); }

static void run_moe(std::vector<int> Bs, std::vector<int> bit_Bs) {
    printf("dec_glu4_rows + dec_down_combine_rows (activations %s)\n", BF16 ? "bf16" : "fp32");
    Moe m;
    for (int B : Bs) {
        MoeIo io(m, B);
        io.logits = vec((size_t)B * m.n_exp, 2.0f);
        io.xn = vec((size_t)B * m.hidden, 1.0f);
        if (BF16) for (auto& v : io.xn) v = (float)f_of_bf16(bf16_of(v));
        io.s_gate = vec(B, 1.0f);
        io.x0 = vec((size_t)B * m.hidden, 1.0f);
        if (BF16) for (auto& v : io.x0) v = (float)f_of_bf16(bf16_of(v));
        std::copy(io.x0.begin(), io.x0.end(), io.x.v.begin());
        moe_rows(m, io);
        // f64 reference, token by token.
        bool ids_ok = true;
        double e_rw = 0, e_h = 0, e_sh = 0, e_x = 0, min_gap = 1e9;
        for (int t = 0; t < B; t++) {
            const float* lt = io.logits.data() + (size_t)t * m.n_exp;
            double mx = -1e300, sum = 0;
            for (int e = 0; e < m.n_exp; e++) mx = std::max(mx, (double)lt[e]);
            std::vector<double> p(m.n_exp);
            for (int e = 0; e < m.n_exp; e++) { p[e] = std::exp(lt[e] - mx); sum += p[e]; }
            for (auto& v : p) v /= sum;
            std::vector<int> order(m.n_exp);
            for (int e = 0; e < m.n_exp; e++) order[e] = e;
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
            min_gap = std::min(min_gap, (p[order[m.top_k - 1]] - p[order[m.top_k]]) / p[order[0]]);
            double picked = 0;
            for (int k = 0; k < m.top_k; k++) picked += p[order[k]];
            std::vector<double> xd(io.xn.begin() + (size_t)t * m.hidden, io.xn.begin() + (size_t)(t + 1) * m.hidden);
            std::vector<double> y(m.hidden, 0.0), want_rw(m.top_k), want_h((size_t)m.top_k * m.inter), want_sh(m.sinter);
            for (int k = 0; k < m.top_k; k++) {
                int e = order[k];
                if (io.ids[(size_t)t * m.top_k + k] != e) ids_ok = false;
                want_rw[k] = rb(p[e] / picked);
                for (int r = 0; r < m.inter; r++) {
                    double gv = m.gate.dot(e, r, xd.data()), uv = m.up.dot(e, r, xd.data());
                    want_h[(size_t)k * m.inter + r] = rb(rb(silu(rb(gv))) * rb(uv));
                }
            }
            for (int r = 0; r < m.sinter; r++) {
                double gv = m.sgate.dot(0, r, xd.data()), uv = m.sup.dot(0, r, xd.data());
                want_sh[r] = rb(rb(silu(rb(gv))) * rb(uv));
            }
            double sg = rb(1 / (1 + std::exp(-(double)io.s_gate[t])));
            std::vector<double> want_x(m.hidden);
            for (int c = 0; c < m.hidden; c++) {
                double acc = 0;
                for (int k = 0; k < m.top_k; k++) acc += want_rw[k] * rb(m.down.dot(order[k], c, &want_h[(size_t)k * m.inter]));
                acc += rb(sg * rb(m.sdown.dot(0, c, want_sh.data())));
                want_x[c] = rb(io.x0[(size_t)t * m.hidden + c] + rb(acc));
            }
            e_rw = std::max(e_rw, rel_l2(io.rw.p() + (size_t)t * m.top_k, want_rw.data(), m.top_k));
            e_h = std::max(e_h, rel_l2(io.eh.p() + (size_t)t * m.top_k * m.inter, want_h.data(), want_h.size()));
            e_sh = std::max(e_sh, rel_l2(io.sh.p() + (size_t)t * m.sinter, want_sh.data(), m.sinter));
            // the residual's change (x − x0): what the kernel adds, not hidden under x0
            std::vector<float> dx(m.hidden); std::vector<double> want_dx(m.hidden);
            for (int c = 0; c < m.hidden; c++) {
                dx[c] = io.x[(size_t)t * m.hidden + c] - io.x0[(size_t)t * m.hidden + c];
                want_dx[c] = want_x[c] - io.x0[(size_t)t * m.hidden + c];
            }
            e_x = std::max(e_x, rel_l2(dx.data(), want_dx.data(), m.hidden));
        }
        bool guards = io.ids.guard_ok() && io.rw.guard_ok() && io.eh.guard_ok() && io.sh.guard_ok() && io.x.guard_ok();
        double tol = BF16 ? 2e-2 : 1e-5;
        char what[160];
        snprintf(what, sizeof what, "%d tokens: expert ids (top-8 margin ≥ %.1e of p_max)", B, min_gap);
        verdict(what, ids_ok);
        snprintf(what, sizeof what, "%d tokens: routing weights", B);
        verdict(what, e_rw < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e", e_rw);
        snprintf(what, sizeof what, "%d tokens: experts' hidden rows [%d, 8, 512]", B, B);
        verdict(what, e_h < tol, "  rel_l2 %.2e", e_h);
        snprintf(what, sizeof what, "%d tokens: shared expert's hidden rows", B);
        verdict(what, e_sh < tol, "  rel_l2 %.2e", e_sh);
        snprintf(what, sizeof what, "%d tokens: residual rows' update (x - x0)", B);
        verdict(what, e_x < (BF16 ? 5e-2 : 1e-5), "  rel_l2 %.2e", e_x);
        snprintf(what, sizeof what, "%d tokens: nothing written past the outputs", B);
        verdict(what, guards);
        if (std::find(bit_Bs.begin(), bit_Bs.end(), B) != bit_Bs.end()) {
            MoeIo one(m, B);
            one.logits = io.logits; one.xn = io.xn; one.s_gate = io.s_gate; one.x0 = io.x0;
            std::copy(io.x0.begin(), io.x0.end(), one.x.v.begin());
            moe_one_at_a_time(m, one);
            snprintf(what, sizeof what, "%d tokens vs dec_glu4 + dec_down_combine a token at a time", B);
            bool same = same_bits(io.ids.p(), one.ids.p(), io.ids.n) && same_bits(io.rw.p(), one.rw.p(), io.rw.n) &&
                        same_bits(io.eh.p(), one.eh.p(), io.eh.n) && same_bits(io.sh.p(), one.sh.p(), io.sh.n) &&
                        same_bits(io.x.p(), one.x.p(), io.x.n);
            verdict(what, same, same ? "  bit for bit" : "  differ");
        }
    }
}

// ---- moe_q8 -------------------------------------------------------------------------------------

// x rounded to int8 per 64-column group as moe_int8 specifies (decode.cu's stage_x8), in our own
// f32 steps: m = max|x|, x̂ = rint(x · (127 / m)) (ties to even), scale = m / 127; returns the
// dequantised values scale · x̂ (in f64: exact products of two f32) and each group's max in gmax.
static std::vector<double> q8_dequant(const float* x, int cols, std::vector<double>& gmax) {
    std::vector<double> out(cols);
    gmax.assign(cols / 64, 0.0);
    for (int g = 0; g < cols / 64; g++) {
        float m = 0.0f;
        for (int j = 0; j < 64; j++) m = std::max(m, std::fabs(x[g * 64 + j]));
        float inv = m > 0.0f ? 127.0f / m : 0.0f, scale = m / 127.0f;
        gmax[g] = m;
        for (int j = 0; j < 64; j++) {
            float prod = x[g * 64 + j] * inv;
            int qi = (int)std::nearbyint(prod);
            if (qi < -127 || qi > 127) { fprintf(stderr, "q8_dequant: %d out of int8\n", qi); std::abort(); }
            out[g * 64 + j] = (double)scale * qi;
        }
    }
    return out;
}

// x rounded to int8 pairs per 64-column group as gemv_int8 specifies (decode.cu's stage_x8x2), in
// our own f32 steps: m = max|x|, inv = 127 / m, scale = m / 127, x_hi = rint(x · inv), r =
// fma(−scale, x_hi, x), x_lo = rint(r · (254 · inv)) (ties to even); returns x̃ = scale · (254 x_hi +
// x_lo) / 254 in f64 (exact) and each group's max in gmax.
static std::vector<double> x8x2_dequant(const float* x, int cols, std::vector<double>& gmax) {
    std::vector<double> out(cols);
    gmax.assign(cols / 64, 0.0);
    for (int g = 0; g < cols / 64; g++) {
        float m = 0.0f;
        for (int j = 0; j < 64; j++) m = std::max(m, std::fabs(x[g * 64 + j]));
        float inv = m > 0.0f ? 127.0f / m : 0.0f, scale = m / 127.0f, inv_lo = 254.0f * inv;
        gmax[g] = m;
        for (int j = 0; j < 64; j++) {
            float v = x[g * 64 + j];
            int hi = (int)std::nearbyint(v * inv);
            int lo = (int)std::nearbyint(std::fmaf(-scale, (float)hi, v) * inv_lo);
            if (hi < -127 || hi > 127 || lo < -127 || lo > 127) {
                fprintf(stderr, "x8x2_dequant: (%d, %d) out of int8\n", hi, lo);
                std::abort();
            }
            out[g * 64 + j] = (double)scale * (254.0 * hi + lo) / 254.0;
        }
    }
    return out;
}

// dec_glu4_q8_rows + dec_down_combine_q8_rows (moe_int8) on the full MoE shape: the routing as
// dec_glu4_rows'; the hidden rows against an f64 SwiGLU of the same quantised arithmetic (int8 x
// per group, the weights' exact values; only f32 rounding between them) and against the
// unquantised f64 SwiGLU within the bound the quantisation step gives (|x̂ − x| ≤ max|x| / 254 per
// element, carried through SiLU(g)·u); the residual update against an f64 combine of the int8
// of the kernel's own hidden rows, and against the unquantised combine of them within its
// bound; everything bit for bit against dec_glu4_q8 + dec_down_combine_q8 a token at a time.
// With `pairs` (moe_int8_pairs): the _x8x2 kernels the same way, the rows rounded to int8 pairs
// (x8x2_dequant, |x̃ − x| ≤ max|x| / 64,516).
static size_t down_smem_q8(const Moe& m, bool pairs) {
    int G = m.inter / 64, lpr = std::min(32, G), spw = 32 / lpr, groups = (m.top_k + 1) * G;
    size_t f32_part = (size_t)groups * (DEC_XPAD + 1) + (DEC_DOWN_KSPLIT + 1) * DEC_DOWN_WARPS * spw;
    return (f32_part + 3) / 4 * 4 + (size_t)groups * ((pairs ? DEC_X8X2PAD : DEC_X8PAD) + 2);
}
static void run_moe_q8(std::vector<int> Bs, bool pairs) {
    const char* name = pairs ? "dec_glu4_x8x2_rows + dec_down_combine_x8x2_rows (moe_int8_pairs"
                             : "dec_glu4_q8_rows + dec_down_combine_q8_rows (moe_int8";
    printf("%s; activations %s)\n", name, BF16 ? "bf16" : "fp32");
    auto glu_rows = pairs ? dec_glu4_x8x2_rows : dec_glu4_q8_rows;
    auto glu_one = pairs ? dec_glu4_x8x2 : dec_glu4_q8;
    auto down_rows = pairs ? dec_down_combine_x8x2_rows : dec_down_combine_q8_rows;
    auto down_one = pairs ? dec_down_combine_x8x2 : dec_down_combine_q8;
    auto dequant = pairs ? x8x2_dequant : q8_dequant;
    const double step = pairs ? 64516 : 254;  // max|x| / step: the rounding's bound an element
    const int glu_blocks = pairs ? LAUNCH_BLOCKS_PER_SM : DEC_Q8_BLOCKS;
    Moe m;
    int per_item = glu_per_item(m), tiles = per_item * (m.top_k + 1);
    QWeight g = m.gate.view(), u = m.up.view(), sg = m.sgate.view(), su = m.sup.view();
    for (int B : Bs) {
        MoeIo io(m, B), f32(m, B);
        io.logits = vec((size_t)B * m.n_exp, 2.0f);
        io.xn = vec((size_t)B * m.hidden, 1.0f);
        // Some groups far wider than others: each group's own scale must be the one applied.
        for (int t = 0; t < B; t++) io.xn[(size_t)t * m.hidden + 64 * (3 + t) + 5] *= 9.0f;
        if (BF16) for (auto& v : io.xn) v = (float)f_of_bf16(bf16_of(v));
        int per_token = (glu_blocks * SM_COUNT + B - 1) / B;
        launch_k({std::min(tiles, per_token), B, 1}, DEC_WARPS * 32, 0, [&] {
            glu_rows(g, u, io.logits.data(), m.n_exp, m.top_k, io.ids.p(), io.rw.p(), sg, su, io.xn.data(),
                             io.eh.p(), m.inter, io.sh.p(), per_item);
        });
        // The f32 kernel on the same rows: the routing must not change.
        launch_k({std::min(tiles, (LAUNCH_BLOCKS_PER_SM * SM_COUNT + B - 1) / B), B, 1}, DEC_WARPS * 32, 0, [&] {
            dec_glu4_rows(g, u, io.logits.data(), m.n_exp, m.top_k, f32.ids.p(), f32.rw.p(), sg, su, io.xn.data(),
                          f32.eh.p(), m.inter, f32.sh.p(), per_item);
        });
        double e_q = 0, e_f = 0, worst = 0;
        bool in_bound = true;
        for (int t = 0; t < B; t++) {
            std::vector<double> gmax;
            const float* xt = io.xn.data() + (size_t)t * m.hidden;
            std::vector<double> xq = dequant(xt, m.hidden, gmax), xd(xt, xt + m.hidden);
            // item k < top_k: routed expert ids[k] (the ids check below holds them to the f32
            // kernel's); item top_k: the shared expert.
            for (int k = 0; k <= m.top_k; k++) {
                const QW& wg = k < m.top_k ? m.gate : m.sgate;
                const QW& wu = k < m.top_k ? m.up : m.sup;
                int e = k < m.top_k ? f32.ids[(size_t)t * m.top_k + k] : 0;
                int rows = k < m.top_k ? m.inter : m.sinter;
                const float* got = k < m.top_k ? io.eh.p() + ((size_t)t * m.top_k + k) * m.inter : io.sh.p() + (size_t)t * m.sinter;
                std::vector<double> want_q(rows), want_f(rows);
                for (int r = 0; r < rows; r++) {
                    double gq = wg.dot(e, r, xq.data()), uq = wu.dot(e, r, xq.data());
                    double gf = wg.dot(e, r, xd.data()), uf = wu.dot(e, r, xd.data());
                    want_q[r] = rb(rb(silu(rb(gq))) * rb(uq));
                    want_f[r] = silu(gf) * uf;
                    // |Δg| ≤ Σ_j |w_j| max|x|_group / 254 (and likewise u); |SiLU'| ≤ 1.1.
                    double eg = 0, eu = 0;
                    for (int c = 0; c < m.hidden; c++) {
                        eg += std::fabs(wg.weight(e, r, c)) * gmax[c / 64] / step;
                        eu += std::fabs(wu.weight(e, r, c)) * gmax[c / 64] / step;
                    }
                    double bound = 1.1 * eg * std::fabs(uf) + std::fabs(silu(gf)) * eu + 1.1 * eg * eu;
                    // and the rounding of the kernel's activations (bf16: act(g) carried through
                    // SiLU, |SiLU'| ≤ 1.1, then three roundings of 2^-9; doubled for margin)
                    bound += (BF16 ? (1.1 * std::fabs(gf * uf) + 3 * std::fabs(want_f[r])) * (1.0 / 256)
                                   : std::fabs(want_f[r]) * 1e-5) + 1e-7;
                    double d = std::fabs(got[r] - want_f[r]);
                    if (!(d <= bound)) in_bound = false;
                    worst = std::max(worst, d / bound);
                }
                e_q = std::max(e_q, rel_l2(got, want_q.data(), rows));
                e_f = std::max(e_f, rel_l2(got, want_f.data(), rows));
            }
        }
        char what[200];
        bool ids_same = same_bits(io.ids.p(), f32.ids.p(), io.ids.n) && same_bits(io.rw.p(), f32.rw.p(), io.rw.n);
        snprintf(what, sizeof what, "%d tokens: routing (ids, weights) as dec_glu4_rows'", B);
        verdict(what, ids_same, ids_same ? "  bit for bit" : "  differ");
        snprintf(what, sizeof what, "%d tokens: hidden rows vs f64 of the int8 x", B);
        verdict(what, e_q < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e", e_q);
        snprintf(what, sizeof what, "%d tokens: hidden rows vs unquantised f64, per element", B);
        verdict(what, in_bound, "  within the bound (worst %.2f of it); rel_l2 %.2e", worst, e_f);
        snprintf(what, sizeof what, "%d tokens: nothing written past the outputs", B);
        verdict(what, io.ids.guard_ok() && io.rw.guard_ok() && io.eh.guard_ok() && io.sh.guard_ok());
        // The down half on the kernel's own hidden rows.
        io.s_gate = vec(B, 1.0f);
        io.x0 = vec((size_t)B * m.hidden, 1.0f);
        if (BF16) for (auto& v : io.x0) v = (float)f_of_bf16(bf16_of(v));
        std::copy(io.x0.begin(), io.x0.end(), io.x.v.begin());
        QWeight dw = m.down.view(), sdw = m.sdown.view();
        int Gd = m.inter / 64, spw = 32 / std::min(32, Gd);
        int dgrid = (m.hidden + DEC_DOWN_WARPS * spw - 1) / (DEC_DOWN_WARPS * spw);
        launch_k({dgrid, B, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, down_smem_q8(m, pairs), [&] {
            down_rows(dw, sdw, io.ids.p(), io.rw.p(), m.top_k, io.eh.p(), m.inter, io.sh.p(),
                                     io.s_gate.data(), io.x.p());
        });
        double e_dq = 0, worst_d = 0;
        bool d_in_bound = true;
        for (int t = 0; t < B; t++) {
            // ĥ of each item (the kernel's hidden rows rounded as specified) and their group maxima
            std::vector<std::vector<double>> hq(m.top_k + 1), hmax(m.top_k + 1), hf(m.top_k + 1);
            for (int k = 0; k <= m.top_k; k++) {
                const float* hk = k < m.top_k ? io.eh.p() + ((size_t)t * m.top_k + k) * m.inter : io.sh.p() + (size_t)t * m.sinter;
                hq[k] = dequant(hk, m.inter, hmax[k]);
                hf[k].assign(hk, hk + m.inter);
            }
            double sgv = rb(1 / (1 + std::exp(-(double)io.s_gate[t])));
            std::vector<float> dx(m.hidden);
            std::vector<double> want_dx(m.hidden);
            for (int c = 0; c < m.hidden; c++) {
                double acc = 0, accf = 0, bound = 0;
                for (int k = 0; k <= m.top_k; k++) {
                    const QW& wd = k < m.top_k ? m.down : m.sdown;
                    int e = k < m.top_k ? io.ids[(size_t)t * m.top_k + k] : 0;
                    double wk = k < m.top_k ? (double)io.rw[(size_t)t * m.top_k + k] : sgv;
                    double dq = wd.dot(e, c, hq[k].data()), df = wd.dot(e, c, hf[k].data()), eb = 0;
                    for (int j = 0; j < m.inter; j++) eb += std::fabs(wd.weight(e, c, j)) * hmax[k][j / 64] / step;
                    acc += k < m.top_k ? wk * rb(dq) : rb(wk * rb(dq));
                    accf += wk * df;
                    bound += std::fabs(wk) * eb;
                }
                double want = rb(io.x0[(size_t)t * m.hidden + c] + rb(acc));
                want_dx[c] = want - io.x0[(size_t)t * m.hidden + c];
                dx[c] = io.x[(size_t)t * m.hidden + c] - io.x0[(size_t)t * m.hidden + c];
                // against the unquantised combine: the rounding step's bound and the activations' rounding
                bound += std::fabs(accf) * (BF16 ? 1.2e-2 : 1e-5) + (BF16 ? std::fabs(io.x0[(size_t)t * m.hidden + c]) * 4e-3 : 0) + 1e-7;
                double d = std::fabs((double)dx[c] - accf);
                if (!(d <= bound)) d_in_bound = false;
                worst_d = std::max(worst_d, d / bound);
            }
            e_dq = std::max(e_dq, rel_l2(dx.data(), want_dx.data(), m.hidden));
        }
        snprintf(what, sizeof what, "%d tokens: residual update vs f64 of the int8 hidden rows", B);
        verdict(what, e_dq < (BF16 ? 5e-2 : 1e-5), "  rel_l2 %.2e", e_dq);
        snprintf(what, sizeof what, "%d tokens: residual update vs unquantised f64, per element", B);
        verdict(what, d_in_bound, "  within the bound (worst %.2f of it)", worst_d);
        snprintf(what, sizeof what, "%d tokens: nothing written past the residual rows", B);
        verdict(what, io.x.guard_ok());
        MoeIo one(m, B), r96(m, B);
        std::copy(io.x0.begin(), io.x0.end(), one.x.v.begin());
        for (int t = 0; t < B; t++) {
            int* ids = one.ids.p() + t * m.top_k; float* rw = one.rw.p() + t * m.top_k;
            float* eh = one.eh.p() + (size_t)t * m.top_k * m.inter; float* sh = one.sh.p() + (size_t)t * m.sinter;
            launch_k({std::min(tiles, glu_blocks * SM_COUNT), 1, 1}, DEC_WARPS * 32, 0, [&] {
                glu_one(g, u, io.logits.data() + t * m.n_exp, m.n_exp, m.top_k, ids, rw, sg, su,
                            io.xn.data() + (size_t)t * m.hidden, eh, m.inter, sh, per_item);
            });
            if (pairs) {
                // down_96_regs: dec_down_combine_x8x2_r96 (the same code held to 96 registers)
                // from the same residual row, before the one-token kernel updates it.
                std::copy(io.x0.begin() + (size_t)t * m.hidden, io.x0.begin() + (size_t)(t + 1) * m.hidden,
                          r96.x.v.begin() + (size_t)t * m.hidden);
                launch_k({dgrid, 1, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, down_smem_q8(m, pairs), [&] {
                    dec_down_combine_x8x2_r96(dw, sdw, ids, rw, m.top_k, eh, m.inter, sh, io.s_gate.data() + t,
                                              r96.x.p() + (size_t)t * m.hidden);
                });
            }
            launch_k({dgrid, 1, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, down_smem_q8(m, pairs), [&] {
                down_one(dw, sdw, ids, rw, m.top_k, eh, m.inter, sh, io.s_gate.data() + t,
                                    one.x.p() + (size_t)t * m.hidden);
            });
        }
        bool same = same_bits(io.eh.p(), one.eh.p(), io.eh.n) && same_bits(io.sh.p(), one.sh.p(), io.sh.n) &&
                    same_bits(io.ids.p(), one.ids.p(), io.ids.n) && same_bits(io.x.p(), one.x.p(), io.x.n);
        snprintf(what, sizeof what, "%d tokens vs the one-token kernels a token at a time", B);
        verdict(what, same, same ? "  bit for bit" : "  differ");
        if (pairs) {
            bool same96 = same_bits(r96.x.p(), one.x.p(), r96.x.n) && r96.x.guard_ok();
            snprintf(what, sizeof what, "%d tokens: dec_down_combine_x8x2_r96 vs dec_down_combine_x8x2", B);
            verdict(what, same96, same96 ? "  bit for bit" : "  differ");
        }
    }
}

// ---- moe_grouped ---------------------------------------------------------------------------------

// dec_glu4_x8x2_grouped + dec_down_combine_x8x2_grouped (moe_grouped_rows: a batched step's MoE
// grouped by expert) on Decode::glu_grouped / down_combine_grouped's geometry, bit for bit against
// dec_glu4_x8x2 + dec_down_combine_x8x2 a row at a time (routing, hidden rows, residual rows), on
// rows whose picks overlap: a third of the rows copy the previous row's logits (every pick
// shared), the others all push the same few experts up (some picks shared by most rows).
static void run_moe_grouped(const Moe& m, const char* shape, std::vector<int> Bs) {
    printf("dec_glu4_x8x2_grouped + dec_down_combine_x8x2_grouped (moe_grouped_rows), %s shape; activations %s\n",
           shape, BF16 ? "bf16" : "fp32");
    int per_item = glu_per_item(m), tiles = per_item * (m.top_k + 1);
    QWeight g = m.gate.view(), u = m.up.view(), sg = m.sgate.view(), su = m.sup.view();
    QWeight dw = m.down.view(), sdw = m.sdown.view();
    int Gd = m.inter / 64, spw = 32 / std::min(32, Gd);
    int dgrid = (m.hidden + DEC_DOWN_WARPS * spw - 1) / (DEC_DOWN_WARPS * spw);
    for (int B : Bs) {
        MoeIo io(m, B), one(m, B);
        io.logits = vec((size_t)B * m.n_exp, 2.0f);
        int hot[3] = {1, m.n_exp / 2 + 3, m.n_exp - 2};
        for (int t = 0; t < B; t++) {
            float* lt = io.logits.data() + (size_t)t * m.n_exp;
            if (t % 3 == 1)
                std::copy(lt - m.n_exp, lt, lt);
            else
                for (int e : hot) lt[e] += 5.0f;
        }
        io.xn = vec((size_t)B * m.hidden, 1.0f);
        for (int t = 0; t < B; t++) io.xn[(size_t)t * m.hidden + 64 * ((3 + t) % (m.hidden / 64)) + 5] *= 9.0f;
        if (BF16) for (auto& v : io.xn) v = (float)f_of_bf16(bf16_of(v));
        io.s_gate = vec(B, 1.0f);
        io.x0 = vec((size_t)B * m.hidden, 1.0f);
        if (BF16) for (auto& v : io.x0) v = (float)f_of_bf16(bf16_of(v));
        std::copy(io.x0.begin(), io.x0.end(), io.x.v.begin());
        std::copy(io.x0.begin(), io.x0.end(), one.x.v.begin());
        int chunks = std::min(std::max(LAUNCH_BLOCKS_PER_SM * SM_COUNT / per_item, 1), 1 + B * m.top_k);
        launch_k({per_item, chunks, 1}, DEC_WARPS * 32, 0, [&] {
            dec_glu4_x8x2_grouped(g, u, io.logits.data(), m.n_exp, m.top_k, io.ids.p(), io.rw.p(), sg, su, io.xn.data(),
                                  io.eh.p(), m.inter, io.sh.p(), B);
        });
        size_t n_in = (size_t)B * (m.top_k + 1);
        size_t smem = n_in * Gd * (DEC_X8X2PAD + 2) + n_in * DEC_DOWN_WARPS * spw;
        launch_k({dgrid, 1, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, smem, [&] {
            dec_down_combine_x8x2_grouped(dw, sdw, io.ids.p(), io.rw.p(), m.top_k, io.eh.p(), m.inter, io.sh.p(),
                                          io.s_gate.data(), io.x.p(), B);
        });
        // grouped_moe_stream: the ring gate/up kernel into its own (NaN-filled) outputs.
        MoeIo ring(m, B);
        launch_k({per_item, chunks, 1}, DEC_WARPS * 32, 0, [&] {
            dec_glu4_x8x2_grouped_ring(g, u, io.logits.data(), m.n_exp, m.top_k, ring.ids.p(), ring.rw.p(), sg, su,
                                       io.xn.data(), ring.eh.p(), m.inter, ring.sh.p(), B);
        });
        // grouped_down_wide: the 16-warp block on the same hidden rows, its own residual rows.
        Buf<float> xw((size_t)B * m.hidden);
        std::copy(io.x0.begin(), io.x0.end(), xw.v.begin());
        launch_k({dgrid, 1, 1}, DEC_DOWN_WARPS * DEC_GRP_DOWN_KCOLS * 32, smem, [&] {
            dec_down_combine_x8x2_grouped_wide(dw, sdw, io.ids.p(), io.rw.p(), m.top_k, io.eh.p(), m.inter,
                                               io.sh.p(), io.s_gate.data(), xw.p(), B);
        });
        // grouped_moe_stream: the down kernel's ring (16 warps, DEC_GRP_DOWN_RING items a warp).
        Buf<float> xr((size_t)B * m.hidden);
        std::copy(io.x0.begin(), io.x0.end(), xr.v.begin());
        launch_k({dgrid, 1, 1}, DEC_DOWN_WARPS * DEC_GRP_DOWN_KCOLS * 32, smem, [&] {
            dec_down_combine_x8x2_grouped_ring(dw, sdw, io.ids.p(), io.rw.p(), m.top_k, io.eh.p(), m.inter,
                                               io.sh.p(), io.s_gate.data(), xr.p(), B);
        });
        for (int t = 0; t < B; t++) {
            int* ids = one.ids.p() + t * m.top_k; float* rw = one.rw.p() + t * m.top_k;
            float* eh = one.eh.p() + (size_t)t * m.top_k * m.inter; float* sh = one.sh.p() + (size_t)t * m.sinter;
            launch_k({std::min(tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT), 1, 1}, DEC_WARPS * 32, 0, [&] {
                dec_glu4_x8x2(g, u, io.logits.data() + t * m.n_exp, m.n_exp, m.top_k, ids, rw, sg, su,
                              io.xn.data() + (size_t)t * m.hidden, eh, m.inter, sh, per_item);
            });
            launch_k({dgrid, 1, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, down_smem_q8(m, true), [&] {
                dec_down_combine_x8x2(dw, sdw, ids, rw, m.top_k, eh, m.inter, sh, io.s_gate.data() + t,
                                      one.x.p() + (size_t)t * m.hidden);
            });
        }
        std::set<int> distinct(one.ids.v.begin(), one.ids.v.begin() + (size_t)B * m.top_k);
        char what[200];
        snprintf(what, sizeof what, "%d rows: picks overlap", B);
        verdict(what, B == 1 || (int)distinct.size() < B * m.top_k, "  %.0f picks, %.0f distinct experts",
                B * m.top_k, (double)distinct.size());
        bool route = same_bits(io.ids.p(), one.ids.p(), io.ids.n) && same_bits(io.rw.p(), one.rw.p(), io.rw.n);
        snprintf(what, sizeof what, "%d rows: routing (ids, weights) vs dec_glu4_x8x2 a row at a time", B);
        verdict(what, route, route ? "  bit for bit" : "  differ");
        bool hid = same_bits(io.eh.p(), one.eh.p(), io.eh.n) && same_bits(io.sh.p(), one.sh.p(), io.sh.n);
        snprintf(what, sizeof what, "%d rows: hidden rows vs dec_glu4_x8x2 a row at a time", B);
        verdict(what, hid, hid ? "  bit for bit" : "  differ");
        bool res = same_bits(io.x.p(), one.x.p(), io.x.n);
        double moved = 0;
        for (size_t i = 0; i < io.x.n; i++) moved = std::max(moved, (double)std::fabs(io.x[i] - io.x0[i]));
        snprintf(what, sizeof what, "%d rows: residual rows vs dec_down_combine_x8x2 a row at a time", B);
        verdict(what, res && moved > 0, res ? "  bit for bit (largest update %.3g)" : "  differ", moved);
        bool wide = same_bits(xw.p(), one.x.p(), xw.n);
        snprintf(what, sizeof what, "%d rows: residual rows of the 16-warp block (grouped_down_wide) vs a row at a time", B);
        verdict(what, wide, wide ? "  bit for bit" : "  differ");
        bool ring_glu = same_bits(ring.ids.p(), one.ids.p(), ring.ids.n) && same_bits(ring.rw.p(), one.rw.p(), ring.rw.n) &&
                        same_bits(ring.eh.p(), one.eh.p(), ring.eh.n) && same_bits(ring.sh.p(), one.sh.p(), ring.sh.n);
        snprintf(what, sizeof what, "%d rows: routing and hidden rows of the ring gate/up kernel (grouped_moe_stream) vs a row at a time", B);
        verdict(what, ring_glu, ring_glu ? "  bit for bit" : "  differ");
        bool ring_down = same_bits(xr.p(), one.x.p(), xr.n);
        snprintf(what, sizeof what, "%d rows: residual rows of the ring down kernel (grouped_moe_stream) vs a row at a time", B);
        verdict(what, ring_down, ring_down ? "  bit for bit" : "  differ");
        snprintf(what, sizeof what, "%d rows: nothing written past the outputs", B);
        verdict(what, io.ids.guard_ok() && io.rw.guard_ok() && io.eh.guard_ok() && io.sh.guard_ok() && io.x.guard_ok() &&
                          xw.guard_ok() && xr.guard_ok() && ring.ids.guard_ok() && ring.rw.guard_ok() &&
                          ring.eh.guard_ok() && ring.sh.guard_ok());
    }
}

// ---- moe_bulk -----------------------------------------------------------------------------------

// Decode::glu_bulk's grid (crates/lily-cuda/src/kernels/decode.rs, glu_bulk_grid): the persistent
// grid, widened where a block would get more than DEC_BULK_SLOTS tiles; and the slots its busiest
// block holds.
static std::pair<int, int> glu_bulk_grid(int tiles, int persistent) {
    int grid = std::max({std::min(tiles, persistent), (tiles + DEC_BULK_SLOTS - 1) / DEC_BULK_SLOTS, 1});
    return {grid, (tiles + grid - 1) / grid};
}

// dec_glu4_x8x2_bulk (moe_bulk: every tile of a block bulk-copied into shared memory before any
// is summed) on Decode::glu_bulk's geometry, bit for bit against dec_glu4_x8x2 (routing, routed
// and shared hidden rows; the GPU test glu_bulk_gives_dec_glu4_x8x2_bits' claim), on `sms` SMs
// (the persistent grid of LAUNCH_BLOCKS_PER_SM blocks each), two tokens.
static void run_moe_bulk(const Moe& m, const char* shape, int sms) {
    int per_item = glu_per_item(m), tiles = per_item * (m.top_k + 1);
    auto [grid, slots] = glu_bulk_grid(tiles, LAUNCH_BLOCKS_PER_SM * sms);
    printf("dec_glu4_x8x2_bulk (moe_bulk) vs dec_glu4_x8x2, %s shape, %d SMs: %d tiles, %d blocks of up to %d; "
           "activations %s\n",
           shape, sms, tiles, grid, slots, BF16 ? "bf16" : "fp32");
    QWeight g = m.gate.view(), u = m.up.view(), sg = m.sgate.view(), su = m.sup.view();
    for (int t = 0; t < 2; t++) {
        MoeIo io(m, 1), bulk(m, 1);
        io.logits = vec(m.n_exp, 2.0f);
        io.xn = vec(m.hidden, 1.0f);
        io.xn[64 * ((3 + t) % (m.hidden / 64)) + 5] *= 9.0f;
        if (BF16) for (auto& v : io.xn) v = (float)f_of_bf16(bf16_of(v));
        launch_k({std::min(tiles, LAUNCH_BLOCKS_PER_SM * sms), 1, 1}, DEC_WARPS * 32, 0, [&] {
            dec_glu4_x8x2(g, u, io.logits.data(), m.n_exp, m.top_k, io.ids.p(), io.rw.p(), sg, su, io.xn.data(),
                          io.eh.p(), m.inter, io.sh.p(), per_item);
        });
        launch_k({grid, 1, 1}, DEC_WARPS * 32, (size_t)slots * DEC_BULK_SLOT / 4, [&] {
            dec_glu4_x8x2_bulk(g, u, io.logits.data(), m.n_exp, m.top_k, bulk.ids.p(), bulk.rw.p(), sg, su,
                               io.xn.data(), bulk.eh.p(), m.inter, bulk.sh.p(), per_item);
        });
        char what[200];
        bool written = true;
        for (size_t i = 0; i < io.eh.n; i++) written = written && std::isfinite(io.eh[i]);
        for (size_t i = 0; i < io.sh.n; i++) written = written && std::isfinite(io.sh[i]);
        snprintf(what, sizeof what, "token %d: dec_glu4_x8x2 wrote every hidden row", t);
        verdict(what, written);
        bool route = same_bits(bulk.ids.p(), io.ids.p(), io.ids.n) && same_bits(bulk.rw.p(), io.rw.p(), io.rw.n);
        snprintf(what, sizeof what, "token %d: routing (ids, weights)", t);
        verdict(what, route, route ? "  bit for bit" : "  differ");
        bool hid = same_bits(bulk.eh.p(), io.eh.p(), io.eh.n) && same_bits(bulk.sh.p(), io.sh.p(), io.sh.n);
        snprintf(what, sizeof what, "token %d: routed and shared hidden rows", t);
        verdict(what, hid, hid ? "  bit for bit" : "  differ");
        snprintf(what, sizeof what, "token %d: nothing written past the outputs", t);
        verdict(what, bulk.ids.guard_ok() && bulk.rw.guard_ok() && bulk.eh.guard_ok() && bulk.sh.guard_ok());
    }
}

// ---- gemv_x8 ------------------------------------------------------------------------------------

// Decode::project's one-row launch with GemvProducts::Int8Pairs (dec_gemv4_x8x2: up to 32 groups,
// DEC_R4_X8X2 rows a sub-warp; dec_gemv4w_x8x2: 64) or Float (dec_gemv4, dec_gemv4w), with the
// prologue's arguments.
struct Prolog { const float* norm_w = nullptr; float eps = 0.0f; const float* gz = nullptr; int head_dim = 1; float* xn_out = nullptr; };
// two_tiles (gemv4w_sm_grid, GemvGrid::TwoTilesABlock): ceil(tiles / 2) blocks where that is at
// most one an SM (decode::gemv_blocks).
static void project_one_4bit(const std::vector<Seg>& segs, std::vector<float*> ys, const float* x, int cols, bool pairs,
                             const Prolog& p, bool two_tiles = false) {
    int G = cols / 64, lpr = std::min(32, G), spw = 32 / lpr;
    int R = G == 64 ? 1 : pairs ? DEC_R4_X8X2 : DEC_R4;
    DecSegs d = make_segs(segs, ys, DEC_WARPS * spw * R);
    int pairs_of_tiles = (d.tiles + 1) / 2;
    int grid = two_tiles && pairs_of_tiles <= SM_COUNT ? pairs_of_tiles : std::min(d.tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT);
    auto k = G == 64 ? (pairs ? dec_gemv4w_x8x2 : dec_gemv4w) : (pairs ? dec_gemv4_x8x2 : dec_gemv4);
    launch_k({grid, 1, 1}, DEC_WARPS * 32, 0, [&] { k(d, x, p.norm_w, p.eps, p.gz, p.head_dim, p.xn_out, cols); });
}

// dec_gemv4_x8x2 / dec_gemv4w_x8x2 (gemv_int8) on one row: the staged row (x itself, or the
// kernel's own normed row from xn_out when a prologue runs) rounded to int8 pairs by our
// x8x2_dequant; exact outputs against the f64 product of that x̃ (≤ 1e-6: only f32 rounding
// apart) and every output against the f64 product of the unrounded row within the pairs' bound
// (|x̃ − x| ≤ max|x|_group / 64,516 per element, times Σ|w|; stored outputs also their act()
// rounding); beside them, the f32 kernel (dec_gemv4 / dec_gemv4w) on the same row (a tolerance).
static void gemv_x8_case(const char* name, int cols, std::vector<QW*> ws, std::vector<int> modes, int prologue) {
    std::vector<Seg> segs;
    for (size_t i = 0; i < ws.size(); i++) segs.push_back({ws[i], modes[i]});
    std::vector<float> x = vec(cols, 1.0f);
    // Some groups far wider than others: each group's own scale must be the one applied.
    for (int g = 3; g < cols / 64; g += 7) x[64 * g + (g % 64)] *= 9.0f;
    if (BF16) for (auto& v : x) v = (float)f_of_bf16(bf16_of(v));
    const int head_dim = 128;
    std::vector<float> norm_w = vec(prologue == 2 ? head_dim : cols, 1.0f), gz = vec(cols, 2.0f);
    Buf<float> xn(cols);
    Prolog p;
    if (prologue) { p.norm_w = norm_w.data(); p.eps = 1e-6f; p.xn_out = xn.p(); }
    if (prologue == 2) { p.gz = gz.data(); p.head_dim = head_dim; }
    auto resid = residuals(ws, 1);
    std::vector<float*> ys;
    auto got = outputs(ws, modes, 1, resid, ys);
    project_one_4bit(segs, ys, x.data(), cols, true, p);
    if (cols == 4096) {
        // gemv4w_sm_grid: the same launch two tiles a block gives the persistent grid's bits.
        std::vector<float> staged0(xn.p(), xn.p() + cols);
        auto two = outputs(ws, modes, 1, resid, ys);
        project_one_4bit(segs, ys, x.data(), cols, true, p, true);
        bool same = !prologue || same_bits(xn.p(), staged0.data(), cols);
        for (size_t i = 0; i < ws.size(); i++) same = same && same_bits(two[i].p(), got[i].p(), ws[i]->rows) && two[i].guard_ok();
        char what[160];
        snprintf(what, sizeof what, "%s: two tiles a block (%d blocks) vs the persistent grid", name,
                 (ws[0]->rows / DEC_WARPS + 1) / 2);
        verdict(what, same, same ? "  bit for bit" : "  differ");
    }
    auto f32 = outputs(ws, modes, 1, resid, ys);
    project_one_4bit(segs, ys, x.data(), cols, false, p);
    // The row the projections read: x, or the prologue's output (checked against f64 here).
    std::vector<float> staged = x;
    if (prologue) {
        double ss = 0;
        for (int c = 0; c < cols; c++) ss += (double)x[c] * x[c];
        std::vector<double> want(cols);
        for (int c = 0; c < cols; c++) {
            if (prologue == 1) {
                want[c] = rb(x[c] / std::sqrt(ss / cols + 1e-6) * norm_w[c]);
            } else {
                int h0 = c / head_dim * head_dim;
                double hs = 0;
                for (int i = 0; i < head_dim; i++) hs += (double)x[h0 + i] * x[h0 + i];
                double z = gz[c];
                want[c] = rb(rb(norm_w[c % head_dim] * rb(x[c] / std::sqrt(hs / head_dim + 1e-6))) * rb(z / (1 + std::exp(-z))));
            }
        }
        double e = rel_l2(xn.p(), want.data(), cols);
        char what[160];
        snprintf(what, sizeof what, "%s: staged row (%s) vs f64", name, prologue == 1 ? "RMSNorm" : "gated norm");
        verdict(what, e < (BF16 ? 1e-2 : 1e-5) && xn.guard_ok(), "  rel_l2 %.2e", e);
        staged.assign(xn.p(), xn.p() + cols);
    }
    std::vector<double> gmax, xt = x8x2_dequant(staged.data(), cols, gmax), xd(staged.begin(), staged.end());
    for (size_t i = 0; i < ws.size(); i++) {
        const QW& w = *ws[i];
        std::vector<double> want_q(w.rows), want_f(w.rows);
        double worst = 0;
        bool in_bound = true;
        for (int r = 0; r < w.rows; r++) {
            double yq = w.dot(0, r, xt.data()), yf = 0, bound = 0, mag = 0;
            for (int c = 0; c < cols; c++) {
                double wc = w.weight(0, r, c);
                yf += wc * xd[c];
                bound += std::fabs(wc) * gmax[c / 64] / 64516;
                mag += std::fabs(wc * xd[c]);
            }
            double r0 = modes[i] == DEC_RESIDUAL ? resid[i][r] : 0.0;
            want_q[r] = modes[i] == DEC_EXACT ? yq : modes[i] == DEC_RESIDUAL ? rb(r0 + rb(yq)) : rb(yq);
            double wf = modes[i] == DEC_EXACT ? yf : modes[i] == DEC_RESIDUAL ? rb(r0 + rb(yf)) : rb(yf);
            want_f[r] = wf;
            // f32 rounding of the sums (1e-6 of Σ|w x|), and the stores' act() roundings
            bound = bound * 1.001 + 1e-6 * mag + 1e-30;
            if (modes[i] != DEC_EXACT && BF16) bound += (std::fabs(wf) + std::fabs(rb(yf))) * (1.0 / 256);
            double d = std::fabs((double)got[i][r] - wf);
            if (!(d <= bound)) in_bound = false;
            worst = std::max(worst, d / bound);
        }
        double eq = rel_l2(got[i].p(), want_q.data(), w.rows);
        std::vector<double> fd(f32[i].p(), f32[i].p() + w.rows);
        double ef = rel_l2(got[i].p(), fd.data(), w.rows);
        const char* mode = modes[i] == DEC_STORE ? "store" : modes[i] == DEC_RESIDUAL ? "residual" : "exact";
        char what[160];
        snprintf(what, sizeof what, "%s: %d cols, 4-bit x %d, %s, vs f64 of the int8 pairs", name, cols, w.rows, mode);
        // exact outputs: f32 rounding only; stored ones: within their act() rounding
        double tol = modes[i] == DEC_EXACT ? 1e-6 : BF16 ? 1e-2 : 1e-6;
        verdict(what, eq < tol && got[i].guard_ok(), "  rel_l2 %.2e", eq);
        snprintf(what, sizeof what, "%s: %d cols, 4-bit x %d, %s, vs unrounded f64", name, cols, w.rows, mode);
        char fmt[96];
        snprintf(fmt, sizeof fmt, "  per element within the bound (worst %%.2f of it); vs f32 kernel %%.2e");
        verdict(what, in_bound && ef < (modes[i] == DEC_EXACT ? 1e-4 : BF16 ? 1e-2 : 1e-4), fmt, worst, ef);
        if (modes[i] == DEC_EXACT && !BF16) {
            // For the record (fp32 builds: a row off the bf16 grid): what rounding the row alone
            // does to these products (f64 sums), as int8 pairs, as bf16 and as one int8 (moe_int8).
            std::vector<double> g8, x8 = q8_dequant(staged.data(), cols, g8), xb(cols);
            for (int c = 0; c < cols; c++) xb[c] = f_of_bf16(bf16_of(staged[c]));
            double num[3] = {0, 0, 0}, den = 0;
            for (int r = 0; r < w.rows; r++) {
                double yf = w.dot(0, r, xd.data()), ys[3] = {w.dot(0, r, xt.data()), w.dot(0, r, xb.data()), w.dot(0, r, x8.data())};
                for (int k = 0; k < 3; k++) num[k] += (ys[k] - yf) * (ys[k] - yf);
                den += yf * yf;
            }
            printf("      the row's rounding alone, rel_l2 of the products: int8 pairs %.2e, bf16 %.2e, one int8 %.2e\n",
                   std::sqrt(num[0] / den), std::sqrt(num[1] / den), std::sqrt(num[2] / den));
        }
    }
}

static void run_gemv_x8() {
    printf("dec_gemv4_x8x2 + dec_gemv4w_x8x2 (gemv_int8; activations %s)\n", BF16 ? "bf16" : "fp32");
    // DeltaNet's in_proj at the model's width (qkv 8192, z 4096, b and a 32 rows; all 4-bit),
    // the block's RMSNorm folded in, every store mode.
    QW qkv(4, 1, 8192, 2048), z(4, 1, 4096, 2048), bw(4, 1, 32, 2048), aw(4, 1, 32, 2048);
    gemv_x8_case("in_proj", 2048, {&qkv, &z, &bw, &aw}, {DEC_EXACT, DEC_STORE, DEC_RESIDUAL, DEC_EXACT}, 1);
    gemv_x8_case("in_proj, no prologue", 2048, {&qkv, &bw}, {DEC_EXACT, DEC_STORE}, 0);
    // out_proj with DeltaNet's gated norm folded in (4,096 columns: two groups a lane), added
    // into the residual; o_proj's plain row, exact.
    QW out(4, 1, 2048, 4096);
    gemv_x8_case("out_proj", 4096, {&out}, {DEC_RESIDUAL}, 2);
    gemv_x8_case("o_proj", 4096, {&out}, {DEC_EXACT}, 0);
    // lm_head-like: rows ending mid-tile; narrow inputs (8 and 4 groups: several rows a warp).
    QW head(4, 1, 3001, 2048), n512(4, 1, 777, 512), n256(4, 1, 300, 256);
    gemv_x8_case("lm_head (3,001 rows)", 2048, {&head}, {DEC_EXACT}, 0);
    gemv_x8_case("narrow", 512, {&n512}, {DEC_EXACT}, 0);
    gemv_x8_case("narrow", 256, {&n256, &n256}, {DEC_STORE, DEC_EXACT}, 0);
}

// ---- dn -----------------------------------------------------------------------------------------

// The f64 conv of one token (MODEL.md §2.5): c = act(silu(act(Σ_j w_j · state_j + w_last · m)))
// per channel, then the conv state [taps - 1, conv_dim] shifted by m.
static std::vector<double> dn_ref_conv(const std::vector<float>& weight, int taps, int conv_dim, const float* m,
                                       std::vector<double>& cv) {
    std::vector<double> cref(conv_dim);
    for (int ch = 0; ch < conv_dim; ch++) {
        double acc = 0;
        for (int j = 0; j < taps - 1; j++) acc += (double)weight[(size_t)ch * taps + j] * cv[(size_t)j * conv_dim + ch];
        acc += (double)weight[(size_t)ch * taps + taps - 1] * m[ch];
        cref[ch] = rb(silu(rb(acc)));
    }
    for (int j = 0; j < taps - 1; j++)
        for (int ch = 0; ch < conv_dim; ch++)
            cv[(size_t)j * conv_dim + ch] = j + 1 < taps - 1 ? cv[(size_t)(j + 1) * conv_dim + ch] : m[ch];
    return cref;
}

// The f64 gated delta rule step of one token (MODEL.md §2.5) from the conv's output cref (q, k,
// v): q and k L2-normed (q also by 1/sqrt(dk)), β = act(sigmoid(b)), α = exp(−exp(a_log) ·
// softplus(a + dt_bias)); per value head S ← α S, then per column the delta update and the output
// o = act(qᵀ S). S [nv, dk, dv] updated; returns o [nv · dv].
static std::vector<double> dn_ref_step(int nk, int nv, int dk, int dv, float eps, const std::vector<double>& cref,
                                       const float* bb, const float* aa, const std::vector<float>& a_log,
                                       const std::vector<float>& dt_bias, double* st) {
    std::vector<double> oref((size_t)nv * dv);
    int key_dim = nk * dk;
    for (int hv = 0; hv < nv; hv++) {
        int hk = hv / (nv / nk);
        const double* q = &cref[(size_t)hk * dk]; const double* k = &cref[(size_t)key_dim + hk * dk];
        double qq = 0, kk = 0;
        for (int i = 0; i < dk; i++) { qq += q[i] * q[i]; kk += k[i] * k[i]; }
        double qn = 1 / std::sqrt(qq + eps) / std::sqrt((double)dk), kn = 1 / std::sqrt(kk + eps);
        double beta = rb(1 / (1 + std::exp(-(double)bb[hv])));
        double x = (double)aa[hv] + dt_bias[hv];
        double g = -std::exp((double)a_log[hv]) * (x > 20 ? x : std::log1p(std::exp(x)));
        double alpha = std::exp(g);
        double* S = &st[(size_t)hv * dk * dv];
        for (int i = 0; i < dk * dv; i++) S[i] *= alpha;
        for (int j = 0; j < dv; j++) {
            double u = 0;
            for (int i = 0; i < dk; i++) u += S[(size_t)i * dv + j] * k[i] * kn;
            double d = beta * (cref[(size_t)2 * key_dim + hv * dv + j] - u);
            double out = 0;
            for (int i = 0; i < dk; i++) { S[(size_t)i * dv + j] += k[i] * kn * d; out += S[(size_t)i * dv + j] * q[i] * qn; }
            oref[(size_t)hv * dv + j] = rb(out);
        }
    }
    return oref;
}

static void run_dn_shape(int nk, int nv, int dk, int dv, int taps, std::vector<int> Bs, std::vector<int> bit_Bs) {
    const float eps = 1e-6f;
    int conv_dim = 2 * nk * dk + nv * dv;
    size_t state_n = (size_t)nv * dk * dv, conv_n = (size_t)(taps - 1) * conv_dim;
    std::vector<float> weight = vec((size_t)conv_dim * taps, 0.5f), a_log = vec(nv, 0.5f), dt_bias = vec(nv, 0.5f);
    for (int B : Bs) {
        bool bits_too = std::find(bit_Bs.begin(), bit_Bs.end(), B) != bit_Bs.end();
        std::vector<Buf<float>> st, cv, st1, cv1;
        std::vector<std::vector<double>> ref_st, ref_cv;
        for (int r = 0; r < B; r++) {
            std::vector<float> s = vec(state_n, 0.1f), c = vec(conv_n, 1.0f);
            st.emplace_back(state_n); cv.emplace_back(conv_n); st1.emplace_back(state_n); cv1.emplace_back(conv_n);
            std::copy(s.begin(), s.end(), st[r].v.begin()); std::copy(s.begin(), s.end(), st1[r].v.begin());
            std::copy(c.begin(), c.end(), cv[r].v.begin()); std::copy(c.begin(), c.end(), cv1[r].v.begin());
            ref_st.emplace_back(s.begin(), s.end()); ref_cv.emplace_back(c.begin(), c.end());
        }
        std::vector<float*> st_t, cv_t;
        for (int r = 0; r < B; r++) { st_t.push_back(st[r].p()); cv_t.push_back(cv[r].p()); }
        for (int step = 0; step < 2; step++) {
            std::vector<float> m = vec((size_t)B * conv_dim, 1.0f), bb = vec((size_t)B * nv, 1.0f), aa = vec((size_t)B * nv, 1.0f);
            Buf<float> c((size_t)B * conv_dim), o((size_t)B * nv * dv), c1((size_t)B * conv_dim), o1((size_t)B * nv * dv);
            launch_k({(conv_dim + 127) / 128, B, 1}, 128, 0, [&] { dec_dn_conv_rows(m.data(), cv_t.data(), weight.data(), c.p(), conv_dim, taps); });
            launch_k({nv, dv / DEC_DN_COLS, B}, 128, 0, [&] {
                dec_dn_step_rows(c.p(), bb.data(), aa.data(), a_log.data(), dt_bias.data(), st_t.data(), o.p(), nk, nv, dk, dv, eps);
            });
            // f64 reference.
            double e_c = 0, e_o = 0, e_s = 0; bool conv_state_exact = true;
            for (int r = 0; r < B; r++) {
                std::vector<double> cref = dn_ref_conv(weight, taps, conv_dim, m.data() + (size_t)r * conv_dim, ref_cv[r]);
                e_c = std::max(e_c, rel_l2(c.p() + (size_t)r * conv_dim, cref.data(), conv_dim));
                for (size_t i = 0; i < conv_n; i++) if ((double)cv[r][i] != ref_cv[r][i]) conv_state_exact = false;
                std::vector<double> oref = dn_ref_step(nk, nv, dk, dv, eps, cref, bb.data() + (size_t)r * nv,
                                                       aa.data() + (size_t)r * nv, a_log, dt_bias, ref_st[r].data());
                e_o = std::max(e_o, rel_l2(o.p() + (size_t)r * nv * dv, oref.data(), oref.size()));
                e_s = std::max(e_s, rel_l2(st[r].p(), ref_st[r].data(), state_n));
            }
            bool guards = c.guard_ok() && o.guard_ok();
            for (int r = 0; r < B; r++) guards = guards && st[r].guard_ok() && cv[r].guard_ok();
            char what[200];
            double tol = BF16 ? 2e-2 : 2e-5;
            snprintf(what, sizeof what, "heads %d/%d of %d/%d, %d taps, %d seqs, step %d: conv out", nk, nv, dk, dv, taps, B, step);
            verdict(what, e_c < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e", e_c);
            snprintf(what, sizeof what, "heads %d/%d of %d/%d, %d taps, %d seqs, step %d: conv states shifted", nk, nv, dk, dv, taps, B, step);
            verdict(what, conv_state_exact, conv_state_exact ? "  exactly" : "");
            snprintf(what, sizeof what, "heads %d/%d of %d/%d, %d taps, %d seqs, step %d: outputs, states", nk, nv, dk, dv, taps, B, step);
            verdict(what, e_o < tol && e_s < tol, "  rel_l2 %.2e, %.2e", e_o, e_s);
            snprintf(what, sizeof what, "heads %d/%d of %d/%d, %d taps, %d seqs, step %d: nothing written past", nk, nv, dk, dv, taps, B, step);
            verdict(what, guards);
            if (bits_too) {
                for (int r = 0; r < B; r++) {
                    float* cr = c1.p() + (size_t)r * conv_dim;
                    launch_k({(conv_dim + 127) / 128, 1, 1}, 128, 0, [&] { dec_dn_conv(m.data() + (size_t)r * conv_dim, cv1[r].p(), weight.data(), cr, conv_dim, taps); });
                    launch_k({nv, dv / DEC_DN_COLS, 1}, 128, 0, [&] {
                        dec_dn_step(cr, bb.data() + (size_t)r * nv, aa.data() + (size_t)r * nv, a_log.data(), dt_bias.data(), st1[r].p(), o1.p() + (size_t)r * nv * dv, nk, nv, dk, dv, eps);
                    });
                }
                bool same = same_bits(c.p(), c1.p(), c.n) && same_bits(o.p(), o1.p(), o.n);
                for (int r = 0; r < B; r++) same = same && same_bits(st[r].p(), st1[r].p(), state_n) && same_bits(cv[r].p(), cv1[r].p(), conv_n);
                snprintf(what, sizeof what, "heads %d/%d, %d seqs, step %d vs dec_dn_conv + dec_dn_step alone", nk, nv, B, step);
                verdict(what, same, same ? "  bit for bit" : "  differ");
            }
        }
    }
}

static void run_dn() {
    printf("dec_dn_conv_rows + dec_dn_step_rows (activations %s)\n", BF16 ? "bf16" : "fp32");
    run_dn_shape(16, 32, 128, 128, 4, {1, 3, 8}, {1, 3, 8});
    run_dn_shape(1, 2, 32, 16, 2, {1, 3, 8}, {1, 3, 8});
}

// ---- attn ---------------------------------------------------------------------------------------
#ifdef LILY_BF16_ACT
// attn_split_mma_prep_rows (or _long_rows) + attn_split_combine_rows against an f64 attention of
// each sequence (RMSNorm and NeoX RoPE of q and the new k, the new key and value into the bf16
// cache at the position, softmax(q·k / sqrt(d)) · v over keys 0..pos, times sigmoid(gate)), and
// bit for bit against attn_split_mma_prep (_long) + attn_split_combine one sequence at a time on
// copies of the caches (the claim of tests/gpu/decode.rs).
static size_t split_mma_smem_floats(int d) {
    size_t bytes = (size_t)(16 + 2 * SPLIT_MMA_STAGES * 32) * (d + 8) * 2 + 16 * (32 + 8) * 2 + 2 * 2 * SPLIT_WARPS * 8 * 4;
    return bytes / 4;
}
// RMSNorm of x (d values, weight w) then NeoX RoPE of its first `rotary` dims at position p, in f64.
static void qk_prep_f64(const float* x, const std::vector<float>& w, int d, int rotary, int p, float theta, float eps,
                        std::vector<double>& y) {
    int half = rotary / 2;
    double ss = 0;
    for (int i = 0; i < d; i++) ss += (double)x[i] * x[i];
    double inv = 1 / std::sqrt(ss / d + eps);
    std::vector<double> n(d);
    for (int i = 0; i < d; i++) n[i] = x[i] * inv * w[i];
    y = n;
    for (int i = 0; i < rotary; i++) {
        int f = i < half ? i : i - half;
        double ang = p / std::pow((double)theta, 2.0 * f / rotary);
        y[i] = i < half ? n[i] * std::cos(ang) - n[i + half] * std::sin(ang) : n[i] * std::cos(ang) + n[i - half] * std::sin(ang);
    }
}
// The f64 gated attention of KV head g's query heads at position p into want [n_q, d]: q and its
// gate from qg (one sequence's [n_q, 2 d]), qk_prep_f64 of q, softmax(q·k / sqrt(d)) · v over keys
// 0..p with key(j, i) / value(j, i) the cache's values, times sigmoid(gate).
template <class Key, class Value>
static void attend_f64(const float* qg, const std::vector<float>& q_norm, int n_q, int n_kv, int g, int d, int rotary,
                       int p, float theta, float eps, Key key, Value value, std::vector<double>& want) {
    for (int h = g * (n_q / n_kv); h < (g + 1) * (n_q / n_kv); h++) {
        std::vector<double> q;
        const float* src = &qg[(size_t)h * 2 * d];
        qk_prep_f64(src, q_norm, d, rotary, p, theta, eps, q);
        std::vector<double> sc(p + 1);
        double mx = -1e300;
        for (int j = 0; j <= p; j++) {
            double s = 0;
            for (int i = 0; i < d; i++) s += q[i] * key(j, i);
            sc[j] = s / std::sqrt((double)d);
            mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (auto& s : sc) { s = std::exp(s - mx); sum += s; }
        for (int i = 0; i < d; i++) {
            double o = 0;
            for (int j = 0; j <= p; j++) o += sc[j] * value(j, i);
            want[(size_t)h * d + i] = o / sum / (1 + std::exp(-(double)src[d + i]));
        }
    }
}
static void run_attn_shape(int n_q, int n_kv, int d, int rotary, bool long_kernel) {
    const float theta = 1e7f, eps = 1e-6f, scale = 1.0f / std::sqrt((float)d);
    const int lens[8] = {37, 700, 5, 129, 1, 64, 9001, 300};
    const int max_ctx = 9088;
    size_t cache_n = (size_t)max_ctx * n_kv * d;
    std::vector<float> q_norm = vec(d, 0.3f), k_norm = vec(d, 0.3f);
    for (auto& v : q_norm) v += 1; for (auto& v : k_norm) v += 1;
    int chunks = (n_q / n_kv + SPLIT_MAX_G - 1) / SPLIT_MAX_G;
    size_t slots = (size_t)DEC_B_MAX * n_q * SPLIT_MAX_SPLITS;
    for (int B : {1, 3, 8}) {
        std::vector<std::vector<u16>> caches(2 * B);
        for (auto& c : caches) { c.resize(cache_n); for (auto& x : c) x = bf16_of(val(1.0f)); }
        std::vector<std::vector<u16>> c_rows = caches, c_one = caches;
        auto rnd_bf16 = [](size_t n) { std::vector<float> v = vec(n, 1.0f); for (auto& x : v) x = (float)f_of_bf16(bf16_of(x)); return v; };
        std::vector<float> qg = rnd_bf16((size_t)B * 2 * n_q * d), kin = rnd_bf16((size_t)B * n_kv * d), vin = rnd_bf16((size_t)B * n_kv * d);
        std::vector<int> pos(B);
        std::vector<const int*> pos_t(B);
        std::vector<u16*> cache_t(2 * B);
        for (int b = 0; b < B; b++) { pos[b] = lens[b] - 1; }
        for (int b = 0; b < B; b++) { pos_t[b] = &pos[b]; cache_t[b] = c_rows[b].data(); cache_t[B + b] = c_rows[B + b].data(); }
        Buf<float> part_o(slots * d), part_ml(slots * 2), out((size_t)B * n_q * d);
        launch_k({SPLIT_MAX_SPLITS, n_kv * chunks, B}, SPLIT_WARPS * 32, split_mma_smem_floats(d), [&] {
            auto k = long_kernel ? attn_split_mma_prep_long_rows : attn_split_mma_prep_rows;
            k(qg.data(), kin.data(), vin.data(), q_norm.data(), k_norm.data(), cache_t.data(), part_o.p(), part_ml.p(),
              pos_t.data(), n_q, n_kv, d, rotary, theta, eps, scale);
        });
        launch_k({n_q, B, (d + 63) / 64}, 256, 0, [&] {
            attn_split_combine_rows(qg.data(), part_o.p(), part_ml.p(), out.p(), pos_t.data(), n_q, d);
        });
        // f64 reference
        double e_out = 0, e_new = 0;
        bool untouched = true;
        for (int b = 0; b < B; b++) {
            int p = pos[b];
            std::vector<double> want((size_t)n_q * d);
            for (int g = 0; g < n_kv; g++) {
                std::vector<double> kn;
                qk_prep_f64(&kin[((size_t)b * n_kv + g) * d], k_norm, d, rotary, p, theta, eps, kn);
                // the new row: bf16 of the f64 key and of the value
                std::vector<double> knew(d), vnew(d);
                for (int i = 0; i < d; i++) { knew[i] = f_of_bf16(bf16_of((float)kn[i])); vnew[i] = f_of_bf16(bf16_of(vin[((size_t)b * n_kv + g) * d + i])); }
                std::vector<double> gk(d), gv(d);
                size_t at = ((size_t)p * n_kv + g) * d;
                for (int i = 0; i < d; i++) { gk[i] = f_of_bf16(c_rows[b][at + i]); gv[i] = f_of_bf16(c_rows[B + b][at + i]); }
                e_new = std::max(e_new, std::max(rel_l2(std::vector<float>(gk.begin(), gk.end()).data(), knew.data(), d),
                                                 rel_l2(std::vector<float>(gv.begin(), gv.end()).data(), vnew.data(), d)));
                attend_f64(
                    &qg[(size_t)b * n_q * 2 * d], q_norm, n_q, n_kv, g, d, rotary, p, theta, eps,
                    [&](int j, int i) { return j == p ? knew[i] : (double)f_of_bf16(caches[b][((size_t)j * n_kv + g) * d + i]); },
                    [&](int j, int i) { return j == p ? vnew[i] : (double)f_of_bf16(caches[B + b][((size_t)j * n_kv + g) * d + i]); },
                    want);
            }
            e_out = std::max(e_out, rel_l2(out.p() + (size_t)b * n_q * d, want.data(), want.size()));
            for (int kvv = 0; kvv < 2; kvv++)
                for (size_t i = 0; i < cache_n; i++)
                    if (c_rows[kvv * B + b][i] != caches[kvv * B + b][i] && i / ((size_t)n_kv * d) != (size_t)p) untouched = false;
        }
        char what[200];
        const char* kname = long_kernel ? "_long" : "";
        snprintf(what, sizeof what, "%d/%d heads of %d, prep%s_rows, %d seqs: outputs", n_q, n_kv, d, kname, B);
        verdict(what, e_out < 2e-2 && out.guard_ok(), "  rel_l2 %.2e (q, P rounded to bf16)", e_out);
        snprintf(what, sizeof what, "%d/%d heads of %d, prep%s_rows, %d seqs: new key, value rows", n_q, n_kv, d, kname, B);
        verdict(what, e_new < 1e-2, "  rel_l2 %.2e", e_new);
        snprintf(what, sizeof what, "%d/%d heads of %d, prep%s_rows, %d seqs: other cache rows untouched", n_q, n_kv, d, kname, B);
        verdict(what, untouched);
        // One sequence at a time.
        Buf<float> out1((size_t)B * n_q * d);
        for (int b = 0; b < B; b++) {
            const float* qgb = qg.data() + (size_t)b * 2 * n_q * d;
            launch_k({SPLIT_MAX_SPLITS, n_kv * chunks, 1}, SPLIT_WARPS * 32, split_mma_smem_floats(d), [&] {
                auto k = long_kernel ? attn_split_mma_prep_long : attn_split_mma_prep;
                k(qgb, kin.data() + (size_t)b * n_kv * d, vin.data() + (size_t)b * n_kv * d, q_norm.data(), k_norm.data(),
                  c_one[b].data(), c_one[B + b].data(), part_o.p(), part_ml.p(), &pos[b], n_q, n_kv, d, rotary, theta, eps, scale);
            });
            launch_k({n_q, 1, (d + 63) / 64}, 256, 0, [&] {
                attn_split_combine(qgb, part_o.p(), part_ml.p(), out1.p() + (size_t)b * n_q * d, &pos[b], 1, n_q, d);
            });
        }
        bool same = same_bits(out.p(), out1.p(), out.n);
        for (int i = 0; i < 2 * B; i++) same = same && c_rows[i] == c_one[i];
        snprintf(what, sizeof what, "%d/%d heads of %d, %d seqs vs prep%s + combine alone", n_q, n_kv, d, B, kname);
        verdict(what, same, same ? "  bit for bit" : "  differ");
    }
}
static void run_attn() {
    printf("attn_split_mma_prep_rows + attn_split_combine_rows (bf16)\n");
    run_attn_shape(16, 2, 256, 64, false);
    run_attn_shape(16, 2, 256, 64, true);
    run_attn_shape(4, 2, 64, 16, false);
}

// ---- attn_int8 ----------------------------------------------------------------------------------
// The int8-row KV cache (issue 30; kv8:: is attention.cu built with LILY_KV_INT8): records of a
// position's n_kv int8 rows then their f32 scales, padded to 16 bytes (kv8_rec_bytes).
static size_t kv8_rec(int n_kv, int d) { return (size_t)n_kv * d + ((size_t)4 * n_kv + 15) / 16 * 16; }
// kv_int8_encode (lily-core cpu::ops), written here from its rule: s = max|x| / 127, q = x / s
// rounded half to even, clamped to ±127; all zero (s = 0) for a zero row.
static float kv8_encode(const float* x, int d, signed char* q) {
    float amax = 0.0f;
    for (int i = 0; i < d; i++) amax = std::max(amax, std::fabs(x[i]));
    if (amax == 0.0f) { for (int i = 0; i < d; i++) q[i] = 0; return 0.0f; }
    float s = amax / 127.0f;
    for (int i = 0; i < d; i++) q[i] = (signed char)std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / s)));
    return s;
}
// Head g's row at position p of an int8 cache as f32 values q · s (what the CPU reference reads).
static void kv8_row(const std::vector<signed char>& c, int n_kv, int d, int p, int g, float* out) {
    size_t rec = kv8_rec(n_kv, d);
    float s; memcpy(&s, &c[p * rec + (size_t)n_kv * d + 4 * g], 4);
    for (int i = 0; i < d; i++) out[i] = (float)c[p * rec + (size_t)g * d + i] * s;
}
// Whether head g's row and scale at position p are the same bytes in a and b.
static bool kv8_same_row(const std::vector<signed char>& a, const std::vector<signed char>& b, int n_kv, int d, int p, int g) {
    size_t rec = kv8_rec(n_kv, d);
    return memcmp(&a[p * rec + (size_t)g * d], &b[p * rec + (size_t)g * d], d) == 0 &&
           memcmp(&a[p * rec + (size_t)n_kv * d + 4 * g], &b[p * rec + (size_t)n_kv * d + 4 * g], 4) == 0;
}
static size_t split_mma8_smem_floats(int d) {
    size_t bytes = (size_t)(16 + 2 * 32) * (d + 8) * 2 + 16 * (32 + 8) * 2 + 2 * 2 * SPLIT_WARPS * 8 * 4 +
                   (size_t)2 * SPLIT_MMA_STAGES * 32 * 16 + (size_t)2 * SPLIT_MMA_STAGES * 32 * d;
    return bytes / 4;
}
// kv8::attn_split_mma_prep_rows (or _long_rows) + attn_split_combine_rows on int8 caches, against:
// an f64 attention over the caches' dequantised values (the new key and value as the kernel
// wrote them), the bound the bf16 kernels meet (2e-2); the new rows bit for bit against
// kv8_encode of the rows the bf16 kernel (attn_split_mma_prep_rows, same inputs) writes, i.e.
// the rule applied to the same key after norm and RoPE; every other record untouched; one
// sequence at a time (kv8::attn_split_mma_prep + combine) bit for bit; kv8::attn_qk_prep +
// kv8::attn_split_mma (the unfused path) near the f64 reference, its rows bit for bit the rule
// on ::attn_qk_prep's bf16 rows; kv8::kv_int8_dequant bit for bit bf16(q · s) over rows 0..pos,
// nothing written past them.
static void run_attn8_shape(int n_q, int n_kv, int d, int rotary, bool long_kernel, std::vector<int> batches = {1, 3, 8}) {
    const float theta = 1e7f, eps = 1e-6f, scale = 1.0f / std::sqrt((float)d);
    const int lens[8] = {37, 700, 5, 129, 1, 64, 9001, 300};
    const int max_ctx = 9088;
    size_t cache_n = (size_t)max_ctx * n_kv * d, rec = kv8_rec(n_kv, d);
    std::vector<float> q_norm = vec(d, 0.3f), k_norm = vec(d, 0.3f);
    for (auto& v : q_norm) v += 1; for (auto& v : k_norm) v += 1;
    int chunks = (n_q / n_kv + SPLIT_MAX_G - 1) / SPLIT_MAX_G;
    size_t slots = (size_t)DEC_B_MAX * n_q * SPLIT_MAX_SPLITS;
    const char* kname = long_kernel ? "_long" : "";
    for (int B : batches) {
        // bf16 caches (random), and the same rows encoded as int8 records; some rows scaled
        // far apart and one all zero, so rows' scales differ by orders of magnitude.
        std::vector<std::vector<u16>> c16(2 * B);
        std::vector<std::vector<signed char>> c8(2 * B);
        for (int c = 0; c < 2 * B; c++) {
            c16[c].resize(cache_n);
            c8[c].assign((size_t)max_ctx * rec, 0);
            for (int p = 0; p < max_ctx; p++)
                for (int g = 0; g < n_kv; g++) {
                    float mag = p % 7 == 3 ? 40.0f : p % 11 == 5 ? 0.01f : 1.0f;
                    std::vector<float> row(d);
                    for (int i = 0; i < d; i++) row[i] = p == 2 ? 0.0f : (float)f_of_bf16(bf16_of(val(mag)));
                    for (int i = 0; i < d; i++) c16[c][((size_t)p * n_kv + g) * d + i] = bf16_of(row[i]);
                    float s = kv8_encode(row.data(), d, &c8[c][p * rec + (size_t)g * d]);
                    memcpy(&c8[c][p * rec + (size_t)n_kv * d + 4 * g], &s, 4);
                }
        }
        std::vector<std::vector<u16>> c16_rows = c16;
        std::vector<std::vector<signed char>> c8_rows = c8, c8_one = c8, c8_unf = c8;
        auto rnd_bf16 = [](size_t n) { std::vector<float> v = vec(n, 1.0f); for (auto& x : v) x = (float)f_of_bf16(bf16_of(x)); return v; };
        std::vector<float> qg = rnd_bf16((size_t)B * 2 * n_q * d), kin = rnd_bf16((size_t)B * n_kv * d), vin = rnd_bf16((size_t)B * n_kv * d);
        std::vector<int> pos(B);
        std::vector<const int*> pos_t(B);
        std::vector<u16*> t16(2 * B);
        std::vector<signed char*> t8(2 * B);
        for (int b = 0; b < B; b++) pos[b] = lens[b] - 1;
        for (int b = 0; b < B; b++) pos_t[b] = &pos[b];
        for (int c = 0; c < 2 * B; c++) { t16[c] = c16_rows[c].data(); t8[c] = c8_rows[c].data(); }
        Buf<float> part_o(slots * d), part_ml(slots * 2), out((size_t)B * n_q * d), out16((size_t)B * n_q * d);
        launch_k({SPLIT_MAX_SPLITS, n_kv * chunks, B}, SPLIT_WARPS * 32, split_mma8_smem_floats(d), [&] {
            auto k = long_kernel ? kv8::attn_split_mma_prep_long_rows : kv8::attn_split_mma_prep_rows;
            k(qg.data(), kin.data(), vin.data(), q_norm.data(), k_norm.data(), t8.data(), part_o.p(), part_ml.p(),
              pos_t.data(), n_q, n_kv, d, rotary, theta, eps, scale);
        });
        launch_k({n_q, B, (d + 63) / 64}, 256, 0, [&] {
            kv8::attn_split_combine_rows(qg.data(), part_o.p(), part_ml.p(), out.p(), pos_t.data(), n_q, d);
        });
        // The bf16 kernel on the same inputs: the new rows it writes (and, for the record, its
        // output's distance from the int8 kernel's).
        launch_k({SPLIT_MAX_SPLITS, n_kv * chunks, B}, SPLIT_WARPS * 32, split_mma_smem_floats(d), [&] {
            auto k = long_kernel ? attn_split_mma_prep_long_rows : attn_split_mma_prep_rows;
            k(qg.data(), kin.data(), vin.data(), q_norm.data(), k_norm.data(), t16.data(), part_o.p(), part_ml.p(),
              pos_t.data(), n_q, n_kv, d, rotary, theta, eps, scale);
        });
        launch_k({n_q, B, (d + 63) / 64}, 256, 0, [&] {
            attn_split_combine_rows(qg.data(), part_o.p(), part_ml.p(), out16.p(), pos_t.data(), n_q, d);
        });
        // f64 reference over the int8 caches' values (the new row as the kernel wrote it).
        auto reference = [&](int b, const std::vector<signed char>& kc, const std::vector<signed char>& vc, std::vector<double>& want) {
            int p = pos[b];
            want.assign((size_t)n_q * d, 0.0);
            std::vector<float> kr((size_t)(p + 1) * d), vr((size_t)(p + 1) * d);
            for (int g = 0; g < n_kv; g++) {
                for (int j = 0; j <= p; j++) { kv8_row(kc, n_kv, d, j, g, &kr[(size_t)j * d]); kv8_row(vc, n_kv, d, j, g, &vr[(size_t)j * d]); }
                attend_f64(&qg[(size_t)b * n_q * 2 * d], q_norm, n_q, n_kv, g, d, rotary, p, theta, eps,
                           [&](int j, int i) { return (double)kr[(size_t)j * d + i]; },
                           [&](int j, int i) { return (double)vr[(size_t)j * d + i]; }, want);
            }
        };
        double e_out = 0, e_16 = 0;
        bool rows_ok = true, untouched = true;
        for (int b = 0; b < B; b++) {
            int p = pos[b];
            std::vector<double> want;
            reference(b, c8_rows[b], c8_rows[B + b], want);
            e_out = std::max(e_out, rel_l2(out.p() + (size_t)b * n_q * d, want.data(), want.size()));
            std::vector<double> o16(out16.p() + (size_t)b * n_q * d, out16.p() + (size_t)(b + 1) * n_q * d);
            e_16 = std::max(e_16, rel_l2(out.p() + (size_t)b * n_q * d, o16.data(), o16.size()));
            for (int kvv = 0; kvv < 2; kvv++) {
                int c = kvv * B + b;
                std::vector<signed char> expect = c8_rows[c];
                for (int g = 0; g < n_kv; g++) {
                    std::vector<float> row(d);
                    for (int i = 0; i < d; i++) row[i] = (float)f_of_bf16(c16_rows[c][((size_t)p * n_kv + g) * d + i]);
                    float s = kv8_encode(row.data(), d, &expect[p * rec + (size_t)g * d]);
                    memcpy(&expect[p * rec + (size_t)n_kv * d + 4 * g], &s, 4);
                    rows_ok = rows_ok && kv8_same_row(expect, c8_rows[c], n_kv, d, p, g);
                }
                for (size_t i = 0; i < c8[c].size(); i++)
                    if (c8_rows[c][i] != c8[c][i] && i / rec != (size_t)p) untouched = false;
            }
        }
        char what[200];
        snprintf(what, sizeof what, "int8 %d/%d heads of %d, prep%s_rows, %d seqs: outputs", n_q, n_kv, d, kname, B);
        verdict(what, e_out < 2e-2 && out.guard_ok(), "  rel_l2 %.2e (from the bf16 kernel's: %.2e)", e_out, e_16);
        snprintf(what, sizeof what, "int8 %d/%d heads of %d, prep%s_rows, %d seqs: new rows = encode", n_q, n_kv, d, kname, B);
        verdict(what, rows_ok, rows_ok ? "  bit for bit" : "  differ");
        snprintf(what, sizeof what, "int8 %d/%d heads of %d, prep%s_rows, %d seqs: other records untouched", n_q, n_kv, d, kname, B);
        verdict(what, untouched);
        // One sequence at a time, fused prep; then the unfused path (attn_qk_prep + attn_split_mma).
        Buf<float> out1((size_t)B * n_q * d), out2((size_t)B * n_q * d);
        Buf<float> q_out((size_t)n_q * d);
        double e_unf = 0;
        bool unf_rows = true;
        for (int b = 0; b < B; b++) {
            const float* qgb = qg.data() + (size_t)b * 2 * n_q * d;
            const float *kb = kin.data() + (size_t)b * n_kv * d, *vb = vin.data() + (size_t)b * n_kv * d;
            launch_k({SPLIT_MAX_SPLITS, n_kv * chunks, 1}, SPLIT_WARPS * 32, split_mma8_smem_floats(d), [&] {
                auto k = long_kernel ? kv8::attn_split_mma_prep_long : kv8::attn_split_mma_prep;
                k(qgb, kb, vb, q_norm.data(), k_norm.data(), c8_one[b].data(), c8_one[B + b].data(), part_o.p(), part_ml.p(),
                  &pos[b], n_q, n_kv, d, rotary, theta, eps, scale);
            });
            launch_k({n_q, 1, (d + 63) / 64}, 256, 0, [&] {
                kv8::attn_split_combine(qgb, part_o.p(), part_ml.p(), out1.p() + (size_t)b * n_q * d, &pos[b], 1, n_q, d);
            });
            // Unfused: kv8::attn_qk_prep (one token) then kv8::attn_split_mma(_long) + combine.
            launch_k({1, n_q + n_kv, 1}, 128, 0, [&] {
                kv8::attn_qk_prep(qgb, kb, vb, q_out.p(), c8_unf[b].data(), c8_unf[B + b].data(), q_norm.data(), k_norm.data(),
                                  &pos[b], 1, n_q, n_kv, d, rotary, theta, eps);
            });
            launch_k({SPLIT_MAX_SPLITS, n_kv * chunks, 1}, SPLIT_WARPS * 32, split_mma8_smem_floats(d), [&] {
                auto k = long_kernel ? kv8::attn_split_mma_long : kv8::attn_split_mma;
                k(q_out.p(), c8_unf[b].data(), c8_unf[B + b].data(), part_o.p(), part_ml.p(), &pos[b], 1, n_q, n_kv, d, scale);
            });
            launch_k({n_q, 1, (d + 63) / 64}, 256, 0, [&] {
                kv8::attn_split_combine(qgb, part_o.p(), part_ml.p(), out2.p() + (size_t)b * n_q * d, &pos[b], 1, n_q, d);
            });
            std::vector<double> want;
            reference(b, c8_unf[b], c8_unf[B + b], want);
            e_unf = std::max(e_unf, rel_l2(out2.p() + (size_t)b * n_q * d, want.data(), want.size()));
            // ::attn_qk_prep's bf16 rows of the same token, encoded, against kv8::attn_qk_prep's.
            std::vector<u16> k16(cache_n), v16(cache_n);
            launch_k({1, n_q + n_kv, 1}, 128, 0, [&] {
                attn_qk_prep(qgb, kb, vb, q_out.p(), k16.data(), v16.data(), q_norm.data(), k_norm.data(), &pos[b], 1, n_q,
                             n_kv, d, rotary, theta, eps);
            });
            for (int kvv = 0; kvv < 2; kvv++) {
                std::vector<signed char> expect = c8_unf[kvv * B + b];
                const std::vector<u16>& src16 = kvv ? v16 : k16;
                for (int g = 0; g < n_kv; g++) {
                    std::vector<float> row(d);
                    for (int i = 0; i < d; i++) row[i] = (float)f_of_bf16(src16[((size_t)pos[b] * n_kv + g) * d + i]);
                    float s = kv8_encode(row.data(), d, &expect[pos[b] * rec + (size_t)g * d]);
                    memcpy(&expect[pos[b] * rec + (size_t)n_kv * d + 4 * g], &s, 4);
                    unf_rows = unf_rows && kv8_same_row(expect, c8_unf[kvv * B + b], n_kv, d, pos[b], g);
                }
            }
        }
        bool same = same_bits(out.p(), out1.p(), out.n);
        for (int i = 0; i < 2 * B; i++) same = same && c8_rows[i] == c8_one[i];
        snprintf(what, sizeof what, "int8 %d/%d heads of %d, %d seqs vs prep%s + combine alone", n_q, n_kv, d, B, kname);
        verdict(what, same, same ? "  bit for bit" : "  differ");
        snprintf(what, sizeof what, "int8 %d/%d heads of %d, %d seqs: qk_prep + split_mma%s", n_q, n_kv, d, B, kname);
        verdict(what, e_unf < 2e-2 && out2.guard_ok(), "  rel_l2 %.2e", e_unf);
        snprintf(what, sizeof what, "int8 %d/%d heads of %d, %d seqs: attn_qk_prep rows = encode", n_q, n_kv, d, B);
        verdict(what, unf_rows, unf_rows ? "  bit for bit" : "  differ");
        // kv_int8_dequant of sequence 0's caches after the step: rows 0..pos as bf16(q · s).
        {
            int p = pos[0];
            std::vector<u16> kd(cache_n, 0xffffu), vd(cache_n, 0xffffu);  // 0xffff: never written
            int per_row = n_kv * (d / 8);
            int grid = (int)(((size_t)max_ctx * per_row + 255) / 256);
            int prev = p;  // the device's position before a one-token step: rows 0..p
            launch_k({grid, 1, 1}, 256, 0, [&] {
                kv8::kv_int8_dequant(c8_rows[0].data(), c8_rows[B].data(), kd.data(), vd.data(), &prev, 1, n_kv, d);
            });
            bool ok = true;
            std::vector<float> row(d);
            for (int j = 0; j < max_ctx && ok; j++)
                for (int g = 0; g < n_kv && ok; g++)
                    for (int kvv = 0; kvv < 2; kvv++) {
                        const std::vector<u16>& o = kvv ? vd : kd;
                        kv8_row(c8_rows[kvv * B], n_kv, d, j, g, row.data());
                        for (int i = 0; i < d; i++)
                            if (o[((size_t)j * n_kv + g) * d + i] != (j <= p ? bf16_of(row[i]) : 0xffffu)) ok = false;
                    }
            snprintf(what, sizeof what, "int8 %d/%d heads of %d: kv_int8_dequant rows 0..%d", n_q, n_kv, d, p);
            verdict(what, ok, ok ? "  bit for bit bf16(q s)" : "  differ");
        }
    }
}
static void run_attn8() {
    printf("kv8:: (LILY_KV_INT8) attn_split_mma_prep_rows + combine, attn_qk_prep, attn_split_mma, kv_int8_dequant (bf16)\n");
    run_attn8_shape(16, 2, 256, 64, false);
    run_attn8_shape(16, 2, 256, 64, true);
    run_attn8_shape(4, 2, 64, 16, false);
    // Six kv heads: the scales' second 16-byte chunk. One query head a kv head averages fewer
    // values, so 9,001 keys (the 8-sequence case) sit at the bound's edge in either format:
    // sequences up to 700 keys.
    run_attn8_shape(6, 6, 64, 16, false, {1, 3});
}
#endif

int main(int argc, char** argv) {
    alarm(600);  // a lane missing a warp collective hangs the emulation: end it
    std::string part = argc > 1 ? argv[1] : "";
    auto t0 = std::chrono::steady_clock::now();
    if (part == "gemv") run_gemv();
    else if (part == "mma") run_mma();
    else if (part == "split") run_split();
    else if (part == "lean") run_lean();
    else if (part == "moe") run_moe({1, 3, 8}, {1, 3, 8});
    else if (part == "moe_q8") run_moe_q8({1, 3, 8}, false);
    else if (part == "moe_x8x2") run_moe_q8({1, 3, 8}, true);
    else if (part == "moe_grouped") {
        run_moe_grouped(Moe(), "full", {1, 2, 3, 4, 8});
        run_moe_grouped(Moe(256, 32, 4, 128, 128), "small", {1, 3, 4, 8});
        run_moe_grouped(Moe(128, 16, 4, 64, 64), "tiny", {1, 3, 4, 8});
    }
    else if (part == "moe_bulk") {
        run_moe_bulk(Moe(), "full", SM_COUNT);
        run_moe_bulk(Moe(), "full", 16);
        run_moe_bulk(Moe(2048, 256, 8, 516, 1024), "routed 516 rows, shared 1,024", SM_COUNT);
        run_moe_bulk(Moe(512, 32, 4, 128, 96), "512 columns (4 rows a warp), shared 96 rows", SM_COUNT);
        run_moe_bulk(Moe(512, 32, 4, 128, 96), "512 columns (4 rows a warp), shared 96 rows", 4);
    }
    else if (part == "gemv_x8") run_gemv_x8();
    else if (part == "dn") run_dn();
#ifdef LILY_BF16_ACT
    else if (part == "attn") run_attn();
    else if (part == "attn_int8") run_attn8();
#endif
    else { fprintf(stderr, "usage: emu gemv|gemv_x8|mma|split|lean|moe|moe_q8|moe_x8x2|moe_grouped|moe_bulk|dn|attn|attn_int8 (attn, attn_int8: bf16 builds)\n"); return 2; }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%s: %s (%.0f s)\n", part.c_str(), g_fail ? "FAILED" : "passed", s);
    return g_fail;
}
