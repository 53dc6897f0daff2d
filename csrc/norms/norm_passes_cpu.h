// CPU building blocks of the norm reductions: vectorised passes over one matrix that accumulate
// row and column abs sums (optionally centred by a given mean vector), and the max/argmax that
// turns them into norms. Shared by the norm ops and the path-tree engine's fused leaf reduction.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/norm_math.h"
#include "norms/params.h"

// Everything here is inlined (PATHKERNELS_INLINE) into the callers' per-matrix functions, which
// are compiled for AVX-512, x86-64-v3 (AVX2 and FMA) and baseline x86-64 and picked at load time
// (PATHKERNELS_MULTIVERSION): one dispatch per matrix, with every loop and the maxima inside the
// clone. Clones for x86-64 levels need GCC 12; with GCC 11 the middle clone is AVX2 alone (same
// results, no FMA).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#if __GNUC__ >= 12
#define PATHKERNELS_AVX2_CLONE "arch=x86-64-v3"
#else
#define PATHKERNELS_AVX2_CLONE "avx2"
#endif
#define PATHKERNELS_MULTIVERSION __attribute__((target_clones("avx512f", PATHKERNELS_AVX2_CLONE, "default")))
#define PATHKERNELS_INLINE inline __attribute__((always_inline))
#define PATHKERNELS_HAVE_FMA_ENTRIES 1
#include <immintrin.h>
#else
#define PATHKERNELS_MULTIVERSION
#define PATHKERNELS_INLINE inline
#endif

namespace pathkernels::cpu {


// One row: Σ_j |v_j| with v = row (or row − mean when kCentred), col_abs += |v| and, when
// kWithSum, col_sum += v. Without kWithAbs only col_sum is accumulated (and 0 returned): the
// column means of a residual whose caller does not want the norms of x. The row is read in its
// own type S and widened to the accumulation type A in registers; the centring subtracts in A, so
// a residual tiny against the mean keeps its relative precision.
template <bool kCentred, bool kWithSum, bool kWithAbs = true, typename S, typename A>
PATHKERNELS_INLINE A row_sums(const S* row, int64_t m, const A* mean, A* col_sum, A* col_abs) {
  A row_abs = A(0);
#pragma omp simd reduction(+ : row_abs)
  for (int64_t j = 0; j < m; ++j) {
    A v = static_cast<A>(row[j]);
    if constexpr (kCentred) {
      v -= mean[j];
    }
    if constexpr (kWithSum) {
      col_sum[j] += v;
    }
    if constexpr (kWithAbs) {
      const A a = std::abs(v);
      col_abs[j] += a;
      row_abs += a;
    }
  }
  return row_abs;
}

// One row of paired_matrix_pass: returns (Σ_j |x_j|, Σ_j |scale·x_j − shift_j|) and adds the
// terms to col_abs and col_abs_shifted.
template <bool kScaled, typename S>
PATHKERNELS_INLINE std::pair<double, double> paired_row_sums(const S* row, int64_t m, const double* shift,
                                                             double scale, double* col_abs,
                                                             double* col_abs_shifted) {
  double row_abs = 0.0;
  double row_abs_shifted = 0.0;
  for (int64_t j = 0; j < m; ++j) {
    const double v = static_cast<double>(row[j]);
    const double a = std::abs(v);
    const double c = std::abs((kScaled ? v * scale : v) - shift[j]);
    col_abs[j] += a;
    col_abs_shifted[j] += c;
    row_abs += a;
    row_abs_shifted += c;
  }
  return {row_abs, row_abs_shifted};
}

// Rows per block of the vectorised passes (row_block_sums).
constexpr int64_t kBlockRows = 4;

// Requests the cache lines of another matrix (the next of a batch) a few at a time, in row-major
// order, so that memory brings it in while the passes over the current matrix compute. Spread
// over every line the passes read: requesting a whole block up front stalled wide rows, and
// requesting only during the second pass left memory idle during the first.
template <typename S>
class PrefetchCursor {
 public:
  static constexpr int64_t kLineBytes = 64;
  static constexpr int64_t kLineElements = kLineBytes / sizeof(S);

