#include <cstdio>
#include <random>
// The GEMM part of scripts/cuda_emu/run.sh: gemm.cu's routed-experts wgmma kernels
// gemm_grouped_wgb32, gemm_grouped_wgb64 and gemm_grouped_wgb128 run through shim.h + wgmma.h on
// random 4-bit experts, against an f64 product of the same bf16 operands. Arguments: rows cols
// group x_div tile count… (items per expert; the items are shuffled); tile 32, 64, 128, or
// 128+32: tiles of 128 until at most 32 items of an expert are left, those in a second list run
// by gemm_grouped_wgb32 in a second launch into the same outputs (the plan's `wgmma_tail_tiles`).
// Each case runs again on the kernels' _lean variants (the plan's `wgmma_lean_dequant`, groups of
// ≥ 64) and on their _hoist variants (`wgmma_hoisted_addrs`), and fails unless every output of
// both is bit-identical to the first run's.
// The tiles are built on the host as moe_group builds them (each expert's items in order, runs
// of up to the tile; the remainders' rule is moe_group's).
static double rel(const std::vector<float>& got, const std::vector<double>& want, size_t* bad) {
    double num = 0, den = 0;
    *bad = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) { (*bad)++; continue; }
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
}
int main(int argc, char** argv) {
    if (argc < 7) { fprintf(stderr, "usage: rows cols group x_div 64|128 counts...\n"); return 2; }
    int rows = atoi(argv[1]), cols = atoi(argv[2]), group = atoi(argv[3]), x_div = atoi(argv[4]);
    int tile = atoi(argv[5]), tail = strchr(argv[5], '+') ? atoi(strchr(argv[5], '+') + 1) : 0;
    if ((tile != 32 && tile != 64 && tile != 128) || (tail && (tile != 128 || tail != 32))) {
        fprintf(stderr, "tile %s: 32, 64, 128 or 128+32\n", argv[5]);
        return 2;
    }
    std::vector<int> counts;
    for (int i = 6; i < argc; i++) counts.push_back(atoi(argv[i]));
    int E = (int)counts.size(), items = 0;
    for (int c : counts) items += c;
    if (items % x_div) { fprintf(stderr, "items %% x_div != 0\n"); return 2; }
    std::mt19937 rng(rows * 31 + cols + items);
    std::uniform_real_distribution<float> U(-1, 1);
    // Weights: 4-bit q, bf16 scales and biases, as the checkpoint stores them.
    int wpr = cols / 8, gpr = cols / group;
    std::vector<u32> q((size_t)E * rows * wpr);
    for (auto& v : q) v = (u32)rng();
    std::vector<u16> sc((size_t)E * rows * gpr), bi(sc.size());
    for (size_t i = 0; i < sc.size(); i++) {
        sc[i] = emu_bf16((0.2f + 0.8f * std::fabs(U(rng))) / (8.0f * std::sqrt((float)cols)));
        bi[i] = emu_bf16(U(rng) * 8.0f * emu_f32(sc[i]));
    }
    QWeight w{q.data(), sc.data(), bi.data(), 4, rows, cols, group};
    auto wdq = [&](int e, int r, int c) -> double {  // bf16(scale·q + bias), as the kernels make it
        size_t row = (size_t)e * rows + r;
        u32 v = (q[row * wpr + c / 8] >> (4 * (c % 8))) & 15u;
        float s = emu_f32(sc[row * gpr + c / group]), b = emu_f32(bi[row * gpr + c / group]);
        return emu_f32(emu_bf16(fmaf(s, (float)v, b)));
    };
    int n_x = items / x_div;
    std::vector<u16> x((size_t)n_x * cols);
    for (auto& v : x) v = emu_bf16(U(rng));
    // Routed items, shuffled; grouped expert by expert into runs of up to `tile`.
    std::vector<int> ids;
    for (int e = 0; e < E; e++) for (int i = 0; i < counts[e]; i++) ids.push_back(e);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int> perm, tiles, tails;
    for (int e = 0; e < E; e++) {
        int start = (int)perm.size(), s = 0;
        for (int i = 0; i < items; i++) if (ids[i] == e) perm.push_back(i);
        for (; s < counts[e] && counts[e] - s > tail; s += tile)
            tiles.insert(tiles.end(), {e, start + s, std::min(tile, counts[e] - s)});
        if (s < counts[e]) tails.insert(tails.end(), {e, start + s, counts[e] - s});
    }
    int n_tiles = (int)tiles.size() / 3, n_tails = (int)tails.size() / 3;
    std::vector<float> y((size_t)items * rows, NAN);
    int groups = cols / group;
    auto smem = [&](int tok) {
        int stages = tok == 32 ? WGB32_STAGES : WGB_STAGES;
        return 1024 + stages * ((size_t)tok * 128 + WG_ROWS * 32) + WG_ROWS * groups * 4;
    };
    // variant 0: the plain kernels, 1: _lean, 2: _hoist.
    auto run = [&](int tok, std::vector<int>& list, int& n, int variant, std::vector<float>& y) {
        dim3e grid{(rows + WG_ROWS - 1) / WG_ROWS, n + 2, 1};  // two blocks past the tiles: they exit
        launch(grid, 256, smem(tok) / 4, [&] {
            decltype(&gemm_grouped_wgb32) ks[3][3] = {
                {gemm_grouped_wgb32, gemm_grouped_wgb32_lean, gemm_grouped_wgb32_hoist},
                {gemm_grouped_wgb64, gemm_grouped_wgb64_lean, gemm_grouped_wgb64_hoist},
                {gemm_grouped_wgb128, gemm_grouped_wgb128_lean, gemm_grouped_wgb128_hoist}};
            auto k = ks[tok == 32 ? 0 : tok == 64 ? 1 : 2][variant];
            k(w, perm.data(), list.data(), &n, x.data(), cols, x_div, y.data(), rows);
        });
    };
    run(tile, tiles, n_tiles, 0, y);
    if (tail) run(tail, tails, n_tails, 0, y);
    // The lean dequantisation (`wgmma_lean_dequant`, groups of ≥ 64): every output bit-identical.
    // Then the _hoist variants (`wgmma_hoisted_addrs`, the same groups): bit-identical too.
    size_t differ = 0, differ_h = 0;
    bool lean = group >= 64;
    if (lean) {
        std::vector<float> y2(y.size(), NAN), y3(y.size(), NAN);
        run(tile, tiles, n_tiles, 1, y2);
        if (tail) run(tail, tails, n_tails, 1, y2);
        run(tile, tiles, n_tiles, 2, y3);
        if (tail) run(tail, tails, n_tails, 2, y3);
        for (size_t i = 0; i < y.size(); i++) {
            differ += memcmp(&y[i], &y2[i], sizeof(float)) != 0;
            differ_h += memcmp(&y[i], &y3[i], sizeof(float)) != 0;
        }
    }
    std::vector<double> want(y.size());
    for (int i = 0; i < items; i++)
        for (int r = 0; r < rows; r++) {
            double s = 0;
            for (int c = 0; c < cols; c++) s += wdq(ids[i], r, c) * emu_f32(x[(size_t)(i / x_div) * cols + c]);
            want[(size_t)i * rows + r] = s;
        }
    size_t bad;
    double e = rel(y, want, &bad);
    bool ok = bad == 0 && e < 5e-3 && g_wg_errors == 0 && differ == 0 && differ_h == 0;
    char runs[64];
    snprintf(runs, sizeof runs, tail ? "%d + %d (_wgb%d)" : "%d", n_tiles, n_tails, tail);
    char lean_s[96];
    snprintf(lean_s, sizeof lean_s,
             lean ? "; _lean: %zu, _hoist: %zu of %zu outputs differ" : "; _lean, _hoist: n/a (group < 64)", differ,
             differ_h, y.size());
    printf("gemm_grouped_wgb%d %dx%d group %d x_div %d, %d items over %d experts in %s runs: rel. L2 %.2e%s%s%s\n",
           tile, rows, cols, group, x_div, items, E, runs, e, lean_s,
           bad ? " (unwritten outputs!)" : "", g_wg_errors ? " (warpgroup ops out of step!)" : "");
    if (!ok) printf("  FAILED\n");
    return ok ? 0 : 1;
}
