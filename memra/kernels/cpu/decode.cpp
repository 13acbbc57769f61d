// The fp32 ops of a CPU decode step besides the linears (qdot.cpp): RMSNorm and SwiGLU's activation over
// rows, and decode attention over a paged KV cache in one call per layer for every row and head, with the
// RoPE of q and k and the K/V write before it. The arithmetic is defined by the pure-torch twin in
// memra/kernels/decode_reference.py, bit for bit; memra/kernels/cpu_decode.py calls this file (built into
// the same library as qdot.cpp by memra/kernels/cpu_qdot.py).
//
// Why the bits cannot depend on the batch or the threads: one thread computes a (row, head) output
// whole, from that row's q and its own prefix, in one fixed order along the key axis; threads split the
// (row, head) pairs only. GQA is an index (query head h reads KV head h / (Hq / Hkv)), never a copy.
//
// Per row r and query head h (g = its KV head, positions j = 0..S-1 of its prefix, in order):
//   RoPE (NeoX, the first R channels; the rest pass through): y_i = x_i * cos_i + x'_i * sin_i with
//        x'_i = -x_{i+R/2} (i < R/2), x_{i-R/2} (else): torch's apply_rope, the same bits.
//   score s_j: eight lanes l, acc_l = acc_l + q_{8t+l} * k_{j,8t+l} over t, tree8(acc) (as qdot's
//        Q8_0 lanes), then * scale.
//   p_j = exp2n(s_j - max s), a Cody-Waite reduction and Cephes' polynomial written out (below), so the
//        twin's elementwise torch ops give its bits; l = ((p_0 + p_1) + p_2) + ...;
//   o = ((p_0 * v_0 + p_1 * v_1) + ...) per channel, in position order; out = o / l.
// RMSNorm of a row x [n] (n a multiple of 8): ss = tree8 of eight lanes of x_i * x_i (as the scores),
//   r = 1 / sqrt(ss / n + eps), y_i = w_i * (x_i * r).
// SwiGLU: gate g, up u: e = exp_neg(-|g|), s = g >= 0 ? 1 / (1 + e) : e / (1 + e), y = (g * s) * u.
// GDN (Gated DeltaNet) decode, per token: q, k of each key head l2-normed (ss = tree8 of eight lanes of x_i^2,
//   r = 1 / sqrt(ss + eps), y_i = x_i * r, q's then * scale) and repeated over its value heads by index;
//   per value head h with state S [Dk, Dv]: e = exp_neg(g), then for i = 0..Dk-1 in order
//   S_i = S_i * e, m = m + S_i * k_i (m from 0); d = (v - m) * beta; then for i in order
//   S_i = S_i + k_i * d, o = o + S_i * q_i (o from 0). Threads split (row, head) pairs only.
// No FMA anywhere (built with -ffp-contract=off): each product is rounded, then each sum.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpFloor = -87.0f;  // below it the result is 0 (2^n would leave the normal range)

// exp(x) for x <= 0, as decode_reference.exp_neg defines it.
float exp_neg(float x) {
  if (x < kExpFloor) return 0.0f;
  float n = nearbyintf(x * kLog2e);  // half to even, as torch.round
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r);
  y = y + r;
  y = y + 1.0f;
  uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return y * scale;
}

#define AVX2 __attribute__((target("avx2")))

// exp_neg on eight lanes: the same operations, each exactly rounded, so the same bits.
AVX2 __m256 exp_neg8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  __m256 y = _mm256_mul_ps(p, _mm256_mul_ps(r, r));
  y = _mm256_add_ps(y, r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  // n >= -126 wherever the lane is kept; the others' bits are thrown away by the blend
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ));
}

float tree8(const float* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

float dot_scalar(const float* a, const float* b, int64_t D) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t t = 0; t < D; t += 8)
    for (int l = 0; l < 8; l++) acc[l] = acc[l] + a[t + l] * b[t + l];
  return tree8(acc);
}

