// The AVX-512 VNNI kernels of qdot.cpp's linears (which calls them where the CPU has VNNI), one weight row at
// a time. The arithmetic is qdot.cpp's header's, bit for bit: the integer sums (exact in any order) come from
// vpdpbusd (four u8 * s8 products a lane) and vpdpwssd (times the sub-block's scale), and the fp32 steps run
// block by block in the header's order (no FMA: built with -ffp-contract=off); the products before the
// running sum (d * xd, then * isum) are lane-wise IEEE multiplies, the scalar ones' bits.
//
// Why one row at a time: decode reads each weight once, from memory. A group of rows read side by side is
// several short streams (a row is 0.5-3 KB) that the hardware prefetcher does not ramp up on (one thread of
// this 2-core EPYC read 4 interleaved 512-byte rows at 11-13 GB/s, one sequential stream at 24); rows one
// after another are one sequential stream. The activations sit in L1, so re-reading them per row is cheap.

#include <immintrin.h>
#include <stdint.h>

#define VNNI __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// How far ahead in a row's stream of quants a kernel asks for a line (bytes): the rows are one stream, which
// the hardware prefetcher follows, but not far enough ahead for a kernel this fast (Q4_K from memory:
// 12.5-13 GB/s without, 15.5 with 2 KiB; 1 KiB or less did not help, 4 KiB no more).
constexpr int64_t AHEAD = 2048;

namespace memra_vnni {
namespace {

VNNI inline float tree8(__m256 a) {  // qdot.cpp's tree8: (l, l+4) pairs, then (0, 2) and (1, 3), then the two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// [sum of v0's lanes, v1's, v2's, v3's]
VNNI inline __m128i sums4(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  // per 128-bit lane: [v0_0 + v0_2, v1_0 + v1_2, v0_1 + v0_3, v1_1 + v1_3], and v2, v3's
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// vpshufb controls that copy int16 scales into the layout of vpackssdw(dot vector, dot vector): in 128-bit
// lanes 0-1 scale a four times then b four times, in lanes 2-3 c then d (Q4_K / Q5_K); Q6_K's: in lane l,
// scale l then 4 + l.
struct Spread {
  alignas(64) uint8_t b[64];
};
constexpr Spread spread(int a, int b, int c, int d) {
  Spread out{};
  const int pick[4][2] = {{a, b}, {a, b}, {c, d}, {c, d}};
  for (int l = 0; l < 4; l++)
    for (int i = 0; i < 8; i++) {
      const int j = pick[l][i / 4];
      out.b[16 * l + 2 * i] = (uint8_t)(2 * j), out.b[16 * l + 2 * i + 1] = (uint8_t)(2 * j + 1);
    }
  return out;
}
constexpr Spread kQ4[2] = {spread(0, 1, 2, 3), spread(4, 5, 6, 7)};  // runs 0|2 with 1|3, 4|6 with 5|7
constexpr Spread kQ5[2] = {spread(0, 2, 1, 3), spread(4, 6, 5, 7)};  // runs 0|1 with 2|3, 4|5 with 6|7
constexpr Spread spread6() {
  Spread out{};
  for (int l = 0; l < 4; l++)
    for (int i = 0; i < 8; i++) {
      const int j = i < 4 ? l : 4 + l;
      out.b[16 * l + 2 * i] = (uint8_t)(2 * j), out.b[16 * l + 2 * i + 1] = (uint8_t)(2 * j + 1);
    }
  return out;
}
constexpr Spread kQ6 = spread6();

VNNI inline __m512i ctl(const Spread& s) { return _mm512_load_si512((const void*)s.b); }

VNNI inline __m128i zero128() { return _mm_setzero_si128(); }

// Lanes [a x8 | b x8]: the sub-blocks' scale indices of a dot vector over two 32-value runs.
VNNI inline __m512i pair_index(int a, int b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)), _mm256_set1_epi32(b), 1);
}

template <int NB>
VNNI inline __m128 load4(const float* p) {  // p[0..NB), zeros after
  return NB == 4 ? _mm_loadu_ps(p) : _mm_maskz_loadu_ps((__mmask8)((1 << NB) - 1), p);
}

// The running sum over a chunk of NB (1..4) 256-blocks: acc = acc + (d * xd) * isum, then (MINS) acc = acc -
// (dmin * xd) * msum, block by block.
template <int NB, bool MINS>
VNNI inline float steps(float acc, __m128i isum, const float* d, const float* xd, __m128i msum, const float* dmin) {
  const __m128 xd4 = load4<NB>(xd);
  alignas(16) float p[4], q[4];
  _mm_store_ps(p, _mm_mul_ps(_mm_mul_ps(load4<NB>(d), xd4), _mm_cvtepi32_ps(isum)));
  if (MINS) _mm_store_ps(q, _mm_mul_ps(_mm_mul_ps(load4<NB>(dmin), xd4), _mm_cvtepi32_ps(msum)));
  for (int b = 0; b < NB; b++) {
    acc = acc + p[b];
    if (MINS) acc = acc - q[b];
  }
  return acc;
}

// A row's fp32 running sum over its nsb 256-blocks: row.run<NB>(acc, s) for chunks of four, then the rest.
template <class Row>
VNNI inline float over_chunks(int64_t nsb, const Row& row) {
  float acc = 0;
  int64_t s = 0;
  for (; s + 4 <= nsb; s += 4) acc = row.template run<4>(acc, s);
  switch (nsb - s) {
    case 3: return row.template run<3>(acc, s);
    case 2: return row.template run<2>(acc, s);
    case 1: return row.template run<1>(acc, s);
  }
  return acc;
}

}  // namespace

