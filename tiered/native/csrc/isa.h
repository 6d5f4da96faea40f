// The ISA paths of the native attention kernel (attend.cpp): per path, the small GEMM, the
// online-softmax step and (avx512bf16, amx) the bf16 products, behind one table of function pointers.
// Every SIMD function carries its own target attribute: the file compiles with plain -O3 and a
// path runs only where attend.cpp's dispatch found the CPU flags for it.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#define TIERED_X86 1
#else
#define TIERED_X86 0
#endif

namespace tiered_native {

constexpr int kKeyTile = 64;      // keys per tile
constexpr int kRowsPerBlock = 64;  // query rows (positions x group heads) per block, unless the path sets its own
constexpr int kBlocksPerTask = 8;  // most blocks of a task: each key tile made ready once serves them all
constexpr int64_t kTasksPerThread = 8;  // fewest tasks a thread, where the blocks allow
constexpr int64_t kStreamBytes = int64_t(1) << 20;  // K,V per KV head past which a piece's tasks are fewest
constexpr int kRowStep = 32;      // rows are padded to a multiple of this (every path's column step divides it)
constexpr int64_t kPrepareBytes = int64_t(4) << 20;  // most bytes of prefix tiles converted once per call
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One ISA path: the inner operations the driver calls per key tile. Scores are kept transposed,
// St[key][row], so K is read in place (no per-tile transpose: Q is packed once per task) and the
// softmax over keys runs down columns, vectorized across query rows with no horizontal reduction.
struct Ops {
  const char* name;
  int head_dim_step;  // the head dims the path takes: multiples of this (its dot products' unit), at most
  int max_head_dim;   // this (0: no limit)
  // The driver pads the value width to Dp, a multiple of this (zero columns past the head dim), so gemm's N
  // and the softmax's rescaled rows are whole registers for every head dim.
  int column_step;
  // C[M, N] (+)= A[M, K] B[K, N], A's element (i, k) at A[i * a_row + k * a_col]; N a multiple of column_step.
  void (*gemm)(const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb, float* C, int64_t ldc,
               int M, int N, int K, bool accumulate);
  // Per row r < R (a multiple of kRowStep), over keys j < n of the scores s = scale St[j * R + r]:
  // m' = max(m, max_j s); P = 2^(s - m'); l = l 2^(m - m') + sum_j P; acc's row r (column r where the path keeps
  // acc transposed) *= 2^(m - m'); m = m'. P is written over St, or, where Pp is not null (the paths with
  // pv_bf16, bf16 inputs), rounded to bf16 into Pp [ceil(n / 2), padded as the path's pv_bf16 reads][R] as
  // pairs of keys (the first key in the low half), zero pairs past n.
  void (*softmax)(float* St, int n, int R, float scale, float* m, float* l, float* alpha, float* acc, int Dp,
                  uint32_t* Pp);
  // St[n, R] = K[n, Dh] . Q^T (unscaled) for bf16 K rows (stride ks, Dh even) and Q packed in pairs [Dh / 2][R][2];
  // null where the path has no bf16 dot product.
  void (*scores_bf16)(const uint16_t* K, int64_t ks, const uint16_t* Qp, float* St, int n, int R, int Dh);
  // n bf16 V rows (stride vs, Dh values) made ready for pv_bf16 (layout per path, zero past Dh and past key n,
  // at most (kKeyTile + 2) x Dp values); null where there is no bf16 dot.
  void (*pack_v)(const uint16_t* V, int64_t vs, uint16_t* Vp, int n, int Dh, int Dp);
  // acc += P V for P as the softmax wrote it into Pp and V packed by pack_v; null where there is no bf16 dot.
  void (*pv_bf16)(const uint32_t* Pp, const uint16_t* Vp, float* acc, int n, int R, int Dp);
  // Called by each thread before its first task and after its last (the amx path's tile registers); or null.
  void (*thread_begin)();
  void (*thread_end)();
  // Whether acc is kept transposed, [Dp][R], when pv_bf16 runs (rows [R][Dp] otherwise).
  bool acc_columns = false;
  // Query rows (positions x group heads) per block.
  int rows_per_block = kRowsPerBlock;
};

// x rounded up to a multiple of step.
constexpr int round_up(int x, int step) { return (x + step - 1) / step * step; }

// The acc rows whose alpha is not 1, rescaled (alpha from the softmax).
inline void rescale_rows(const float* alpha, int R, float* acc, int Dp) {
  for (int r = 0; r < R; ++r)
    if (alpha[r] != 1.f)
      for (int d = 0; d < Dp; ++d) acc[r * Dp + d] *= alpha[r];
}

// ---- scalar: portable C++ ------------------------------------------------------------------------

void gemm_scalar(const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb, float* C, int64_t ldc,
                 int M, int N, int K, bool accumulate) {
  for (int i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    if (!accumulate) std::fill(c, c + N, 0.f);
    for (int k = 0; k < K; ++k) {
      const float a = A[i * a_row + k * a_col];
      const float* b = B + k * ldb;
      for (int j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

void softmax_scalar(float* St, int n, int R, float scale, float* m, float* l, float* alpha, float* acc, int Dp,
                    uint32_t*) {
  for (int r = 0; r < R; ++r) {
    float m_new = m[r];
    for (int j = 0; j < n; ++j) m_new = std::max(m_new, St[j * R + r] *= scale);
    const float safe = m_new == kNegInf ? 0.f : m_new;  // every key so far masked: no NaN from -inf - -inf
    float sum = 0.f;
    for (int j = 0; j < n; ++j) sum += (St[j * R + r] = std::exp2(St[j * R + r] - safe));
    alpha[r] = std::exp2(m[r] - safe);
    l[r] = l[r] * alpha[r] + sum;
    m[r] = m_new;
  }
  rescale_rows(alpha, R, acc, Dp);
}

const Ops kScalar{"scalar", 1, 0, 1, gemm_scalar, softmax_scalar, nullptr, nullptr, nullptr, nullptr, nullptr};

#if TIERED_X86
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
// Register tiles are arrays of vectors indexed by constant-trip loops: unrolled early, GCC keeps
// them in registers; otherwise it stores every accumulator to the stack on every step.
#define UNROLL _Pragma("GCC unroll 16")
#define TARGET_AVX512 __attribute__((target("avx512f")))
#define TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// ---- avx2: AVX2 + FMA, 8 floats a register -------------------------------------------------------

// A tile of R rows x 16 columns of C in 2R accumulators; B's 16 columns loaded once per k for all rows.
template <int R>
TARGET_AVX2 inline void tile_avx2(const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb, float* C,
                                  int64_t ldc, int K, bool accumulate) {
  __m256 c0[R], c1[R];
  UNROLL for (int r = 0; r < R; ++r) {
    c0[r] = accumulate ? _mm256_loadu_ps(C + r * ldc) : _mm256_setzero_ps();
    c1[r] = accumulate ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * a_row + k * a_col);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(C + r * ldc, c0[r]);
    _mm256_storeu_ps(C + r * ldc + 8, c1[r]);
  }
}

TARGET_AVX2 void gemm_avx2(const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb, float* C,
                           int64_t ldc, int M, int N, int K, bool accumulate) {
  for (int j = 0; j < N; j += 16) {
    int i = 0;
    for (; i + 6 <= M; i += 6) tile_avx2<6>(A + i * a_row, a_row, a_col, B + j, ldb, C + i * ldc + j, ldc, K, accumulate);
    const float* a = A + i * a_row;
    float* c = C + i * ldc + j;
    switch (M - i) {
      case 5: tile_avx2<5>(a, a_row, a_col, B + j, ldb, c, ldc, K, accumulate); break;
      case 4: tile_avx2<4>(a, a_row, a_col, B + j, ldb, c, ldc, K, accumulate); break;
      case 3: tile_avx2<3>(a, a_row, a_col, B + j, ldb, c, ldc, K, accumulate); break;
      case 2: tile_avx2<2>(a, a_row, a_col, B + j, ldb, c, ldc, K, accumulate); break;
      case 1: tile_avx2<1>(a, a_row, a_col, B + j, ldb, c, ldc, K, accumulate); break;
      default: break;
    }
  }
}

// 2^f = sum_k (ln 2)^k / k! f^k: the Taylor coefficients, lowest degree first.
constexpr float kExp2Taylor[8] = {1.f,          6.9314718e-1f, 2.4022651e-1f, 5.5504109e-2f,
                                  9.6181291e-3f, 1.3333558e-3f, 1.5403530e-4f, 1.5252734e-5f};

// 2^x for x <= 0: 2^round(x) by the exponent bits times a degree-7 polynomial of the rest
// (|rest| <= 1/2; relative error ~1e-8 before rounding). x below -126 (and -inf) gives 2^-126.
TARGET_AVX2 inline __m256 exp2_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Taylor[7]);
  UNROLL for (int k = 6; k >= 0; --k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Taylor[k]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

TARGET_AVX2 void softmax_avx2(float* St, int n, int R, float scale, float* m, float* l, float* alpha, float* acc,
                              int Dp, uint32_t*) {
  const __m256 ninf = _mm256_set1_ps(kNegInf), zero = _mm256_setzero_ps(), vscale = _mm256_set1_ps(scale);
  for (int r = 0; r < R; r += 8) {
    const __m256 m_old = _mm256_loadu_ps(m + r);
    __m256 raw = ninf;
    for (int j = 0; j < n; ++j) raw = _mm256_max_ps(raw, _mm256_loadu_ps(St + j * R + r));
    const __m256 m_new = _mm256_max_ps(m_old, _mm256_mul_ps(raw, vscale));
    const __m256 safe = _mm256_blendv_ps(m_new, zero, _mm256_cmp_ps(m_new, ninf, _CMP_EQ_OQ));
    __m256 sum = zero;
    for (int j = 0; j < n; ++j) {
      const __m256 p = exp2_avx2(_mm256_fmsub_ps(_mm256_loadu_ps(St + j * R + r), vscale, safe));
      _mm256_storeu_ps(St + j * R + r, p);
      sum = _mm256_add_ps(sum, p);
    }
    const __m256 a = exp2_avx2(_mm256_sub_ps(m_old, safe));
    _mm256_storeu_ps(alpha + r, a);
    _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
    _mm256_storeu_ps(m + r, m_new);
  }
  for (int r = 0; r < R; ++r) {
    if (alpha[r] == 1.f) continue;
    const __m256 a = _mm256_set1_ps(alpha[r]);
    for (int d = 0; d < Dp; d += 8) _mm256_storeu_ps(acc + r * Dp + d, _mm256_mul_ps(_mm256_loadu_ps(acc + r * Dp + d), a));
  }
}

const Ops kAvx2{"avx2", 1, 0, 16, gemm_avx2, softmax_avx2, nullptr, nullptr, nullptr, nullptr, nullptr};

// ---- avx512: AVX-512F, 16 floats a register ------------------------------------------------------

template <int R>
TARGET_AVX512 inline void tile_avx512(const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb,
                                      float* C, int64_t ldc, int K, bool accumulate) {
  __m512 c0[R], c1[R];
  UNROLL for (int r = 0; r < R; ++r) {
    c0[r] = accumulate ? _mm512_loadu_ps(C + r * ldc) : _mm512_setzero_ps();
    c1[r] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(B + k * ldb), b1 = _mm512_loadu_ps(B + k * ldb + 16);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * a_row + k * a_col]);
      c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(C + r * ldc, c0[r]);
    _mm512_storeu_ps(C + r * ldc + 16, c1[r]);
  }
}

TARGET_AVX512 void gemm_avx512(const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb, float* C,
                               int64_t ldc, int M, int N, int K, bool accumulate) {
  for (int j = 0; j < N; j += 32) {
    int i = 0;
    for (; i + 12 <= M; i += 12)
      tile_avx512<12>(A + i * a_row, a_row, a_col, B + j, ldb, C + i * ldc + j, ldc, K, accumulate);
    for (; i + 4 <= M; i += 4)
      tile_avx512<4>(A + i * a_row, a_row, a_col, B + j, ldb, C + i * ldc + j, ldc, K, accumulate);
    for (; i < M; ++i) tile_avx512<1>(A + i * a_row, a_row, a_col, B + j, ldb, C + i * ldc + j, ldc, K, accumulate);
  }
}

// 2^x for x <= 0 as in exp2_avx2 with a polynomial of kDegree (7: ~1e-8; 4, what a bf16 P keeps: relative
// error below 1e-4, a twentieth of bf16's rounding); scalef applies 2^round(x).
template <int kDegree = 7>
TARGET_AVX512 inline __m512 exp2_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Taylor[kDegree]);
  UNROLL for (int k = kDegree - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[k]));
  return _mm512_scalef_ps(p, n);
}

