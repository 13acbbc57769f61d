// A row-invariant fp32 linear for CPU: y[m, n] = dot(x[m, :], w[n, :]) (+ b[n]), every output computed in
// one fixed order whatever the row count M, the row's place in the batch or the thread count. MKL picks its
// kernel (and so a row's reduction order) by M; this file's order is its own. memra/kernels/flin_reference.py
// is its pure-torch twin, bit for bit; memra/kernels/cpu_flin.py calls it.
//
// The order: 16 lanes, lane l taking k = 16t + l (t = 0, 1, ...) with a fused multiply-add each,
// acc[l] = fma(x[k], w[k], acc[l]) from acc = +0; then one tree, s[l] = acc[l] + acc[l + 8] (l < 8), then
// s[l] + s[l + 4], s[l] + s[l + 2], s[0] + s[1]; then y = y + b[n] where there is a bias. AVX-512 (one
// 16-lane register, masked for K's tail), AVX2 (two 8-lane registers: lanes 0..7 and 8..15) and the scalar
// loop (std::fmaf) do exactly those roundings. Register blocking (MR rows x NR weight rows at once) and the
// threads (which split weight rows) change which outputs are computed together, never an output's steps.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int LANES = 16;

int64_t outputs_at[3];  // memra_flin_outputs: outputs computed at each level since load
void count(int level, int64_t n) { __atomic_fetch_add(&outputs_at[level], n, __ATOMIC_RELAXED); }

float tree16(const float* a) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; l++) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; l++) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

// ---- scalar: the definition, and the fallback without AVX2 / FMA ----

float dot_scalar(const float* x, const float* w, int64_t K) {
  float acc[LANES] = {};
  for (int64_t k = 0; k < K; k++) acc[k % LANES] = fmaf(x[k], w[k], acc[k % LANES]);
  return tree16(acc);
}

// ---- AVX-512: one register a lane set; MR x NR outputs at once ----

#define AVX512 __attribute__((target("avx512f,avx2,fma")))

AVX512 inline float hsum512(__m512 a) {  // tree16's pairs: (l, l+8), (l, l+4), (l, l+2), (0, 1)
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// tree16 of 16 accumulators at once, each level adding the same pairs as tree16 for every accumulator: (l, l+8)
// between 256-bit halves, (l, l+4) between 128-bit chunks, then (l, l+2) and (0, 1) within chunks. Lane 4c + j
// of the result holds a[4j + c]'s sum.
AVX512 inline __m512 reduce16(const __m512* a) {
  __m512 c[8], e[4], g[2];
  for (int i = 0; i < 8; i++)  // c[i]: s8 of a[2i] (lanes 0..7), of a[2i+1] (8..15)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; j++)  // e[j]: chunk k holds s4 of a[4j + k]
    e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  for (int k = 0; k < 2; k++)  // g[k]: chunk c holds s2 of a[8k + c], then of a[8k + 4 + c]
    g[k] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
}

template <int MR, int NR>
AVX512 void block512(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NR; c++) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    __m512 xv[MR];
    for (int r = 0; r < MR; r++) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < NR; c++) {
      __m512 wv = _mm512_loadu_ps(w + c * K + k);
      for (int r = 0; r < MR; r++) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (k < K) {  // the tail: lanes 0..K-k-1 take one more fma, the others keep their sums (not + 0 * 0: -0 stays)
    const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
    __m512 xv[MR];
    for (int r = 0; r < MR; r++) xv[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
    for (int c = 0; c < NR; c++) {
      __m512 wv = _mm512_maskz_loadu_ps(m, w + c * K + k);
      for (int r = 0; r < MR; r++) acc[r][c] = _mm512_mask3_fmadd_ps(xv[r], wv, acc[r][c], m);
    }
  }
  if (MR * NR < 4) {  // too few to share the reduction
    for (int r = 0; r < MR; r++)
      for (int c = 0; c < NR; c++) y[r * ldy + c] = hsum512(acc[r][c]);
    return;
  }
  // output L = r * NR + c goes in as accumulator 4 (L % 4) + L / 4, so that it comes out in lane L: row r's
  // outputs are lanes r * NR.. in order, stored whole where the block is 4 x 4 or 2 x 8
  __m512 all[16];
  for (int i = 0; i < 16; i++) {
    const int L = 4 * (i % 4) + i / 4;
    all[i] = L < MR * NR ? acc[L / NR][L % NR] : _mm512_setzero_ps();
  }
  const __m512 h = reduce16(all);
  if (MR == 4 && NR == 4) {
    _mm_storeu_ps(y, _mm512_extractf32x4_ps(h, 0));
    _mm_storeu_ps(y + ldy, _mm512_extractf32x4_ps(h, 1));
    _mm_storeu_ps(y + 2 * ldy, _mm512_extractf32x4_ps(h, 2));
    _mm_storeu_ps(y + 3 * ldy, _mm512_extractf32x4_ps(h, 3));
  } else if (MR == 2 && NR == 8) {
    _mm256_storeu_ps(y, _mm512_castps512_ps256(h));
    _mm256_storeu_ps(y + ldy, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(h), 1)));
  } else {
    float t[16];
    _mm512_storeu_ps(t, h);
    for (int r = 0; r < MR; r++)
      for (int c = 0; c < NR; c++) y[r * ldy + c] = t[r * NR + c];
  }
}

