// CPU kernels of norm_parts and its backward. Parallel over the batch; within a matrix, rows are
// streamed twice (column means, then the centred sums) by the vectorised passes of
// norm_passes_cpu.h: float and double straight from x in blocks of rows, other dtypes and strides
// through an L1-resident widened row buffer.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "norms/norm_passes_cpu.h"
#include "norms/norms.h"

namespace pathkernels {
namespace {

using namespace cpu;

// One matrix: pass 1 gives the column means and (unless centred without with_norm) the norms of
// x, pass 2 (when centred) the norms of the residual, re-reading x from cache. Both passes
// request `next` (the batch's next matrix, or null) as they go, so that memory and arithmetic
// overlap. Column sums run over rows 0..n−1 in order, as on CUDA.
template <typename T, typename A = norm_acc_t<T>>
PATHKERNELS_MULTIVERSION void norm_parts_matrix(const T* x, const T* next, const MatrixBatch& s, bool centered,
                                                bool with_norm, NormWork<A>& w, T* parts, int64_t* argmax) {
  const int64_t m = s.cols;
  std::fill(w.mean, w.mean + 3 * m, A(0));
  PrefetchCursor<T> prefetch(next, s, centered ? 2 : 1);
  if (!centered) {
    matrix_pass<false, false>(x, s, w.mean, w.mean, w.col_abs, w.row_abs, w.buffer, &prefetch);
  } else if (with_norm) {
    matrix_pass<false, true>(x, s, w.mean, w.mean, w.col_abs, w.row_abs, w.buffer, &prefetch);
  } else {
    matrix_pass<false, true, /*kWithAbs=*/false>(x, s, w.mean, w.mean, w.col_abs, w.row_abs, w.buffer, &prefetch);
  }
  if (measures_x(centered, with_norm)) {
    const int target = x_target(centered);
    write_target(parts + target * kNumParts, argmax + target * kNumArgs, w.col_abs, m, w.row_abs, s.rows);
  }
  if (!centered) {
    return;
  }
  for (int64_t j = 0; j < m; ++j) {
    w.mean[j] /= static_cast<A>(s.rows);
  }
  matrix_pass<true, false>(x, s, w.mean, w.mean, w.col_res, w.row_abs, w.buffer, &prefetch);
  write_target(parts, argmax, w.col_res, m, w.row_abs, s.rows);
}

// Matrices per parallel task: 256K elements (1 MiB of float32, ~30-100 us of work) at least, so
// that handing a task to another thread (a wake-up and a barrier: microseconds when the machine is
// quiet, milliseconds when its cores are busy) stays small beside the task itself. A batch below
// that runs on the calling thread alone.
int64_t batch_grain(const MatrixBatch& s) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, s.rows * s.cols));
}

std::tuple<at::Tensor, at::Tensor> norm_parts_cpu(const at::Tensor& x, bool centered, bool with_norm) {
  NormPartsPlan plan = prepare_norm_parts(x, centered, with_norm);
  const NormPartsParams& p = plan.params;
  const int targets = num_targets(centered, with_norm);
  PATHKERNELS_DISPATCH_FLOATING(x.scalar_type(), "norm_parts_cpu", [&] {
    using A = norm_acc_t<scalar_t>;
    const auto* xs = static_cast<const scalar_t*>(p.x);
    auto* parts = static_cast<scalar_t*>(p.parts);
    at::parallel_for(0, p.shape.batch, batch_grain(p.shape), [&](int64_t begin, int64_t end) {
      NormWork<A> work(p.shape.rows, p.shape.cols);
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* next = b + 1 < end ? xs + (b + 1) * p.shape.batch_stride : nullptr;
        norm_parts_matrix(xs + b * p.shape.batch_stride, next, p.shape, centered, with_norm, work,
                          parts + b * targets * kNumParts, p.argmax + b * targets * kNumArgs);
      }
    });
  });
  return {plan.parts, plan.argmax};
}

// One matrix of the backward pass: grad_x = C(G_0) + G_1 when centred (G_t the sparse sign
// pattern of target t, C the centring map; G_1 = 0 without with_norm), grad_x = G_0 otherwise.
template <typename T, typename A = norm_acc_t<T>>
PATHKERNELS_MULTIVERSION void norm_parts_backward_matrix(const T* x, const MatrixBatch& s, bool centered,
                                                         bool with_norm, const T* grad_parts, const T* parts,
                                                         const int64_t* argmax, NormWork<A>& w, T* grad_x) {
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
  const TargetGrad<A> g1 = num_targets(centered, with_norm) == 2
                               ? load_target_grad(grad_parts + kNumParts, parts + kNumParts, argmax + kNumArgs)
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
                                   const at::Tensor& argmax, bool centered, bool with_norm) {
  NormPartsBackwardPlan plan = prepare_norm_parts_backward(grad_parts, x, parts, argmax, centered, with_norm);
  const NormPartsBackwardParams& p = plan.params;
  const int targets = num_targets(centered, with_norm);
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
        norm_parts_backward_matrix(xs + b * p.shape.batch_stride, p.shape, centered, with_norm,
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
