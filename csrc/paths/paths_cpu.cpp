// CPU backend of the path-tree engine (engine.h): blocks of nodes run in parallel, one thread
// per block with its own GEMMs (gemm_cpu.h: every element computed alike, whatever the block, the
// thread or the budget), and each leaf block is reduced in the same thread while it is still in
// cache, with the vectorised paired pass of norm_passes_cpu.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "norms/norm_passes_cpu.h"
#include "paths/engine.h"
#include "paths/gemm_cpu.h"

namespace pathkernels {
namespace {

using namespace cpu;

// Norms of `count` leaves stored as [n, count, m] with the given row stride (elements between
// rows of one leaf), leaf k holding R'_k = R_k / scale[k]: residual[k] = ‖R_k‖_{1,∞} and
// norm[k] = ‖1μ_kᵀ + R_k‖_{1,∞}, in double.
template <typename T>
PATHKERNELS_MULTIVERSION void reduce_leaves(const T* leaves, int64_t n, int64_t count, int64_t m, int64_t row_stride,
                                             const T* means, int64_t mean_stride, const double* scale,
                                             double* residual, double* norm) {
  NormWork<double> w(n, m);
  std::vector<double> shift(m);
  std::vector<double> row_norm(n);
  for (int64_t k = 0; k < count; ++k) {
    for (int64_t j = 0; j < m; ++j) {
      shift[j] = -static_cast<double>(means[k * mean_stride + j]);  // |s·R' − (−μ)| = |1μᵀ + R|
    }
    std::fill(w.col_abs, w.col_abs + 2 * m, 0.0);
    if (scale[k] == 1.0) {  // unscaled nodes (all of float64's, most of float32's) skip a multiply
      paired_matrix_pass<false>(leaves + k * m, n, m, row_stride, shift.data(), 1.0, w.col_abs, w.row_abs, w.col_res,
                                row_norm.data());
    } else {
      paired_matrix_pass<true>(leaves + k * m, n, m, row_stride, shift.data(), scale[k], w.col_abs, w.row_abs,
                               w.col_res, row_norm.data());
    }
    residual[k] = scale[k] * maxima(w.col_abs, m, w.row_abs, n).composite();
    norm[k] = maxima(w.col_res, m, row_norm.data(), n).composite();
  }
}

// scales.h's renormalisation rule for one node R' ([n, m], row stride given), in place; returns
// the factor 2^e its scale takes (1 when the node is left alone).
template <typename T>
PATHKERNELS_MULTIVERSION double renormalise_node(T* x, int64_t n, int64_t m, int64_t row_stride) {
  scales::MagnitudeBits<T> largest_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T* row = x + i * row_stride;
    for (int64_t j = 0; j < m; ++j) {
      largest_bits = std::max(largest_bits, scales::magnitude_bits(row[j]));
    }
  }
  const int e = scales::renormalise_exponent(scales::from_magnitude_bits<T>(largest_bits));
  if (e == 0) {
    return 1.0;
  }
  const T factor = static_cast<T>(std::ldexp(1.0, -e));
  for (int64_t i = 0; i < n; ++i) {
    T* row = x + i * row_stride;
    for (int64_t j = 0; j < m; ++j) {
      row[j] *= factor;
    }
  }
  return std::ldexp(1.0, e);
}

struct CpuBackend {
  static constexpr bool kFusedLeaves = false;  // a leaf block is reduced while in cache instead

  explicit CpuBackend(LeafKernel /*a CUDA option*/) {}

  // PATHKERNELS_ENGINE_GEMM=aten: the products through ATen's BLAS instead of gemm_cpu.h, for
  // measuring what the reproducible GEMM costs (bench/bench_paths.py --gemm-cost). Its results
  // then depend on the budget and the thread count, as docs/DESIGN.md §3 says a BLAS's do.
  const bool aten_gemm_ = [] {
    const char* value = std::getenv("PATHKERNELS_ENGINE_GEMM");
    return value != nullptr && std::string(value) == "aten";
  }();

  int workers() const {
    return at::get_num_threads();
  }

  void matmul(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
    if (aten_gemm_) {
      at::Tensor target = out;
      accumulate ? target.addmm_(a, b) : at::mm_out(target, a, b);
      return;
    }
    cpu::mm_out(out, a, b, accumulate);
  }

  // Every head's product in turn on the threads, each by matmul: the bits of the per-head path.
  void head_products(const at::Tensor& out, const at::Tensor& attn, const at::Tensor& right) {
    at::parallel_for(0, attn.size(0), 1, [&](int64_t first, int64_t last) {
      for (int64_t h = first; h < last; ++h) {
        matmul(out[h], attn[h], right, false);
      }
    });
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

  // The scales' two per-node steps (engine.h) as loops over a block the thread holds in cache: ATen
  // calls on blocks of a few nodes cost more in dispatch than in work.
  template <typename T>
  at::Tensor add_scaled(const at::Tensor& mean, const at::Tensor& shift, const at::Tensor& scale) {
    TORCH_INTERNAL_ASSERT(mean.stride(1) == 1 && shift.is_contiguous() && scale.is_contiguous());
    const int64_t c = shift.size(0), m = shift.size(1);
    at::Tensor out = at::empty_like(shift);
    const T* mu = mean.const_data_ptr<T>();
    const T* sh = shift.const_data_ptr<T>();
    const double* s = scale.const_data_ptr<double>();
    T* o = out.mutable_data_ptr<T>();
    for (int64_t k = 0; k < c; ++k) {
      const T factor = static_cast<T>(s[k]);
      for (int64_t j = 0; j < m; ++j) {
        o[k * m + j] = mu[k * mean.stride(0) + j] + factor * sh[k * m + j];
      }
    }
    return out;
  }

  template <typename T>
  void carry_scales(const engine::Nodes& out, const at::Tensor& parent_scale, bool renormalise) {
    const at::Tensor& r = out.residual;
    TORCH_INTERNAL_ASSERT(r.stride(2) == 1 && r.stride(1) == r.size(2) && parent_scale.is_contiguous() &&
                          out.scale.is_contiguous());
    const double* parent = parent_scale.const_data_ptr<double>();
    double* scale = out.scale.mutable_data_ptr<double>();
    T* nodes = r.mutable_data_ptr<T>();
    for (int64_t k = 0; k < r.size(1); ++k) {
      scale[k] = parent[k];
      if (renormalise) {
        scale[k] *= renormalise_node(nodes + k * r.size(2), r.size(0), r.size(2), r.stride(0));
      }
    }
  }

  // The heads leaf kernel's CPU harness: the GPU's program thread by thread, for the tests of the
  // engine's "heads_*" leaf kernels (slow; the Python layer sends the CPU "simt").
  std::tuple<at::Tensor, at::Tensor> heads_leaf_norms(const HeadsLeafOperands& ops) {
    return heads_leaf_norms_on_host(ops);
  }

  // leaves [n, c, m] (any row stride, unit column stride), means [c, m], scales [c] (double).
  template <typename T>
  void reduce(const engine::Nodes& leaves, double* residual, double* norm) {
    reduce_leaves(leaves.residual.const_data_ptr<T>(), leaves.residual.size(0), leaves.residual.size(1),
                  leaves.residual.size(2), leaves.residual.stride(0), leaves.mean.const_data_ptr<T>(),
                  leaves.mean.stride(0), leaves.scale.const_data_ptr<double>(), residual, norm);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("path_chunk_norms", &engine::path_chunk_norms<CpuBackend>);
}

}  // namespace pathkernels
