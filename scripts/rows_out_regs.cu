// A CUDA transcription (by hand, session 29, branch s29wout; shaders/wgsl/linear_q4_rows.wgsl is
// the reference) of linear_q4_rows' one-round kernels as decode's output projections run them
// (EARLY 1, PERSIST 0, 4-bit; `two` and the folded norm chosen at run time, accumulate):
//   k_two_rows      RB 2 (`out_rows` 2: today's out_proj / o), `row_total`;
//   k_lean_one_row  RB 1 with LEAN (`router_lean`'s kernel; `out_lean` gives it out_proj / o).
// Registers a thread as NVRTC + ptxas give them for sm_90: python3 scripts/nvrtc_regs.py
// scripts/rows_out_regs.cu (the Vulkan driver compiles the SPIR-V on the same back end). Not run
// anywhere: only compiled. Helpers as scripts/rows_persist_regs.cu's.
struct Words { uint4 w[8]; float s[8]; float b[8]; };
struct P { unsigned rows, cols, scale_off, bias_off, x_off, y_off, norm; float eps; unsigned nblocks_unused; };

__device__ __forceinline__ float bf(const unsigned* W, unsigned i) {
  unsigned v = W[i >> 1]; v = (i & 1) ? (v & 0xffff0000u) : (v << 16); return __uint_as_float(v);
}
template <int RI>
__device__ __forceinline__ Words read_words(const uint4* W, const unsigned* Wh, const P& p,
    unsigned r0, unsigned rr, unsigned nr, unsigned q, unsigned g, unsigned quads, unsigned groups) {
  Words o;
#pragma unroll
  for (int j = 0; j < RI; j++) {
    unsigned row = (rr + j < nr) ? r0 + rr + j : r0;
    o.w[j] = W[row * quads + q];
    o.s[j] = bf(Wh, p.scale_off + row * groups + g);
    o.b[j] = bf(Wh, p.bias_off + row * groups + g);
  }
  return o;
}
__device__ __forceinline__ float qd(uint4 w, const float4* x) {
  unsigned u[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 4; k++) {
#pragma unroll
    for (int n = 0; n < 2; n++) {
      float4 xv = x[k * 2 + n];
      unsigned v = u[k] >> (16 * n);
      s += float(v & 15u) * xv.x + float((v >> 4) & 15u) * xv.y + float((v >> 8) & 15u) * xv.z + float((v >> 12) & 15u) * xv.w;
    }
  }
  return s;
}
__device__ __forceinline__ float xsum(const float4* x) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) s += x[i].x + x[i].y + x[i].z + x[i].w;
  return s;
}
__shared__ float part[16 * 65];
__device__ __forceinline__ void row_put(unsigned lid, unsigned r, float v) { part[r * 65 + lid] = v; }
template <int RB>
__device__ __forceinline__ float row_total(unsigned lid) {
  __syncthreads();
  unsigned pr = 64 / RB, r = lid / pr, k = lid % pr;
  float t = 0.f;
  for (unsigned i = 0; i < RB; i++) t += part[r * 65 + k * RB + i];
  __syncthreads();
  part[r * 65 + k] = t;
  __syncthreads();
  float total = 0.f;
  if (k == 0) for (unsigned i = 0; i < pr; i++) total += part[r * 65 + i];
  return total;
}
__shared__ float2 wgp2[2];
__device__ __forceinline__ float2 wg_sum2(unsigned lid, float2 v) {
  for (int o = 16; o > 0; o >>= 1) { v.x += __shfl_xor_sync(0xffffffffu, v.x, o); v.y += __shfl_xor_sync(0xffffffffu, v.y, o); }
  if ((lid & 31) == 0) wgp2[lid >> 5] = v;
  __syncthreads();
  return make_float2(wgp2[0].x + wgp2[1].x, wgp2[0].y + wgp2[1].y);
}
__device__ __forceinline__ float rms(unsigned lid, float ss, unsigned cols, float eps) {
  __shared__ float red[64]; red[lid] = ss; __syncthreads();
  float t = 0.f; for (int i = 0; i < 64; i++) t += red[i]; __syncthreads();
  return rsqrtf(t / cols + eps);
}



