// run_batch.sh's `fused` part (included by driver_batch.cpp, whose helpers it uses): decode.cu's
// dec_moe, the whole MoE block of one token in one persistent launch, on a grid of 7 blocks
// whose threads are fibers of one scheduler (shim_decode.h's launch_coop; 7 so the shares of
// rows are uneven), against
//   (a) an f64 MoE layer from the same weights: the residual RMS-normed, router logits, softmax,
//       top_k (ties to the lower id), renormalised weights, SiLU GLU of the picked experts and of
//       the shared expert, down projections, the shared expert gated by sigmoid, the residual
//       add, with act() where the kernels store; and
//   (b) today's three launches (dec_gemv8 with the norm folded in, dec_glu4, dec_down_combine)
//       run through the same emulator: bit for bit, every output (the kernel claims the same
//       sums in the same order);
// then launched again on the same inputs: the same bits, and the grid barrier's words back to
// a count of 0 (it resets itself, as CUDA graph replays need). The real shape (hidden 2048,
// expert and shared widths 512, 8-bit router and shared gate, 4-bit experts) with 16 experts,
// top 8, to stay fast. What it cannot show: the barrier's memory ordering and L1 coherence on
// a GPU, PDL, occupancy, speed.

static const int FUSED_GRID = 7;

struct FusedMoe {
    int hidden = 2048, inter = 512, n_exp = 16, top_k = 8;
    QW router{8, 1, 16, 2048}, sgw{8, 1, 1, 2048};
    QW gate{4, 16, 512, 2048}, up{4, 16, 512, 2048}, sgate{4, 1, 512, 2048}, sup{4, 1, 512, 2048};
    QW down{4, 16, 2048, 512}, sdown{4, 1, 2048, 512};
};

// Everything the MoE block writes, NaN-poisoned.
struct FusedOut {
    Buf<float> x, xn, logits, s_gate, rw, h, hs;
    Buf<int> ids;
    FusedOut(const FusedMoe& m)
        : x(m.hidden), xn(m.hidden), logits(m.n_exp), s_gate(1), rw(m.top_k), h((size_t)m.top_k * m.inter),
          hs(m.inter), ids(m.top_k) {}
    bool guards() const {
        return x.guard_ok() && xn.guard_ok() && logits.guard_ok() && s_gate.guard_ok() && rw.guard_ok() &&
               h.guard_ok() && hs.guard_ok() && ids.guard_ok();
    }
    bool same(const FusedOut& o) const {
        return same_bits(x.v.data(), o.x.v.data(), x.n) && same_bits(xn.v.data(), o.xn.v.data(), xn.n) &&
               same_bits(logits.v.data(), o.logits.v.data(), logits.n) &&
               same_bits(s_gate.v.data(), o.s_gate.v.data(), 1) && same_bits(rw.v.data(), o.rw.v.data(), rw.n) &&
               same_bits(h.v.data(), o.h.v.data(), h.n) && same_bits(hs.v.data(), o.hs.v.data(), hs.n) &&
               same_bits(ids.v.data(), o.ids.v.data(), ids.n);
    }
};

// Decode::moe's geometry (crates/lily-cuda/src/kernels/decode.rs moe_shares, moe_smem).
static size_t fused_smem_floats(const FusedMoe& m, int grid, int& gu_share, int& down_share) {
    auto r4 = [](size_t n) { return (n + 3) / 4 * 4; };
    int items = m.top_k + 1, gh = m.hidden / 64, gi = m.inter / 64;
    gu_share = (items * m.inter + grid - 1) / grid;
    down_share = (m.hidden + grid - 1) / grid;
    size_t rec_h = m.hidden / 2 + m.hidden / 16, rec_i = m.inter / 2 + m.inter / 16;
    size_t front = 4 * (gh * DEC_XPAD + r4(gh) + 2 * r4(m.n_exp));
    size_t gu = 2 * (size_t)gu_share * rec_h;
    size_t phase_c = 4 * (items * gi * DEC_XPAD + r4(items * gi) + r4((size_t)down_share * items));
    size_t bytes = front + std::max(gu, phase_c) + (size_t)down_share * items * rec_i;
    return bytes / 4;
}

