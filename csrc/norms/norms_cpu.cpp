// CPU kernels of norm_parts and its backward. Parallel over the batch; within a matrix, rows are
// streamed twice (column means, then the centred sums) through an L1-resident row buffer, so the
// inner loops are unit-stride and vectorised whatever the input's dtype or strides.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/dispatch.h"
#include "common/norm_math.h"
#include "norms/norms.h"

// The hot row loops are compiled for AVX-512, AVX2 and baseline x86-64, picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PATHKERNELS_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PATHKERNELS_MULTIVERSION
#endif

namespace pathkernels {
namespace {

// One row: Σ_j |v_j| with v = row (or row − mean when kCentred), col_abs += |v| and, when
// kWithSum, col_sum += v. The row is read in its own type S and widened to the accumulation type
// A in registers; the centring subtracts in A, so a residual tiny against the mean keeps its
// relative precision.
template <bool kCentred, bool kWithSum, typename S, typename A>
PATHKERNELS_MULTIVERSION A row_sums(const S* row, int64_t m, const A* mean, A* col_sum, A* col_abs) {
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
    const A a = std::abs(v);
    col_abs[j] += a;
    row_abs += a;
  }
  return row_abs;
}

// A block of kBlockRows consecutive rows at a time, for float or double inputs accumulated in
// double: rows stream sequentially (prefetcher-friendly), each column accumulator is loaded and
// stored once per block rather than once per row, and the rows' partial sums stay in registers.
// Written with GCC/Clang vector extensions, which each target_clones variant lowers to its own
// SIMD width. Column j still sums rows in order 0..n−1, as everywhere else.
#if defined(__GNUC__)
#define PATHKERNELS_HAVE_ROW_BLOCKS 1
constexpr int64_t kLanes = 4;
constexpr int64_t kBlockRows = 4;
using double_lanes = double __attribute__((vector_size(kLanes * sizeof(double))));
using float_lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
using int64_lanes = int64_t __attribute__((vector_size(kLanes * sizeof(int64_t))));

inline double_lanes load_lanes(const double* p) {
  double_lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline double_lanes load_lanes(const float* p) {
  float_lanes v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, double_lanes);
}
inline void store_lanes(double* p, double_lanes v) {
  std::memcpy(p, &v, sizeof v);
}
inline double_lanes abs_lanes(double_lanes v) {
  return reinterpret_cast<double_lanes>(reinterpret_cast<int64_lanes>(v) & INT64_MAX);
}

template <bool kCentred, bool kWithSum, typename S>
PATHKERNELS_MULTIVERSION void row_block_sums(const S* x, int64_t row_stride, int64_t m, const double* mean,
                                             double* col_sum, double* col_abs, double* row_abs) {
  double_lanes row_part[kBlockRows] = {};
  int64_t j = 0;
  for (; j + kLanes <= m; j += kLanes) {
    const double_lanes mu = kCentred ? load_lanes(mean + j) : double_lanes{};
    double_lanes sum = kWithSum ? load_lanes(col_sum + j) : double_lanes{};
    double_lanes abs_sum = load_lanes(col_abs + j);
#pragma GCC unroll 4
    for (int64_t r = 0; r < kBlockRows; ++r) {
      double_lanes value = load_lanes(x + r * row_stride + j);
      if constexpr (kCentred) {
        value -= mu;
      }
      if constexpr (kWithSum) {
        sum += value;
      }
      const double_lanes a = abs_lanes(value);
      abs_sum += a;
      row_part[r] += a;
    }
    if constexpr (kWithSum) {
      store_lanes(col_sum + j, sum);
    }
    store_lanes(col_abs + j, abs_sum);
  }
  for (int64_t r = 0; r < kBlockRows; ++r) {
    const double tail = row_sums<kCentred, kWithSum>(x + r * row_stride + j, m - j, mean + j, col_sum + j, col_abs + j);
    row_abs[r] = (row_part[r][0] + row_part[r][1]) + (row_part[r][2] + row_part[r][3]) + tail;
  }
}
#endif

// One pass over a matrix: row_abs[i] = Σ_j |v_ij|, col_abs[j] += Σ_i |v_ij| (and col_sum[j] +=
// Σ_i v_ij when kWithSum), with v = x, or x − mean when kCentred. float and double inputs with unit
// column stride go by blocks of rows straight from x; the others (half, bfloat16, strided) row by row
// through `buffer`, a copy of the row widened to A.
template <bool kCentred, bool kWithSum, typename T, typename A>
void matrix_pass(const T* x, const MatrixBatch& s, const A* mean, A* col_sum, A* col_abs, A* row_abs, A* buffer) {
  const int64_t m = s.cols;
#ifdef PATHKERNELS_HAVE_ROW_BLOCKS
  if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, double>) && std::is_same_v<A, double>) {
    if (s.col_stride == 1) {
      int64_t i = 0;
      for (; i + kBlockRows <= s.rows; i += kBlockRows) {
        row_block_sums<kCentred, kWithSum>(x + i * s.row_stride, s.row_stride, m, mean, col_sum, col_abs,
                                           row_abs + i);
      }
      for (; i < s.rows; ++i) {
        row_abs[i] = row_sums<kCentred, kWithSum>(x + i * s.row_stride, m, mean, col_sum, col_abs);
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
    row_abs[i] = row_sums<kCentred, kWithSum>(static_cast<const A*>(buffer), m, mean, col_sum, col_abs);
  }
}

template <typename A>
void vector_max(const A* values, int64_t count, A& best, int64_t& best_index) {
  best = A(0);
  best_index = 0;
  for (int64_t k = 0; k < count; ++k) {
    max_update(values[k], k, best, best_index);
  }
}

template <typename T, typename A>
void write_target(T* parts, int64_t* argmax, const A* col_abs, int64_t cols, const A* row_abs, int64_t rows) {
  A l1, linf;
  int64_t col, row;
  vector_max(col_abs, cols, l1, col);
  vector_max(row_abs, rows, linf, row);
  parts[kPartL1] = static_cast<T>(l1);
  parts[kPartLinf] = static_cast<T>(linf);
  parts[kPartComposite] = static_cast<T>(composite_from_parts(l1, linf));
  argmax[kArgColumn] = col;
  argmax[kArgRow] = row;
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

// One matrix: pass 1 gives the norms of x and the column means, pass 2 (when centred) the norms
// of the residual, re-reading x from cache. Column sums run over rows 0..n−1 in order, as on CUDA.
template <typename T, typename A = norm_acc_t<T>>
void norm_parts_matrix(const T* x, const MatrixBatch& s, bool centered, NormWork<A>& w, T* parts, int64_t* argmax) {
  const int64_t m = s.cols;
  std::fill(w.mean, w.mean + 3 * m, A(0));
  const int plain_target = centered ? 1 : 0;
  if (centered) {
    matrix_pass<false, true>(x, s, w.mean, w.mean, w.col_abs, w.row_abs, w.buffer);
  } else {
    matrix_pass<false, false>(x, s, w.mean, w.mean, w.col_abs, w.row_abs, w.buffer);
  }
  write_target(parts + plain_target * kNumParts, argmax + plain_target * kNumArgs, w.col_abs, m, w.row_abs, s.rows);
  if (!centered) {
    return;
  }
  for (int64_t j = 0; j < m; ++j) {
    w.mean[j] /= static_cast<A>(s.rows);
  }
  matrix_pass<true, false>(x, s, w.mean, w.mean, w.col_res, w.row_abs, w.buffer);
  write_target(parts, argmax, w.col_res, m, w.row_abs, s.rows);
}

// Matrices per parallel task: enough elements (~64K) to amortise the task.
int64_t batch_grain(const MatrixBatch& s) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, s.rows * s.cols));
}

