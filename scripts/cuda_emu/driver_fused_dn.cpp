// run_batch.sh's `fused_dn` part (included by driver_batch.cpp, whose helpers it uses): decode.cu's
// dec_dn_layer, the gated DeltaNet layer of one token in one persistent launch, on a grid of 7
// blocks whose threads are fibers of one scheduler (shim_decode.h's launch_coop; 7 so the shares
// of rows are uneven and phase B's 256 work items take many rounds), at the full widths (hidden
// 2048, 16 key heads and 32 value heads of 128, 4 conv taps), against
//   (a) an f64 layer from the same weights: the input RMS-normed, in_proj's four projections, the
//       conv (dn_ref_conv) and the gated delta rule step (dn_ref_step), the gated RMS norm with
//       SiLU(z), out_proj and the residual add, with act() where the kernels store; and
//   (b) today's four launches (dec_gemv4 with the norm folded in, dec_dn_conv, dec_dn_step,
//       dec_gemv4w with the gated norm folded in) run through the same emulator: bit for bit, every
//       output, the recurrent and conv states too (the kernel claims the same sums in the same
//       order);
// then launched again from the same inputs and states: the same bits, and the grid barrier's words
// back to a count of 0 (it resets itself, as CUDA graph replays need). What it cannot show: the
// barrier's memory ordering and L1 coherence on a GPU, PDL, occupancy, speed.

static const int FUSED_DN_GRID = 7;

struct FusedDn {
    int hidden = 2048, nk = 16, nv = 32, dk = 128, dv = 128, taps = 4;
    int conv_dim = 2 * 16 * 128 + 32 * 128, vd = 32 * 128;
    QW in_qkv{4, 1, 8192, 2048}, in_z{4, 1, 4096, 2048}, in_b{4, 1, 32, 2048}, in_a{4, 1, 32, 2048};
    QW out{4, 1, 2048, 4096};
    std::vector<float> conv_w = vec((size_t)conv_dim * taps, 0.5f), a_log = vec(nv, 0.5f), dt_bias = vec(nv, 0.5f);
    std::vector<float> norm_w = vec(hidden, 0.3f), gnorm_w = vec(dv, 0.3f);
    FusedDn() {
        for (auto& v : norm_w) v += 1.0f;
        for (auto& v : gnorm_w) v += 1.0f;
    }
};

// Everything the layer writes (NaN-poisoned) or updates (the residual row and the states, from
// the given starting values).
struct DnLayerIo {
    Buf<float> x, m, c, z, b, a, o, state, conv;
    DnLayerIo(const FusedDn& d, const std::vector<float>& x0, const std::vector<float>& s0, const std::vector<float>& c0)
        : x(d.hidden), m(d.conv_dim), c(d.conv_dim), z(d.vd), b(d.nv), a(d.nv), o(d.vd), state(s0.size()),
          conv(c0.size()) {
        std::copy(x0.begin(), x0.end(), x.v.begin());
        std::copy(s0.begin(), s0.end(), state.v.begin());
        std::copy(c0.begin(), c0.end(), conv.v.begin());
    }
    bool guards() const {
        return x.guard_ok() && c.guard_ok() && z.guard_ok() && b.guard_ok() && a.guard_ok() && o.guard_ok() &&
               state.guard_ok() && conv.guard_ok();
    }
    // Every output but m (the four launches' in_proj_qkv row, which dec_dn_layer keeps to itself).
    bool same(const DnLayerIo& t) const {
        auto eq = [](const Buf<float>& p, const Buf<float>& q) { return same_bits(p.v.data(), q.v.data(), p.n); };
        return eq(x, t.x) && eq(c, t.c) && eq(z, t.z) && eq(b, t.b) && eq(a, t.a) && eq(o, t.o) && eq(state, t.state) &&
               eq(conv, t.conv);
    }
};

// Decode::dn_layer's geometry (crates/lily-cuda/src/kernels/decode/dn_layer.rs dn_layer_shares,
// dn_layer_smem), in floats.
static size_t fused_dn_smem_floats(const FusedDn& d, int grid, int& in_share, int& out_share) {
    auto r4 = [](size_t n) { return (n + 3) / 4 * 4; };
    int rows = d.conv_dim + d.vd + 2 * d.nv, gh = d.hidden / 64, gv = d.vd / 64;
    in_share = (rows + grid - 1) / grid;
    out_share = (d.hidden + grid - 1) / grid;
    size_t rec_h = d.hidden / 2 + d.hidden / 16, rec_v = d.vd / 2 + d.vd / 16;
    size_t front = 4 * (gh * DEC_XPAD + r4(gh) + r4((size_t)in_share * d.taps) + r4((size_t)in_share * (d.taps - 1)));
    size_t phase_c = 4 * (gv * DEC_XPAD + r4(gv));
    size_t bytes = front + std::max((size_t)in_share * rec_h, phase_c) + (size_t)out_share * rec_v;
    return bytes / 4;
}

