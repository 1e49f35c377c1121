// The portable row kernels: plain C++, built for the compiler's baseline target.

#include <cstring>

#include "qkernels.h"

namespace mnb {
namespace {

template <int BITS, int M>
void rows(const QJob& job, int n0, int n1) {
  const int K = job.K, N = job.N, group = job.group, G = K / group;
  const int64_t row_bytes = int64_t(K) * BITS / 8;
  constexpr uint32_t mask = (1u << BITS) - 1;
  constexpr int per_word = 32 / BITS;
  float s[kMaxGroups], b[kMaxGroups];
  for (int n = n0; n < n1; ++n) {
    widen_row(job, n, s, b);
    const uint8_t* wr = job.w + n * row_bytes;
    float acc[M] = {};
    for (int g = 0; g < G; ++g) {
      for (int k = g * group; k < (g + 1) * group; k += per_word) {
        uint32_t word;
        std::memcpy(&word, wr + int64_t(k) * BITS / 8, 4);
        for (int i = 0; i < per_word; ++i) {
          const float wf = float((word >> (i * BITS)) & mask) * s[g] + b[g];
          for (int m = 0; m < M; ++m) {
            acc[m] += wf * job.x[int64_t(m) * K + k + i];
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      job.out[int64_t(m) * N + n] = acc[m];
    }
  }
}

template <int BITS>
RowsFn pick(int M) {
  switch (M) {
    case 1: return rows<BITS, 1>;
    case 2: return rows<BITS, 2>;
    case 3: return rows<BITS, 3>;
    case 4: return rows<BITS, 4>;
    case 5: return rows<BITS, 5>;
    case 6: return rows<BITS, 6>;
    case 7: return rows<BITS, 7>;
    case 8: return rows<BITS, 8>;
    default: return nullptr;
  }
}

} // namespace

RowsFn portable_rows(const QJob& job) {
  if (job.K / job.group > kMaxGroups) {
    return nullptr;
  }
  if (job.bits == 8) {
    return pick<8>(job.M);
  }
  if (job.bits == 4) {
    return pick<4>(job.M);
  }
  return nullptr;
}

} // namespace mnb