// DecMoe's fields for the outputs `o`, the shares left to the caller.
static DecMoe moe_args(const FusedMoe& m, const std::vector<float>& norm_w, float eps, FusedOut& o, unsigned* bar) {
    DecMoe a;
    a.router = m.router.view(); a.sgw = m.sgw.view();
    a.gate = m.gate.view(); a.up = m.up.view(); a.sgate = m.sgate.view(); a.sup = m.sup.view();
    a.down = m.down.view(); a.sdown = m.sdown.view();
    a.norm_w = norm_w.data(); a.eps = eps;
    a.x = o.x.p(); a.xn = o.xn.p(); a.logits = o.logits.p(); a.s_gate = o.s_gate.p();
    a.ids = o.ids.p(); a.route_w = o.rw.p(); a.h = o.h.p(); a.hs = o.hs.p(); a.bar = bar;
    a.n_experts = m.n_exp; a.top_k = m.top_k;
    return a;
}

static void fused_launch(const FusedMoe& m, const std::vector<float>& norm_w, float eps, FusedOut& o,
                         unsigned* bar) {
    DecMoe a = moe_args(m, norm_w, eps, o, bar);
    size_t smem = fused_smem_floats(m, FUSED_GRID, a.gu_share, a.down_share);
    launch_coop(FUSED_GRID, DEC_WARPS * 32, smem, [&] { dec_moe(a); });
}

