// Integer block dot products of int8-quantized activations with GGUF weights in their split layouts
// (memra/kernels/split.py), for CPU decode. The arithmetic is defined by the pure-torch twin in
// memra/kernels/qdot_reference.py, bit for bit; memra/kernels/cpu_qdot.py builds and calls this file.
//
// Why the bits cannot depend on the batch: every output y[m, n] is computed by one thread from row m's
// quantized activations and weight row n alone, in one fixed order; threads split the output rows n only.
// Integer sums are exact, so the AVX2, the AVX-512 VNNI (qdot_vnni.cpp; the level: memra_qdot_has_avx2 there)
// and the scalar code may add them in any order; the float steps are written out one by one (no FMA: built
// with -ffp-contract=off) in the same order in all.
//
// Activations: per block of 32 (Q8_0) or 256 (K-quants) values, d = max|x| / 127, q = round-half-even(x / d)
// computed as x * (1 / d); the K-quants also take int32 sums of q per 16 values.
// Q8_0: per 32-block b and lane l (4 values: 4l..4l+3), s = int sum; acc[l] = acc[l] + (wd_b * xd_b) * s;
//       y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)).
// Q4_K, Q5_K: per 256-block, isum = sum_j scale_j * dot_j (j: the eight 32-value sub-blocks),
//       msum = sum_j min_j * xsum_j; acc = acc + (d * xd) * isum; acc = acc - (dmin * xd) * msum.
// Q6_K: per 256-block, isum = sum_j scale_j * dot_j (j: sixteen 16-value sub-blocks); acc = acc + (d * xd) * isum.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <tuple>
#include <vector>

namespace memra_vnni {  // qdot_vnni.cpp: the AVX-512 VNNI kernels
void q8_0_row(const int8_t* w, const uint16_t* wd, int64_t K, const int8_t* x, const float* xd, float* y);
void q8_0_group4(const int8_t* w, const uint16_t* wd, int64_t K, const int8_t* x, const float* xd, float* y);
void q4k_order(const int8_t* x, int64_t n, int8_t* out);
void qk_rows(int bits, int64_t rows, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc,
             const uint8_t* mn, int64_t K, const int8_t* x, const float* xd, const int16_t* xs32, float* y);
void q6k_offsets(const int8_t* x, int64_t n, int32_t* out);
void q6k_rows(int64_t rows, const uint8_t* ql, const uint8_t* qh, const float* d, const int8_t* sc, int64_t K,
              const int8_t* x, const float* xd, const int32_t* x4, float* y);
}  // namespace memra_vnni