  PrefetchCursor() = default;  // requests nothing
  // matrix (null: request nothing) has the layout of s; only unit column strides are requested.
  // passes: how many passes over the current matrix will call request() (1 or 2), which sets the
  // pace so that the last line goes out near the end of the last pass.
  PrefetchCursor(const S* matrix, const MatrixBatch& s, int64_t passes)
      : row_(reinterpret_cast<const char*>(matrix)),
        row_bytes_(s.cols * static_cast<int64_t>(sizeof(S))),
        row_stride_bytes_(s.row_stride * static_cast<int64_t>(sizeof(S))),
        rows_left_(matrix != nullptr && s.col_stride == 1 ? s.rows : 0),
        lines_per_request_(std::max<int64_t>(1, kBlockRows / passes)) {}

  // Called once per kBlockRows × kLineElements elements read: each call asks for that many lines
  // (the same amount of the next matrix, over all passes).
  PATHKERNELS_INLINE void request() {
    for (int64_t k = 0; k < lines_per_request_ && rows_left_ > 0; ++k) {
#if defined(__GNUC__)
      __builtin_prefetch(row_ + offset_);
#endif
      offset_ += kLineBytes;
      if (offset_ >= row_bytes_) {
        offset_ = 0;
        row_ += row_stride_bytes_;
        --rows_left_;
      }
    }
  }