AVX2 float dot_avx2(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t t = 0; t < D; t += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // tree8's order
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

AVX2 void axpy_avx2(float* o, float p, const float* v, int64_t D) {  // o = o + p * v, per channel
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t t = 0; t < D; t += 8)
    _mm256_storeu_ps(o + t, _mm256_add_ps(_mm256_loadu_ps(o + t), _mm256_mul_ps(pv, _mm256_loadu_ps(v + t))));
}

void axpy_scalar(float* o, float p, const float* v, int64_t D) {
  for (int64_t t = 0; t < D; t++) o[t] = o[t] + p * v[t];
}

// x [D] -> y [D]: NeoX RoPE over the first R channels (cos, sin [R]).
void rope(const float* x, const float* c, const float* s, int64_t R, int64_t D, float* y) {
  const int64_t half = R / 2;
  for (int64_t i = 0; i < R; i++) {
    float other = i < half ? -x[i + half] : x[i - half];
    float a = x[i] * c[i], b = other * s[i];
    y[i] = a + b;
  }
  for (int64_t i = R; i < D; i++) y[i] = x[i];
}

// One (row, head): q [D] (rotated) over the prefix rows[0..S) of the pools -> out [D].
void attend_head(const float* q, const float* k_pool, const float* v_pool, const int64_t* rows, int64_t S,
                 int64_t stride, int64_t D, float scale, float* out, bool avx2) {
  thread_local std::vector<float> p;
  if ((int64_t)p.size() < S) p.resize(S);
  float m = -INFINITY;
  for (int64_t j = 0; j < S; j++) {
    const float* k = k_pool + rows[j] * stride;
    float s = (avx2 ? dot_avx2(q, k, D) : dot_scalar(q, k, D)) * scale;
    p[j] = s;
    m = s > m ? s : m;
  }
  float l = 0.0f;
  for (int64_t t = 0; t < D; t++) out[t] = 0.0f;
  for (int64_t j = 0; j < S; j++) {
    float e = exp_neg(p[j] - m);
    l = l + e;
    const float* v = v_pool + rows[j] * stride;
    if (avx2) axpy_avx2(out, e, v, D);
    else axpy_scalar(out, e, v, D);
  }
  for (int64_t t = 0; t < D; t++) out[t] = out[t] / l;
}

float silu_mul1(float g, float u) {
  float e = exp_neg(-fabsf(g)), d = 1.0f + e;
  float s = g >= 0.0f ? 1.0f / d : e / d;
  return (g * s) * u;
}

AVX2 void silu_mul_avx2(const float* g, const float* u, int64_t F, float* y) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= F; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 e = exp_neg8(_mm256_or_ps(gv, sign));  // -|g|
    __m256 d = _mm256_add_ps(one, e);
    __m256 s = _mm256_blendv_ps(_mm256_div_ps(e, d), _mm256_div_ps(one, d), _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, s), _mm256_loadu_ps(u + i)));
  }
  for (; i < F; i++) y[i] = silu_mul1(g[i], u[i]);
}

void rms_row(const float* x, const float* w, int64_t n, float eps, float* y, bool avx2) {
  float ss = avx2 ? dot_avx2(x, x, n) : dot_scalar(x, x, n);
  float r = 1.0f / sqrtf(ss / (float)n + eps);
  for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}


// x [D] -> y [D]: x / sqrt(tree8 lanes of x^2 + eps), times mul unless mul is 1 (GDN's q and k).
void l2norm(const float* x, int64_t D, float eps, float mul, float* y, bool avx2) {
  float ss = avx2 ? dot_avx2(x, x, D) : dot_scalar(x, x, D);
  float r = 1.0f / sqrtf(ss + eps);
  for (int64_t i = 0; i < D; i++) y[i] = x[i] * r;
  if (mul != 1.0f)
    for (int64_t i = 0; i < D; i++) y[i] = y[i] * mul;
}

