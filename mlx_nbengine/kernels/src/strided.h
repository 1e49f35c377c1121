// Walking an evaluated MLX array by its strides (a transposed or sliced view read in place).

#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace mnb {

// Where each row of `a` (all its axes but the last) starts, in elements of its data.
inline std::vector<int64_t> row_starts(const mlx::core::array& a) {
  const int nd = a.ndim();
  const int64_t rows = nd > 1 ? int64_t(a.size() / a.shape(-1)) : 1;
  std::vector<int64_t> starts(rows);
  std::vector<int> index(nd > 1 ? nd - 1 : 0, 0);
  int64_t at = 0;
  for (int64_t r = 0; r < rows; ++r) {
    starts[r] = at;
    for (int d = nd - 2; d >= 0; --d) { // advance the multi-index, last axis first
      at += a.strides()[d];
      if (++index[d] < a.shape(d)) {
        break;
      }
      at -= int64_t(a.strides()[d]) * a.shape(d);
      index[d] = 0;
    }
  }
  return starts;
}

// The rows of a float32 `a` as one row-major buffer: `a`'s own data where its last axis is
// contiguous (then `starts` says where each row begins), else gathered into `scratch`.
inline const float* rows_of(const mlx::core::array& a, std::vector<float>& scratch,
                            std::vector<int64_t>& starts) {
  starts = row_starts(a);
  const int n = a.ndim() ? a.shape(-1) : 1;
  const int64_t step = a.ndim() ? int64_t(a.strides().back()) : 1;
  if (step == 1 || n == 1) {
    return a.data<float>();
  }
  scratch.resize(starts.size() * size_t(n));
  const float* src = a.data<float>();
  for (size_t r = 0; r < starts.size(); ++r) {
    for (int i = 0; i < n; ++i) {
      scratch[r * n + i] = src[starts[r] + i * step];
    }
    starts[r] = int64_t(r) * n;
  }
  return scratch.data();
}

// A float32 `a` as rows x its last axis, row-major: its own data where it is row-contiguous,
// else a copy in `dense`.
inline const float* dense_rows(const mlx::core::array& a, std::vector<float>& dense) {
  if (a.flags().row_contiguous) {
    return a.data<float>();
  }
  std::vector<int64_t> starts;
  const float* rows = rows_of(a, dense, starts);
  if (rows == dense.data()) {
    return rows;
  }
  const int64_t n = a.shape(-1);
  dense.resize(a.size());
  for (size_t r = 0; r < starts.size(); ++r) {
    for (int64_t i = 0; i < n; ++i) {
      dense[r * n + i] = rows[starts[r] + i];
    }
  }
  return dense.data();
}

} // namespace mnb
