// RMSNorm (MODEL.md §2.2), the plain form: y = x · rsqrt(mean(x²) + eps) · w, computed in fp32.
// The zero-centred (+1) convention is resolved at load, so w here is always the multiplier.
// x [n_rows, cols] with row stride x_stride; y likewise; w [cols] fp32. One block per row.
// Bytes: x read once, y written once.

extern "C" __global__ void rms_norm(const float* __restrict__ x, int x_stride, const float* __restrict__ w,
                                    float* __restrict__ y, int y_stride, int cols, float eps, int n_rows) {
    pdl_wait();
    int row = blockIdx.x;
    if (row >= n_rows) return;
    const float* xr = x + (long long)row * x_stride;
    float* yr = y + (long long)row * y_stride;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss);
    float inv = rsqrtf(ss / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = act(xr[c] * inv * w[c]);
}

// rms_norm_rows (`batch_lean_glue`): rms_norm's outputs bit for bit (the same block of
// RMS_ROWS_THREADS = 256 threads a row, each thread's columns c = tid + 256 k summed in k order,
// the same block_sum, the same y expression), for the few rows of a batched decode step
// (≤ 8 rows: ≤ 8 blocks, so each block's chain of dependent memory round trips is the launch's
// time). Each thread's weight values are requested before the dependency wait (the norm weight
// is not written by the kernel before), all its x values right after it into registers (at most
// RMS_ROWS_REG a thread: cols ≤ 256 · RMS_ROWS_REG, the launcher checks), so a row costs one
// round trip for its loads instead of rms_norm's one a loop trip (cols / 256 = 8 at 2,048
// columns, twice: the sum of squares, then the outputs, which read x again). The next kernel is
// let launch after the wait (its prologue, weight loads, overlaps this one; its own wait still
// sees every row stored).
#if !defined(RMS_ROWS_THREADS) || !defined(RMS_ROWS_REG)
#error "RMS_ROWS_THREADS and RMS_ROWS_REG come from the launcher module (crates/lily-cuda/src/kernels/norm.rs)"
#endif
extern "C" __global__ void __launch_bounds__(RMS_ROWS_THREADS)
rms_norm_rows(const float* __restrict__ x, int x_stride, const float* __restrict__ w, float* __restrict__ y,
              int y_stride, int cols, float eps, int n_rows) {
    int row = blockIdx.x, t = threadIdx.x;
    float wr[RMS_ROWS_REG], v[RMS_ROWS_REG];
#pragma unroll
    for (int k = 0; k < RMS_ROWS_REG; k++) {
        int c = t + k * RMS_ROWS_THREADS;
        wr[k] = c < cols ? w[c] : 0.0f;
    }
    pdl_wait();
    pdl_trigger();
    if (row >= n_rows) return;
    const float* xr = x + (long long)row * x_stride;
    float* yr = y + (long long)row * y_stride;
#pragma unroll
    for (int k = 0; k < RMS_ROWS_REG; k++) {
        int c = t + k * RMS_ROWS_THREADS;
        v[k] = c < cols ? xr[c] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_ROWS_REG; k++)
        if (t + k * RMS_ROWS_THREADS < cols) ss += v[k] * v[k];
    ss = block_sum(ss);
    float inv = rsqrtf(ss / (float)cols + eps);
#pragma unroll
    for (int k = 0; k < RMS_ROWS_REG; k++) {
        int c = t + k * RMS_ROWS_THREADS;
        if (c < cols) yr[c] = act(v[k] * inv * wr[k]);
    }
}