// max over keys j < n of St[j * R + r .. r + 15], in four chains (one vmaxps waits for the last otherwise).
TARGET_AVX512 inline __m512 column_max(const float* St, int n, int R, int r) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 c0 = ninf, c1 = ninf, c2 = ninf, c3 = ninf;
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    c0 = _mm512_max_ps(c0, _mm512_loadu_ps(St + int64_t(j) * R + r));
    c1 = _mm512_max_ps(c1, _mm512_loadu_ps(St + int64_t(j + 1) * R + r));
    c2 = _mm512_max_ps(c2, _mm512_loadu_ps(St + int64_t(j + 2) * R + r));
    c3 = _mm512_max_ps(c3, _mm512_loadu_ps(St + int64_t(j + 3) * R + r));
  }
  for (; j < n; ++j) c0 = _mm512_max_ps(c0, _mm512_loadu_ps(St + int64_t(j) * R + r));
  return _mm512_max_ps(_mm512_max_ps(c0, c1), _mm512_max_ps(c2, c3));
}

// The running max of rows r .. r + 15 after this tile's scaled scores, and the value exponents are taken
// against (0 where every key so far is masked: no NaN from -inf - -inf).
struct RowMax {
  __m512 m_new, safe;
};

TARGET_AVX512 inline RowMax row_max(const float* St, int n, int R, int r, __m512 vscale, __m512 m_old) {
  const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(column_max(St, n, R, r), vscale));
  const __mmask16 masked = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
  return {m_new, _mm512_mask_blend_ps(masked, m_new, _mm512_setzero_ps())};
}

