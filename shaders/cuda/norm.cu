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