// Forward::moe_one_token's three launches (Decode::project, glu, down_combine geometry).
static void three_launches(const FusedMoe& m, const std::vector<float>& norm_w, float eps, FusedOut& o) {
    int G = m.hidden / 64, lpr = std::min(32, G), spw = 32 / lpr;
    DecSegs d = make_segs({{&m.router, DEC_EXACT}, {&m.sgw, DEC_STORE}}, {o.logits.p(), o.s_gate.p()}, DEC_WARPS * spw);
    int grid = std::min(d.tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT);
    launch_k({grid, 1, 1}, DEC_WARPS * 32, 0, [&] { dec_gemv8(d, o.x.p(), norm_w.data(), eps, nullptr, 1, o.xn.p(), m.hidden); });
    int per_item = (m.inter + DEC_WARPS * spw * DEC_GLU_R4 - 1) / (DEC_WARPS * spw * DEC_GLU_R4);
    int tiles = per_item * (m.top_k + 1);
    QWeight g = m.gate.view(), u = m.up.view(), sg = m.sgate.view(), su = m.sup.view();
    launch_k({std::min(tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT), 1, 1}, DEC_WARPS * 32, 0, [&] {
        dec_glu4(g, u, o.logits.p(), m.n_exp, m.top_k, o.ids.p(), o.rw.p(), sg, su, o.xn.p(), o.h.p(), m.inter, o.hs.p(), per_item);
    });
    int Gi = m.inter / 64, lpr_i = std::min(32, Gi), spw_i = 32 / lpr_i;
    int dgrid = (m.hidden + DEC_DOWN_WARPS * spw_i - 1) / (DEC_DOWN_WARPS * spw_i);
    size_t smem = (size_t)(m.top_k + 1) * Gi * (DEC_XPAD + 1) + (DEC_DOWN_KSPLIT + 1) * DEC_DOWN_WARPS * spw_i;
    QWeight dw = m.down.view(), sd = m.sdown.view();
    launch_k({dgrid, 1, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, smem, [&] {
        dec_down_combine(dw, sd, o.ids.p(), o.rw.p(), m.top_k, o.h.p(), m.inter, o.hs.p(), o.s_gate.p(), o.x.p());
    });
}

// The f64 MoE layer of one row x0: the residual RMS-normed, router logits, softmax, top_k (ties
// to the lower id), renormalised weights, SiLU GLU of the picked experts and of the shared
// expert, down projections, the shared expert gated by sigmoid, the residual add (dx = x − x0),
// with act() where the kernels store.
struct FusedRef {
    std::vector<double> xn, lg, rw, h, hs, dx;
    std::vector<int> order;
    double sg, gap;
};
static FusedRef fused_ref(const FusedMoe& m, const float* x0, const std::vector<float>& norm_w, float eps) {
    FusedRef r;
    double ss = 0;
    for (int c = 0; c < m.hidden; c++) ss += (double)x0[c] * x0[c];
    double inv = 1 / std::sqrt(ss / m.hidden + eps);
    r.xn.resize(m.hidden); r.lg.resize(m.n_exp);
    std::vector<double> p(m.n_exp);
    for (int c = 0; c < m.hidden; c++) r.xn[c] = rb(x0[c] * inv * norm_w[c]);
    double mx = -1e300, sum = 0;
    for (int e = 0; e < m.n_exp; e++) { r.lg[e] = m.router.dot(0, e, r.xn.data()); mx = std::max(mx, r.lg[e]); }
    for (int e = 0; e < m.n_exp; e++) { p[e] = std::exp(r.lg[e] - mx); sum += p[e]; }
    for (auto& v : p) v /= sum;
    r.order.resize(m.n_exp);
    for (int e = 0; e < m.n_exp; e++) r.order[e] = e;
    std::stable_sort(r.order.begin(), r.order.end(), [&](int a, int b) { return p[a] > p[b]; });
    r.gap = (p[r.order[m.top_k - 1]] - p[r.order[m.top_k]]) / p[r.order[0]];
    double picked = 0;
    for (int k = 0; k < m.top_k; k++) picked += p[r.order[k]];
    r.rw.resize(m.top_k); r.h.resize((size_t)m.top_k * m.inter); r.hs.resize(m.inter); r.dx.resize(m.hidden);
    for (int k = 0; k < m.top_k; k++) {
        int e = r.order[k];
        r.rw[k] = rb(p[e] / picked);
        for (int q = 0; q < m.inter; q++)
            r.h[(size_t)k * m.inter + q] =
                rb(rb(silu(rb(m.gate.dot(e, q, r.xn.data())))) * rb(m.up.dot(e, q, r.xn.data())));
    }
    for (int q = 0; q < m.inter; q++)
        r.hs[q] = rb(rb(silu(rb(m.sgate.dot(0, q, r.xn.data())))) * rb(m.sup.dot(0, q, r.xn.data())));
    r.sg = rb(m.sgw.dot(0, 0, r.xn.data()));
    double gate_s = rb(1 / (1 + std::exp(-r.sg)));
    for (int c = 0; c < m.hidden; c++) {
        double acc = 0;
        for (int k = 0; k < m.top_k; k++) acc += r.rw[k] * rb(m.down.dot(r.order[k], c, &r.h[(size_t)k * m.inter]));
        acc += rb(gate_s * rb(m.sdown.dot(0, c, r.hs.data())));
        r.dx[c] = rb(x0[c] + rb(acc)) - x0[c];
    }
    return r;
}

// The last checks of a one-launch kernel (dec_moe, dec_dn_layer): its outputs against the launches
// it replaces (`same`, those named `replaced`), the grid barrier's words after the launch, then a
// second launch (a graph replay, starting where the first left the barrier: `again` runs it and
// says whether its outputs are the first's bits), the words after it.
template <class Again>
static void relaunch_checks(const char* replaced, bool same, const unsigned* bar, const char* again_what, Again again) {
    char what[160];
    snprintf(what, sizeof what, "vs %s", replaced);
    verdict(what, same, same ? "  bit for bit" : "  differ");
    verdict("grid barrier reset after a launch (count 0, two generations)", bar[0] == 0 && bar[1] == 2, "  %g, %g",
            bar[0], bar[1]);
    same = again();
    verdict(again_what, same, same ? "  bit for bit" : "  differ");
    verdict("grid barrier after the second launch (count 0, four generations)", bar[0] == 0 && bar[1] == 4,
            "  %g, %g", bar[0], bar[1]);
}

static void run_fused_moe() {
    printf("dec_moe on %d blocks (activations %s)\n", FUSED_GRID, BF16 ? "bf16" : "fp32");
    FusedMoe m;
    const float eps = 1e-6f;
    std::vector<float> x0 = vec(m.hidden, 1.0f), norm_w = vec(m.hidden, 0.3f);
    for (auto& v : norm_w) v += 1.0f;
    if (BF16) for (auto& v : x0) v = (float)f_of_bf16(bf16_of(v));
    FusedOut one(m), three(m), again(m);
    std::copy(x0.begin(), x0.end(), one.x.v.begin());
    std::copy(x0.begin(), x0.end(), three.x.v.begin());
    std::copy(x0.begin(), x0.end(), again.x.v.begin());
    unsigned bar[2] = {0, 0};
    fused_launch(m, norm_w, eps, one, bar);
    three_launches(m, norm_w, eps, three);

    // (a) the f64 layer.
    FusedRef ref = fused_ref(m, x0.data(), norm_w, eps);
    const std::vector<double>&xn = ref.xn, &lg = ref.lg, &rw = ref.rw, &h = ref.h, &hs = ref.hs, &dx = ref.dx;
    double sg = ref.sg, gap = ref.gap;
    bool ids_ok = true;
    for (int k = 0; k < m.top_k; k++) ids_ok &= one.ids[k] == ref.order[k];
    std::vector<float> got_dx(m.hidden);
    for (int c = 0; c < m.hidden; c++) got_dx[c] = one.x[c] - x0[c];
    double tol = BF16 ? 2e-2 : 1e-5;
    char what[160];
    verdict("normed row (xn)", rel_l2(one.xn.p(), xn.data(), m.hidden) < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e",
            rel_l2(one.xn.p(), xn.data(), m.hidden));
    double e_lg = rel_l2(one.logits.p(), lg.data(), m.n_exp);
    verdict("router logits (exact)", e_lg < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e", e_lg);
    snprintf(what, sizeof what, "expert ids (top-%d margin %.1e of p_max)", m.top_k, gap);
    verdict(what, ids_ok);
    verdict("routing weights", rel_l2(one.rw.p(), rw.data(), m.top_k) < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e",
            rel_l2(one.rw.p(), rw.data(), m.top_k));
    double e_sg = std::fabs(one.s_gate[0] - sg) / std::fabs(sg);
    verdict("shared expert's gate logit", e_sg < (BF16 ? 1e-2 : 1e-5), "  rel %.2e", e_sg);
    double e_h = rel_l2(one.h.p(), h.data(), h.size()), e_hs = rel_l2(one.hs.p(), hs.data(), m.inter);
    verdict("experts' and shared expert's hidden rows", e_h < tol && e_hs < tol, "  rel_l2 %.2e, %.2e", e_h, e_hs);
    double e_x = rel_l2(got_dx.data(), dx.data(), m.hidden);
    verdict("residual row's update (x - x0)", e_x < (BF16 ? 5e-2 : 1e-5), "  rel_l2 %.2e", e_x);
    verdict("nothing written past the outputs", one.guards() && three.guards());
    // (b) the three launches; a second launch.
    relaunch_checks("dec_gemv8 + dec_glu4 + dec_down_combine", one.same(three), bar, "launched again: the same outputs",
                    [&] {
                        fused_launch(m, norm_w, eps, again, bar);
                        return one.same(again);
                    });
}
