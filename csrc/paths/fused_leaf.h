// The fused leaf kernel's per-thread logic (docs/DESIGN.md §1): one CTA of kThreads threads
// computes one column tile of one leaf, R' = C(A) · right_k (n ≤ kMaxRows rows, any number of
// columns), in registers, and reduces it on chip to the column abs sums of R' and of 1μᵀ + sR'
// (s the leaf's scale, so that sR' = R) and to the tile's share of their row abs sums. No leaf matrix is ever written to memory; a finish
// step turns the sums into the two norms (sqrt of max column sum × max row sum).
//
// Every step is a C10_HOST_DEVICE function of (params, shared tile, registers, thread index):
// the CUDA kernel (paths_cuda.cu) runs the steps separated by __syncthreads(), and the CPU
// harness (fused_leaf_cpu.cpp) runs each step for every thread in turn. The CPU tests of the
// `_fused_leaf_norms` op therefore exercise the very code each GPU thread runs.
//
// Ownership: thread (ty, tx) = (tid / kThreadCols, tid % kThreadCols) owns the accumulators of
// rows ty·R + i (i < R, R = kRows / kThreadRows) and columns tx·C + j (j < C = 4) of the tile:
// contiguous, so that each k step reads its R + C operands from shared memory as 16-byte vectors
// (R/4 + 1 loads for R·4 multiply-adds instead of R + 4 scalar loads). A warp's two thread rows
// read two addresses of C(A) (broadcast) and its 16 thread columns 256 contiguous bytes of right.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/norm_math.h"

#if defined(__CUDA_ARCH__)
#define PATHKERNELS_UNROLL _Pragma("unroll")
#else
#define PATHKERNELS_UNROLL
#endif

namespace pathkernels::fused_leaf {

constexpr int kThreads = 128;
constexpr int kThreadCols = 16;
constexpr int kThreadRows = kThreads / kThreadCols;  // 8
constexpr int kTileCols = 64;                        // columns of R per CTA
constexpr int kTileDepth = 16;                       // k-slice of C(A) and right staged per step
constexpr int kMaxRows = 128;                        // larger n goes through cuBLAS and a reduction
constexpr int kStats = 2;                            // per sum: |R| (the residual), |R + μ| (the product)
constexpr int kVectorBytes = 16;                     // shared-memory reads of the k loop

// dst = src[0 : N], src 16-byte aligned (in shared memory): 16-byte vector loads on the GPU.
template <int N, typename T>
C10_HOST_DEVICE inline void load_vector(const T* src, T (&dst)[N]) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float> && N % 4 == 0) {
    PATHKERNELS_UNROLL
    for (int v = 0; v < N / 4; ++v) {
      const float4 q = reinterpret_cast<const float4*>(src)[v];
      dst[4 * v] = q.x;
      dst[4 * v + 1] = q.y;
      dst[4 * v + 2] = q.z;
      dst[4 * v + 3] = q.w;
    }
  } else if constexpr (std::is_same_v<T, double> && N % 2 == 0) {
    PATHKERNELS_UNROLL
    for (int v = 0; v < N / 2; ++v) {
      const double2 q = reinterpret_cast<const double2*>(src)[v];
      dst[2 * v] = q.x;
      dst[2 * v + 1] = q.y;
    }
  } else  // NOLINT(readability/braces): the scalar loop below is the other types' branch
#endif
  {
    PATHKERNELS_UNROLL
    for (int i = 0; i < N; ++i) {
      dst[i] = src[i];
    }
  }
}

// Kernel boundary: plain pointers and element strides.
struct Params {
  const void* attn = nullptr;   // C(A) [n, n], row-major, contiguous
  int64_t n = 0;
  const void* right = nullptr;  // leaf k's element (i, j) at k·leaf_stride + i·row_stride + j
  int64_t row_stride = 0;
  int64_t leaf_stride = 0;
  int64_t count = 0;            // leaves
  int64_t cols = 0;             // m
  const void* means = nullptr;  // leaf k's μ_j at k·mean_stride + j
  int64_t mean_stride = 0;
  const double* scales = nullptr;  // [count]: leaf k is R_k = scales[k] · C(A) right_k (engine.h)
  void* col_stats = nullptr;    // A [count, cols, kStats]: column abs sums, complete
  void* row_stats = nullptr;    // A [count, tiles, n, kStats]: row abs sums, one share per column tile
  int64_t tiles = 0;            // column tiles per leaf
};

C10_HOST_DEVICE inline int64_t column_tiles(int64_t cols) {
  return (cols + kTileCols - 1) / kTileCols;
}

// Calls fn(std::integral_constant<int, R>) with R, the CTA tile's rows: the smallest of 32, 64
// and 128 that holds n (≤ kMaxRows).
template <typename Fn>
void dispatch_tile_rows(int64_t n, Fn&& fn) {
  if (n <= 32) {
    fn(std::integral_constant<int, 32>{});
  } else if (n <= 64) {
    fn(std::integral_constant<int, 64>{});
  } else {
    fn(std::integral_constant<int, 128>{});
  }
}