namespace {

float half_to_float(uint16_t h) {  // exact, as torch's float16 -> float32
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, f;
  if (exp == 0) {
    if (mant == 0) {
      f = sign;
    } else {  // subnormal: normalise
      exp = 113;
      while (!(mant & 0x400)) { mant <<= 1; exp--; }
      f = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    f = sign | 0x7f800000u | (mant << 13);
  } else {
    f = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  __builtin_memcpy(&out, &f, 4);
  return out;
}

float tree8(const float* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// ---- scalar: the definition, and the fallback where AVX2 is missing ----

float q8_0_scalar(const int8_t* w, const uint16_t* wd, const int8_t* x, const float* xd, int64_t nb) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t b = 0; b < nb; b++) {
    float dd = half_to_float(wd[b]) * xd[b];
    for (int l = 0; l < 8; l++) {
      int32_t s = 0;
      for (int i = 0; i < 4; i++) s += (int32_t)w[32 * b + 4 * l + i] * x[32 * b + 4 * l + i];
      acc[l] = acc[l] + dd * (float)s;
    }
  }
  return tree8(acc);
}

// Q4_K (bits == 4: 4-bit q packed as split.Q4KSplit, 32 bytes per 64 values) and Q5_K (bits == 5: a byte each)
float qk_scalar(int bits, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc, const uint8_t* mn,
                const int8_t* x, const float* xd, const int32_t* xs, int64_t nsb) {
  float acc = 0;
  for (int64_t s = 0; s < nsb; s++) {
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; j++) {
      int32_t dot = 0;
      for (int i = 0; i < 32; i++) {
        int v = bits == 5 ? q[256 * s + 32 * j + i]
                          : (q[128 * s + 32 * (j / 2) + i] >> (4 * (j % 2))) & 0xF;
        dot += v * x[256 * s + 32 * j + i];
      }
      isum += (int32_t)sc[8 * s + j] * dot;
      msum += (int32_t)mn[8 * s + j] * (xs[16 * s + 2 * j] + xs[16 * s + 2 * j + 1]);
    }
    acc = acc + (d[s] * xd[s]) * (float)isum;
    acc = acc - (dmin[s] * xd[s]) * (float)msum;
  }
  return acc;
}

// Q6_K's q - 32 of value v (0..255) of a block whose planes start at ql (128 bytes) and qh (64): the file's
// layout (memra.kernels.split.q6_quants).
inline int32_t q6_value(const uint8_t* ql, const uint8_t* qh, int v) {
  const int h = v / 128, c = v % 128 / 32, l = v % 32;
  const int lo = (ql[64 * h + 32 * (c % 2) + l] >> (4 * (c / 2))) & 0x0F, hi = (qh[32 * h + l] >> (2 * c)) & 3;
  return (lo | (hi << 4)) - 32;
}

float q6k_scalar(const uint8_t* ql, const uint8_t* qh, const float* d, const int8_t* sc, const int8_t* x,
                 const float* xd, int64_t nsb) {
  float acc = 0;
  for (int64_t s = 0; s < nsb; s++) {
    int32_t isum = 0;
    for (int j = 0; j < 16; j++) {
      int32_t dot = 0;
      for (int i = 0; i < 16; i++) dot += q6_value(ql + 128 * s, qh + 64 * s, 16 * j + i) * x[256 * s + 16 * j + i];
      isum += (int32_t)sc[16 * s + j] * dot;
    }
    acc = acc + (d[s] * xd[s]) * (float)isum;
  }
  return acc;
}

// ---- AVX2: R weight rows at a time share each activation load ----

#define AVX2 __attribute__((target("avx2,f16c")))

AVX2 inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

AVX2 inline float tree8_avx(__m256 a) {  // tree8's order: (l, l+4) pairs, then (0, 2) and (1, 3), then the two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int R>
AVX2 void q8_0_avx2(const int8_t* w, const uint16_t* wd, int64_t K, const int8_t* x, const float* xd, float* y) {
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    __m256i xv = _mm256_loadu_si256((const __m256i*)(x + 32 * b));
    for (int r = 0; r < R; r++) {
      // the next group's row r, a cache line a step: a group's rows are short streams (K bytes each, side by
      // side), too short for the hardware prefetcher to ramp up on
      if (b % 2 == 0) _mm_prefetch((const char*)(w + (r + R) * K + 32 * b), _MM_HINT_T0);
      __m256i wv = _mm256_loadu_si256((const __m256i*)(w + r * K + 32 * b));
      // |w| * (x signed by w): maddubs wants one unsigned operand; |w| <= 128 and |x| <= 127 fit its int16 pairs
      __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
      __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));  // lane l: values 4l..4l+3
      __m256 dd = _mm256_set1_ps(_cvtsh_ss(wd[r * nb + b]) * xd[b]);
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dd, s));
    }
  }
  for (int r = 0; r < R; r++) y[r] = tree8_avx(acc[r]);
}

// Byte-shuffle indices that copy int16 lane j of a 128-bit half into all eight of its lanes: a scale vector
// in one instruction (a broadcast from memory costs three).
alignas(32) const uint8_t kSpread[8][32] = {
#define S(j) {2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, \
              2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1}
    S(0), S(1), S(2), S(3), S(4), S(5), S(6), S(7)
#undef S
};