template <int RB, int LEAN>
__device__ void body(const P p, const uint4* __restrict__ W, const unsigned* __restrict__ Wh,
    const float4* __restrict__ X, float* __restrict__ Y, const float4* __restrict__ Wn) {
  constexpr int RI = RB < 8 ? RB : 8;
  unsigned lid = threadIdx.x, block = blockIdx.x;
  unsigned r0 = block * RB;
  if (r0 >= p.rows) return;
  unsigned quads = p.cols / 32;
  bool two = quads > 64;
  unsigned groups = p.cols / 64, ga = (lid * 32) / 64, gc = ((lid + 64) * 32) / 64;
  unsigned nr = min((unsigned)RB, p.rows - r0);
  Words cur = read_words<RI>(W, Wh, p, r0, 0, nr, lid, ga, quads, groups);
  Words cur2 = {};
  if (two) cur2 = read_words<RI>(W, Wh, p, r0, 0, nr, lid + 64, gc, quads, groups);
  float4 xa[8], xc[8];
#pragma unroll
  for (int i = 0; i < 8; i++) { xa[i] = X[p.x_off + lid * 8 + i]; xc[i] = make_float4(0, 0, 0, 0); }
  if (two) {
#pragma unroll
    for (int i = 0; i < 8; i++) xc[i] = X[p.x_off + (lid + 64) * 8 + i];
  }
  float ss = 0.f;
  if (p.norm) {
    float4 wa[8], wc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) { wa[i] = Wn[lid * 8 + i]; wc[i] = make_float4(1, 1, 1, 1); }
    if (two) {
#pragma unroll
      for (int i = 0; i < 8; i++) wc[i] = Wn[(lid + 64) * 8 + i];
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
      ss += xa[i].x * xa[i].x + xa[i].y * xa[i].y + xa[i].z * xa[i].z + xa[i].w * xa[i].w
          + xc[i].x * xc[i].x + xc[i].y * xc[i].y + xc[i].z * xc[i].z + xc[i].w * xc[i].w;
      xa[i] = make_float4(xa[i].x * wa[i].x, xa[i].y * wa[i].y, xa[i].z * wa[i].z, xa[i].w * wa[i].w);
      xc[i] = make_float4(xc[i].x * wc[i].x, xc[i].y * wc[i].y, xc[i].z * wc[i].z, xc[i].w * wc[i].w);
    }
  }
  float sa = xsum(xa), sc = xsum(xc);
  float pa[RI];
#pragma unroll
  for (int j = 0; j < RI; j++) pa[j] = cur.s[j] * qd(cur.w[j], xa) + cur.b[j] * sa;
  if (two) {
#pragma unroll
    for (int j = 0; j < RI; j++) pa[j] += cur2.s[j] * qd(cur2.w[j], xc) + cur2.b[j] * sc;
  }
  if (LEAN) {
    float2 t = wg_sum2(lid, make_float2(pa[0], ss));
    float rl = p.norm ? rsqrtf(t.y / p.cols + p.eps) : 1.f;
    if (lid == 0) { unsigned o = p.y_off + r0; Y[o] = Y[o] + t.x * rl; }
    return;
  }
#pragma unroll
  for (int j = 0; j < RI; j++) row_put(lid, j, pa[j]);
  float rn = p.norm ? rms(lid, ss, p.cols, p.eps) : 1.f;
  float t = row_total<RB>(lid) * rn;
  unsigned r = lid / (64 / RB);
  if (lid % (64 / RB) == 0 && r < nr) { unsigned o = p.y_off + r0 + r; Y[o] = Y[o] + t; }
}
extern "C" __global__ void __launch_bounds__(64) k_two_rows(const P p, const uint4* W, const unsigned* Wh, const float4* X, float* Y, const float4* Wn) { body<2, 0>(p, W, Wh, X, Y, Wn); }
extern "C" __global__ void __launch_bounds__(64) k_lean_one_row(const P p, const uint4* W, const unsigned* Wh, const float4* X, float* Y, const float4* Wn) { body<1, 1>(p, W, Wh, X, Y, Wn); }