// Q8_0, R rows of w [R, K] (K / 32 a multiple of 8) side by side, sharing each activation load: two 32-blocks
// a step, the blocks' scales eight at a time; each lane's fp32 steps block by block, as q8_0_avx2's. R = 1
// for B = 1 (one stream from memory); R = 4 where several activation rows re-read a group from cache.
template <int R>
VNNI void q8_0_vnni(const int8_t* w, const uint16_t* wd, int64_t K, const int8_t* x, const float* xd, float* y) {
  const int64_t nb = K / 32;
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b8 = 0; b8 < nb; b8 += 8) {
    const __m256 xd8 = _mm256_loadu_ps(xd + b8);
    __m512 dd8[R];  // lanes 0..7: wd_b * xd_b of blocks b8..b8+7
    for (int r = 0; r < R; r++) {
      const __m256 wd8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wd + r * nb + b8)));
      dd8[r] = _mm512_castps256_ps512(_mm256_mul_ps(wd8, xd8));
    }
    for (int j = 0; j < 8; j += 2) {
      const int64_t b = b8 + j;
      const __m512i xv = _mm512_loadu_si512((const void*)(x + 32 * b));
      for (int r = 0; r < R; r++) {
        // R > 1: the next group's row r, a line a step (its short side-by-side rows get no hardware prefetch)
        if (R > 1) _mm_prefetch((const char*)(w + (r + R) * K + 32 * b), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512((const void*)(w + r * K + 32 * b));
        // x signed by w
        const __m512i xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
        const __m512 s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), xs));
        const __m512 p = _mm512_mul_ps(_mm512_permutexvar_ps(pair_index(j, j + 1), dd8[r]), s);  // b: 0..7, b+1: 8..15
        acc[r] = _mm256_add_ps(acc[r], _mm512_castps512_ps256(p));
        acc[r] = _mm256_add_ps(acc[r], _mm512_extractf32x8_ps(p, 1));
      }
    }
  }
  for (int r = 0; r < R; r++) y[r] = tree8(acc[r]);
}

void q8_0_row(const int8_t* w, const uint16_t* wd, int64_t K, const int8_t* x, const float* xd, float* y) {
  q8_0_vnni<1>(w, wd, K, x, xd, y);
}

void q8_0_group4(const int8_t* w, const uint16_t* wd, int64_t K, const int8_t* x, const float* xd, float* y) {
  q8_0_vnni<4>(w, wd, K, x, xd, y);
}

// Q4_K's activations for qk_rows: per 256-block the eight 32-value runs in the order 0 2 1 3 4 6 5 7, the
// order of a 64-byte load's nibbles (low: runs 0 and 2, high: 1 and 3; split.Q4KSplit). x [n], n % 256 == 0.
void q4k_order(const int8_t* x, int64_t n, int8_t* out) {
  static const int run[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int64_t s = 0; s < n / 256; s++)
    for (int p = 0; p < 8; p++) __builtin_memcpy(out + 256 * s + 32 * p, x + 256 * s + 32 * run[p], 32);
}