static const float DN_EPS = 1e-6f;

static void fused_dn_launch(const FusedDn& d, DnLayerIo& io, const float* x, unsigned* bar) {
    DecDn a;
    a.in_qkv = d.in_qkv.view(); a.in_z = d.in_z.view(); a.in_b = d.in_b.view(); a.in_a = d.in_a.view();
    a.out = d.out.view();
    a.x = x; a.norm_w = d.norm_w.data(); a.conv_w = d.conv_w.data(); a.conv_state = io.conv.p();
    a.a_log = d.a_log.data(); a.dt_bias = d.dt_bias.data(); a.state = io.state.p(); a.gnorm_w = d.gnorm_w.data();
    a.c = io.c.p(); a.z = io.z.p(); a.b = io.b.p(); a.a = io.a.p(); a.o = io.o.p(); a.y = io.x.p(); a.bar = bar;
    a.eps = DN_EPS; a.gnorm_eps = DN_EPS; a.prep_eps = DN_EPS;
    a.n_k = d.nk; a.n_v = d.nv; a.dk = d.dk; a.dv = d.dv; a.k = d.taps;
    size_t smem = fused_dn_smem_floats(d, FUSED_DN_GRID, a.in_share, a.out_share);
    launch_coop(FUSED_DN_GRID, DEC_WARPS * 32, smem, [&] { dec_dn_layer(a); });
}

// Forward::deltanet_one_token's four launches (Decode::project, dn_conv, dn_step geometry).
static void four_launches(const FusedDn& d, DnLayerIo& io, const float* x) {
    int G = d.hidden / 64, lpr = std::min(32, G), spw = 32 / lpr;
    DecSegs in = make_segs({{&d.in_qkv, DEC_STORE}, {&d.in_z, DEC_STORE}, {&d.in_b, DEC_STORE}, {&d.in_a, DEC_STORE}},
                           {io.m.p(), io.z.p(), io.b.p(), io.a.p()}, DEC_WARPS * spw * DEC_R4);
    launch_k({std::min(in.tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT), 1, 1}, DEC_WARPS * 32, 0,
             [&] { dec_gemv4(in, x, d.norm_w.data(), DN_EPS, nullptr, 1, nullptr, d.hidden); });
    launch_k({(d.conv_dim + 127) / 128, 1, 1}, 128, 0,
             [&] { dec_dn_conv(io.m.p(), io.conv.p(), d.conv_w.data(), io.c.p(), d.conv_dim, d.taps); });
    launch_k({d.nv, d.dv / DEC_DN_COLS, 1}, 128, 0, [&] {
        dec_dn_step(io.c.p(), io.b.p(), io.a.p(), d.a_log.data(), d.dt_bias.data(), io.state.p(), io.o.p(), d.nk, d.nv,
                    d.dk, d.dv, DN_EPS);
    });
    DecSegs out = make_segs({{&d.out, DEC_RESIDUAL}}, {io.x.p()}, DEC_WARPS * 1);
    launch_k({std::min(out.tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT), 1, 1}, DEC_WARPS * 32, 0,
             [&] { dec_gemv4w(out, io.o.p(), d.gnorm_w.data(), DN_EPS, io.z.p(), d.dv, nullptr, d.vd); });
}

// dec_dn_layer's last checks: its outputs against the launches it replaces (`same`, those named
// `replaced`), the grid barrier's words after the launch, then a second launch (a graph replay,
// starting where the first left the barrier: `again` runs it and says whether its outputs are the
// first's bits), the words after it.
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