// alpha = 2^(m - m'), l = l alpha + sum, m = m' for rows r .. r + 15.
TARGET_AVX512 inline void update_rows(float* m, float* l, float* alpha, int r, const RowMax& x, __m512 sum) {
  const __m512 a = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(m + r), x.safe));
  _mm512_storeu_ps(alpha + r, a);
  _mm512_storeu_ps(l + r, _mm512_fmadd_ps(_mm512_loadu_ps(l + r), a, sum));
  _mm512_storeu_ps(m + r, x.m_new);
}

TARGET_AVX512 void rescale_rows_avx512(const float* alpha, int R, float* acc, int Dp) {
  for (int r = 0; r < R; ++r) {
    if (alpha[r] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int d = 0; d < Dp; d += 16)
      _mm512_storeu_ps(acc + r * Dp + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * Dp + d), a));
  }
}

TARGET_AVX512 void softmax_avx512(float* St, int n, int R, float scale, float* m, float* l, float* alpha, float* acc,
                                  int Dp, uint32_t*) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r = 0; r < R; r += 16) {
    const RowMax x = row_max(St, n, R, r, vscale, _mm512_loadu_ps(m + r));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; ++j) {
      const __m512 p = exp2_avx512(_mm512_fmsub_ps(_mm512_loadu_ps(St + j * R + r), vscale, x.safe));
      _mm512_storeu_ps(St + j * R + r, p);
      sum = _mm512_add_ps(sum, p);
    }
    update_rows(m, l, alpha, r, x, sum);
  }
  rescale_rows_avx512(alpha, R, acc, Dp);
}

