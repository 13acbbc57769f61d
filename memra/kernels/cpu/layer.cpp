// One decoder layer's decode step (one token) for a dense attention + SwiGLU block whose projections are
// packed GGUF weights, in one call: the composition of the library's kernels (qdot.cpp's linears,
// decode.cpp's RMSNorm, SwiGLU and attention) in the order memra/model/block.py calls them, so it has
// that path's bits exactly (tests/test_cpu_decode.py). What it saves is the Python between them: a
// layer's plan (shapes, weight pointers, norms) is made once at load (memra/kernels/cpu_layer.py).
//
//   x = rms(h, attn_norm); qkv = x Wqkv^T; q, k = per-head rms (q_norm, k_norm, where the model has them);
//   a = attend(rope(q), rope(k) and v written); s = h + a Wo^T; x = rms(s, ffn_norm);
//   h' = s + silu_mul(x Wgu^T) Wdown^T

#include <stdint.h>

#include <vector>

extern "C" {
void memra_quantize_rows(const float* x, int64_t M, int64_t K, int64_t blk, int8_t* q, float* d, int32_t* xs);
void memra_qdot_q8_0(const int8_t* w, const uint16_t* wd, int64_t N, int64_t K, const int8_t* x, const float* xd,
                     int64_t M, float* y, int64_t ldy, int nthreads, int avx2);
void memra_qdot_qk(int bits, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc, const uint8_t* mn,
                   int64_t N, int64_t K, const int8_t* x, const float* xd, const int32_t* xs, int64_t M, float* y,
                   int64_t ldy, int nthreads, int avx2);
void memra_qdot_q6k(const uint8_t* ql, const uint8_t* qh, const float* d, const int8_t* sc, int64_t N, int64_t K,
                    const int8_t* x, const float* xd, int64_t M, float* y, int64_t ldy, int nthreads, int avx2);
void memra_rms_rows(const float* x, const float* add, float* sum, const float* w, int64_t M, int64_t n, float eps,
                    float* y, int avx2);
void memra_silu_mul_rows(const float* gu, int64_t M, int64_t F, float* y, int avx2);
void memra_attend_rows(const float* q, int64_t R, int64_t Hq, int64_t Hkv, int64_t D, const float* k_new,
                       const float* v_new, const float* cos, const float* sin, int64_t Rd, float* k_pool,
                       float* v_pool, const int64_t* write_rows, const int64_t* read_rows, const int64_t* starts,
                       const int64_t* lens, int64_t S, float scale, float* out, int nthreads, int avx2);
}

namespace {

constexpr int kMaxParts = 8;

struct Part {  // one split layout (memra/kernels/split.py): kind 8 = Q8_0, 4 = Q4_K, 5 = Q5_K, 6 = Q6_K
  int64_t kind, n;
  const void *q, *d, *dmin, *sc, *mn;
};

struct Weight {  // [N, K]: row blocks of one or more layouts
  int64_t n, k, nparts;
  Part parts[kMaxParts];
};

struct Plan {  // memra/kernels/cpu_layer.py's LayerPlan, field for field
  int64_t E, Hq, Hkv, D, F;
  float eps, scale;
  const float *attn_norm, *ffn_norm, *q_norm, *k_norm;  // q_norm / k_norm null: none
  Weight wqkv, wo, wgu, wdown;
};

// y [N] = x [K] W^T: cpu_qdot.linear's calls for one row (activations quantized per block kind once).
void linear(const Weight& w, const float* x, float* y, int nthreads, int avx2) {
  const int64_t K = w.k;
  thread_local std::vector<int8_t> q32, q256;
  thread_local std::vector<float> d32, d256;
  thread_local std::vector<int32_t> s32, s256;
  bool have32 = false, have256 = false;
  int64_t col = 0;
  for (int64_t i = 0; i < w.nparts; i++) {
    const Part& p = w.parts[i];
    if (p.kind == 8) {
      if (!have32) {
        q32.resize(K), d32.resize(K / 32), s32.resize(K / 16);
        memra_quantize_rows(x, 1, K, 32, q32.data(), d32.data(), s32.data());
        have32 = true;
      }
      memra_qdot_q8_0((const int8_t*)p.q, (const uint16_t*)p.d, p.n, K, q32.data(), d32.data(), 1, y + col, w.n,
                      nthreads, avx2);
    } else {
      if (!have256) {
        q256.resize(K), d256.resize(K / 256), s256.resize(K / 16);
        memra_quantize_rows(x, 1, K, 256, q256.data(), d256.data(), s256.data());
        have256 = true;
      }
      if (p.kind == 6)
        memra_qdot_q6k((const uint8_t*)p.q, (const uint8_t*)p.mn, (const float*)p.d, (const int8_t*)p.sc, p.n, K,
                       q256.data(), d256.data(), 1, y + col, w.n, nthreads, avx2);
      else
        memra_qdot_qk((int)p.kind, (const uint8_t*)p.q, (const float*)p.d, (const float*)p.dmin,
                      (const uint8_t*)p.sc, (const uint8_t*)p.mn, p.n, K, q256.data(), d256.data(), s256.data(), 1,
                      y + col, w.n, nthreads, avx2);
    }
    col += p.n;
  }
}

}  // namespace

extern "C" {

// h [E] -> h [E] in place: one token through the layer (the file's head). cos / sin [Rd]; the token's K/V go
// to pool row write_row; it attends over read_rows[0 .. S) (its prefix, itself last).
void memra_decode_layer(const Plan* p, float* h, const float* cos, const float* sin, int64_t Rd, float* k_pool,
                        float* v_pool, const int64_t* write_row, const int64_t* read_rows, int64_t S, int nthreads,
                        int avx2) {
  const int64_t E = p->E, qd = p->Hq * p->D, kvd = p->Hkv * p->D;
  thread_local std::vector<float> x, qkv, qn, kn, a, o, s, gu, act;
  x.resize(E), qkv.resize(qd + 2 * kvd), qn.resize(qd), kn.resize(kvd), a.resize(qd), o.resize(E), s.resize(E);
  gu.resize(2 * p->F), act.resize(p->F);
  memra_rms_rows(h, nullptr, nullptr, p->attn_norm, 1, E, p->eps, x.data(), avx2);
  linear(p->wqkv, x.data(), qkv.data(), nthreads, avx2);
  const float *q = qkv.data(), *k = q + qd, *v = k + kvd;
  if (p->q_norm) {
    memra_rms_rows(q, nullptr, nullptr, p->q_norm, p->Hq, p->D, p->eps, qn.data(), avx2);
    q = qn.data();
  }
  if (p->k_norm) {
    memra_rms_rows(k, nullptr, nullptr, p->k_norm, p->Hkv, p->D, p->eps, kn.data(), avx2);
    k = kn.data();
  }
  memra_attend_rows(q, 1, p->Hq, p->Hkv, p->D, k, v, cos, sin, Rd, k_pool, v_pool, write_row, read_rows, nullptr,
                    nullptr, S, p->scale, a.data(), nthreads, avx2);
  linear(p->wo, a.data(), o.data(), nthreads, avx2);
  memra_rms_rows(h, o.data(), s.data(), p->ffn_norm, 1, E, p->eps, x.data(), avx2);
  linear(p->wgu, x.data(), gu.data(), nthreads, avx2);
  memra_silu_mul_rows(gu.data(), 1, p->F, act.data(), avx2);
  linear(p->wdown, act.data(), o.data(), nthreads, avx2);
  for (int64_t i = 0; i < E; i++) h[i] = s[i] + o[i];
}

}  // extern "C"