static void run_fused_dn() {
    printf("dec_dn_layer on %d blocks (activations %s)\n", FUSED_DN_GRID, BF16 ? "bf16" : "fp32");
    FusedDn d;
    std::vector<float> x0 = vec(d.hidden, 1.0f), s0 = vec((size_t)d.nv * d.dk * d.dv, 0.1f),
                       c0 = vec((size_t)(d.taps - 1) * d.conv_dim, 1.0f);
    if (BF16) for (auto& v : x0) v = (float)f_of_bf16(bf16_of(v));
    DnLayerIo one(d, x0, s0, c0), four(d, x0, s0, c0), again(d, x0, s0, c0);
    unsigned bar[2] = {0, 0};
    fused_dn_launch(d, one, x0.data(), bar);
    four_launches(d, four, x0.data());

    // (a) the f64 layer.
    double ss = 0;
    for (int c = 0; c < d.hidden; c++) ss += (double)x0[c] * x0[c];
    double inv = 1 / std::sqrt(ss / d.hidden + DN_EPS);
    std::vector<double> xn(d.hidden);
    for (int c = 0; c < d.hidden; c++) xn[c] = rb(x0[c] * inv * d.norm_w[c]);
    std::vector<float> m(d.conv_dim), bb(d.nv), aa(d.nv);
    std::vector<double> z(d.vd), b(d.nv), a(d.nv);
    for (int r = 0; r < d.conv_dim; r++) m[r] = (float)rb(d.in_qkv.dot(0, r, xn.data()));
    for (int r = 0; r < d.vd; r++) z[r] = rb(d.in_z.dot(0, r, xn.data()));
    for (int r = 0; r < d.nv; r++) {
        b[r] = rb(d.in_b.dot(0, r, xn.data()));
        a[r] = rb(d.in_a.dot(0, r, xn.data()));
        bb[r] = (float)b[r];
        aa[r] = (float)a[r];
    }
    std::vector<double> cv(c0.begin(), c0.end()), st(s0.begin(), s0.end());
    std::vector<double> cref = dn_ref_conv(d.conv_w, d.taps, d.conv_dim, m.data(), cv);
    std::vector<double> oref = dn_ref_step(d.nk, d.nv, d.dk, d.dv, DN_EPS, cref, bb.data(), aa.data(), d.a_log,
                                           d.dt_bias, st.data());
    std::vector<double> y(d.vd), dx(d.hidden);
    for (int hv = 0; hv < d.nv; hv++) {
        double s2 = 0;
        for (int i = 0; i < d.dv; i++) s2 += oref[(size_t)hv * d.dv + i] * oref[(size_t)hv * d.dv + i];
        double gi = 1 / std::sqrt(s2 / d.dv + DN_EPS);
        for (int i = 0; i < d.dv; i++) {
            size_t c = (size_t)hv * d.dv + i;
            y[c] = rb(rb(d.gnorm_w[i] * rb(oref[c] * gi)) * silu(z[c]));
        }
    }
    for (int r = 0; r < d.hidden; r++) dx[r] = rb(x0[r] + rb(d.out.dot(0, r, y.data()))) - x0[r];
    std::vector<float> got_dx(d.hidden);
    for (int r = 0; r < d.hidden; r++) got_dx[r] = one.x[r] - x0[r];
    // m, b and a enter the reference's conv and step as floats (the f64 dots rounded to float), as
    // they are stored between the kernels. The projections' tolerance: fp32 sums of 2,048 terms.
    double tol_p = BF16 ? 1e-2 : 2e-6, tol_s = BF16 ? 2e-2 : 2e-5;
    double e_z = rel_l2(one.z.p(), z.data(), d.vd), e_b = rel_l2(one.b.p(), b.data(), d.nv),
           e_a = rel_l2(one.a.p(), a.data(), d.nv);
    verdict("in_proj's z, b, a (input norm folded in)", e_z < tol_p && e_b < tol_p && e_a < tol_p,
            "  rel_l2 %.2e, ...", std::max(e_z, std::max(e_b, e_a)));
    double e_c = rel_l2(one.c.p(), cref.data(), d.conv_dim);
    verdict("conv output (qkv channels)", e_c < (BF16 ? 1e-2 : 2e-6), "  rel_l2 %.2e", e_c);
    // The older rows move exactly; the last row is the token's qkv row (a projection).
    size_t last = (size_t)(d.taps - 2) * d.conv_dim;
    bool shifted = same_bits(one.conv.p(), c0.data() + d.conv_dim, last);
    double e_m = rel_l2(one.conv.p() + last, cv.data() + last, d.conv_dim);
    verdict("conv state shifted, the token's qkv row last", shifted && e_m < tol_p, "  rel_l2 %.2e", e_m);
    double e_o = rel_l2(one.o.p(), oref.data(), d.vd), e_s = rel_l2(one.state.p(), st.data(), st.size());
    verdict("recurrence output and state (32 heads x 128 x 128)", e_o < tol_s && e_s < tol_s, "  rel_l2 %.2e, %.2e",
            e_o, e_s);
    double e_x = rel_l2(got_dx.data(), dx.data(), d.hidden);
    verdict("residual row's update (x - x0)", e_x < (BF16 ? 5e-2 : 1e-5), "  rel_l2 %.2e", e_x);
    verdict("nothing written past the outputs", one.guards() && four.guards());
    // (b) the four launches; a second launch from the same states.
    relaunch_checks("dec_gemv4 + dec_dn_conv + dec_dn_step + dec_gemv4w", one.same(four), bar,
                    "launched again: the same outputs and states", [&] {
                        fused_dn_launch(d, again, x0.data(), bar);
                        return one.same(again);
                    });
}
