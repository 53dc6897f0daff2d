// CPU kernels of norm_parts and its backward. Parallel over the batch; within a matrix, rows are
// streamed twice (column means, then the centred sums) through an L1-resident row buffer, so the
// inner loops are unit-stride and vectorised whatever the input's dtype or strides.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

// Σ_j |row_j|, with col_sum += row and col_abs += |row|.
template <typename A>
C10_ALWAYS_INLINE A accumulate_row(const A* row, int64_t m, A* col_sum, A* col_abs) {
  A row_abs = A(0);
#pragma omp simd reduction(+ : row_abs)
  for (int64_t j = 0; j < m; ++j) {
    const A a = std::abs(row[j]);
    col_sum[j] += row[j];
    col_abs[j] += a;
    row_abs += a;
  }
  return row_abs;
}

// Σ_j |row_j − mean_j|, with col_abs += |row − mean|.
template <typename A>
C10_ALWAYS_INLINE A accumulate_centred_row(const A* row, const A* mean, int64_t m, A* col_abs) {
  A row_abs = A(0);
#pragma omp simd reduction(+ : row_abs)
  for (int64_t j = 0; j < m; ++j) {
    const A a = std::abs(row[j] - mean[j]);
    col_abs[j] += a;
    row_abs += a;
  }
  return row_abs;
}

PATHKERNELS_MULTIVERSION float row_sums(const float* r, int64_t m, float* s, float* a) {
  return accumulate_row(r, m, s, a);
}
PATHKERNELS_MULTIVERSION double row_sums(const double* r, int64_t m, double* s, double* a) {
  return accumulate_row(r, m, s, a);
}
PATHKERNELS_MULTIVERSION float centred_row_sums(const float* r, const float* mu, int64_t m, float* a) {
  return accumulate_centred_row(r, mu, m, a);
}
PATHKERNELS_MULTIVERSION double centred_row_sums(const double* r, const double* mu, int64_t m, double* a) {
  return accumulate_centred_row(r, mu, m, a);
}

// Row i of x in the accumulation type: the input itself when it already is unit-stride A,
// otherwise converted (or gathered) into `buffer`.
template <typename T, typename A>
const A* load_row(const T* x, const MatrixBatch& s, int64_t i, A* buffer) {
  const T* row = x + i * s.row_stride;
  if constexpr (std::is_same_v<T, A>) {
    if (s.col_stride == 1) {
      return row;
    }
  }
  if (s.col_stride == 1) {
    for (int64_t j = 0; j < s.cols; ++j) {
      buffer[j] = static_cast<A>(row[j]);
    }
  } else {
    for (int64_t j = 0; j < s.cols; ++j) {
      buffer[j] = static_cast<A>(row[j * s.col_stride]);
    }
  }
  return buffer;
}

template <typename A>
void column_max(const A* col, int64_t m, A& best, int64_t& best_index) {
  best = A(0);
  best_index = 0;
  for (int64_t j = 0; j < m; ++j) {
    max_update(col[j], j, best, best_index);
  }
}

template <typename T, typename A>
void write_target(T* parts, int64_t* argmax, A l1, int64_t col, A linf, int64_t row) {
  parts[kPartL1] = static_cast<T>(l1);
  parts[kPartLinf] = static_cast<T>(linf);
  parts[kPartComposite] = static_cast<T>(composite_from_parts(l1, linf));
  argmax[kArgColumn] = col;
  argmax[kArgRow] = row;
}

// One matrix. `work` holds 4·m accumulators: row buffer, column sums (then means), column abs
// sums of x, column abs sums of the residual. Sums run over rows in order 0..n−1, as on CUDA.
template <typename T>
void norm_parts_matrix(const T* x, const MatrixBatch& s, bool centered, norm_acc_t<T>* work, T* parts,
                       int64_t* argmax) {
  using A = norm_acc_t<T>;
  const int64_t m = s.cols;
  A* buffer = work;
  A* mean = work + m;
  A* col_abs = work + 2 * m;
  A* col_res = work + 3 * m;
  std::fill(mean, mean + 3 * m, A(0));

  A row_max = A(0);
  int64_t row_arg = 0;
  for (int64_t i = 0; i < s.rows; ++i) {
    max_update(row_sums(load_row(x, s, i, buffer), m, mean, col_abs), i, row_max, row_arg);
  }
  A col_max = A(0);
  int64_t col_arg = 0;
  column_max(col_abs, m, col_max, col_arg);
  const int plain_target = centered ? 1 : 0;
  write_target(parts + plain_target * kNumParts, argmax + plain_target * kNumArgs, col_max, col_arg, row_max,
               row_arg);
  if (!centered) {
    return;
  }

  for (int64_t j = 0; j < m; ++j) {
    mean[j] /= static_cast<A>(s.rows);
  }
  A res_row_max = A(0);
  int64_t res_row_arg = 0;
  for (int64_t i = 0; i < s.rows; ++i) {
    max_update(centred_row_sums(load_row(x, s, i, buffer), mean, m, col_res), i, res_row_max, res_row_arg);
  }
  A res_col_max = A(0);
  int64_t res_col_arg = 0;
  column_max(col_res, m, res_col_max, res_col_arg);
  write_target(parts, argmax, res_col_max, res_col_arg, res_row_max, res_row_arg);
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
      std::vector<A> work(4 * p.shape.cols);
      for (int64_t b = begin; b < end; ++b) {
        norm_parts_matrix(xs + b * p.shape.batch_stride, p.shape, centered, work.data(),
                          parts + b * targets * kNumParts, p.argmax + b * targets * kNumArgs);
      }
    });
  });
  return {plan.parts, plan.argmax};
}

// One matrix of the backward pass: grad_x = C(G_0) + G_1 when centred (G_t the sparse sign
// pattern of target t, C the centring map), grad_x = G_0 otherwise.
template <typename T>
void norm_parts_backward_matrix(const T* x, const MatrixBatch& s, bool centered, const T* grad_parts,
                                const T* parts, const int64_t* argmax, norm_acc_t<T>* work, T* grad_x) {
  using A = norm_acc_t<T>;
  const int64_t n = s.rows;
  const int64_t m = s.cols;
  A* buffer = work;
  A* mean = work + m;
  A* scratch = work + 2 * m;
  A* grad_mean = work + 3 * m;
  std::fill(mean, mean + 3 * m, A(0));
  auto at = [&](int64_t i, int64_t j) { return static_cast<A>(x[i * s.row_stride + j * s.col_stride]); };

  const TargetGrad<A> g0 = load_target_grad(grad_parts, parts, argmax);
  if (centered) {
    for (int64_t i = 0; i < n; ++i) {
      row_sums(load_row(x, s, i, buffer), m, mean, scratch);
    }
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
      std::vector<A> work(4 * p.shape.cols);
      for (int64_t b = begin; b < end; ++b) {
        norm_parts_backward_matrix(xs + b * p.shape.batch_stride, p.shape, centered,
                                   grad_parts_data + b * targets * kNumParts, parts_data + b * targets * kNumParts,
                                   p.argmax + b * targets * kNumArgs, work.data(), grad_x + b * matrix);
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