// The epilogue's partial sums, in shared memory: per column one share per thread row (kThreadRows),
// per row one share per thread column (kThreadCols). Both tiles (SIMT and tensor-core) fill every
// entry, so that write_sums below serves both.
template <typename A, int kRows>
struct TileSums {
  A col[kThreadRows][kTileCols][kStats];
  A row[kRows][kThreadCols][kStats];
};

// A tile's shared memory: the GEMM's staged operands and the epilogue's partial sums are never live
// at once, so they share it; the column means live beside them.
template <typename Operands, typename A, int kRows>
struct TileShared {
  union {
    Operands operands;
    TileSums<A, kRows> sums;
  };
  A mean[kTileCols];
};

// The tile's column means μ (zero beyond the last column).
template <typename T, typename A>
C10_HOST_DEVICE inline void load_mean(const Params& p, A (&mean)[kTileCols], int tid, int64_t leaf, int64_t tile) {
  const T* means = static_cast<const T*>(p.means) + leaf * p.mean_stride;
  for (int c = tid; c < kTileCols; c += kThreads) {
    const int64_t col = tile * kTileCols + c;
    mean[c] = col < p.cols ? static_cast<A>(means[col]) : A(0);
  }
}

// Stage C(A)[:, k0 : k0 + kTileDepth] and right_k[k0 : k0 + kTileDepth, tile's columns], zero
// outside the matrices, through store_attn(kk, row, value) and store_right(kk, column, value).
// Consecutive threads read consecutive addresses of both. A thread always stages the same k of
// C(A) and the same column of right, at rows a fixed stride apart, so its column offset and
// column bounds check are set once and the loops unroll with no division.
constexpr int kAttnRowsPerStep = kThreads / kTileDepth;  // rows of C(A) staged per CTA-wide step
constexpr int kRightRowsPerStep = kThreads / kTileCols;  // k-rows of right staged per step
static_assert(kThreads % kTileDepth == 0 && kThreads % kTileCols == 0, "staging steps");

template <typename T, int kRows, typename StoreAttn, typename StoreRight>
C10_HOST_DEVICE inline void stage_slice(const Params& p, int tid, int64_t leaf, int64_t tile, int64_t k0,
                                        StoreAttn&& store_attn, StoreRight&& store_right) {
  const int kk = tid % kTileDepth;
  const bool k_inside = k0 + kk < p.n;
  const T* attn_column = static_cast<const T*>(p.attn) + (k0 + kk);
  PATHKERNELS_UNROLL
  for (int step = 0; step < kRows / kAttnRowsPerStep; ++step) {
    const int row = tid / kTileDepth + kAttnRowsPerStep * step;
    store_attn(kk, row, (k_inside && row < p.n) ? attn_column[row * p.n] : T(0));
  }
  const int c = tid % kTileCols;
  const int64_t col = tile * kTileCols + c;
  const bool col_inside = col < p.cols;
  const T* right_column = static_cast<const T*>(p.right) + leaf * p.leaf_stride + col;
  PATHKERNELS_UNROLL
  for (int step = 0; step < kTileDepth / kRightRowsPerStep; ++step) {
    const int kr = tid / kTileCols + kRightRowsPerStep * step;
    const int64_t k = k0 + kr;
    store_right(kr, c, (col_inside && k < p.n) ? right_column[k * p.row_stride] : T(0));
  }
}

// Combine the partial sums across threads and write the tile's column sums (complete: the CTA
// holds every row) and its share of the row sums.
template <typename A, int kRows>
C10_HOST_DEVICE inline void write_sums(const Params& p, const TileSums<A, kRows>& sums, int tid, int64_t leaf,
                                       int64_t tile) {
  A* col_stats = static_cast<A*>(p.col_stats) + leaf * p.cols * kStats;
  for (int e = tid; e < kTileCols * kStats; e += kThreads) {
    const int c = e / kStats;
    const int stat = e % kStats;
    const int64_t col = tile * kTileCols + c;
    if (col < p.cols) {
      A sum = A(0);
      for (int ty = 0; ty < kThreadRows; ++ty) {
        sum += sums.col[ty][c][stat];
      }
      col_stats[col * kStats + stat] = sum;
    }
  }
  A* row_stats = static_cast<A*>(p.row_stats) + (leaf * p.tiles + tile) * p.n * kStats;
  for (int e = tid; e < kRows * kStats; e += kThreads) {
    const int row = e / kStats;
    const int stat = e % kStats;
    if (row < p.n) {
      A sum = A(0);
      for (int tx = 0; tx < kThreadCols; ++tx) {
        sum += sums.row[row][tx][stat];
      }
      row_stats[row * kStats + stat] = sum;
    }
  }
}

// The abs sums of one element v of R' at (row, column c of the tile) into a row share and a
// column share: |v| (the residual's, unscaled) and |s·v + μ_c| (the product's). s is a power of
// two, so s·v is exact.
template <typename A>
C10_HOST_DEVICE inline void add_element(A v, A scale, A mean, A (&row_sums)[kStats], A (&col_sums)[kStats]) {
  const A residual = ::fabs(v);
  const A product = ::fabs(v * scale + mean);
  row_sums[0] += residual;
  row_sums[1] += product;
  col_sums[0] += residual;
  col_sums[1] += product;
}

