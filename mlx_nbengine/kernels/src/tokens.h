// A cache layer's token slices joined into one array (a restore's rebuild: the Python side is
// mlx_nbengine/cache/assembly.py's join_tokens). The slices are copied once, straight into
// memory MLX owns; only the room after them is zeroed, where mx.zeros would first write every
// byte (a third of a 4,420-token restore's time on the default model).

#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace mnb {

namespace mx = mlx::core;

// One slice [B, H, n, D] of the layer: its first element's address and its strides in bytes
// for the batch, head and token axes (the last axis is contiguous).
struct TokenSlice {
  std::uintptr_t data;
  int64_t s0, s1, s2;
  int n;
};

// [B, H, T, D] of `dtype`: the slices' tokens in order along axis 2, zeros after them.
mx::array join_tokens(const std::vector<TokenSlice>& slices, int B, int H, int T, int D, mx::Dtype dtype);

} // namespace mnb
