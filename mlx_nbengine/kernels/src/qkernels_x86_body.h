// The x86 row kernels' bodies, included by qkernels_x86.cpp once per instruction set with
// MNB_TARGET (the target attribute), MNB_NS (the namespace) and MNB_PIECE_ROWS (the rows of
// x one pass takes) defined. No include guard.

namespace MNB_NS {

// How far ahead of the group being read its row's weights are prefetched, in bytes: the
// hardware prefetcher alone left one core reading the weights at about half its bandwidth.
constexpr int kPrefetchAhead = 2048;

template <ScaleType T>
MNB_TARGET inline float one(const void* p, int64_t i) {
  if constexpr (T == ScaleType::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == ScaleType::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  } else {
    const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

// Four scales (or biases) from index i, as float32.
template <ScaleType T>
MNB_TARGET inline __m128 four(const void* p, int64_t i) {
  if constexpr (T == ScaleType::f32) {
    return _mm_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (T == ScaleType::f16) {
      return _mm_cvtph_ps(h);
    } else {
      return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
  }
}

MNB_TARGET inline float hsum4(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

MNB_TARGET inline float hsum8(__m256 v) {
  return hsum4(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

MNB_TARGET inline int hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The four groups' sums of 8 lanes each, as one vector: [sum d0, sum d1, sum d2, sum d3].
MNB_TARGET inline __m128i reduce4(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// One group of a row (weights `wr`, the group's first element k0) against M rows of int16
// x: 8 int32 partial sums per row added into d. 8-bit: 16 weights a step (bytes widened to
// 16-bit lanes); 4-bit: 32 a step (16 bytes; the low nibbles are the even elements, the
// high ones the odd, as QActivations stores x).
template <int BITS, int M, int GROUP>
MNB_TARGET __attribute__((always_inline)) inline void group_dots(
    const uint8_t* wr, const int16_t* xq, int64_t K, int64_t k0, __m256i* d) {
  for (int m = 0; m < M; ++m) {
    d[m] = _mm256_setzero_si256();
  }
  if constexpr (BITS == 8) {
#pragma GCC unroll 8
    for (int64_t k = k0; k < k0 + GROUP; k += 16) {
      const __m256i w =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k)));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + int64_t(m) * K + k));
        d[m] = _mm256_add_epi32(d[m], _mm256_madd_epi16(w, x));
      }
    }
  } else {
    const __m256i low = _mm256_set1_epi16(15);
#pragma GCC unroll 4
    for (int64_t k = k0; k < k0 + GROUP; k += 32) {
      const __m256i bytes =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2)));
      const __m256i lo = _mm256_and_si256(bytes, low);
      const __m256i hi = _mm256_srli_epi16(bytes, 4);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int16_t* x = xq + int64_t(m) * K + k;
        const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
        d[m] = _mm256_add_epi32(
            d[m], _mm256_add_epi32(_mm256_madd_epi16(lo, even), _mm256_madd_epi16(hi, odd)));
      }
    }
  }
}

// Rows n0..n1 for 1 or 2 rows of x: four groups at a time, their sums reduced together.
template <int BITS, int M, ScaleType T, int GROUP>
MNB_TARGET void rows_by4(const QJob& job, int n0, int n1) {
  const int K = job.K, N = job.N, G = K / GROUP, P = job.padded_groups;
  const int64_t row_bytes = int64_t(K) * BITS / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = job.w + n * row_bytes;
    const int64_t sb = int64_t(n) * G;
    __m128 acc[M], bacc[M];
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm_setzero_ps();
      bacc[m] = _mm_setzero_ps();
    }
    int g = 0;
    for (; g + 4 <= G; g += 4) {
      const char* ahead =
          reinterpret_cast<const char*>(wr) + kPrefetchAhead + int64_t(g) * GROUP * BITS / 8;
#pragma GCC unroll 8
      for (int line = 0; line < GROUP * BITS / 2; line += 64) {
        _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      __m256i d[4][M];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        group_dots<BITS, M, GROUP>(wr, job.xq, K, int64_t(g + c) * GROUP, d[c]);
      }
      const __m128 sc = four<T>(job.scales, sb + g);
      const __m128 bi = four<T>(job.biases, sb + g);
      for (int m = 0; m < M; ++m) {
        const __m128 dots = _mm_cvtepi32_ps(reduce4(d[0][m], d[1][m], d[2][m], d[3][m]));
        const __m128 xs = _mm_loadu_ps(job.xscale + int64_t(m) * P + g);
        acc[m] = _mm_fmadd_ps(dots, _mm_mul_ps(sc, xs), acc[m]);
        bacc[m] = _mm_fmadd_ps(bi, _mm_loadu_ps(job.xsum + int64_t(m) * P + g), bacc[m]);
      }
    }
    float tail[M] = {};
    for (; g < G; ++g) {
      __m256i d[M];
      group_dots<BITS, M, GROUP>(wr, job.xq, K, int64_t(g) * GROUP, d);
      const float s = one<T>(job.scales, sb + g), b = one<T>(job.biases, sb + g);
      for (int m = 0; m < M; ++m) {
        tail[m] += s * job.xscale[int64_t(m) * P + g] * float(hsum8i(d[m])) +
            b * job.xsum[int64_t(m) * P + g];
      }
    }
    for (int m = 0; m < M; ++m) {
      job.out[int64_t(m) * N + n] = hsum4(_mm_add_ps(acc[m], bacc[m])) + tail[m];
    }
  }
}