const Ops kAvx512{"avx512", 1, 0, 32, gemm_avx512, softmax_avx512, nullptr, nullptr, nullptr, nullptr, nullptr};

// ---- avx512bf16: scores of bf16 inputs by dot products of bf16 pairs into fp32 ------------------

// NR keys x 32 rows of St: each key's pair (d, d + 1) broadcast against 16 rows' pairs a register.
template <int NR>
TARGET_AVX512BF16 inline void scores_tile_bf16(const uint16_t* K, int64_t ks, const uint16_t* Qp, float* St, int R,
                                               int Dh) {
  __m512 c0[NR], c1[NR];
  UNROLL for (int i = 0; i < NR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int d2 = 0; d2 < Dh / 2; ++d2) {
    const __m512i q0 = _mm512_loadu_si512(Qp + 2 * (int64_t(d2) * R));
    const __m512i q1 = _mm512_loadu_si512(Qp + 2 * (int64_t(d2) * R + 16));
    UNROLL for (int i = 0; i < NR; ++i) {
      int32_t pair;
      std::memcpy(&pair, K + i * ks + 2 * d2, sizeof pair);
      const __m512i a = _mm512_set1_epi32(pair);
      c0[i] = _mm512_dpbf16_ps(c0[i], (__m512bh)a, (__m512bh)q0);
      c1[i] = _mm512_dpbf16_ps(c1[i], (__m512bh)a, (__m512bh)q1);
    }
  }
  UNROLL for (int i = 0; i < NR; ++i) {
    _mm512_storeu_ps(St + i * R, c0[i]);
    _mm512_storeu_ps(St + i * R + 16, c1[i]);
  }
}

