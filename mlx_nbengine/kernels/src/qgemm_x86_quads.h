// The int8 quads' weight layout (qgemm.h, `tile8`), included by qgemm_x86.cpp before the
// body of each set that multiplies quads (vpdpbusd: AVX-512 VNNI, AVX-VNNI). No include guard:
// each include defines the macros the body reads, and qgemm_x86.cpp undefines them after it.

// 8-bit weights: their bytes as they are, 32 at a time.
#define WIDEN8_STEP 32
#define WIDEN8(src, dst)                                                                   \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),                                    \
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)))
// 4-bit weights: 16 bytes of nibbles as 32 bytes, each byte's low nibble first.
#define WIDEN4_STEP 16
#define WIDEN4(src, dst)                                                                   \
  do {                                                                                     \
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));             \
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15));                                \
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));             \
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi8(lo, hi));          \
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst) + 1, _mm_unpackhi_epi8(lo, hi));      \
  } while (0)
