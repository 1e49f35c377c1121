#include "tokens.h"

#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"

namespace mnb {

mx::array join_tokens(const std::vector<TokenSlice>& slices, int B, int H, int T, int D, mx::Dtype dtype) {
  int64_t filled = 0;
  for (const auto& s : slices) {
    if (s.n < 0) {
      throw std::invalid_argument("join_tokens: a slice has a negative length");
    }
    filled += s.n;
  }
  if (B < 1 || H < 1 || D < 1 || filled > T) {
    throw std::invalid_argument("join_tokens: the slices do not fit the array");
  }
  const int64_t row = int64_t(D) * mx::size_of(dtype);
  mx::array out(mx::allocator::malloc(size_t(B) * H * T * row), mx::Shape{B, H, T, D}, dtype);
  char* const base = out.data<char>();
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      char* dst = base + (int64_t(b) * H + h) * T * row;
      for (const auto& s : slices) {
        const char* src = reinterpret_cast<const char*>(s.data) + b * s.s0 + h * s.s1;
        if (s.s2 == row) {
          std::memcpy(dst, src, size_t(s.n * row));
        } else {
          for (int t = 0; t < s.n; ++t) {
            std::memcpy(dst + t * row, src + t * s.s2, size_t(row));
          }
        }
        dst += s.n * row;
      }
      std::memset(dst, 0, size_t((T - filled) * row));
    }
  }
  return out;
}

} // namespace mnb
