// run_batch.sh's `fused_rows` part (included by driver_batch.cpp after driver_fused_moe.cpp, whose
// FusedMoe shape and f64 layer it uses): decode.cu's dec_moe_rows, the MoE block of a batched
// step's nb rows in one persistent launch, on a grid of 5 blocks (uneven shares) whose threads are
// fibers of one scheduler (launch_coop), for nb = 2, 3 and 8 with rings of 6, 3 and 2 slots (so the
// ring wraps many times), against
//   (a) the f64 MoE layer of each row (fused_ref), and
//   (b) what the batched step runs without it, through the same emulator: each row's RMS norm as
//       rms_norm computes it (dec_gemv8's folded norm, stage_x, writes the normed row), then
//       dec_gemv_rows (router + shared-expert gate over the rows), dec_glu4_rows and
//       dec_down_combine_rows, on Decode's launch geometry: bit for bit, every output;
// then launched again on the same inputs: the same bits, the grid barrier back to a count of 0.
// The real widths (hidden 2048, expert and shared widths 512, 8-bit router and shared gate, 4-bit
// experts) with 16 experts, top 8: the rows' picks overlap (printed). What it cannot show: as
// driver_fused_moe.cpp.

static const int ROWS_GRID = 5;

struct RowsOut {
    int nb;
    Buf<float> x, xn, logits, s_gate, rw, h, hs;
    Buf<int> ids;
    RowsOut(const FusedMoe& m, int nb_)
        : nb(nb_), x((size_t)nb_ * m.hidden), xn((size_t)nb_ * m.hidden), logits((size_t)nb_ * m.n_exp),
          s_gate(nb_), rw((size_t)nb_ * m.top_k), h((size_t)nb_ * m.top_k * m.inter), hs((size_t)nb_ * m.inter),
          ids((size_t)nb_ * m.top_k) {}
    bool guards() const {
        return x.guard_ok() && xn.guard_ok() && logits.guard_ok() && s_gate.guard_ok() && rw.guard_ok() &&
               h.guard_ok() && hs.guard_ok() && ids.guard_ok();
    }
    bool same(const RowsOut& o) const {
        return same_bits(x.v.data(), o.x.v.data(), x.n) && same_bits(xn.v.data(), o.xn.v.data(), xn.n) &&
               same_bits(logits.v.data(), o.logits.v.data(), logits.n) &&
               same_bits(s_gate.v.data(), o.s_gate.v.data(), s_gate.n) && same_bits(rw.v.data(), o.rw.v.data(), rw.n) &&
               same_bits(h.v.data(), o.h.v.data(), h.n) && same_bits(hs.v.data(), o.hs.v.data(), hs.n) &&
               same_bits(ids.v.data(), o.ids.v.data(), ids.n);
    }
};

// Decode::moe_rows' geometry (crates/lily-cuda/src/kernels/decode.rs moe_rows_shares,
// moe_rows_smem).
static size_t rows_smem_floats(const FusedMoe& m, int nb, int grid, int slots, int& gu_share, int& down_share) {
    auto r4 = [](size_t n) { return (n + 3) / 4 * 4; };
    int items = m.top_k + 1, gh = m.hidden / 64, gi = m.inter / 64;
    gu_share = ((1 + nb * m.top_k) * m.inter + grid - 1) / grid;
    down_share = (m.hidden + grid - 1) / grid;
    size_t rec_i = m.inter / 2 + m.inter / 16;
    size_t staged = std::max((size_t)nb * gh * DEC_XPAD, items * gi * DEC_XPAD + r4(items * gi) + r4((size_t)down_share * items));
    size_t bytes = 4 * (staged + 2 * r4((size_t)nb * gh) + 2 * r4((size_t)nb * m.n_exp)) +
                   ((size_t)down_share * rec_i + 15) / 16 * 16 + (size_t)slots * MOE_SLOT;
    return bytes / 4;
}

static void rows_launch(const FusedMoe& m, const std::vector<float>& norm_w, float eps, RowsOut& o, int slots,
                        unsigned* bar) {
    DecMoeRows a;
    a.m = moe_args(m, norm_w, eps, o, bar);
    a.nb = o.nb; a.slots = slots;
    size_t smem = rows_smem_floats(m, o.nb, ROWS_GRID, slots, a.m.gu_share, a.m.down_share);
    launch_coop(ROWS_GRID, DEC_WARPS * 32, smem, [&] { dec_moe_rows(a); });
}

