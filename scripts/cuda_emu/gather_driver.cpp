// linear.cu's linear_gather (y[n, r] = Σ_c W_{ids[n]}[r, c] x[n / x_div, c]) on the emulation,
// with grid.y smaller than the items (GRID_Y_MAX past 65,535 items on the device; a small grid
// here, so each block row loops over items gridDim.y apart more than once), against an f64
// product of the same dequantised weights, and bit for bit against one pass (grid.y = items).
// Fails on any output left NaN (unwritten), above 1e-5 relative, or on any bit differing.
//   emu_gather rows cols bits n_items x_div grid_y
#include <random>
#include <cstdlib>

static u16 bf16_of(float f) {
    u32 x = as_u(f);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

int main(int argc, char** argv) {
    if (argc != 7) { fprintf(stderr, "usage: emu_gather rows cols bits n_items x_div grid_y\n"); return 2; }
    int rows = atoi(argv[1]), cols = atoi(argv[2]), bits = atoi(argv[3]);
    int n_items = atoi(argv[4]), x_div = atoi(argv[5]), grid_y = atoi(argv[6]);
    const int experts = 5, group = 64;
    std::mt19937 rng(rows * 7919 + cols * 31 + bits + n_items * 17 + grid_y);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    int wpr = cols * bits / 32;
    std::vector<u32> q((size_t)experts * rows * wpr);
    for (auto& v : q) v = (u32)rng();
    if (bits == 16)  // finite bf16 pairs
        for (auto& v : q) v = (u32)bf16_of(uni(rng)) | ((u32)bf16_of(uni(rng)) << 16);
    size_t n_groups = (size_t)experts * rows * (cols / group);
    std::vector<u16> scales(n_groups), biases(n_groups);
    for (auto& s : scales) s = bf16_of(0.01f + 0.05f * (uni(rng) + 1.0f));
    for (auto& b : biases) b = bf16_of(0.2f * uni(rng));
    QWeight w{q.data(), scales.data(), biases.data(), bits, rows, cols, group};
    int n_x = (n_items + x_div - 1) / x_div;
    std::vector<float> x((size_t)n_x * cols);
    for (auto& v : x) v = uni(rng);
    std::vector<int> ids(n_items);
    for (auto& id : ids) id = (int)(rng() % experts);
    auto run = [&](int gy) {
        std::vector<float> y((size_t)n_items * rows, NAN);
        launch({(rows + LINEAR_WARPS - 1) / LINEAR_WARPS, gy, 1}, LINEAR_WARPS * 32, 0, [&] {
            linear_gather(w, ids.data(), x.data(), cols, x_div, y.data(), rows, n_items);
        });
        return y;
    };
    std::vector<float> looped = run(grid_y), once = run(n_items);
    double err = 0, norm = 0;
    int unwritten = 0, differ = 0;
    for (int n = 0; n < n_items; n++)
        for (int r = 0; r < rows; r++) {
            long long row = (long long)ids[n] * rows + r;
            double want = 0;
            for (int wi = 0; wi < wpr; wi++) {
                float vals[8];
                int per = qw_unpack(w, row, wi, vals);
                for (int j = 0; j < per; j++) want += (double)vals[j] * x[(size_t)(n / x_div) * cols + wi * per + j];
            }
            float got = looped[(size_t)n * rows + r];
            if (std::isnan(got)) unwritten++;
            if (as_u(got) != as_u(once[(size_t)n * rows + r])) differ++;
            err += (got - want) * (got - want);
            norm += want * want;
        }
    double rel = std::sqrt(err / std::max(norm, 1e-30));
    bool ok = unwritten == 0 && differ == 0 && rel <= 1e-5;
    printf("linear_gather rows %d cols %d bits %d items %d x_div %d grid.y %d (%d passes): rel %.2e, "
           "%d unwritten, %d differing from one pass%s\n",
           rows, cols, bits, n_items, x_div, grid_y, (n_items + grid_y - 1) / grid_y, rel, unwritten, differ,
           ok ? "" : "  FAIL");
    return ok ? 0 : 1;
}