// ---- AVX2: lanes 0..7 and 8..15 in two registers; the tail lane by lane in scalar fmaf ----

#define AVX2 __attribute__((target("avx2,fma")))

template <int MR, int NR>
AVX2 void block256(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  __m256 lo[MR][NR], hi[MR][NR];
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NR; c++) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    __m256 xl[MR], xh[MR];
    for (int r = 0; r < MR; r++) {
      xl[r] = _mm256_loadu_ps(x + r * ldx + k);
      xh[r] = _mm256_loadu_ps(x + r * ldx + k + 8);
    }
    for (int c = 0; c < NR; c++) {
      __m256 wl = _mm256_loadu_ps(w + c * K + k), wh = _mm256_loadu_ps(w + c * K + k + 8);
      for (int r = 0; r < MR; r++) {
        lo[r][c] = _mm256_fmadd_ps(xl[r], wl, lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(xh[r], wh, hi[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NR; c++) {
      float acc[LANES];
      _mm256_storeu_ps(acc, lo[r][c]);
      _mm256_storeu_ps(acc + 8, hi[r][c]);
      for (int64_t j = k; j < K; j++) acc[j - k] = fmaf(x[r * ldx + j], w[c * K + j], acc[j - k]);
      y[r * ldy + c] = tree16(acc);
    }
}

// [mr - 1][nr - 1]: the block function of that shape. AVX-512 takes 4 rows x 4 weight rows (16 accumulators
// of its 32 registers), or 1-2 rows x 8 (a decode step's M = 1: eight independent fma chains hide the latency);
// AVX2 2 x 2 (8 register pairs of its 16 with the loads).
using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
constexpr int MR512 = 4, NR512 = 8, MR256 = 2, NR256 = 2;
int nr512(int64_t mr) { return mr <= 2 ? 8 : 4; }

const BlockFn T512[MR512][NR512] = {
    {block512<1, 1>, block512<1, 2>, block512<1, 3>, block512<1, 4>, block512<1, 5>, block512<1, 6>, block512<1, 7>,
     block512<1, 8>},
    {block512<2, 1>, block512<2, 2>, block512<2, 3>, block512<2, 4>, block512<2, 5>, block512<2, 6>, block512<2, 7>,
     block512<2, 8>},
    {block512<3, 1>, block512<3, 2>, block512<3, 3>, block512<3, 4>},
    {block512<4, 1>, block512<4, 2>, block512<4, 3>, block512<4, 4>},
};
const BlockFn T256[MR256][NR256] = {
    {block256<1, 1>, block256<1, 2>},
    {block256<2, 1>, block256<2, 2>},
};

int threads_for(int64_t tasks, int64_t work, int nthreads) {
  if (work < (int64_t)1 << 16) return 1;  // a small call: the threads' start costs more than they save
  return tasks < nthreads ? (int)(tasks > 0 ? tasks : 1) : nthreads;
}

}  // namespace

extern "C" {

// 0: scalar only, 1: AVX2 and FMA, 2: AVX-512F too (memra_flin's `level` takes one <= this)
int memra_flin_level() {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
  return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

// x [M, K] (row stride ldx), w [N, K] contiguous, b [N] or null -> y [M, N] (row stride ldy).
// Threads take panels of weight rows; within one, rows of x in blocks of MR, weight rows in blocks of NR.
void memra_flin(const float* x, int64_t ldx, const float* w, const float* b, int64_t M, int64_t N, int64_t K, float* y,
                int64_t ldy, int nthreads, int level) {
  count(level, M * N);
  const int64_t MR = level == 2 ? MR512 : level == 1 ? MR256 : 1;
  const int64_t panel = 64;  // weight rows a task (64 KiB of weight at K = 256: it stays in L2 over the rows of x)
  const int64_t tasks = (N + panel - 1) / panel;
#pragma omp parallel for schedule(static) num_threads(threads_for(tasks, M * N * K, nthreads))
  for (int64_t t = 0; t < tasks; t++) {
    const int64_t n_end = (t + 1) * panel < N ? (t + 1) * panel : N;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t mr = M - m0 < MR ? M - m0 : MR;
      const int64_t NR = level == 2 ? nr512(mr) : level == 1 ? NR256 : 1;
      for (int64_t n0 = t * panel; n0 < n_end; n0 += NR) {
        const int64_t nr = n_end - n0 < NR ? n_end - n0 : NR;
        const float* xm = x + m0 * ldx;
        float* ym = y + m0 * ldy + n0;
        if (level == 2) {
          T512[mr - 1][nr - 1](xm, ldx, w + n0 * K, K, ym, ldy);
        } else if (level == 1) {
          T256[mr - 1][nr - 1](xm, ldx, w + n0 * K, K, ym, ldy);
        } else {
          *ym = dot_scalar(xm, w + n0 * K, K);
        }
      }
    }
  }
  if (b)
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) y[m * ldy + n] = y[m * ldy + n] + b[n];
}

int64_t memra_flin_outputs(int level) { return __atomic_load_n(&outputs_at[level], __ATOMIC_RELAXED); }

}  // extern "C"