// Q4_K / Q5_K: xs32 holds the activation's int sums per 32 values as int16 (|sum| <= 32 * 127).
template <int R>
AVX2 void qk_avx2(int bits, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc, const uint8_t* mn,
                  int64_t K, const int8_t* x, const float* xd, const int16_t* xs32, float* y) {
  const int64_t nsb = K / 256, qrow = bits == 5 ? K : K / 2;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  float acc[R];
  for (int r = 0; r < R; r++) acc[r] = 0;
  for (int64_t s = 0; s < nsb; s++) {
    __m256i ia[R], scales[R];
    for (int r = 0; r < R; r++) {
      ia[r] = _mm256_setzero_si256();
      __m128i s16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sc + r * (K / 32) + 8 * s)));
      scales[r] = _mm256_broadcastsi128_si256(s16);  // the eight 6-bit scales as int16, in both halves
    }
    for (int j = 0; j < 8; j += 2) {  // two 32-value sub-blocks
      __m256i x0 = _mm256_loadu_si256((const __m256i*)(x + 256 * s + 32 * j));
      __m256i x1 = _mm256_loadu_si256((const __m256i*)(x + 256 * s + 32 * j + 32));
      __m256i sp0 = _mm256_load_si256((const __m256i*)kSpread[j]), sp1 = _mm256_load_si256((const __m256i*)kSpread[j + 1]);
      for (int r = 0; r < R; r++) {
        const uint8_t* qr = q + r * qrow;
        __m256i q0, q1;
        if (bits == 5) {
          q0 = _mm256_loadu_si256((const __m256i*)(qr + 256 * s + 32 * j));
          q1 = _mm256_loadu_si256((const __m256i*)(qr + 256 * s + 32 * j + 32));
        } else {
          if (j % 4 == 0) _mm_prefetch((const char*)(qr + R * qrow + 128 * s + 16 * j), _MM_HINT_T0);  // as q8_0_avx2
          __m256i b = _mm256_loadu_si256((const __m256i*)(qr + 128 * s + 16 * j));
          q0 = _mm256_and_si256(b, m4);
          q1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
        }
        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, x0), _mm256_shuffle_epi8(scales[r], sp0));
        __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, x1), _mm256_shuffle_epi8(scales[r], sp1));
        ia[r] = _mm256_add_epi32(ia[r], _mm256_add_epi32(p0, p1));
      }
    }
    const __m128i xsv = _mm_loadu_si128((const __m128i*)(xs32 + 8 * s));
    for (int r = 0; r < R; r++) {
      __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(mn + r * (K / 32) + 8 * s)));
      __m128i ms = _mm_madd_epi16(m16, xsv);  // min_j * xsum_j, in pairs
      ms = _mm_add_epi32(ms, _mm_unpackhi_epi64(ms, ms));
      int32_t msum = _mm_cvtsi128_si32(_mm_add_epi32(ms, _mm_shuffle_epi32(ms, 1)));
      acc[r] = acc[r] + (d[r * nsb + s] * xd[s]) * (float)hsum_i32(ia[r]);
      acc[r] = acc[r] - (dmin[r * nsb + s] * xd[s]) * (float)msum;
    }
  }
  for (int r = 0; r < R; r++) y[r] = acc[r];
}

// Values 32t..32t+31 of a Q6_K block (t = 0..7) as int8 q - 32: the low nibbles of 32 ql bytes (high ones for
// the block's third and fourth runs of 32 in each half) and two bits of 32 qh bytes.
AVX2 inline __m256i q6_run(const uint8_t* ql, const uint8_t* qh, int t) {
  const int h = t / 4, c = t % 4;
  const __m256i lo = _mm256_and_si256(
      _mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32 * (c % 2))), 4 * (c / 2)),
      _mm256_set1_epi8(0x0F));
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(qh + 32 * h)), 2 * c),
                                      _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

template <int R>
AVX2 void q6k_avx2(const uint8_t* ql, const uint8_t* qh, const float* d, const int8_t* sc, int64_t K, const int8_t* x,
                   const float* xd, float* y) {
  const int64_t nsb = K / 256;
  float acc[R];
  for (int r = 0; r < R; r++) acc[r] = 0;
  for (int64_t s = 0; s < nsb; s++) {
    __m256i ia[R], lo[R], hi[R];  // scales 0..7 / 8..15 as int16, in both 128-bit halves
    for (int r = 0; r < R; r++) {
      ia[r] = _mm256_setzero_si256();
      __m128i s8 = _mm_loadu_si128((const __m128i*)(sc + r * (K / 16) + 16 * s));
      lo[r] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8));
      hi[r] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(s8, 8)));
    }
    for (int j = 0; j < 16; j += 2) {  // two 16-value sub-blocks, one per 128-bit half
      __m256i xv = _mm256_loadu_si256((const __m256i*)(x + 256 * s + 16 * j));
      // [scale j x8 | scale j+1 x8]: one shuffle of the half of the scales holding both
      __m256i idx = _mm256_set_m128i(_mm_load_si128((const __m128i*)kSpread[(j + 1) % 8]),
                                     _mm_load_si128((const __m128i*)kSpread[j % 8]));
      for (int r = 0; r < R; r++) {
        if (j % 8 == 0) {  // the next group's planes, as q8_0_avx2 prefetches its rows
          _mm_prefetch((const char*)(ql + (r + R) * (K / 2) + 128 * s + 8 * j), _MM_HINT_T0);
          _mm_prefetch((const char*)(qh + (r + R) * (K / 4) + 64 * s + 4 * j), _MM_HINT_T0);
        }
        __m256i qv = q6_run(ql + r * (K / 2) + 128 * s, qh + r * (K / 4) + 64 * s, j / 2);
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(xv, qv));
        ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(p, _mm256_shuffle_epi8(j < 8 ? lo[r] : hi[r], idx)));
      }
    }
    for (int r = 0; r < R; r++) acc[r] = acc[r] + (d[r * nsb + s] * xd[s]) * (float)hsum_i32(ia[r]);
  }
  for (int r = 0; r < R; r++) y[r] = acc[r];
}

