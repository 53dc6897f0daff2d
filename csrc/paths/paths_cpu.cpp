// CPU backend of the path-tree engine (engine.h): blocks of nodes run in parallel, one thread
// per block with its own single-threaded GEMMs, and each leaf block is reduced in the same thread
// while it is still in cache, with the vectorised paired pass of norm_passes_cpu.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "norms/norm_passes_cpu.h"
#include "paths/engine.h"

namespace pathkernels {
namespace {

using namespace cpu;

// Norms of `count` leaves stored as [n, count, m] with the given row stride (elements between
// rows of one leaf): residual[k] = ‖R_k‖_{1,∞}, norm[k] = ‖1μ_kᵀ + R_k‖_{1,∞}.
template <typename T>
PATHKERNELS_MULTIVERSION void reduce_leaves(const T* leaves, int64_t n, int64_t count, int64_t m, int64_t row_stride,
                                             const T* means, int64_t mean_stride, T* residual, T* norm) {
  const MatrixBatch shape{1, n, m, 0, row_stride, 1};
  NormWork<double> w(n, m);
  std::vector<double> shift(m);
  std::vector<double> row_norm(n);
  for (int64_t k = 0; k < count; ++k) {
    for (int64_t j = 0; j < m; ++j) {
      shift[j] = -static_cast<double>(means[k * mean_stride + j]);  // |R − (−μ)| = |1μᵀ + R|
    }
    std::fill(w.col_abs, w.col_abs + 2 * m, 0.0);
    paired_matrix_pass(leaves + k * m, shape, shift.data(), w.col_abs, w.row_abs, w.col_res, row_norm.data(),
                       w.buffer);
    residual[k] = static_cast<T>(maxima(w.col_abs, m, w.row_abs, n).composite());
    norm[k] = static_cast<T>(maxima(w.col_res, m, row_norm.data(), n).composite());
  }
}

struct CpuBackend {
  static constexpr bool kFusedLeaves = false;  // a leaf block is reduced while in cache instead

  explicit CpuBackend(bool /*fused_leaves: a CUDA option*/) {}

  int workers() const {
    return at::get_num_threads();
  }

  template <typename Fn>
  void for_each_block(int64_t count, Fn&& fn) {
    at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
      const int worker = at::get_thread_num();
      for (int64_t k = first; k < last; ++k) {
        fn(k, worker);
      }
    });
  }

  // leaves [n, c, m] (any row stride, unit column stride), means [c, m].
  template <typename T>
  void reduce(const at::Tensor& leaves, const at::Tensor& means, T* residual, T* norm) {
    reduce_leaves(leaves.const_data_ptr<T>(), leaves.size(0), leaves.size(1), leaves.size(2), leaves.stride(0),
                  means.const_data_ptr<T>(), means.stride(0), residual, norm);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("path_chunk_norms", &engine::path_chunk_norms<CpuBackend>);
}

}  // namespace pathkernels