template <typename T, typename A, int kRows>
struct Tile {
  static_assert(kRows % kThreadRows == 0 && kRows <= kMaxRows, "tile rows");
  using Element = T;
  static constexpr bool kTensorCores = false;
  static constexpr int kRowsPerThread = kRows / kThreadRows;
  static constexpr int kColsPerThread = kTileCols / kThreadCols;
  // Pads each k-row of the staged C(A) by one vector: rows stay 16-byte aligned, and the
  // transposing stores of consecutive k land on different banks.
  static constexpr int kAttnPad = kVectorBytes / sizeof(T);
  static_assert(kRowsPerThread % kAttnPad == 0 && kColsPerThread % kAttnPad == 0, "vector reads");

  struct alignas(kVectorBytes) Operands {
    T attn[kTileDepth][kRows + kAttnPad];  // k-major
    T right[kTileDepth][kTileCols];
  };
  using Shared = TileShared<Operands, A, kRows>;
  struct Registers {
    T acc[kRowsPerThread][kColsPerThread];
  };

  static C10_HOST_DEVICE void clear(Registers& r) {
    PATHKERNELS_UNROLL
    for (int i = 0; i < kRowsPerThread; ++i) {
      PATHKERNELS_UNROLL
      for (int j = 0; j < kColsPerThread; ++j) {
        r.acc[i][j] = T(0);
      }
    }
  }

  static C10_HOST_DEVICE void load(const Params& p, Shared& s, int tid, int64_t leaf, int64_t tile, int64_t k0) {
    stage_slice<T, kRows>(
        p, tid, leaf, tile, k0, [&](int kk, int row, T v) { s.operands.attn[kk][row] = v; },
        [&](int kk, int c, T v) { s.operands.right[kk][c] = v; });
  }

  // acc += the staged slice's contribution to the thread's outputs.
  static C10_HOST_DEVICE void multiply(const Shared& s, Registers& r, int tid) {
    const int ty = tid / kThreadCols;
    const int tx = tid % kThreadCols;
    PATHKERNELS_UNROLL
    for (int kk = 0; kk < kTileDepth; ++kk) {
      T a[kRowsPerThread];
      T b[kColsPerThread];
      load_vector(&s.operands.attn[kk][ty * kRowsPerThread], a);
      load_vector(&s.operands.right[kk][tx * kColsPerThread], b);
      PATHKERNELS_UNROLL
      for (int i = 0; i < kRowsPerThread; ++i) {
        PATHKERNELS_UNROLL
        for (int j = 0; j < kColsPerThread; ++j) {
          r.acc[i][j] += a[i] * b[j];
        }
      }
    }
  }

  // The thread's abs sums of R' and of sR' + μ: per owned column over its rows, and per owned row
  // over its columns, into shared memory (which the operands no longer need). Elements outside
  // the matrix count zero.
  static C10_HOST_DEVICE void partial_sums(const Params& p, Shared& s, const Registers& r, int tid, int64_t leaf,
                                           int64_t tile) {
    const int ty = tid / kThreadCols;
    const int tx = tid % kThreadCols;
    const A scale = static_cast<A>(p.scales[leaf]);
    A col_sums[kColsPerThread][kStats] = {};
    PATHKERNELS_UNROLL
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = ty * kRowsPerThread + i;
      A row_sums[kStats] = {};
      PATHKERNELS_UNROLL
      for (int j = 0; j < kColsPerThread; ++j) {
        const int c = tx * kColsPerThread + j;
        if (row < p.n && tile * kTileCols + c < p.cols) {
          add_element(static_cast<A>(r.acc[i][j]), scale, s.mean[c], row_sums, col_sums[j]);
        }
      }
      s.sums.row[row][tx][0] = row_sums[0];
      s.sums.row[row][tx][1] = row_sums[1];
    }
    PATHKERNELS_UNROLL
    for (int j = 0; j < kColsPerThread; ++j) {
      s.sums.col[ty][tx * kColsPerThread + j][0] = col_sums[j][0];
      s.sums.col[ty][tx * kColsPerThread + j][1] = col_sums[j][1];
    }
  }
};

// Finish step, a leaf's report of stat `stat` from the composite of its sums: the residual's sums
// are of R' (times the leaf's scale s), the product's already of 1μᵀ + sR'.
template <typename A>
C10_HOST_DEVICE inline double leaf_report(A composite, int stat, double scale) {
  return stat == 0 ? scale * static_cast<double>(composite) : static_cast<double>(composite);
}

// Finish step, element e of one leaf's [n, kStats] row sums: add the shares of tiles 1.. into
// tile 0's (in place), so that the row sums are complete before their maximum is taken.
template <typename A>
C10_HOST_DEVICE inline void fold_row_tiles(A* leaf_row_stats, int64_t tiles, int64_t n, int64_t e) {
  A sum = leaf_row_stats[e];
  for (int64_t t = 1; t < tiles; ++t) {
    sum += leaf_row_stats[t * n * kStats + e];
  }
  leaf_row_stats[e] = sum;
}

}  // namespace pathkernels::fused_leaf