constexpr int64_t G = 4;  // weight rows per task

int64_t outputs_at[3];  // memra_qdot_outputs
void count(int level, int64_t n) { __atomic_fetch_add(&outputs_at[level], n, __ATOMIC_RELAXED); }

int threads_for(int64_t groups, int nthreads) { return groups < nthreads ? (int)(groups > 0 ? groups : 1) : nthreads; }

// Every output y[m, n] (row stride ldy): threads take groups of G weight rows; a whole group runs
// group(n0, m, y + m * ldy + n0), a ragged last one row by row through one(n, m, y + m * ldy + n). Each
// output's arithmetic is the same either way, so neither the grouping nor the threads change its bits.
template <class Group, class One>
void each_output(int64_t N, int64_t M, float* y, int64_t ldy, int nthreads, bool avx2, Group group, One one) {
  const int64_t groups = (N + G - 1) / G;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads_for(groups, nthreads))
  for (int64_t g = 0; g < groups; g++) {
    const int64_t n0 = g * G, rows = N - n0 < G ? N - n0 : G;
    for (int64_t m = 0; m < M; m++) {
      if (avx2 && rows == G) {
        group(n0, m, y + m * ldy + n0);
      } else {
        for (int64_t n = n0; n < n0 + rows; n++) one(n, m, y + m * ldy + n);
      }
    }
  }
}

}  // namespace

