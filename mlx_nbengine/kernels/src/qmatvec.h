// QuantizedMatVec: x (M x K) times the transpose of an MLX affine-quantized W (N x K), as an
// MLX primitive on the CPU device: 1 to 8 rows on the row kernels, more on qgemm.h's GEMM.

#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "qgemm.h"
#include "qkernels.h"

namespace mnb {

namespace mx = mlx::core;

// The row kernels take up to kBlockRows rows of x at a time. A set with a GEMM (the
// vectorized ones) takes any more rows on it; the portable set takes up to kMaxRows, block
// after block on each chunk of output columns (a chunk's weights read from memory once, then
// from cache).
constexpr int kBlockRows = 8;
constexpr int kMaxRows = 64;

// x @ dequantize(w, scales, biases).T for x of any leading shape (at most kMaxRows rows in
// all on the portable set, unless `long_products` is int8); the result has x's dtype.
// `threads` splits the output columns; `long_products` says how a long step multiplies
// (qgemm.h).
mx::array quantized_matvec(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    Isa isa,
    int threads,
    LongProducts long_products = LongProducts::int16);

class QuantizedMatVec : public mx::UnaryPrimitive {
 public:
  QuantizedMatVec(mx::Stream stream, int group_size, int bits, Isa isa, int threads,
                  LongProducts long_products)
      : mx::UnaryPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        isa_(isa),
        threads_(threads),
        long_products_(long_products) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "MnbQuantizedMatVec";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  Isa isa_;
  int threads_;
  LongProducts long_products_;
};

// The kernel set `isa` asks for, or the portable one where this CPU lacks it.
Isa usable(Isa isa);

// Shared with the fused products (gated_mlp.cpp).
ScaleType scale_type(mx::Dtype t); // throws for a dtype the kernels do not read
RowsFn rows_for(Isa isa, const QJob& job); // the row kernel of the set, else the portable one
mx::array contiguous_input(const mx::array& a, mx::Stream s);
int product_threads(const QJob& job, int threads); // 1 for a matrix too small to split
int product_chunk(int N, int threads); // output rows per chunk of work
// job.out = job.x @ W.T for job.M <= kBlockRows rows on the set's row kernel (x rounded to
// int16 where the set reads it so), the output rows split over `threads`: what
// QuantizedMatVec runs for a decode step's product, for primitives that fuse one.
void rows_product(QJob job, Isa isa, int threads);

} // namespace mnb