 private:
  const char* row_ = nullptr;
  int64_t offset_ = 0;
  int64_t row_bytes_ = 0;
  int64_t row_stride_bytes_ = 0;
  int64_t rows_left_ = 0;
  int64_t lines_per_request_ = 0;
};

// A block of kBlockRows consecutive rows at a time, for float or double inputs accumulated in
// double: rows stream sequentially (prefetcher-friendly), each column accumulator is loaded and
// stored once per block rather than once per row, and the rows' partial sums stay in registers.
// Written with GCC/Clang vector extensions, which each target_clones variant lowers to its own
// SIMD width. Column j still sums rows in order 0..n−1, as everywhere else.
#if defined(__GNUC__)
#define PATHKERNELS_HAVE_ROW_BLOCKS 1
constexpr int64_t kLanes = 4;
using double_lanes = double __attribute__((vector_size(kLanes * sizeof(double))));
using int64_lanes = int64_t __attribute__((vector_size(kLanes * sizeof(int64_t))));

PATHKERNELS_INLINE double_lanes load_lanes(const double* p) {
  double_lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// Element by element, which GCC turns into one 4-wide vcvtps2pd from memory; converting a loaded
// 4-float vector (__builtin_convertvector) became two 2-wide conversions and an insert, ~20 % slower.
PATHKERNELS_INLINE double_lanes load_lanes(const float* p) {
  return double_lanes{static_cast<double>(p[0]), static_cast<double>(p[1]), static_cast<double>(p[2]),
                      static_cast<double>(p[3])};
}
PATHKERNELS_INLINE void store_lanes(double* p, double_lanes v) {
  std::memcpy(p, &v, sizeof v);
}
PATHKERNELS_INLINE double_lanes abs_lanes(double_lanes v) {
  return reinterpret_cast<double_lanes>(reinterpret_cast<int64_lanes>(v) & INT64_MAX);
}

PATHKERNELS_INLINE double horizontal_sum(double_lanes v) {
  return (v[0] + v[1]) + (v[2] + v[3]);
}

// sum + a, as the caller's target computes it: with kFma, as fma(a, 1, sum), which has the same
// bits (a·1 is exact, then one rounding) but runs on the FMA units. Where those are apart from the
// adders (AMD Zen 4 and Zen 5: two FMA and two add pipes), the leaf pass's row sums then leave the
// adders to its column sums and centring: 15 % less time per 32 × 32 leaf on a Zen 5. kFma only in the call
// trees of functions compiled for FMA whose `flatten` inlines fma_add there (paths_cpu.cpp's
// reduce_leaves entries), as gemm_cpu.cpp's fma_lanes.
#ifdef PATHKERNELS_HAVE_FMA_ENTRIES
__attribute__((target("fma"))) inline double_lanes fma_add(double_lanes sum, double_lanes a) {
  return reinterpret_cast<double_lanes>(_mm256_fmadd_pd(reinterpret_cast<__m256d>(a), _mm256_set1_pd(1.0),
                                                        reinterpret_cast<__m256d>(sum)));
}
#endif
template <bool kFma>
PATHKERNELS_INLINE double_lanes add_lanes(double_lanes sum, double_lanes a) {
#ifdef PATHKERNELS_HAVE_FMA_ENTRIES
  if constexpr (kFma) {
    return fma_add(sum, a);
  }
#endif
  return sum + a;
}

// prefetch, when not null, brings in the next matrix as the block is read (PrefetchCursor).
template <bool kCentred, bool kWithSum, bool kWithAbs, typename S>
PATHKERNELS_INLINE void row_block_sums(const S* x, int64_t row_stride, int64_t m, const double* mean,
                                       double* col_sum, double* col_abs, double* row_abs,
                                       PrefetchCursor<S>* prefetch) {
  constexpr int64_t kLineElements = PrefetchCursor<S>::kLineElements;
  double_lanes row_part[kBlockRows];
#pragma GCC unroll 4
  for (int64_t r = 0; r < kBlockRows; ++r) {
    row_part[r] = double_lanes{};
  }
  int64_t j = 0;
  for (; j + kLanes <= m; j += kLanes) {
    if (prefetch != nullptr && j % kLineElements == 0) {
      prefetch->request();
    }
    const double_lanes mu = kCentred ? load_lanes(mean + j) : double_lanes{};
    double_lanes sum = kWithSum ? load_lanes(col_sum + j) : double_lanes{};
    double_lanes abs_sum = kWithAbs ? load_lanes(col_abs + j) : double_lanes{};
#pragma GCC unroll 4
    for (int64_t r = 0; r < kBlockRows; ++r) {
      double_lanes value = load_lanes(x + r * row_stride + j);
      if constexpr (kCentred) {
        value -= mu;
      }
      if constexpr (kWithSum) {
        sum += value;
      }
      if constexpr (kWithAbs) {
        const double_lanes a = abs_lanes(value);
        abs_sum += a;
        row_part[r] += a;
      }
    }
    if constexpr (kWithSum) {
      store_lanes(col_sum + j, sum);
    }
    if constexpr (kWithAbs) {
      store_lanes(col_abs + j, abs_sum);
    }
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < kBlockRows; ++r) {
    const double tail = j < m ? row_sums<kCentred, kWithSum, kWithAbs>(x + r * row_stride + j, m - j, mean + j,
                                                                        col_sum + j, col_abs + j)
                              : 0.0;
    if constexpr (kWithAbs) {
      row_abs[r] = horizontal_sum(row_part[r]) + tail;
    }
  }
}

// Both sums of paired_matrix_pass for kBlockRows rows at once (see there). One load feeds both.
template <bool kScaled, bool kFma, typename S>
PATHKERNELS_INLINE void paired_row_block_sums(const S* x, int64_t row_stride, int64_t m, const double* shift,
                                              double scale, double* col_abs, double* col_abs_shifted,
                                              double* row_abs, double* row_abs_shifted) {
  const double_lanes scale_lanes = double_lanes{scale, scale, scale, scale};
  double_lanes row_part[kBlockRows];
  double_lanes row_part_shifted[kBlockRows];
#pragma GCC unroll 4
  for (int64_t r = 0; r < kBlockRows; ++r) {
    row_part[r] = double_lanes{};
    row_part_shifted[r] = double_lanes{};
  }
  int64_t j = 0;
  for (; j + kLanes <= m; j += kLanes) {
    const double_lanes mu = load_lanes(shift + j);
    double_lanes abs_sum = load_lanes(col_abs + j);
    double_lanes abs_sum_shifted = load_lanes(col_abs_shifted + j);
#pragma GCC unroll 4
    for (int64_t r = 0; r < kBlockRows; ++r) {
      const double_lanes value = load_lanes(x + r * row_stride + j);
      const double_lanes a = abs_lanes(value);
      const double_lanes c = abs_lanes((kScaled ? value * scale_lanes : value) - mu);
      abs_sum += a;
      abs_sum_shifted += c;
      row_part[r] = add_lanes<kFma>(row_part[r], a);
      row_part_shifted[r] = add_lanes<kFma>(row_part_shifted[r], c);
    }
    store_lanes(col_abs + j, abs_sum);
    store_lanes(col_abs_shifted + j, abs_sum_shifted);
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < kBlockRows; ++r) {
    const auto [tail, tail_shifted] =
        paired_row_sums<kScaled>(x + r * row_stride + j, m - j, shift + j, scale, col_abs + j, col_abs_shifted + j);
    row_abs[r] = horizontal_sum(row_part[r]) + tail;
    row_abs_shifted[r] = horizontal_sum(row_part_shifted[r]) + tail_shifted;
  }
}
#endif

// One pass over a matrix: row_abs[i] = Σ_j |v_ij|, col_abs[j] += Σ_i |v_ij| (and col_sum[j] +=
// Σ_i v_ij when kWithSum), with v = x, or x − mean when kCentred. float and double inputs with unit
// column stride go by blocks of rows straight from x; the others (half, bfloat16, strided) row by row
// through `buffer`, a copy of the row widened to A. `prefetch`, when not null, is asked for the
// next lines of another matrix (the next of a batch) as the row blocks go.
template <bool kCentred, bool kWithSum, bool kWithAbs = true, typename T, typename A>
PATHKERNELS_INLINE void matrix_pass(const T* x, const MatrixBatch& s, const A* mean, A* col_sum, A* col_abs, A* row_abs,
                                    A* buffer, PrefetchCursor<T>* prefetch = nullptr) {
  const int64_t m = s.cols;
#ifdef PATHKERNELS_HAVE_ROW_BLOCKS
  if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, double>) && std::is_same_v<A, double>) {
    if (s.col_stride == 1) {
      int64_t i = 0;
      for (; i + kBlockRows <= s.rows; i += kBlockRows) {
        row_block_sums<kCentred, kWithSum, kWithAbs>(x + i * s.row_stride, s.row_stride, m, mean, col_sum, col_abs,
                                                     row_abs + i, prefetch);
      }
      for (; i < s.rows; ++i) {
        const A sum = row_sums<kCentred, kWithSum, kWithAbs>(x + i * s.row_stride, m, mean, col_sum, col_abs);
        if constexpr (kWithAbs) {
          row_abs[i] = sum;
        }
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < s.rows; ++i) {
    const T* row = x + i * s.row_stride;
    for (int64_t j = 0; j < m; ++j) {
      buffer[j] = static_cast<A>(row[j * s.col_stride]);
    }
    const A sum = row_sums<kCentred, kWithSum, kWithAbs>(static_cast<const A*>(buffer), m, mean, col_sum, col_abs);
    if constexpr (kWithAbs) {
      row_abs[i] = sum;
    }
  }
}

// The path engine's leaf reduction, for a matrix with unit column stride holding R' (a leaf's
// residual divided by its scale, engine.h): sums of |x| into (col_abs, row_abs), and of
// |scale·x − shift| into the *_shifted arrays; with shift = −μ the latter are the abs sums of the
// product 1μᵀ + R at its true scale. A power-of-two scale makes scale·x exact, so scale = 1 and any
// other scale round alike; kScaled = false assumes scale = 1 and skips the multiply. kFma: the
// row sums as FMAs (add_lanes), in callers compiled for FMA; the same bits.
template <bool kScaled, bool kFma = false, typename T>
PATHKERNELS_INLINE void paired_matrix_pass(const T* x, int64_t rows, int64_t cols, int64_t row_stride,
                                           const double* shift, double scale, double* col_abs, double* row_abs,
                                           double* col_abs_shifted, double* row_abs_shifted) {
  int64_t i = 0;
#ifdef PATHKERNELS_HAVE_ROW_BLOCKS
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    for (; i + kBlockRows <= rows; i += kBlockRows) {
      paired_row_block_sums<kScaled, kFma>(x + i * row_stride, row_stride, cols, shift, scale, col_abs, col_abs_shifted,
                            row_abs + i, row_abs_shifted + i);
    }
  }
#endif
  for (; i < rows; ++i) {
    std::tie(row_abs[i], row_abs_shifted[i]) =
        paired_row_sums<kScaled>(x + i * row_stride, cols, shift, scale, col_abs, col_abs_shifted);
  }
}

// max_update over values[0 : count] from (0, 0), for values ≥ 0 or NaN (abs sums): the first NaN
// if there is one, else the largest value at its first index. Two branch-free-able scans (the
// maximum, then its first index) instead of max_update's branchy one: the latter took ~10 % of a
// 64 × 64 residual norm.
template <typename A>
PATHKERNELS_INLINE void vector_max(const A* values, int64_t count, A& best, int64_t& best_index) {
  A top = A(0);
  bool any_nan = false;
  for (int64_t k = 0; k < count; ++k) {
    const A v = values[k];
    any_nan |= is_nan(v);
    top = v > top ? v : top;
  }
  best = A(0);
  best_index = 0;
  for (int64_t k = 0; k < count; ++k) {
    if (any_nan ? is_nan(values[k]) : values[k] == top) {
      best = values[k];
      best_index = k;
      return;
    }
  }
}

// vector_max's value without its index: the largest of values[0 : count] (≥ 0 or NaN), or the
// first NaN if there is one, in one scan that vectorises (vector_max's NaN test did not: a
// quarter of a 32 × 32 leaf's reduction went to its four scans).
template <typename A>
PATHKERNELS_INLINE A largest(const A* values, int64_t count) {
  A top = A(0);
  int64_t nans = 0;
#pragma omp simd reduction(max : top) reduction(+ : nans)
  for (int64_t k = 0; k < count; ++k) {
    const A v = values[k];
    nans += v != v;
    top = v > top ? v : top;
  }
  if (nans > 0) {
    for (int64_t k = 0;; ++k) {
      if (is_nan(values[k])) {
        return values[k];
      }
    }
  }
  return top;
}

// The two maxima of one matrix's abs sums and where they sit: ‖v‖_1 from the column sums, ‖v‖_∞
// from the row sums.
template <typename A>
struct Maxima {
  A l1, linf;
  int64_t col, row;
  A composite() const {
    return composite_from_parts(l1, linf);
  }
};

template <typename A>
PATHKERNELS_INLINE Maxima<A> maxima(const A* col_abs, int64_t cols, const A* row_abs, int64_t rows) {
  Maxima<A> out;
  vector_max(col_abs, cols, out.l1, out.col);
  vector_max(row_abs, rows, out.linf, out.row);
  return out;
}

template <typename T, typename A>
PATHKERNELS_INLINE void write_target(T* parts, int64_t* argmax, const A* col_abs, int64_t cols, const A* row_abs,
                                     int64_t rows) {
  const Maxima<A> found = maxima(col_abs, cols, row_abs, rows);
  parts[kPartL1] = static_cast<T>(found.l1);
  parts[kPartLinf] = static_cast<T>(found.linf);
  parts[kPartComposite] = static_cast<T>(found.composite());
  argmax[kArgColumn] = found.col;
  argmax[kArgRow] = found.row;
}

// Per-thread accumulators for one matrix at a time.
template <typename A>
struct NormWork {
  NormWork(int64_t rows, int64_t cols) : storage(4 * cols + rows) {
    buffer = storage.data();
    mean = buffer + cols;
    col_abs = mean + cols;
    col_res = col_abs + cols;
    row_abs = col_res + cols;
  }
  std::vector<A> storage;
  A* buffer;   // [cols] a widened row
  A* mean;     // [cols] column sums, then means
  A* col_abs;  // [cols] Σ_i |x_ij|
  A* col_res;  // [cols] Σ_i |x_ij − mean_j|
  A* row_abs;  // [rows] the current pass's row sums
};

}  // namespace pathkernels::cpu
