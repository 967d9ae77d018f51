#include <cstdio>
#include <random>
// The f64 reference and the driver of scripts/cuda_emu/run.sh (its emu.cpp includes this after
// shim.h and the kernels). Arguments: k heads, v heads, dk (= dv), tokens, decay scale, tf32 (0/1).
static double rel(const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0, den = 0; size_t bad = 0;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) { bad++; continue; }
        num += (got[i] - want[i]) * (got[i] - want[i]); den += want[i] * want[i];
    }
    if (bad) { printf("  %zu non-finite values!\n", bad); return 1e9; }
    return std::sqrt(num / std::max(den, 1e-300));
}
int main(int argc, char** argv) {
    int n_k = atoi(argv[1]), n_v = atoi(argv[2]), dk = atoi(argv[3]), dv = dk, n = atoi(argv[4]);
    float decay = atof(argv[5]); g_tf32 = atoi(argv[6]);
    std::mt19937 rng(n * 7 + dk);
    std::uniform_real_distribution<float> U(-1, 1), P(0, 1);
    int key_dim = n_k * dk; long conv_dim = 2 * key_dim + n_v * dv;
    std::vector<float> qk((size_t)n * n_k * 2 * dk), ab((size_t)n * n_v * 2), c((size_t)n * conv_dim, NAN);
    for (int t = 0; t < n; t++) for (int h = 0; h < n_k; h++) for (int w = 0; w < 2; w++) {
        float* r = &qk[((size_t)(t * n_k + h) * 2 + w) * dk]; double ss = 0;
        for (int i = 0; i < dk; i++) { r[i] = U(rng); ss += r[i] * r[i]; }
        float sc = 1.0 / std::sqrt(ss) * (w == 0 ? 1.0 / std::sqrt((double)dk) : 1.0);
        for (int i = 0; i < dk; i++) r[i] *= sc;
    }
    for (int t = 0; t < n; t++) for (int h = 0; h < n_v; h++) {
        ab[(t * n_v + h) * 2] = -decay * P(rng); ab[(t * n_v + h) * 2 + 1] = 0.05 + 0.9 * P(rng);
        for (int j = 0; j < dv; j++) c[(size_t)t * conv_dim + 2 * key_dim + h * dv + j] = U(rng);
    }
    std::vector<float> state((size_t)n_v * dk * dv);
    for (auto& v : state) v = 0.3 * U(rng);
    std::vector<float> init = state;
    int C = DN_WY_C, chunks = (n + C - 1) / C;
    std::vector<float> rec((size_t)chunks * n_v * C * (dk + dv + C + 1), NAN);
    std::vector<float> o((size_t)n * n_v * dv, NAN);
    int LD = DN_MAX_DK + 4, LDC = C + 4, LDV = DN_WY_COLS + 8;
    size_t prep_smem = 2 * C * LD + 2 * C * LDC + 3 * C;
    size_t scan_smem = 3 * C * LD + C * LDC + DN_MAX_DK * LDV + C * LDV + 2 * C;
    launch({chunks, n_v, 1}, DN_WY_PREP_THREADS, prep_smem, [&] { dn_wy_prep(c.data(), qk.data(), ab.data(), rec.data(), n, n_k, n_v, dk, dv); });
    launch({n_v, dv / DN_WY_COLS, 1}, DN_WY_SCAN_THREADS, scan_smem, [&] { dn_wy_scan(qk.data(), rec.data(), state.data(), o.data(), n, n_k, n_v, dk, dv); });
    // f64 reference, token by token
    std::vector<double> wo((size_t)n * n_v * dv), ws(state.size());
    for (int hv = 0; hv < n_v; hv++) {
        int hk = hv / (n_v / n_k);
        std::vector<double> S(init.begin() + (size_t)hv * dk * dv, init.begin() + (size_t)(hv + 1) * dk * dv);
        for (int t = 0; t < n; t++) {
            double alpha = std::exp((double)ab[(t * n_v + hv) * 2]), beta = ab[(t * n_v + hv) * 2 + 1];
            const float* q = &qk[((size_t)(t * n_k + hk) * 2) * dk]; const float* k = q + dk;
            const float* v = &c[(size_t)t * conv_dim + 2 * key_dim + hv * dv];
            for (auto& x : S) x *= alpha;
            for (int j = 0; j < dv; j++) {
                double u = 0; for (int i = 0; i < dk; i++) u += S[i * dv + j] * k[i];
                double d = beta * (v[j] - u);
                for (int i = 0; i < dk; i++) S[i * dv + j] += k[i] * d;
            }
            for (int j = 0; j < dv; j++) { double s = 0; for (int i = 0; i < dk; i++) s += S[i * dv + j] * q[i]; wo[((size_t)t * n_v + hv) * dv + j] = s; }
        }
        std::copy(S.begin(), S.end(), ws.begin() + (size_t)hv * dk * dv);
    }
    double eo = rel(o, wo), es = rel(state, ws);
    printf("heads %d/%d dk %d n %d decay %.2f tf32 %d: outputs rel_l2 %.3e, state rel_l2 %.3e\n", n_k, n_v, dk, n, decay, (int)g_tf32, eo, es);
    // The GPU test's tolerance for tf32 products (tests/gpu/deltanet.rs TC_SCAN_TOL); fp32 ones
    // differ from f64 by summation order only.
    double tol = g_tf32 ? 3e-3 : 1e-5;
    if (!(eo < tol && es < tol)) { printf("  FAILED: above %.0e\n", tol); return 1; }
    return 0;
}