// One value head's delta-rule step, state S [Dk, Dv] in place; m [Dv] scratch -> o [Dv]. Elementwise over
// the Dv lanes (the compiler's vectors do not reorder anything), in order over Dk.
__attribute__((target_clones("avx2", "default")))
void delta_head(float* S, const float* q, const float* k, const float* v, float beta, float g, int64_t Dk,
                int64_t Dv, float* m, float* o) {
  const float e = exp_neg(g);
  for (int64_t j = 0; j < Dv; j++) m[j] = 0.0f;
  for (int64_t i = 0; i < Dk; i++) {
    float* row = S + i * Dv;
    const float ki = k[i];
    for (int64_t j = 0; j < Dv; j++) {
      float s = row[j] * e;
      row[j] = s;
      m[j] = m[j] + s * ki;
    }
  }
  for (int64_t j = 0; j < Dv; j++) m[j] = (v[j] - m[j]) * beta;
  for (int64_t j = 0; j < Dv; j++) o[j] = 0.0f;
  for (int64_t i = 0; i < Dk; i++) {
    float* row = S + i * Dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < Dv; j++) {
      float s = row[j] + ki * m[j];
      row[j] = s;
      o[j] = o[j] + s * qi;
    }
  }
}

}  // namespace

extern "C" {

// x [M, n] -> y [M, n]: RMSNorm of each row (n a multiple of 8) with weight w [n]; with add (not null) the
// row is first sum = x + add (written to sum [M, n]): a residual add and the norm that reads it.
void memra_rms_rows(const float* x, const float* add, float* sum, const float* w, int64_t M, int64_t n, float eps,
                    float* y, int avx2) {
  for (int64_t m = 0; m < M; m++) {
    const float* src = x + m * n;
    if (add) {
      float* s = sum + m * n;
      for (int64_t i = 0; i < n; i++) s[i] = src[i] + add[m * n + i];
      src = s;
    }
    rms_row(src, w, n, eps, y + m * n, avx2 != 0);
  }
}

// gate_up [M, 2F] (gate | up) -> y [M, F]: SwiGLU's activation, as the file's head says.
void memra_silu_mul_rows(const float* gu, int64_t M, int64_t F, float* y, int avx2) {
  for (int64_t m = 0; m < M; m++) {
    const float *g = gu + m * 2 * F, *u = g + F;
    if (avx2) {
      silu_mul_avx2(g, u, F, y + m * F);
    } else {
      for (int64_t i = 0; i < F; i++) y[m * F + i] = silu_mul1(g[i], u[i]);
    }
  }
}

// R query rows, each over its own prefix read_rows[starts[r] .. starts[r] + lens[r]) (flat pool rows of
// positions 0.. in order; starts / lens null: one row over read_rows[0 .. S)). Pools [rows, Hkv, D] fp32.
// With k_new (not null): first rotate k_new [R, Hkv, D] and write it and v_new to the pool rows
// write_rows [R]. With cos (not null, [R, Rd]): q [R, Hq, D] is rotated first. -> out [R, Hq, D].
void memra_attend_rows(const float* q, int64_t R, int64_t Hq, int64_t Hkv, int64_t D, const float* k_new,
                       const float* v_new, const float* cos, const float* sin, int64_t Rd, float* k_pool,
                       float* v_pool, const int64_t* write_rows, const int64_t* read_rows, const int64_t* starts,
                       const int64_t* lens, int64_t S, float scale, float* out, int nthreads, int avx2) {
  const int64_t stride = Hkv * D, group = Hq / Hkv;
  if (k_new) {
    for (int64_t r = 0; r < R; r++)
      for (int64_t g = 0; g < Hkv; g++) {
        float* kd = k_pool + write_rows[r] * stride + g * D;
        const float* ks = k_new + (r * Hkv + g) * D;
        if (cos) rope(ks, cos + r * Rd, sin + r * Rd, Rd, D, kd);
        else memcpy(kd, ks, D * sizeof(float));
        memcpy(v_pool + write_rows[r] * stride + g * D, v_new + (r * Hkv + g) * D, D * sizeof(float));
      }
  }
  const int64_t pairs = R * Hq;
  const int threads = pairs < nthreads ? (int)pairs : nthreads;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
  for (int64_t i = 0; i < pairs; i++) {
    const int64_t r = i / Hq, h = i % Hq;
    float qr[1024];  // D <= 1024 (checked by the caller)
    const float* qh = q + i * D;
    if (cos) {
      rope(qh, cos + r * Rd, sin + r * Rd, Rd, D, qr);
      qh = qr;
    }
    const int64_t* rows = starts ? read_rows + starts[r] : read_rows;
    attend_head(qh, k_pool + (h / group) * D, v_pool + (h / group) * D, rows, lens ? lens[r] : S, stride, D, scale,
                out + i * D, avx2 != 0);
  }
}


// GDN's q and k: mixed [N, C] conv outputs (q | k | v, C >= 2 * Hk * Dk) -> q, k [N, Hv, Dk], each key head
// l2-normed (q also * scale) and written to its Hv / Hk value heads (value head h reads key head h / (Hv / Hk)).
void memra_gdn_heads_rows(const float* mixed, int64_t N, int64_t C, int64_t Hk, int64_t Hv, int64_t Dk, float eps,
                          float scale, float* q, float* k, int avx2) {
  const int64_t ratio = Hv / Hk;
  for (int64_t n = 0; n < N; n++)
    for (int64_t g = 0; g < Hk; g++) {
      float* qd = q + (n * Hv + g * ratio) * Dk;
      float* kd = k + (n * Hv + g * ratio) * Dk;
      l2norm(mixed + n * C + g * Dk, Dk, eps, scale, qd, avx2 != 0);
      l2norm(mixed + n * C + (Hk + g) * Dk, Dk, eps, 1.0f, kd, avx2 != 0);
      for (int64_t j = 1; j < ratio; j++) {
        memcpy(qd + j * Dk, qd, Dk * sizeof(float));
        memcpy(kd + j * Dk, kd, Dk * sizeof(float));
      }
    }
}

// One token of the delta rule for R rows: q, k [R, H, Dk], v [R, H, Dv], beta, g [R, H]; row r's state is
// states + slots[r] * H * Dk * Dv (slots null: slot r), [H, Dk, Dv], stepped in place -> o [R, H, Dv].
void memra_delta_rows(const float* q, const float* k, const float* v, const float* beta, const float* g,
                      float* states, const int64_t* slots, int64_t R, int64_t H, int64_t Dk, int64_t Dv, float* o,
                      int nthreads) {
  const int64_t pairs = R * H;
  const int threads = pairs < nthreads ? (int)pairs : nthreads;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
  {
    std::vector<float> m(Dv);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; i++) {
      const int64_t r = i / H, h = i % H;
      float* S = states + ((slots ? slots[r] : r) * H + h) * Dk * Dv;
      delta_head(S, q + i * Dk, k + i * Dk, v + i * Dv, beta[i], g[i], Dk, Dv, m.data(), o + i * Dv);
    }
  }
}