// Q4_K (bits 4, x in q4k_order) and Q5_K (bits 5, x as is): each 64 values a vpdpbusd (lane = four products,
// |sum| <= 4 * 31 * 127: an int16); two such vectors packed to int16 (vpackssdw, exact), then a vpdpwssd by
// their runs' scales; msum from the mins and xs32 (the activations' sums per 32, int16). A chunk of NB
// 256-blocks (1..4) of a row, the pointers at its first block -> acc after its steps.
template <int BITS, int NB>
VNNI inline float qk_chunk(float acc, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc,
                           const uint8_t* mn, const int8_t* x, const float* xd, const int16_t* xs32) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  // int16 scale vectors from the eight scales broadcast to every 128-bit lane: lanes 0-1 [s_a x4, s_b x4],
  // lanes 2-3 [s_c x4, s_d x4], matching vpackssdw of two dot vectors
  const __m512i ctl0 = ctl(BITS == 4 ? kQ4[0] : kQ5[0]), ctl1 = ctl(BITS == 4 ? kQ4[1] : kQ5[1]);
  __m512i isum[4] = {zero, zero, zero, zero};
  for (int b = 0; b < NB; b++) {
    const __m512i s16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sc + 8 * b))));
    __m512i dots[4];
    for (int t = 0; t < 4; t++) {
      __m512i qv;
      if (BITS == 4) {
        if (t % 2 == 0) _mm_prefetch((const char*)(q + 128 * b + 64 * (t / 2) + AHEAD), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512((const void*)(q + 128 * b + 64 * (t / 2)));
        qv = t % 2 == 0 ? _mm512_and_si512(wv, m4) : _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
      } else {
        _mm_prefetch((const char*)(q + 256 * b + 64 * t + AHEAD), _MM_HINT_T0);
        qv = _mm512_loadu_si512((const void*)(q + 256 * b + 64 * t));
      }
      dots[t] = _mm512_dpbusd_epi32(zero, qv, _mm512_loadu_si512((const void*)(x + 256 * b + 64 * t)));
    }
    isum[b] = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(dots[0], dots[1]), _mm512_shuffle_epi8(s16, ctl0));
    isum[b] = _mm512_dpwssd_epi32(isum[b], _mm512_packs_epi32(dots[2], dots[3]), _mm512_shuffle_epi8(s16, ctl1));
  }
  // msum: 128-bit lane b of the mins-by-sums products holds block b's four pair sums
  const __mmask32 m32 = (__mmask32)((1ull << (8 * NB)) - 1);
  const __m256i mins = NB == 4 ? _mm256_loadu_si256((const __m256i*)mn) : _mm256_maskz_loadu_epi8(m32, mn);
  const __m512i xs = NB == 4 ? _mm512_loadu_si512((const void*)xs32) : _mm512_maskz_loadu_epi16(m32, xs32);
  __m512i ms = _mm512_madd_epi16(_mm512_cvtepu8_epi16(mins), xs);
  ms = _mm512_add_epi32(ms, _mm512_shuffle_epi32(ms, _MM_PERM_BADC));
  ms = _mm512_add_epi32(ms, _mm512_shuffle_epi32(ms, _MM_PERM_CDAB));
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128i msum = _mm512_castsi512_si128(_mm512_permutexvar_epi32(firsts, ms));
  return steps<NB, true>(acc, sums4(isum[0], isum[1], isum[2], isum[3]), d, xd, msum, dmin);
}

template <int BITS>
struct QkRow {  // a row's pointers at its first block, for over_chunks
  const uint8_t *q, *sc, *mn;
  const float *d, *dmin, *xd;
  const int8_t* x;
  const int16_t* xs32;
  template <int NB>
  VNNI float run(float acc, int64_t s) const {  // blocks s..s+NB
    return qk_chunk<BITS, NB>(acc, q + (BITS == 4 ? 128 : 256) * s, d + s, dmin + s, sc + 8 * s, mn + 8 * s,
                              x + 256 * s, xd + s, xs32 + 8 * s);
  }
};

template <int BITS>
VNNI void qk_rows_(int64_t rows, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc,
                   const uint8_t* mn, int64_t K, const int8_t* x, const float* xd, const int16_t* xs32, float* y) {
  const int64_t nsb = K / 256, qrow = BITS == 4 ? K / 2 : K;
  for (int64_t r = 0; r < rows; r++, q += qrow, d += nsb, dmin += nsb, sc += K / 32, mn += K / 32) {
    const QkRow<BITS> row{q, sc, mn, d, dmin, xd, x, xs32};
    y[r] = over_chunks(nsb, row);
  }
}

void qk_rows(int bits, int64_t rows, const uint8_t* q, const float* d, const float* dmin, const uint8_t* sc,
             const uint8_t* mn, int64_t K, const int8_t* x, const float* xd, const int16_t* xs32, float* y) {
  if (bits == 5) qk_rows_<5>(rows, q, d, dmin, sc, mn, K, x, xd, xs32, y);
  else qk_rows_<4>(rows, q, d, dmin, sc, mn, K, x, xd, xs32, y);
}

// Q6_K's activation term for q6k_rows: per 4 values, -32 times their sum (int32 [n / 4]), where vpdpbusd
// starts, so that it sums (q - 32) * x with q unsigned (0..63; |sum| <= 4 * 32 * 127: an int16).
void q6k_offsets(const int8_t* x, int64_t n, int32_t* out) {
  for (int64_t i = 0; i < n / 4; i++) out[i] = -32 * ((int32_t)x[4 * i] + x[4 * i + 1] + x[4 * i + 2] + x[4 * i + 3]);
}

