// The x86-64 row kernels: AVX2 + FMA (8 floats a vector) and AVX-512F (16).
//
// Each function carries its own target attribute, so the file builds for the compiler's
// baseline and the CPU that runs it decides (cpu_has_*). A vector of packed weights is
// widened to float32, dequantized with one FMA (q * scale + bias, as mx.dequantize does) and
// multiplied into every row of x it serves: the activations stay float32, so the result
// matches dequantize + matmul to float rounding. U independent accumulators per row hide the
// FMA latency when there are few rows.

#include <cstring>

#include "qkernels.h"

#if defined(__x86_64__)

#include <immintrin.h>

#define MNB_AVX2 __attribute__((target("avx2,fma")))
#define MNB_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace mnb {

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f");
}

namespace {

// Accumulators per row: enough independent FMA chains for the rows there are.
constexpr int unroll_for(int M) {
  return M == 1 ? 4 : (M == 2 ? 2 : 1);
}

template <int BITS>
MNB_AVX2 inline __m256 q8x(const uint8_t* wr, int k) {
  if constexpr (BITS == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  } else {
    uint32_t word;
    std::memcpy(&word, wr + k / 2, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  }
}

MNB_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int BITS, int M, int U>
MNB_AVX2 void rows_avx2(const QJob& job, int n0, int n1) {
  constexpr int W = 8;
  const int K = job.K, N = job.N, group = job.group, G = K / group;
  const int64_t row_bytes = int64_t(K) * BITS / 8;
  float s[kMaxGroups], b[kMaxGroups];
  for (int n = n0; n < n1; ++n) {
    widen_row(job, n, s, b);
    const uint8_t* wr = job.w + n * row_bytes;
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < U; ++u) {
        acc[m][u] = _mm256_setzero_ps();
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 vs = _mm256_set1_ps(s[g]), vb = _mm256_set1_ps(b[g]);
      const int end = (g + 1) * group;
      for (int k = g * group; k < end; k += W * U) {
        for (int u = 0; u < U; ++u) {
          const int ku = k + u * W;
          const __m256 wf = _mm256_fmadd_ps(q8x<BITS>(wr, ku), vs, vb);
          for (int m = 0; m < M; ++m) {
            const __m256 xv = _mm256_loadu_ps(job.x + int64_t(m) * K + ku);
            acc[m][u] = _mm256_fmadd_ps(wf, xv, acc[m][u]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 t = acc[m][0];
      for (int u = 1; u < U; ++u) {
        t = _mm256_add_ps(t, acc[m][u]);
      }
      job.out[int64_t(m) * N + n] = hsum8(t);
    }
  }
}

template <int BITS>
MNB_AVX512 inline __m512 q16x(const uint8_t* wr, int k) {
  if constexpr (BITS == 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  } else {
    // 16 nibbles in 8 bytes: low nibble of byte j is element 2j, high nibble 2j+1.
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k / 2));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  }
}

template <int BITS, int M, int U>
MNB_AVX512 void rows_avx512(const QJob& job, int n0, int n1) {
  constexpr int W = 16;
  const int K = job.K, N = job.N, group = job.group, G = K / group;
  const int64_t row_bytes = int64_t(K) * BITS / 8;
  float s[kMaxGroups], b[kMaxGroups];
  for (int n = n0; n < n1; ++n) {
    widen_row(job, n, s, b);
    const uint8_t* wr = job.w + n * row_bytes;
    __m512 acc[M][U];
    for (int m = 0; m < M; ++m) {
      for (int u = 0; u < U; ++u) {
        acc[m][u] = _mm512_setzero_ps();
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 vs = _mm512_set1_ps(s[g]), vb = _mm512_set1_ps(b[g]);
      const int end = (g + 1) * group;
      for (int k = g * group; k < end; k += W * U) {
        for (int u = 0; u < U; ++u) {
          const int ku = k + u * W;
          const __m512 wf = _mm512_fmadd_ps(q16x<BITS>(wr, ku), vs, vb);
          for (int m = 0; m < M; ++m) {
            const __m512 xv = _mm512_loadu_ps(job.x + int64_t(m) * K + ku);
            acc[m][u] = _mm512_fmadd_ps(wf, xv, acc[m][u]);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      __m512 t = acc[m][0];
      for (int u = 1; u < U; ++u) {
        t = _mm512_add_ps(t, acc[m][u]);
      }
      job.out[int64_t(m) * N + n] = _mm512_reduce_add_ps(t);
    }
  }
}

// The kernel for M rows, with as many accumulators as a group of `vectors` vectors allows.
template <int BITS, int M, bool WIDE>
RowsFn with_unroll(int vectors) {
  constexpr int U = unroll_for(M);
  if constexpr (WIDE) {
    if (vectors >= U) {
      return rows_avx512<BITS, M, U>;
    }
    if constexpr (U > 2) {
      if (vectors >= 2) {
        return rows_avx512<BITS, M, 2>;
      }
    }
    return rows_avx512<BITS, M, 1>;
  } else {
    if (vectors >= U) {
      return rows_avx2<BITS, M, U>;
    }
    return rows_avx2<BITS, M, 1>;
  }
}

template <int BITS, bool WIDE>
RowsFn pick(int M, int vectors) {
  switch (M) {
    case 1: return with_unroll<BITS, 1, WIDE>(vectors);
    case 2: return with_unroll<BITS, 2, WIDE>(vectors);
    case 3: return with_unroll<BITS, 3, WIDE>(vectors);
    case 4: return with_unroll<BITS, 4, WIDE>(vectors);
    case 5: return with_unroll<BITS, 5, WIDE>(vectors);
    case 6: return with_unroll<BITS, 6, WIDE>(vectors);
    case 7: return with_unroll<BITS, 7, WIDE>(vectors);
    case 8: return with_unroll<BITS, 8, WIDE>(vectors);
    default: return nullptr;
  }
}

template <bool WIDE>
RowsFn choose(const QJob& job) {
  const int width = WIDE ? 16 : 8;
  if (job.K / job.group > kMaxGroups || job.group % width != 0 ||
      ((job.group / width) & (job.group / width - 1)) != 0) {
    return nullptr;
  }
  const int vectors = job.group / width;
  if (job.bits == 8) {
    return pick<8, WIDE>(job.M, vectors);
  }
  if (job.bits == 4) {
    return pick<4, WIDE>(job.M, vectors);
  }
  return nullptr;
}

} // namespace

RowsFn avx2_rows(const QJob& job) {
  return cpu_has_avx2() ? choose<false>(job) : nullptr;
}

RowsFn avx512_rows(const QJob& job) {
  return cpu_has_avx512() ? choose<true>(job) : nullptr;
}

} // namespace mnb

#else // not x86-64: the portable kernels only

namespace mnb {
bool cpu_has_avx2() {
  return false;
}
bool cpu_has_avx512() {
  return false;
}
RowsFn avx2_rows(const QJob&) {
  return nullptr;
}
RowsFn avx512_rows(const QJob&) {
  return nullptr;
}
} // namespace mnb

#endif
