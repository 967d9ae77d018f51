// A CUDA transcription (by hand, session 25, branch s25wdec; shaders/wgsl/attend_gqa.wgsl is the
// reference) of attend_gqa's block loop as decode runs it on the full model (G 8, D 256, FLAT 1,
// an f16 cache, 256 invocations), for the registers ptxas gives each form
// (`python3 scripts/nvrtc_regs.py scripts/attend_gqa_regs.cu`):
//   k_flat    today: the values read after the softmax in rounds of 8;
//   k_vearly  `VEARLY` 1 as built: the block's 32 values requested once its key products are
//             written (`attn_v_early`);
//   k_vbeside the values requested beside the keys' words (the placement not taken);
//   k_knext   k_vearly and the next block's key words (packed f16) requested after the early
//             values, used by the next block instead of its own reads (not built: a next step).
// The prep (attn_prep's work) is left out: its registers are dead before the loop.
// Not run anywhere: only compiled.
// f16 without cuda_fp16.h (NVRTC here has no include path): the conversion in PTX.
__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
#define G 8
#define D 256
#define D4 64
#define KB 32
#define VE 32
struct P { unsigned hkv, span, pos0, nsplit; float scale; };
__shared__ float4 qs[G * D4];
__shared__ float kp[G * KB * (G + 1)];
__shared__ float sc[256];
__shared__ float pr[256];
__shared__ float knew[D];
__shared__ float vnew[D];

template <int MODE>
__device__ void body(const P& p, const uint2* Kc, const unsigned short* Vc, float* Part) {
  unsigned lid = threadIdx.x, kvh = blockIdx.x, split = blockIdx.z;
  unsigned n = p.pos0 + 1, k0 = split * p.span, k1 = min(n, k0 + p.span);
  unsigned pos_new = p.pos0;
  unsigned kj = lid / G, ks = lid % G, sg = lid / KB, sj = lid % KB;
  float m[G], l[G], acc[G];
#pragma unroll
  for (int g = 0; g < G; g++) { m[g] = -1e30f; l[g] = 0.f; acc[g] = 0.f; }
  uint2 kn[8];
  for (unsigned kb = k0; kb < k1; kb += KB) {
    float ve[VE];
    unsigned cv = min(lid, D - 1u);
    if (MODE == 2) {
#pragma unroll
      for (int i = 0; i < VE; i++) ve[i] = h2f(Vc[(min(kb + i, k1 - 1) * p.hkv + kvh) * D + cv]);
    }
    {
      float4 pd[G];
#pragma unroll
      for (int g = 0; g < G; g++) pd[g] = make_float4(0, 0, 0, 0);
      unsigned jr = min(kb + kj, k1 - 1), kbase = (jr * p.hkv + kvh) * D4;
      float4 kw[8];
#pragma unroll
      for (int i = 0; i < 8; i++) {
        uint2 w = (MODE == 3 && kb != k0) ? kn[i] : Kc[kbase + min(ks + i * G, D4 - 1u)];
        kw[i] = make_float4(h2f(w.x & 0xffffu), h2f(w.x >> 16), h2f(w.y & 0xffffu), h2f(w.y >> 16));
      }
#pragma unroll
      for (int i = 0; i < 8; i++) {
        unsigned cc = min(ks + i * G, D4 - 1u);
        float4 kv = kw[i];
        if (jr == pos_new) kv = make_float4(knew[4 * cc], knew[4 * cc + 1], knew[4 * cc + 2], knew[4 * cc + 3]);
#pragma unroll
        for (int g = 0; g < G; g++) {
          float4 q = qs[g * D4 + cc];
          pd[g].x += q.x * kv.x; pd[g].y += q.y * kv.y; pd[g].z += q.z * kv.z; pd[g].w += q.w * kv.w;
        }
      }
#pragma unroll
      for (int g = 0; g < G; g++) kp[(g * KB + kj) * (G + 1) + ks] = (pd[g].x + pd[g].y) + (pd[g].z + pd[g].w);
    }
    if (MODE == 1 || MODE == 3) {
#pragma unroll
      for (int i = 0; i < VE; i++) ve[i] = h2f(Vc[(min(kb + i, k1 - 1) * p.hkv + kvh) * D + cv]);
    }
    if (MODE == 3 && kb + KB < k1) {
      unsigned jn = min(kb + KB + kj, k1 - 1), nbase = (jn * p.hkv + kvh) * D4;
#pragma unroll
      for (int i = 0; i < 8; i++) kn[i] = Kc[nbase + min(ks + i * G, D4 - 1u)];
    }
    __syncthreads();
    unsigned j = kb + sj;
    float s = -1e30f;
    if (j < k1) {
      float tot = 0.f;
      for (int i = 0; i < G; i++) tot += kp[(sg * KB + sj) * (G + 1) + i];
      s = tot * p.scale;
    }
    sc[lid] = s;
    __syncthreads();
    for (unsigned st = KB / 2; st > 0; st >>= 1) {
      if (sj < st) sc[lid] = fmaxf(sc[lid], sc[lid + st]);
      __syncthreads();
    }
    float corr[G];
#pragma unroll
    for (int g = 0; g < G; g++) { float mn = fmaxf(m[g], sc[g * KB]); corr[g] = __expf(m[g] - mn); m[g] = mn; }
    pr[lid] = (j < k1) ? __expf(s - m[sg]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; g++) { acc[g] *= corr[g]; l[g] *= corr[g]; }
    if (MODE == 0) {
#pragma unroll
      for (int j0 = 0; j0 < KB; j0 += 8) {
        float vv[8];
#pragma unroll
        for (int i = 0; i < 8; i++) vv[i] = h2f(Vc[(min(kb + j0 + i, k1 - 1) * p.hkv + kvh) * D + cv]);
#pragma unroll
        for (int i = 0; i < 8; i++) {
          float v = (min(kb + j0 + i, k1 - 1) == pos_new) ? vnew[cv] : vv[i];
#pragma unroll
          for (int g = 0; g < G; g++) { float w = pr[g * KB + j0 + i]; acc[g] += w * v; l[g] += w; }
        }
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < VE; jj++) {
        float v = (min(kb + jj, k1 - 1) == pos_new) ? vnew[cv] : ve[jj];
#pragma unroll
        for (int g = 0; g < G; g++) { float w = pr[g * KB + jj]; acc[g] += w * v; l[g] += w; }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int g = 0; g < G; g++) {
    unsigned pb = ((kvh * G + g) * p.nsplit + split) * (D + 2);
    Part[pb + lid] = acc[g];
    if (lid == 0) { Part[pb + D] = m[g]; Part[pb + D + 1] = l[g]; }
  }
}
extern "C" __global__ void __launch_bounds__(256) k_flat(P p, const uint2* Kc, const unsigned short* Vc, float* Part) { body<0>(p, Kc, Vc, Part); }
extern "C" __global__ void __launch_bounds__(256) k_vearly(P p, const uint2* Kc, const unsigned short* Vc, float* Part) { body<1>(p, Kc, Vc, Part); }
extern "C" __global__ void __launch_bounds__(256) k_vbeside(P p, const uint2* Kc, const unsigned short* Vc, float* Part) { body<2>(p, Kc, Vc, Part); }
extern "C" __global__ void __launch_bounds__(256) k_knext(P p, const uint2* Kc, const unsigned short* Vc, float* Part) { body<3>(p, Kc, Vc, Part); }