// Q6_K (split.Q6KSplit's planes, a block's at ql + 128 s, qh + 64 s): per half h of a block, its 64 ql bytes'
// low nibbles are values 0..63 of the half and the high ones 64..127; qh's 32 bytes (in both 256-bit halves)
// give bits 4-5 of run c (of 32 values) at bits 2c, 2c+1. Each 64 values: vpdpbusd from x4 (q6k_offsets);
// two such vectors packed to int16, then vpdpwssd by their 16-runs' scales. A chunk of NB 256-blocks, as qk_chunk.
template <int NB>
VNNI inline float q6k_chunk(float acc, const uint8_t* ql, const uint8_t* qh, const float* d, const int8_t* sc,
                            const int8_t* x, const float* xd, const int32_t* x4) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  // runs (0, 1) to bits 4-5: left by 4 and 2; runs (2, 3): right by 0 and 2 (16-bit lanes, then masked)
  const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  // dot vector t (values 64t..64t+63): 128-bit lane i holds sub-block 4t + i; packed in pairs (t = 0, 1 and
  // 2, 3), lane i is [sub-block i x4, 4 + i x4] (and 8 + i, 12 + i): the scales' int16 vectors to match
  const __m512i ctl6 = ctl(kQ6);
  const __m512i zero = _mm512_setzero_si512();
  __m512i isum[4] = {zero, zero, zero, zero};
  for (int b = 0; b < NB; b++) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(sc + 16 * b)));
    const __m512i s_lo = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_castsi256_si128(s16)), ctl6);
    const __m512i s_hi = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_extracti128_si256(s16, 1)), ctl6);
    __m512i dots[4];
    for (int h = 0; h < 2; h++) {
      _mm_prefetch((const char*)(ql + 128 * b + 64 * h + AHEAD), _MM_HINT_T0);
      if (h == 0) _mm_prefetch((const char*)(qh + 64 * b + AHEAD / 2), _MM_HINT_T0);
      const __m512i l = _mm512_loadu_si512((const void*)(ql + 128 * b + 64 * h));
      const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qh + 64 * b + 32 * h)));
      for (int u = 0; u < 2; u++) {  // values 64u..64u+63 of the half
        const int t = 2 * h + u;
        const __m512i lo = u == 0 ? _mm512_and_si512(l, m4) : _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
        const __m512i hi = u == 0 ? _mm512_sllv_epi16(hb, up) : _mm512_srlv_epi16(hb, down);
        const __m512i qv = _mm512_ternarylogic_epi32(lo, hi, m30, 0xF8);  // lo | (hi & 0x30)
        dots[t] = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void*)(x4 + 64 * b + 16 * t)), qv,
                                      _mm512_loadu_si512((const void*)(x + 256 * b + 64 * t)));
      }
    }
    isum[b] = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(dots[0], dots[1]), s_lo);
    isum[b] = _mm512_dpwssd_epi32(isum[b], _mm512_packs_epi32(dots[2], dots[3]), s_hi);
  }
  return steps<NB, false>(acc, sums4(isum[0], isum[1], isum[2], isum[3]), d, xd, zero128(), nullptr);
}

struct Q6kRow {  // as QkRow
  const uint8_t *ql, *qh;
  const float *d, *xd;
  const int8_t *sc, *x;
  const int32_t* x4;
  template <int NB>
  VNNI float run(float acc, int64_t s) const {
    return q6k_chunk<NB>(acc, ql + 128 * s, qh + 64 * s, d + s, sc + 16 * s, x + 256 * s, xd + s, x4 + 64 * s);
  }
};

VNNI void q6k_rows(int64_t rows, const uint8_t* ql, const uint8_t* qh, const float* d, const int8_t* sc, int64_t K,
                   const int8_t* x, const float* xd, const int32_t* x4, float* y) {
  const int64_t nsb = K / 256;
  for (int64_t r = 0; r < rows; r++, ql += K / 2, qh += K / 4, d += nsb, sc += K / 16) {
    const Q6kRow row{ql, qh, d, xd, sc, x, x4};
    y[r] = over_chunks(nsb, row);
  }
}

}  // namespace memra_vnni

// 0: scalar only, 1: AVX2 and F16C, 2: AVX-512 VNNI too (qdot.cpp's `avx2` arguments take a level <= this)
extern "C" int memra_qdot_has_avx2() {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))) return 0;
  bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
              __builtin_cpu_supports("avx512vnni");
  return vnni ? 2 : 1;
}
