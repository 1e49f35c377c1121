#include "qgemm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "blas.h"
#include "workers.h"


namespace mnb {

namespace {

GemmSet set_for(Isa isa) {
  GemmSet s;
  if (isa == Isa::avx512) {
    s = gemm_avx512();
  }
  if (s.tile == nullptr && isa != Isa::portable) {
    s = gemm_avx2();
  }
  return s;
}

// x rounded to int16 per row and group as QActivations rounds it, in blocks of `lanes`
// rows: pairs [block][pair][lane], xscale and xsum [block][group][lane]; rows past M zero.
struct PackedX {
  std::vector<int32_t> pairs;
  std::vector<float> scale, sum;
  void pack(const QJob& job, int lanes, int threads) {
    const int M = job.M, K = job.K, group = job.group, G = K / group, P = K / 2;
    const int blocks = (M + lanes - 1) / lanes;
    pairs.assign(size_t(blocks) * P * lanes, 0);
    scale.assign(size_t(blocks) * G * lanes, 0.0f);
    sum.assign(size_t(blocks) * G * lanes, 0.0f);
    workers().run(threads, M, std::max(1, M / (threads * 4)), [&](int m0, int m1) {
      pack_rows(job, lanes, m0, m1);
    });
  }
  void pack_rows(const QJob& job, int lanes, int m0, int m1) {
    const int K = job.K, group = job.group, G = K / group, P = K / 2;
    std::vector<int16_t> q(static_cast<size_t>(group));
    for (int m = m0; m < m1; ++m) {
      const int b = m / lanes, l = m % lanes;
      for (int g = 0; g < G; ++g) {
        const float* x = job.x + int64_t(m) * K + int64_t(g) * group;
        const size_t at = (size_t(b) * G + g) * lanes + l;
        round_group(x, group, q.data(), scale[at], sum[at]);
        int32_t* dst = pairs.data() + (size_t(b) * P + int64_t(g) * group / 2) * lanes + l;
        for (int p = 0; p < group / 2; ++p) {
          dst[int64_t(p) * lanes] =
              int32_t(uint32_t(uint16_t(q[2 * p])) | uint32_t(uint16_t(q[2 * p + 1])) << 16);
        }
      }
    }
  }
};

// Bytes of x's pairs one chunk of row blocks holds: the chunk stays in a core's L2 cache
// while every tile of output columns passes over it.
constexpr int64_t kChunkBytes = 256 << 10;
// Past this many rows the BLAS's float32 product of W dequantized beats the integer tiles
// (measured on Zen 4, 2 threads: at 128 rows and more the BLAS ran 1.0-1.5x the tiles, at 32
// to 96 the tiles ran 2-8x MLX's dequantize + matmul); the float copy is made this many
// bytes at a time.
constexpr int kBlasRows = 96;
constexpr int64_t kBlasTileBytes = 8 << 20;

} // namespace

bool qgemm_available(Isa isa) {
  return set_for(isa).tile != nullptr;
}

namespace {

// Many rows: W dequantized to float32 a tile of columns at a time (our threads), each tile
// multiplied on the BLAS (its threads), so the float copy never exceeds kBlasTileBytes.
void dequantized_product(const QJob& job, const GemmSet& set, int threads) {
  const int M = job.M, K = job.K, N = job.N;
  const int rows = int(std::clamp<int64_t>(kBlasTileBytes / (int64_t(K) * 4), 64, N));
  thread_local std::vector<float> dense; // this (the stream's) thread's; workers get a pointer
  dense.resize(size_t(rows) * K);
  float* const buffer = dense.data();
  for (int n0 = 0; n0 < N; n0 += rows) {
    const int n1 = std::min(N, n0 + rows);
    workers().run(threads, n1 - n0, std::max(16, (n1 - n0) / (threads * 4)), [&](int a, int b) {
      set.dequantize(job, n0 + a, n0 + b, buffer + int64_t(a) * K);
    });
    workers().rest(); // the BLAS's threads take the cores next
    cblas_sgemm(101, 111, 112, M, n1 - n0, K, 1.0f, job.x, K, buffer, K, 0.0f,
                job.out + n0, N);
  }
}

} // namespace

void qgemm(const QJob& job, Isa isa, int threads) {
  const GemmSet set = set_for(isa);
  if (job.M > kBlasRows) {
    dequantized_product(job, set, threads);
    return;
  }
  const int L = set.lanes, NR = set.nr;
  const int M = job.M, K = job.K, N = job.N, G = K / job.group, P = K / 2;
  if (int64_t(M) * N * K < (int64_t(1) << 22)) {
    threads = 1;
  }
  PackedX x;
  x.pack(job, L, threads);
  const int blocks = (M + L - 1) / L;
  const int per_chunk = int(std::max<int64_t>(1, kChunkBytes / (int64_t(L) * P * 4)));
  const int chunks = (blocks + per_chunk - 1) / per_chunk;
  const int tiles = (N + NR - 1) / NR;
  // Work item t: row chunk t / tiles against column tile t % tiles; the threads take items
  // in order, so they share a chunk while it is in cache.
  workers().run(threads, chunks * tiles, 1, [&](int t0, int t1) {
    thread_local std::vector<int32_t> wt;
    thread_local std::vector<float> st, bt, res;
    wt.resize(size_t(NR) * gemm_wstride(P));
    st.resize(size_t(NR) * G);
    bt.resize(size_t(NR) * G);
    res.resize(size_t(NR) * L);
    for (int t = t0; t < t1; ++t) {
      const int c = t / tiles, n0 = (t % tiles) * NR;
      set.widen(job, n0, wt.data(), st.data(), bt.data());
      const int ncols = std::min(NR, N - n0);
      for (int b = c * per_chunk; b < std::min(blocks, (c + 1) * per_chunk); ++b) {
        GemmArgs a{
            x.pairs.data() + size_t(b) * P * L,
            x.scale.data() + size_t(b) * G * L,
            x.sum.data() + size_t(b) * G * L,
            wt.data(),
            st.data(),
            bt.data(),
            P,
            G,
            job.group / 2,
            gemm_wstride(P),
            res.data()};
        const int rows = std::min(L, M - b * L);
        // A last block of few rows (an edit's tail of 20 is 16 + 4) on half the lanes: the
        // same operations lane by lane, so the same bits.
        (rows <= L / 2 && set.tile_half != nullptr ? set.tile_half : set.tile)(a);
        for (int l = 0; l < rows; ++l) {
          float* dst = job.out + int64_t(b * L + l) * N + n0;
          for (int j = 0; j < ncols; ++j) {
            dst[j] = res[size_t(j) * L + l];
          }
        }
      }
    }
  });
}

} // namespace mnb