extern "C" {

// x fp32 [M, K] -> q int8 [M, K], d fp32 [M, K / blk], and (xs != null) int32 sums of q per 16 [M, K / 16].
void memra_quantize_rows(const float* x, int64_t M, int64_t K, int64_t blk, int8_t* q, float* d, int32_t* xs) {
  for (int64_t i = 0; i < M * (K / blk); i++) {
    const float* xb = x + i * blk;
    float amax = 0;
    for (int64_t t = 0; t < blk; t++) amax = fmaxf(amax, fabsf(xb[t]));
    float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    d[i] = dd;
    for (int64_t t = 0; t < blk; t++) {
      float v = nearbyintf(xb[t] * id);  // the default rounding mode: half to even, as torch.round
      q[i * blk + t] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
  }
  if (xs)
    for (int64_t i = 0; i < M * (K / 16); i++) {
      int32_t s = 0;
      for (int t = 0; t < 16; t++) s += q[16 * i + t];
      xs[i] = s;
    }
}

// y[m, n] (row stride ldy) for weight rows n < N, activations' rows m < M.
void memra_qdot_q8_0(const int8_t* w, const uint16_t* wd, int64_t N, int64_t K, const int8_t* x, const float* xd,
                     int64_t M, float* y, int64_t ldy, int nthreads, int avx2) {
  const int64_t nb = K / 32;
  const bool vnni = avx2 >= 2 && nb % 8 == 0;
  count(vnni ? 2 : avx2 ? 1 : 0, N * M);
  auto row = [&](int64_t n, int64_t m, float* out) {
    memra_vnni::q8_0_row(w + n * K, wd + n * nb, K, x + m * K, xd + m * nb, out);
  };
  each_output(N, M, y, ldy, nthreads, avx2,
      [&](int64_t n0, int64_t m, float* out) {
        if (vnni && M == 1) for (int64_t r = 0; r < G; r++) row(n0 + r, m, out + r);
        else if (vnni) memra_vnni::q8_0_group4(w + n0 * K, wd + n0 * nb, K, x + m * K, xd + m * nb, out);
        else q8_0_avx2<G>(w + n0 * K, wd + n0 * nb, K, x + m * K, xd + m * nb, out);
      },
      [&](int64_t n, int64_t m, float* out) {
        if (vnni) row(n, m, out);
        else if (avx2) q8_0_avx2<1>(w + n * K, wd + n * nb, K, x + m * K, xd + m * nb, out);
        else *out = q8_0_scalar(w + n * K, wd + n * nb, x + m * K, xd + m * nb, nb);
      });
}

// Q4_K (bits 4) and Q5_K (bits 5) in their split layouts; activations per 256 with sums per 16.
void memra_qdot_qk(int bits, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc,
                   const uint8_t* mn, int64_t N, int64_t K, const int8_t* x, const float* xd, const int32_t* xs,
                   int64_t M, float* y, int64_t ldy, int nthreads, int avx2) {
  const int64_t nsb = K / 256, qrow = bits == 5 ? K : K / 2;
  const bool vnni = avx2 >= 2;
  count(avx2 < 2 ? avx2 : 2, N * M);
  std::vector<int16_t> xs32(M * (K / 32));  // the activations' sums per 32 values (|sum| <= 4064: int16)
  for (int64_t t = 0; t < M * (K / 32); t++) xs32[t] = (int16_t)(xs[2 * t] + xs[2 * t + 1]);
  std::vector<int8_t> xo(vnni && bits == 4 ? M * K : 0);  // Q4_K's VNNI rows read x in nibble order
  if (!xo.empty()) memra_vnni::q4k_order(x, M * K, xo.data());
  const int8_t* xv = xo.empty() ? x : xo.data();
  auto args = [&](int64_t n) { return std::make_tuple(q + n * qrow, d + n * nsb, dmin + n * nsb, sc + n * (K / 32), mn + n * (K / 32)); };
  auto rows = [&](int64_t n, int64_t count, int64_t m, float* out) {  // weight rows n.. one after another
    auto [qn, dn, dminn, scn, mnn] = args(n);
    memra_vnni::qk_rows(bits, count, qn, dn, dminn, scn, mnn, K, xv + m * K, xd + m * nsb, xs32.data() + m * (K / 32),
                        out);
  };
  each_output(N, M, y, ldy, nthreads, avx2,
      [&](int64_t n0, int64_t m, float* out) {
        if (vnni) return rows(n0, G, m, out);
        auto [qn, dn, dminn, scn, mnn] = args(n0);
        qk_avx2<G>(bits, qn, dn, dminn, scn, mnn, K, x + m * K, xd + m * nsb, xs32.data() + m * (K / 32), out);
      },
      [&](int64_t n, int64_t m, float* out) {
        if (vnni) return rows(n, 1, m, out);
        auto [qn, dn, dminn, scn, mnn] = args(n);
        if (avx2) qk_avx2<1>(bits, qn, dn, dminn, scn, mnn, K, x + m * K, xd + m * nsb, xs32.data() + m * (K / 32), out);
        else *out = qk_scalar(bits, qn, dn, dminn, scn, mnn, x + m * K, xd + m * nsb, xs + m * (K / 16), nsb);
      });
}

void memra_qdot_q6k(const uint8_t* ql, const uint8_t* qh, const float* d, const int8_t* sc, int64_t N, int64_t K,
                    const int8_t* x, const float* xd, int64_t M, float* y, int64_t ldy, int nthreads, int avx2) {
  const int64_t nsb = K / 256;
  const bool vnni = avx2 >= 2;
  count(avx2 < 2 ? avx2 : 2, N * M);
  std::vector<int32_t> x4(vnni ? M * K / 4 : 0);  // the VNNI rows' -32 * (sum of each 4 activations)
  if (vnni) memra_vnni::q6k_offsets(x, M * K, x4.data());
  auto rows = [&](int64_t n, int64_t count, int64_t m, float* out) {  // weight rows n.. one after another
    memra_vnni::q6k_rows(count, ql + n * (K / 2), qh + n * (K / 4), d + n * nsb, sc + n * (K / 16), K, x + m * K,
                         xd + m * nsb, x4.data() + m * (K / 4), out);
  };
  each_output(N, M, y, ldy, nthreads, avx2,
      [&](int64_t n0, int64_t m, float* out) {
        if (vnni) rows(n0, G, m, out);
        else q6k_avx2<G>(ql + n0 * (K / 2), qh + n0 * (K / 4), d + n0 * nsb, sc + n0 * (K / 16), K, x + m * K,
                         xd + m * nsb, out);
      },
      [&](int64_t n, int64_t m, float* out) {
        if (vnni) rows(n, 1, m, out);
        else if (avx2) q6k_avx2<1>(ql + n * (K / 2), qh + n * (K / 4), d + n * nsb, sc + n * (K / 16), K, x + m * K,
                                   xd + m * nsb, out);
        else *out = q6k_scalar(ql + n * (K / 2), qh + n * (K / 4), d + n * nsb, sc + n * (K / 16), x + m * K,
                               xd + m * nsb, nsb);
      });
}

// Outputs computed at each level since load (0 scalar, 1 AVX2, 2 AVX-512 VNNI): the tests' proof of the path.
int64_t memra_qdot_outputs(int level) { return __atomic_load_n(&outputs_at[level], __ATOMIC_RELAXED); }

}  // extern "C"