TARGET_AVX512BF16 void scores_bf16_avx512(const uint16_t* K, int64_t ks, const uint16_t* Qp, float* St, int n, int R,
                                          int Dh) {
  for (int c = 0; c < R; c += 32) {
    int i = 0;
    for (; i + 12 <= n; i += 12) scores_tile_bf16<12>(K + i * ks, ks, Qp + 2 * c, St + i * R + c, R, Dh);
    for (; i + 4 <= n; i += 4) scores_tile_bf16<4>(K + i * ks, ks, Qp + 2 * c, St + i * R + c, R, Dh);
    for (; i < n; ++i) scores_tile_bf16<1>(K + i * ks, ks, Qp + 2 * c, St + i * R + c, R, Dh);
  }
}

// NR rows x 32 columns of acc: each row's pair of P broadcast against 16 columns' V pairs a register.
template <int NR>
TARGET_AVX512BF16 inline void pv_tile_bf16(const uint32_t* Pp, int R, int n2, const uint16_t* Vp, float* acc, int Dp) {
  __m512 c0[NR], c1[NR];
  UNROLL for (int i = 0; i < NR; ++i) {
    c0[i] = _mm512_loadu_ps(acc + i * Dp);
    c1[i] = _mm512_loadu_ps(acc + i * Dp + 16);
  }
  for (int j2 = 0; j2 < n2; ++j2) {
    const __m512i v0 = _mm512_loadu_si512(Vp + 2 * (int64_t(j2) * Dp));
    const __m512i v1 = _mm512_loadu_si512(Vp + 2 * (int64_t(j2) * Dp + 16));
    UNROLL for (int i = 0; i < NR; ++i) {
      const __m512i a = _mm512_set1_epi32(int32_t(Pp[int64_t(j2) * R + i]));
      c0[i] = _mm512_dpbf16_ps(c0[i], (__m512bh)a, (__m512bh)v0);
      c1[i] = _mm512_dpbf16_ps(c1[i], (__m512bh)a, (__m512bh)v1);
    }
  }
  UNROLL for (int i = 0; i < NR; ++i) {
    _mm512_storeu_ps(acc + i * Dp, c0[i]);
    _mm512_storeu_ps(acc + i * Dp + 16, c1[i]);
  }
}

