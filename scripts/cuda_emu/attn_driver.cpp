#include <cstdio>
#include <random>
// The attention part of scripts/cuda_emu/run.sh: attention.cu's attn_prefill_wg and
// attn_prefill_wg_pipe (the plan's `wgmma_attention_pipelined`) through shim.h + wgmma.h on random
// bf16 q and caches, causal, head dim 256. Arguments: n_q n_kv pos T (query heads, kv heads, the
// chunk's position and tokens). Fails unless every output of attn_prefill_wg_pipe is
// bit-identical to attn_prefill_wg's, or where either leaves an output unwritten or is off an f64
// reference by a relative L2 of 1e-2 or more (the GPU test's tolerance: P and the output are
// rounded to bf16).
int main(int argc, char** argv) {
    if (argc != 5) { fprintf(stderr, "usage: n_q n_kv pos T\n"); return 2; }
    int n_q = atoi(argv[1]), n_kv = atoi(argv[2]), pos = atoi(argv[3]), T = atoi(argv[4]);
    const int D = 256;
    if (n_q % n_kv || (n_q / n_kv) % 2) { fprintf(stderr, "query heads a kv head must be even\n"); return 2; }
    std::mt19937 rng(n_q * 131 + pos * 7 + T);
    std::uniform_real_distribution<float> U(-1, 1);
    auto val = [&](float scale) {  // never zero, as the GPU tests' Rng::val
        float u = U(rng);
        return (u < 0 ? -1.0f : 1.0f) * (0.05f + 0.95f * std::fabs(u)) * scale;
    };
    int keys = pos + T;
    std::vector<u16> kc((size_t)keys * n_kv * D), vc(kc.size());
    for (auto& v : kc) v = emu_bf16(val(1.0f));
    for (auto& v : vc) v = emu_bf16(val(1.0f));
    std::vector<float> q((size_t)T * n_q * D), qg((size_t)T * n_q * 2 * D);
    for (auto& v : q) v = emu_f32(emu_bf16(val(3.0f)));
    for (auto& v : qg) v = val(2.0f);
    float scale = 1.0f / std::sqrt((float)D);
    int pos_dev = pos;
    dim3e grid{(T + WGA_Q - 1) / WGA_Q, n_q / 2, 1};
    auto run = [&](bool pipe) {
        std::vector<float> out((size_t)T * n_q * D, NAN);
        launch(grid, 256, WGA_SMEM / 4, [&] {
            if (pipe)
                attn_prefill_wg_pipe(q.data(), qg.data(), kc.data(), vc.data(), out.data(), &pos_dev, T, n_q, n_kv, D, scale);
            else
                attn_prefill_wg(q.data(), qg.data(), kc.data(), vc.data(), out.data(), &pos_dev, T, n_q, n_kv, D, scale);
        });
        return out;
    };
    std::vector<float> base = run(false), pipe = run(true);
    // f64 reference: softmax(q·kᵀ·scale) over keys ≤ pos + t, times v, gated by sigmoid(gate).
    std::vector<double> ref(base.size());
    for (int t = 0; t < T; t++)
        for (int h = 0; h < n_q; h++) {
            int kvh = h / (n_q / n_kv), nk = pos + t + 1;
            std::vector<double> s(nk);
            double m = -1e300;
            for (int k = 0; k < nk; k++) {
                double a = 0;
                for (int c = 0; c < D; c++)
                    a += (double)q[((size_t)t * n_q + h) * D + c] * emu_f32(kc[((size_t)k * n_kv + kvh) * D + c]);
                s[k] = a * scale;
                m = std::max(m, s[k]);
            }
            double l = 0;
            for (auto& x : s) { x = std::exp(x - m); l += x; }
            for (int c = 0; c < D; c++) {
                double o = 0;
                for (int k = 0; k < nk; k++) o += s[k] * emu_f32(vc[((size_t)k * n_kv + kvh) * D + c]);
                double gate = qg[((size_t)t * n_q * 2 + (size_t)h * 2) * D + D + c];
                ref[((size_t)t * n_q + h) * D + c] = o / l / (1.0 + std::exp(-gate));
            }
        }
    auto rel = [&](const std::vector<float>& got, size_t* bad) {
        double num = 0, den = 0;
        *bad = 0;
        for (size_t i = 0; i < got.size(); i++) {
            if (!std::isfinite(got[i])) { (*bad)++; continue; }
            num += (got[i] - ref[i]) * (got[i] - ref[i]);
            den += ref[i] * ref[i];
        }
        return std::sqrt(num / std::max(den, 1e-300));
    };
    size_t bad_b, bad_p, differ = 0;
    double e_b = rel(base, &bad_b), e_p = rel(pipe, &bad_p);
    for (size_t i = 0; i < base.size(); i++) differ += as_u(base[i]) != as_u(pipe[i]);
    int errs = g_wg_errors.exchange(0);
    bool ok = bad_b == 0 && bad_p == 0 && e_b < 1e-2 && e_p < 1e-2 && differ == 0 && errs == 0;
    printf("attn Hq %d Hkv %d pos %d T %d: attn_prefill_wg rel %.3e (%zu unwritten), _pipe rel %.3e (%zu unwritten), "
           "%zu of %zu outputs differ, %d wgmma errors: %s\n",
           n_q, n_kv, pos, T, e_b, bad_b, e_p, bad_p, differ, base.size(), errs, ok ? "ok" : "FAIL");
    return ok ? 0 : 1;
}
