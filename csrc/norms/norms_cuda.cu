// CUDA kernels of norm_parts and its backward: the same algorithm as norms_cpu.cpp (column sums
// over rows 0..n−1 in order, then the centred sums, then max/argmax with the shared tie rule), in
// three small kernels that each own one slice of the work.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/cuda_reduce.cuh"
#include "common/dispatch.h"
#include "common/norm_math.h"
#include "norms/norms.h"

namespace pathkernels {
namespace {

using namespace cuda;

constexpr int kColumnThreads = 128;
constexpr int kRowWarps = 8;
constexpr int kFinishThreads = 256;

// Per-matrix workspace, in the accumulation type: column stats [cols, kColumnStats] and row
// stats [rows, kRowStats].
constexpr int kColumnStats = 3;  // mean, Σ_i |x_ij|, Σ_i |x_ij − mean_j|
constexpr int kRowStats = 2;     // Σ_j |x_ij|, Σ_j |x_ij − mean_j|

template <typename T>
__device__ inline const T* matrix_of(const NormPartsParams& p, int64_t b) {
  return static_cast<const T*>(p.x) + b * p.shape.batch_stride;
}

// Thread (b, j) owns column j of matrix b: its mean and both abs sums.
template <typename T, typename A>
__global__ void norm_columns_kernel(NormPartsParams p, A* col_stats) {
  const int64_t b = blockIdx.x;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= p.shape.cols) {
    return;
  }
  const T* col = matrix_of<T>(p, b) + j * p.shape.col_stride;
  A sum = A(0);
  A abs_sum = A(0);
  for (int64_t i = 0; i < p.shape.rows; ++i) {
    const A v = static_cast<A>(col[i * p.shape.row_stride]);
    sum += v;
    abs_sum += ::fabs(v);
  }
  const A mean = sum / static_cast<A>(p.shape.rows);
  A res_sum = A(0);
  if (p.centered) {
    for (int64_t i = 0; i < p.shape.rows; ++i) {
      res_sum += ::fabs(static_cast<A>(col[i * p.shape.row_stride]) - mean);
    }
  }
  A* out = col_stats + (b * p.shape.cols + j) * kColumnStats;
  out[0] = mean;
  out[1] = abs_sum;
  out[2] = res_sum;
}

// Warp (b, i) owns row i of matrix b: lanes stride over columns, then a shuffle tree sums.
template <typename T, typename A>
__global__ void norm_rows_kernel(NormPartsParams p, const A* col_stats, A* row_stats) {
  const int64_t b = blockIdx.x;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * kRowWarps + threadIdx.x / kWarpSize;
  if (i >= p.shape.rows) {
    return;
  }
  const T* row = matrix_of<T>(p, b) + i * p.shape.row_stride;
  const A* stats = col_stats + b * p.shape.cols * kColumnStats;
  A abs_sum = A(0);
  A res_sum = A(0);
  for (int64_t j = lane; j < p.shape.cols; j += kWarpSize) {
    const A v = static_cast<A>(row[j * p.shape.col_stride]);
    abs_sum += ::fabs(v);
    res_sum += ::fabs(v - stats[j * kColumnStats]);
  }
  abs_sum = warp_sum(abs_sum);
  res_sum = warp_sum(res_sum);
  if (lane == 0) {
    A* out = row_stats + (b * p.shape.rows + i) * kRowStats;
    out[0] = abs_sum;
    out[1] = res_sum;
  }
}

// Block b owns matrix b's outputs: it reduces the column and row stats to the norms.
template <typename T, typename A>
__global__ void norm_finish_kernel(NormPartsParams p, const A* col_stats, const A* row_stats) {
  __shared__ A s_value[kFinishThreads];
  __shared__ int64_t s_index[kFinishThreads];
  const int64_t b = blockIdx.x;
  const int targets = num_targets(p.centered, p.with_norm);
  const A* cols = col_stats + b * p.shape.cols * kColumnStats;
  const A* rows = row_stats + b * p.shape.rows * kRowStats;
  T* parts = static_cast<T*>(p.parts) + b * targets * kNumParts;
  int64_t* argmax = p.argmax + b * targets * kNumArgs;

  A l1, linf;
  int64_t col, row;
  // x's own sums are always accumulated above (free beside the memory traffic), written if asked.
  if (measures_x(p.centered, p.with_norm)) {
    block_argmax(cols + 1, p.shape.cols, kColumnStats, s_value, s_index, l1, col);
    block_argmax(rows + 0, p.shape.rows, kRowStats, s_value, s_index, linf, row);
    const int target = x_target(p.centered);
    if (threadIdx.x == 0) {
      write_target(parts + target * kNumParts, argmax + target * kNumArgs, l1, col, linf, row);
    }
  }
  if (p.centered) {
    block_argmax(cols + 2, p.shape.cols, kColumnStats, s_value, s_index, l1, col);
    block_argmax(rows + 1, p.shape.rows, kRowStats, s_value, s_index, linf, row);
    if (threadIdx.x == 0) {
      write_target(parts, argmax, l1, col, linf, row);
    }
  }
}

// Thread (b, j) owns column j of grad_x[b]: the centring of the residual's sparse gradient needs
// only this column's mean, the maximal row's entry, and (on the maximal column) a sign sum.
template <typename T, typename A>
__global__ void norm_parts_backward_kernel(NormPartsBackwardParams p) {
  const int64_t b = blockIdx.x;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t n = p.shape.rows;
  if (j >= p.shape.cols) {
    return;
  }
  const int targets = num_targets(p.centered, p.with_norm);
  const int64_t offset = b * targets;
  const T* grad_parts = static_cast<const T*>(p.grad_parts) + offset * kNumParts;
  const T* parts = static_cast<const T*>(p.parts) + offset * kNumParts;
  const int64_t* argmax = p.argmax + offset * kNumArgs;
  const T* col = static_cast<const T*>(p.x) + b * p.shape.batch_stride + j * p.shape.col_stride;
  T* out = static_cast<T*>(p.grad_x) + b * n * p.shape.cols + j;

  const TargetGrad<A> g0 = load_target_grad(grad_parts, parts, argmax);
  TargetGrad<A> g1;
  A mean = A(0);
  A grad_mean = A(0);
  if (targets == 2) {
    g1 = load_target_grad(grad_parts + kNumParts, parts + kNumParts, argmax + kNumArgs);
  }
  if (p.centered) {
    for (int64_t i = 0; i < n; ++i) {
      mean += static_cast<A>(col[i * p.shape.row_stride]);
    }
    mean /= static_cast<A>(n);
    A col_sign_sum = A(0);
    if (j == g0.col) {
      for (int64_t i = 0; i < n; ++i) {
        col_sign_sum += abs_grad(static_cast<A>(col[i * p.shape.row_stride]) - mean);
      }
    }
    const A v_on_row = static_cast<A>(col[g0.row * p.shape.row_stride]) - mean;
    grad_mean = target_grad_column_mean(g0, j, v_on_row, col_sign_sum, n);
  }
  for (int64_t i = 0; i < n; ++i) {
    const A v = static_cast<A>(col[i * p.shape.row_stride]);
    A g = target_grad_element(g0, i, j, v - mean);
    if (p.centered) {
      g += target_grad_element(g1, i, j, v) - grad_mean;
    }
    out[i * p.shape.cols] = static_cast<T>(g);
  }
}

std::tuple<at::Tensor, at::Tensor> norm_parts_cuda(const at::Tensor& x, bool centered, bool with_norm) {
  const c10::cuda::CUDAGuard guard(x.device());
  NormPartsPlan plan = prepare_norm_parts(x, centered, with_norm);
  const NormPartsParams& p = plan.params;
  if (p.shape.batch == 0) {
    return {plan.parts, plan.argmax};
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 column_grid(p.shape.batch, blocks_for(p.shape.cols, kColumnThreads, "columns"));
  const dim3 row_grid(p.shape.batch, blocks_for(p.shape.rows, kRowWarps, "rows"));
  PATHKERNELS_DISPATCH_FLOATING(x.scalar_type(), "norm_parts_cuda", [&] {
    using A = norm_acc_t<scalar_t>;
    at::Tensor col_stats = at::empty({p.shape.batch, p.shape.cols, kColumnStats},
                                     x.options().dtype(c10::CppTypeToScalarType<A>::value));
    at::Tensor row_stats = at::empty({p.shape.batch, p.shape.rows, kRowStats}, col_stats.options());
    A* cols = col_stats.mutable_data_ptr<A>();
    A* rows = row_stats.mutable_data_ptr<A>();
    norm_columns_kernel<scalar_t, A><<<column_grid, kColumnThreads, 0, stream>>>(p, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    norm_rows_kernel<scalar_t, A><<<row_grid, kRowWarps * kWarpSize, 0, stream>>>(p, cols, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    norm_finish_kernel<scalar_t, A><<<p.shape.batch, kFinishThreads, 0, stream>>>(p, cols, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {plan.parts, plan.argmax};
}

at::Tensor norm_parts_backward_cuda(const at::Tensor& grad_parts, const at::Tensor& x, const at::Tensor& parts,
                                    const at::Tensor& argmax, bool centered, bool with_norm) {
  const c10::cuda::CUDAGuard guard(x.device());
  NormPartsBackwardPlan plan = prepare_norm_parts_backward(grad_parts, x, parts, argmax, centered, with_norm);
  const NormPartsBackwardParams& p = plan.params;
  if (p.shape.batch == 0 || p.shape.cols == 0) {
    return plan.grad_x;
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(p.shape.batch, blocks_for(p.shape.cols, kColumnThreads, "columns"));
  PATHKERNELS_DISPATCH_FLOATING(x.scalar_type(), "norm_parts_backward_cuda", [&] {
    using A = norm_acc_t<scalar_t>;
    norm_parts_backward_kernel<scalar_t, A><<<grid, kColumnThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return plan.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CUDA, m) {
  m.impl("norm_parts", &norm_parts_cuda);
  m.impl("norm_parts_backward", &norm_parts_backward_cuda);
}

}  // namespace pathkernels