// Vp [n2][Dp][2]: per pair of keys (a, b) and column d, the two bf16 values a[d] b[d] side by side.
TARGET_AVX512BF16 void pack_v_avx512(const uint16_t* V, int64_t vs, uint16_t* Vp, int n, int Dh, int Dp) {
  // lo: a0 b0 a1 b1 ... a15 b15; hi: a16 b16 ... a31 b31
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = uint16_t(i), lo_idx[2 * i + 1] = uint16_t(32 + i);
    hi_idx[2 * i] = uint16_t(16 + i), hi_idx[2 * i + 1] = uint16_t(48 + i);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int j2 = 0; j2 < (n + 1) / 2; ++j2) {
    const bool pair = 2 * j2 + 1 < n;
    const uint16_t* v0 = V + int64_t(2 * j2) * vs;
    for (int d = 0; d < Dp; d += 32) {  // columns past Dh read as zeros (masked loads: no read past a row)
      const __mmask32 cols = Dh - d >= 32 ? ~__mmask32(0) : __mmask32((uint64_t(1) << std::max(0, Dh - d)) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(cols, v0 + d);
      const __m512i b = pair ? _mm512_maskz_loadu_epi16(cols, v0 + vs + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(Vp + 2 * (int64_t(j2) * Dp + d), _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(Vp + 2 * (int64_t(j2) * Dp + d + 16), _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// Two rows of 16 fp32 as 16 pairs (bf16 of x) | (bf16 of y) << 16, rounded to nearest even.
TARGET_AVX512BF16 inline __m512i bf16_pairs(__m512 x, __m512 y) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(y, x);  // x's 16 values, then y's
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
}

// The softmax of the bf16 paths: as softmax_avx512, P written as bf16 pairs of keys into Pp [n2, padded][R]
// (no fp32 P is stored); kColumns: acc is [Dp][R]. Without Pp (fp32 inputs), softmax_avx512.
template <bool kColumns, int kPairStep>
TARGET_AVX512BF16 void softmax_pairs(float* St, int n, int R, float scale, float* m, float* l, float* alpha,
                                     float* acc, int Dp, uint32_t* Pp) {
  if (!Pp) return softmax_avx512(St, n, R, scale, m, l, alpha, acc, Dp, Pp);
  const __m512 vscale = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
  const int full = n / 2, n2 = (n + 1) / 2, padded = round_up(n2, kPairStep);
  for (int r = 0; r < R; r += 16) {
    const RowMax x = row_max(St, n, R, r, vscale, _mm512_loadu_ps(m + r));
    __m512 s0 = zero, s1 = zero;
    for (int j2 = 0; j2 < full; ++j2) {
      const float* s = St + int64_t(2 * j2) * R + r;
      const __m512 p0 = exp2_avx512<4>(_mm512_fmsub_ps(_mm512_loadu_ps(s), vscale, x.safe));
      const __m512 p1 = exp2_avx512<4>(_mm512_fmsub_ps(_mm512_loadu_ps(s + R), vscale, x.safe));
      s0 = _mm512_add_ps(s0, p0);
      s1 = _mm512_add_ps(s1, p1);
      _mm512_storeu_si512(Pp + int64_t(j2) * R + r, bf16_pairs(p0, p1));
    }
    if (n2 > full) {  // an odd last key, paired with zero
      const __m512 p0 =
          exp2_avx512<4>(_mm512_fmsub_ps(_mm512_loadu_ps(St + int64_t(n - 1) * R + r), vscale, x.safe));
      s0 = _mm512_add_ps(s0, p0);
      _mm512_storeu_si512(Pp + int64_t(full) * R + r, bf16_pairs(p0, zero));
    }
    for (int j2 = n2; j2 < padded; ++j2) _mm512_storeu_si512(Pp + int64_t(j2) * R + r, _mm512_setzero_si512());
    update_rows(m, l, alpha, r, x, _mm512_add_ps(s0, s1));
  }
  if constexpr (kColumns) {
    for (int r = 0; r < R; r += 16) {
      const __m512 a = _mm512_loadu_ps(alpha + r);
      if (_mm512_cmp_ps_mask(a, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) == 0) continue;
      for (int d = 0; d < Dp; ++d) _mm512_storeu_ps(acc + d * R + r, _mm512_mul_ps(_mm512_loadu_ps(acc + d * R + r), a));
    }
  } else {
    rescale_rows_avx512(alpha, R, acc, Dp);
  }
}

TARGET_AVX512BF16 void pv_bf16_avx512(const uint32_t* Pp, const uint16_t* Vp, float* acc, int n, int R, int Dp) {
  const int n2 = (n + 1) / 2;
  for (int d = 0; d < Dp; d += 32) {
    int r = 0;
    for (; r + 12 <= R; r += 12) pv_tile_bf16<12>(Pp + r, R, n2, Vp + 2 * d, acc + r * Dp + d, Dp);
    for (; r + 4 <= R; r += 4) pv_tile_bf16<4>(Pp + r, R, n2, Vp + 2 * d, acc + r * Dp + d, Dp);
    for (; r < R; ++r) pv_tile_bf16<1>(Pp + r, R, n2, Vp + 2 * d, acc + r * Dp + d, Dp);
  }
}

const Ops kAvx512Bf16{"avx512bf16",       2,      0,      32, gemm_avx512, softmax_pairs<false, 1>, scores_bf16_avx512,
                      pack_v_avx512, pv_bf16_avx512, nullptr, nullptr};

// ---- amx: the bf16 products on AMX tiles (tdpbf16ps), the rest as avx512bf16 -------------------
// Compiled where the compiler knows AMX (GCC 12, clang 14 and newer); run where the CPU has
// AMX-BF16 and the kernel grants this process the tile data state (arch_prctl).
#if (defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 12)
#define TIERED_AMX 1
#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
// The tile loads are asm that names no memory: writes to the buffers they read must be ordered first.
#define TILE_FENCE() __asm__ volatile("" ::: "memory")
constexpr int kAmxMaxHeadDim = 256;

// Palette 1, eight tiles of 16 rows x 64 bytes (16 fp32, or 32 bf16 in pairs), for every product below.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

TARGET_AMX void amx_thread_begin() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  TILE_FENCE();
  _tile_loadconfig(&cfg);
}

TARGET_AMX void amx_thread_end() { _tile_release(); }

// St[n, R] = K Q^T in blocks of 32 keys x 32 rows: tmm0-3 the four 16 x 16 blocks of St, tmm4-5 K's
// rows (16 keys x 32 dims), tmm6-7 Qp (16 pairs of dims x 16 rows). A last block of fewer than 32 keys is
// read from a copy padded with zero keys (St's rows past n are written and not read).
TARGET_AMX void scores_amx(const uint16_t* K, int64_t ks, const uint16_t* Qp, float* St, int n, int R, int Dh) {
  alignas(64) uint16_t padded[32 * kAmxMaxHeadDim];
  const int64_t sb = int64_t(R) * 4;  // bytes per row of St and of Qp
  for (int j = 0; j < n; j += 32) {
    const uint16_t* kb = K + j * ks;
    int64_t kr = ks;  // K's row stride, in elements
    if (n - j < 32) {
      std::memset(padded, 0, sizeof(uint16_t) * 32 * Dh);
      for (int i = 0; i < n - j; ++i) std::memcpy(padded + i * Dh, kb + i * ks, sizeof(uint16_t) * Dh);
      kb = padded, kr = Dh;
      TILE_FENCE();
    }
    for (int c = 0; c < R; c += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int d = 0; d < Dh; d += 32) {
        _tile_loadd(4, kb + d, kr * 2);
        _tile_loadd(5, kb + 16 * kr + d, kr * 2);
        _tile_loadd(6, Qp + 2 * (int64_t(d / 2) * R + c), sb);
        _tile_loadd(7, Qp + 2 * (int64_t(d / 2) * R + c + 16), sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* s = St + int64_t(j) * R + c;
      _tile_stored(0, s, sb);
      _tile_stored(1, s + 16, sb);
      _tile_stored(2, s + 16 * int64_t(R), sb);
      _tile_stored(3, s + 16 * int64_t(R) + 16, sb);
    }
  }
}

// The keys of an AMX tile: P V reads whole tiles of 16 pairs of keys.
constexpr int kAmxPairs = 16;

// A 16 x 16 matrix of 32-bit elements, one row a register, transposed in registers.
TARGET_AMX inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // per lane L of group g (rows g .. g + 3): columns 4L .. 4L + 3
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // column 4L + i: lane L of each group's vector i
    const __m512i lo01 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x44), hi01 = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xEE);
    const __m512i lo23 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x44);
    const __m512i hi23 = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xEE);
    t[i] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(lo01, lo23, 0xDD);
    t[8 + i] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(hi01, hi23, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// V transposed for P V with acc kept [Dp][R]: Vt [Dp][keys] in bf16, keys padded with zeros to whole tiles of
// kAmxPairs pairs (the row length; at most kKeyTile, so the buffer's (kKeyTile + 2) x Dp values hold it).
// Made 16 pairs of keys x 16 columns at a time: each pair's columns interleaved, the 16 x 16 block transposed.
TARGET_AMX void pack_v_amx(const uint16_t* V, int64_t vs, uint16_t* Vt, int n, int Dh, int Dp) {
  const int row = 2 * round_up((n + 1) / 2, kAmxPairs);
  uint32_t* out = reinterpret_cast<uint32_t*>(Vt);  // [Dp][row / 2] pairs
  for (int j2 = 0; j2 < row / 2; j2 += 16)
    for (int d = 0; d < Dp; d += 16) {
      const __mmask16 cols = Dh - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(0, Dh - d)) - 1);
      __m512i block[16];
      for (int i = 0; i < 16; ++i) {  // pair j2 + i at columns d .. d + 15
        const int key = 2 * (j2 + i);
        const __m512i a = key < n ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, V + key * vs + d))
                                  : _mm512_setzero_si512();
        const __m512i b = key + 1 < n ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, V + (key + 1) * vs + d))
                                      : _mm512_setzero_si512();
        block[i] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
      }
      transpose16(block);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + int64_t(d + i) * (row / 2) + j2, block[i]);
    }
}