constexpr int kPieceRows = MNB_PIECE_ROWS;

// The rows [n0, n1) of x's rows from `first` on, in pieces of kPieceRows rows.
template <int BITS, int M, ScaleType T, int GROUP, int FIRST = 0>
MNB_TARGET inline void rows_piece(const QJob& job, int n0, int n1) {
  constexpr int here = M - FIRST < kPieceRows ? M - FIRST : kPieceRows;
  if constexpr (here > 0) {
    QJob part = job;
    const int64_t P = job.padded_groups;
    part.M = here;
    part.xq = job.xq + int64_t(FIRST) * job.K;
    part.xscale = job.xscale + FIRST * P;
    part.xsum = job.xsum + FIRST * P;
    part.out = job.out + int64_t(FIRST) * job.N;
    rows_by4<BITS, here, T, GROUP>(part, n0, n1);
    rows_piece<BITS, M, T, GROUP, FIRST + here>(job, n0, n1);
  }
}

// Rows n0..n1 for M rows of x in pieces of at most kPieceRows (what rows_by4 keeps in
// registers: 2 under AVX2's 16 vector registers, 4 under AVX-512's 32), piece after piece
// over a few output rows at a time, so that later pieces read the weights from cache.
template <int BITS, int M, ScaleType T, int GROUP>
MNB_TARGET void rows_in_pieces(const QJob& job, int n0, int n1) {
  constexpr int kSpan = 16; // output rows per round of pieces: their weights stay in L1
  for (int a = n0; a < n1; a += kSpan) {
    const int b = std::min(n1, a + kSpan);
    rows_piece<BITS, M, T, GROUP>(job, a, b);
  }
}

template <int BITS, ScaleType T, int GROUP>
RowsFn pick(int M) {
  switch (M) {
    case 1: return rows_by4<BITS, 1, T, GROUP>;
    case 2: return rows_in_pieces<BITS, 2, T, GROUP>;
    case 3: return rows_in_pieces<BITS, 3, T, GROUP>;
    case 4: return rows_in_pieces<BITS, 4, T, GROUP>;
    case 5: return rows_in_pieces<BITS, 5, T, GROUP>;
    case 6: return rows_in_pieces<BITS, 6, T, GROUP>;
    case 7: return rows_in_pieces<BITS, 7, T, GROUP>;
    case 8: return rows_in_pieces<BITS, 8, T, GROUP>;
    default: return nullptr;
  }
}

template <int BITS, ScaleType T>
RowsFn pick_group(const QJob& job) {
  switch (job.group) {
    case 32: return pick<BITS, T, 32>(job.M);
    case 64: return pick<BITS, T, 64>(job.M);
    case 128: return pick<BITS, T, 128>(job.M);
    default: return nullptr;
  }
}

template <int BITS>
RowsFn pick_scales(const QJob& job) {
  switch (job.scale_type) {
    case ScaleType::f32: return pick_group<BITS, ScaleType::f32>(job);
    case ScaleType::f16: return pick_group<BITS, ScaleType::f16>(job);
    default: return pick_group<BITS, ScaleType::bf16>(job);
  }
}

RowsFn choose(const QJob& job) {
  if (job.bits == 8) {
    return pick_scales<8>(job);
  }
  if (job.bits == 4) {
    return pick_scales<4>(job);
  }
  return nullptr;
}

} // namespace MNB_NS