// A sequence's T tokens of the delta rule in order (a verify's columns): q, k [T, H, Dk], v [T, H, Dv], beta, g
// [T, H]; the state s [H, Dk, Dv] is read, and after token t it is states[t] ([T, H, Dk, Dv]; the last one is
// also written back to s; states null: s is stepped in place, nothing else kept) -> o [T, H, Dv]. Each token is delta_head as memra_delta_rows runs it: the same bits.
void memra_delta_scan(const float* q, const float* k, const float* v, const float* beta, const float* g, float* s,
                      int64_t T, int64_t H, int64_t Dk, int64_t Dv, float* o, float* states, int nthreads) {
  const int threads = H < nthreads ? (int)H : nthreads;
  const int64_t size = Dk * Dv;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
  {
    std::vector<float> m(Dv);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; h++) {
      const float* prev = s + h * size;
      for (int64_t t = 0; t < T; t++) {
        const int64_t i = t * H + h;
        float* S = states ? states + i * size : s + h * size;  // no states kept: s stepped in place
        if (states) memcpy(S, prev, size * sizeof(float));
        delta_head(S, q + i * Dk, k + i * Dk, v + i * Dv, beta[i], g[i], Dk, Dv, m.data(), o + i * Dv);
        prev = S;
      }
      if (states && T > 0) memcpy(s + h * size, prev, size * sizeof(float));
    }
  }
}

}  // extern "C"