// acc^T [Dp][R] += V^T P^T in blocks of 32 columns of V x 32 rows: tmm0-3 acc^T's four 16 x 16 blocks, tmm4-5
// Vt's rows (16 columns x 32 keys), tmm6-7 Pp (16 pairs of keys x 16 rows, as the softmax wrote it).
TARGET_AMX void pv_amx(const uint32_t* Pp, const uint16_t* Vt, float* acc, int n, int R, int Dp) {
  const int n2r = round_up((n + 1) / 2, kAmxPairs), row = 2 * n2r;
  const int64_t ab = int64_t(R) * 4, vb = int64_t(row) * 2;  // bytes per row of acc^T and Pp; of Vt
  TILE_FENCE();
  for (int d = 0; d < Dp; d += 32)
    for (int r = 0; r < R; r += 32) {
      float* c = acc + int64_t(d) * R + r;
      _tile_loadd(0, c, ab);
      _tile_loadd(1, c + 16, ab);
      _tile_loadd(2, c + 16 * int64_t(R), ab);
      _tile_loadd(3, c + 16 * int64_t(R) + 16, ab);
      for (int j2 = 0; j2 < n2r; j2 += kAmxPairs) {
        _tile_loadd(4, Vt + int64_t(d) * row + 2 * j2, vb);
        _tile_loadd(5, Vt + int64_t(d + 16) * row + 2 * j2, vb);
        _tile_loadd(6, Pp + int64_t(j2) * R + r, ab);
        _tile_loadd(7, Pp + int64_t(j2) * R + r + 16, ab);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, ab);
      _tile_stored(1, c + 16, ab);
      _tile_stored(2, c + 16 * int64_t(R), ab);
      _tile_stored(3, c + 16 * int64_t(R) + 16, ab);
    }
}

const Ops kAmx{"amx",          32,         kAmxMaxHeadDim, 32, gemm_avx512, softmax_pairs<true, kAmxPairs>,
               scores_amx,     pack_v_amx, pv_amx,         amx_thread_begin, amx_thread_end,
               /*acc_columns=*/true,
               // A block's scores, P, acc and the tile's packed V stay in L1 at 32 rows, not at 64.
               /*rows_per_block=*/32};
#else
#define TIERED_AMX 0
#endif
#endif  // TIERED_X86

}  // namespace tiered_native