std::tuple<at::Tensor, at::Tensor> norm_parts_cpu(const at::Tensor& x, bool centered) {
  NormPartsPlan plan = prepare_norm_parts(x, centered);
  const NormPartsParams& p = plan.params;
  const int targets = num_targets(centered);
  PATHKERNELS_DISPATCH_FLOATING(x.scalar_type(), "norm_parts_cpu", [&] {
    using A = norm_acc_t<scalar_t>;
    const auto* xs = static_cast<const scalar_t*>(p.x);
    auto* parts = static_cast<scalar_t*>(p.parts);
    at::parallel_for(0, p.shape.batch, batch_grain(p.shape), [&](int64_t begin, int64_t end) {
      NormWork<A> work(p.shape.rows, p.shape.cols);
      for (int64_t b = begin; b < end; ++b) {
        norm_parts_matrix(xs + b * p.shape.batch_stride, p.shape, centered, work,
                          parts + b * targets * kNumParts, p.argmax + b * targets * kNumArgs);
      }
    });
  });
  return {plan.parts, plan.argmax};
}

// One matrix of the backward pass: grad_x = C(G_0) + G_1 when centred (G_t the sparse sign
// pattern of target t, C the centring map), grad_x = G_0 otherwise.
template <typename T, typename A = norm_acc_t<T>>
void norm_parts_backward_matrix(const T* x, const MatrixBatch& s, bool centered, const T* grad_parts,
                                const T* parts, const int64_t* argmax, NormWork<A>& w, T* grad_x) {
  const int64_t n = s.rows;
  const int64_t m = s.cols;
  A* mean = w.mean;
  A* grad_mean = w.col_res;
  std::fill(mean, mean + 3 * m, A(0));
  auto at = [&](int64_t i, int64_t j) { return static_cast<A>(x[i * s.row_stride + j * s.col_stride]); };

  const TargetGrad<A> g0 = load_target_grad(grad_parts, parts, argmax);
  if (centered) {
    matrix_pass<false, true>(x, s, mean, mean, w.col_abs, w.row_abs, w.buffer);
    for (int64_t j = 0; j < m; ++j) {
      mean[j] /= static_cast<A>(n);
    }
    A col_sign_sum = A(0);
    if (m > 0) {
      for (int64_t i = 0; i < n; ++i) {
        col_sign_sum += abs_grad(at(i, g0.col) - mean[g0.col]);
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      grad_mean[j] = target_grad_column_mean(g0, j, at(g0.row, j) - mean[j], col_sign_sum, n);
    }
  }
  const TargetGrad<A> g1 = centered ? load_target_grad(grad_parts + kNumParts, parts + kNumParts, argmax + kNumArgs)
                                    : TargetGrad<A>{};
  for (int64_t i = 0; i < n; ++i) {
    T* out = grad_x + i * m;
    for (int64_t j = 0; j < m; ++j) {
      const A v = at(i, j);
      A g = target_grad_element(g0, i, j, v - mean[j]);
      if (centered) {
        g += target_grad_element(g1, i, j, v) - grad_mean[j];
      }
      out[j] = static_cast<T>(g);
    }
  }
}

at::Tensor norm_parts_backward_cpu(const at::Tensor& grad_parts, const at::Tensor& x, const at::Tensor& parts,
                                   const at::Tensor& argmax, bool centered) {
  NormPartsBackwardPlan plan = prepare_norm_parts_backward(grad_parts, x, parts, argmax, centered);
  const NormPartsBackwardParams& p = plan.params;
  const int targets = num_targets(centered);
  const int64_t matrix = p.shape.rows * p.shape.cols;
  PATHKERNELS_DISPATCH_FLOATING(x.scalar_type(), "norm_parts_backward_cpu", [&] {
    using A = norm_acc_t<scalar_t>;
    const auto* xs = static_cast<const scalar_t*>(p.x);
    const auto* grad_parts_data = static_cast<const scalar_t*>(p.grad_parts);
    const auto* parts_data = static_cast<const scalar_t*>(p.parts);
    auto* grad_x = static_cast<scalar_t*>(p.grad_x);
    at::parallel_for(0, p.shape.batch, batch_grain(p.shape), [&](int64_t begin, int64_t end) {
      NormWork<A> work(p.shape.rows, p.shape.cols);
      for (int64_t b = begin; b < end; ++b) {
        norm_parts_backward_matrix(xs + b * p.shape.batch_stride, p.shape, centered,
                                   grad_parts_data + b * targets * kNumParts, parts_data + b * targets * kNumParts,
                                   p.argmax + b * targets * kNumArgs, work, grad_x + b * matrix);
      }
    });
  });
  return plan.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("norm_parts", &norm_parts_cpu);
  m.impl("norm_parts_backward", &norm_parts_backward_cpu);
}

}  // namespace pathkernels