// Forward::moe_batch's BatchMoe::Rows: the norm, dec_gemv_rows, dec_glu4_rows, dec_down_combine_rows.
static void rows_three_kernels(const FusedMoe& m, const std::vector<float>& norm_w, float eps, RowsOut& o) {
    int nb = o.nb, G = m.hidden / 64, lpr = std::min(32, G), spw = 32 / lpr;
    Buf<float> lg1(m.n_exp), sg1(1);
    DecSegs one = make_segs({{&m.router, DEC_EXACT}, {&m.sgw, DEC_STORE}}, {lg1.p(), sg1.p()}, DEC_WARPS * spw);
    for (int b = 0; b < nb; b++) {
        float* xb = o.x.p() + (size_t)b * m.hidden;
        float* xnb = o.xn.p() + (size_t)b * m.hidden;
        launch_k({std::min(one.tiles, LAUNCH_BLOCKS_PER_SM * SM_COUNT), 1, 1}, DEC_WARPS * 32, 0,
                 [&] { dec_gemv8(one, xb, norm_w.data(), eps, nullptr, 1, xnb, m.hidden); });
    }
    project_rows({{&m.router, DEC_EXACT}, {&m.sgw, DEC_STORE}}, {o.logits.p(), o.s_gate.p()}, o.xn.p(), m.hidden, nb);
    int per_item = (m.inter + DEC_WARPS * spw * DEC_GLU_R4 - 1) / (DEC_WARPS * spw * DEC_GLU_R4);
    int tiles = per_item * (m.top_k + 1), per_token = (LAUNCH_BLOCKS_PER_SM * SM_COUNT + nb - 1) / nb;
    QWeight g = m.gate.view(), u = m.up.view(), sg = m.sgate.view(), su = m.sup.view();
    launch_k({std::min(tiles, per_token), nb, 1}, DEC_WARPS * 32, 0, [&] {
        dec_glu4_rows(g, u, o.logits.p(), m.n_exp, m.top_k, o.ids.p(), o.rw.p(), sg, su, o.xn.p(), o.h.p(), m.inter,
                      o.hs.p(), per_item);
    });
    int Gi = m.inter / 64, lpr_i = std::min(32, Gi), spw_i = 32 / lpr_i;
    int dgrid = (m.hidden + DEC_DOWN_WARPS * spw_i - 1) / (DEC_DOWN_WARPS * spw_i);
    size_t smem = (size_t)(m.top_k + 1) * Gi * (DEC_XPAD + 1) + (DEC_DOWN_KSPLIT + 1) * DEC_DOWN_WARPS * spw_i;
    QWeight dw = m.down.view(), sd = m.sdown.view();
    launch_k({dgrid, nb, 1}, DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, smem, [&] {
        dec_down_combine_rows(dw, sd, o.ids.p(), o.rw.p(), m.top_k, o.h.p(), m.inter, o.hs.p(), o.s_gate.p(), o.x.p());
    });
}

static void run_fused_moe_rows() {
    printf("dec_moe_rows on %d blocks (activations %s)\n", ROWS_GRID, BF16 ? "bf16" : "fp32");
    FusedMoe m;
    const float eps = 1e-6f;
    std::vector<float> norm_w = vec(m.hidden, 0.3f);
    for (auto& v : norm_w) v += 1.0f;
    for (auto [nb, slots] : {std::pair{2, 6}, std::pair{3, 3}, std::pair{8, 2}}) {
        std::vector<float> x0 = vec((size_t)nb * m.hidden, 1.0f);
        if (BF16) for (auto& v : x0) v = (float)f_of_bf16(bf16_of(v));
        RowsOut one(m, nb), three(m, nb), again(m, nb);
        for (RowsOut* o : {&one, &three, &again}) std::copy(x0.begin(), x0.end(), o->x.v.begin());
        unsigned bar[2] = {0, 0};
        rows_launch(m, norm_w, eps, one, slots, bar);
        rows_three_kernels(m, norm_w, eps, three);
        // (a) each row's f64 layer.
        bool ids_ok = true;
        double min_gap = 1e9, e_xn = 0, e_lg = 0, e_rw = 0, e_sg = 0, e_h = 0, e_hs = 0, e_x = 0;
        std::vector<int> picked(m.n_exp, 0);
        std::vector<double> sg_want(nb);  // (one logit a row: held as a vector, not each to its own scale)
        for (int b = 0; b < nb; b++) {
            const float* xb = x0.data() + (size_t)b * m.hidden;
            FusedRef r = fused_ref(m, xb, norm_w, eps);
            min_gap = std::min(min_gap, r.gap);
            for (int k = 0; k < m.top_k; k++) {
                ids_ok &= one.ids[(size_t)b * m.top_k + k] == r.order[k];
                picked[r.order[k]]++;
            }
            e_xn = std::max(e_xn, rel_l2(one.xn.p() + (size_t)b * m.hidden, r.xn.data(), m.hidden));
            e_lg = std::max(e_lg, rel_l2(one.logits.p() + (size_t)b * m.n_exp, r.lg.data(), m.n_exp));
            e_rw = std::max(e_rw, rel_l2(one.rw.p() + (size_t)b * m.top_k, r.rw.data(), m.top_k));
            sg_want[b] = r.sg;
            e_h = std::max(e_h, rel_l2(one.h.p() + (size_t)b * m.top_k * m.inter, r.h.data(), r.h.size()));
            e_hs = std::max(e_hs, rel_l2(one.hs.p() + (size_t)b * m.inter, r.hs.data(), m.inter));
            std::vector<float> got_dx(m.hidden);
            for (int c = 0; c < m.hidden; c++) got_dx[c] = one.x[(size_t)b * m.hidden + c] - xb[c];
            e_x = std::max(e_x, rel_l2(got_dx.data(), r.dx.data(), m.hidden));
        }
        e_sg = rel_l2(one.s_gate.p(), sg_want.data(), nb);
        int shared_picks = 0;
        for (int v : picked) shared_picks += v > 1;
        double tol = BF16 ? 2e-2 : 1e-5;
        char what[200];
        snprintf(what, sizeof what, "%d rows, %d slots: normed rows (xn)", nb, slots);
        verdict(what, e_xn < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e", e_xn);
        snprintf(what, sizeof what, "%d rows: router logits (exact)", nb);
        verdict(what, e_lg < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e", e_lg);
        snprintf(what, sizeof what, "%d rows: expert ids (margin %.1e; %d experts picked by several rows)", nb, min_gap,
                 shared_picks);
        verdict(what, ids_ok && (nb < 2 || shared_picks > 0));
        snprintf(what, sizeof what, "%d rows: routing weights", nb);
        verdict(what, e_rw < (BF16 ? 1e-2 : 1e-6), "  rel_l2 %.2e", e_rw);
        snprintf(what, sizeof what, "%d rows: shared expert's gate logits", nb);
        verdict(what, e_sg < (BF16 ? 1e-2 : 1e-5), "  rel_l2 %.2e", e_sg);
        snprintf(what, sizeof what, "%d rows: experts' and shared expert's hidden rows", nb);
        verdict(what, e_h < tol && e_hs < tol, "  rel_l2 %.2e, %.2e", e_h, e_hs);
        snprintf(what, sizeof what, "%d rows: residual rows' update (x - x0)", nb);
        verdict(what, e_x < (BF16 ? 5e-2 : 1e-5), "  rel_l2 %.2e", e_x);
        snprintf(what, sizeof what, "%d rows: nothing written past the outputs", nb);
        verdict(what, one.guards() && three.guards());
        // (b) the batched step's kernels without it.
        bool same = one.same(three);
        snprintf(what, sizeof what, "%d rows vs rms_norm + dec_gemv_rows + dec_glu4_rows + dec_down_combine_rows", nb);
        verdict(what, same, same ? "  bit for bit" : "  differ");
        snprintf(what, sizeof what, "%d rows: grid barrier reset (count 0, two generations)", nb);
        verdict(what, bar[0] == 0 && bar[1] == 2, "  %g, %g", bar[0], bar[1]);
        rows_launch(m, norm_w, eps, again, slots, bar);
        same = one.same(again);
        snprintf(what, sizeof what, "%d rows launched again: the same outputs", nb);
        verdict(what, same, same ? "  bit for bit" : "  differ");
        snprintf(what, sizeof what, "%d rows: grid barrier after the second launch (count 0, four)", nb);
        verdict(what, bar[0] == 0 && bar[1] == 4, "  %g, %g", bar[0], bar[1]);
    }
}
