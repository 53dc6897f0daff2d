// CPU backend of the path-tree engine (engine.h): blocks of nodes run in parallel, one thread
// per block with its own GEMMs (gemm_cpu.h: every element computed alike, whatever the block, the
// thread or the budget), and each leaf block is reduced in the same thread while it is still in
// cache, with the vectorised paired pass of norm_passes_cpu.h. A leaf level whose parents every
// head shares goes by blocks of parents instead, each read once for all heads
// (shared_parent_leaves).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "norms/norm_passes_cpu.h"
#include "paths/engine.h"
#include "paths/gemm_cpu.h"

namespace pathkernels {
namespace {

using namespace cpu;

// Norms of `count` leaves stored as [n, count, m] with the given row stride (elements between
// rows of one leaf), leaf k holding R'_k = R_k / scale[k]: residual[k] = ‖R_k‖_{1,∞} and
// norm[k] = ‖1μ_kᵀ + R_k‖_{1,∞}, in double. kFma: the row sums as FMAs (norm_passes_cpu.h,
// add_lanes), for the entries compiled for FMA below; every entry gives the same bits.
template <typename T, bool kFma>
PATHKERNELS_INLINE void reduce_leaves_on(const T* leaves, int64_t n, int64_t count, int64_t m, int64_t row_stride,
                                         const T* means, int64_t mean_stride, const double* scale, double* residual,
                                         double* norm) {
  NormWork<double> w(n, m);
  std::vector<double> shift(m);
  std::vector<double> row_norm(n);
  for (int64_t k = 0; k < count; ++k) {
    for (int64_t j = 0; j < m; ++j) {
      shift[j] = -static_cast<double>(means[k * mean_stride + j]);  // |s·R' − (−μ)| = |1μᵀ + R|
    }
    std::fill(w.col_abs, w.col_abs + 2 * m, 0.0);
    if (scale[k] == 1.0) {  // unscaled nodes (all of float64's, most of float32's) skip a multiply
      paired_matrix_pass<false, kFma>(leaves + k * m, n, m, row_stride, shift.data(), 1.0, w.col_abs, w.row_abs,
                                      w.col_res, row_norm.data());
    } else {
      paired_matrix_pass<true, kFma>(leaves + k * m, n, m, row_stride, shift.data(), scale[k], w.col_abs, w.row_abs,
                                     w.col_res, row_norm.data());
    }
    residual[k] = scale[k] * composite_from_parts(largest(w.col_abs, m), largest(w.row_abs, n));
    norm[k] = composite_from_parts(largest(w.col_res, m), largest(row_norm.data(), n));
  }
}

#define PATHKERNELS_REDUCE_LEAVES_ARGS                                                                          \
  const T *leaves, int64_t n, int64_t count, int64_t m, int64_t row_stride, const T *means, int64_t mean_stride, \
      const double *scale, double *residual, double *norm
#define PATHKERNELS_REDUCE_LEAVES_CALL leaves, n, count, m, row_stride, means, mean_stride, scale, residual, norm

#ifdef PATHKERNELS_HAVE_FMA_ENTRIES
template <typename T>
__attribute__((target("avx512f,fma"), flatten)) void reduce_leaves_avx512(PATHKERNELS_REDUCE_LEAVES_ARGS) {
  reduce_leaves_on<T, true>(PATHKERNELS_REDUCE_LEAVES_CALL);
}
template <typename T>
__attribute__((target("avx2,fma"), flatten)) void reduce_leaves_avx2(PATHKERNELS_REDUCE_LEAVES_ARGS) {
  reduce_leaves_on<T, true>(PATHKERNELS_REDUCE_LEAVES_CALL);
}
#endif
template <typename T>
void reduce_leaves_portable(PATHKERNELS_REDUCE_LEAVES_ARGS) {
  reduce_leaves_on<T, false>(PATHKERNELS_REDUCE_LEAVES_CALL);
}

// reduce_leaves_on by the entry for `isa` (kAuto: the widest this CPU runs).
template <typename T>
void reduce_leaves(GemmIsa isa, PATHKERNELS_REDUCE_LEAVES_ARGS) {
  switch (isa == GemmIsa::kAuto ? widest_isa() : isa) {
#ifdef PATHKERNELS_HAVE_FMA_ENTRIES
    case GemmIsa::kAvx512:
      return reduce_leaves_avx512<T>(PATHKERNELS_REDUCE_LEAVES_CALL);
    case GemmIsa::kAvx2:
      return reduce_leaves_avx2<T>(PATHKERNELS_REDUCE_LEAVES_CALL);
#endif
    default:
      return reduce_leaves_portable<T>(PATHKERNELS_REDUCE_LEAVES_CALL);
  }
}
#undef PATHKERNELS_REDUCE_LEAVES_ARGS
#undef PATHKERNELS_REDUCE_LEAVES_CALL

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

// How the engine takes a leaf level whose parents every head shares: PATHKERNELS_ENGINE_LEAVES
// unset, "auto" or "all_heads" block of parents by block of parents, every head's leaves from one
// read of each block (engine.h, every_head_leaf_blocks); "per_head", head run by head run, as other
// leaf levels (for tests and measurements: the two give the same bits).
bool shared_parent_leaves_from_env() {
  const char* value = std::getenv("PATHKERNELS_ENGINE_LEAVES");
  const std::string name = value == nullptr ? "auto" : value;
  TORCH_CHECK_VALUE(name == "auto" || name == "all_heads" || name == "per_head",
                    "pathkernels.path_chunk_norms: expected PATHKERNELS_ENGINE_LEAVES in ['auto', 'all_heads', "
                    "'per_head'] or unset, got '",
                    name, "'");
  return name != "per_head";
}

// Which entry reduces the leaves: PATHKERNELS_ENGINE_REDUCTION_ISA unset or "auto", the widest the
// CPU runs; "avx512", "avx2" or "portable" for the tests, which hold every entry to the same bits.
GemmIsa reduction_isa_from_env() {
  const char* value = std::getenv("PATHKERNELS_ENGINE_REDUCTION_ISA");
  return parse_gemm_isa(value == nullptr ? "auto" : value,
                        "pathkernels.path_chunk_norms (PATHKERNELS_ENGINE_REDUCTION_ISA)");
}

// The parents one block of shared_parent_leaves holds: at most leaf_block, fewer where every head's
// column means would push its scratch (a head's leaves and every head's means, (n + H)·m per
// parent) past the leaf block's n·m per leaf, and the level split into blocks of equal size.
int64_t parents_per_block(int64_t count, int64_t n, int64_t heads, int64_t leaf_block) {
  const int64_t most = std::max<int64_t>(1, std::min(leaf_block, leaf_block * n / (n + heads)));
  const int64_t blocks = (count + most - 1) / most;
  return (count + blocks - 1) / blocks;
}

// out[k] = mean[k] + scale[k]·shift[k] for `count` rows of m (mean's rows mean_stride apart, shift's
// and out's m apart; out may be shift): add_scaled's arithmetic, which block_means shares, so that
// the shared parents' leaves have the bits of the per-head blocks.
template <typename T>
void add_scaled_rows(const T* mean, int64_t mean_stride, const T* shift, const double* scale, int64_t count, int64_t m,
                     T* out) {
  for (int64_t k = 0; k < count; ++k) {
    const T factor = static_cast<T>(scale[k]);
    for (int64_t j = 0; j < m; ++j) {
      out[k * m + j] = mean[k * mean_stride + j] + factor * shift[k * m + j];
    }
  }
}

struct CpuBackend {
  static constexpr bool kFusedLeaves = false;  // a leaf block is reduced while in cache instead
  static constexpr bool kSharedParentLeaves = true;

  explicit CpuBackend(LeafKernel /*a CUDA option*/) {}

  const bool shared_parent_leaves_ = shared_parent_leaves_from_env();
  const GemmIsa reduction_isa_ = reduction_isa_from_env();

  bool shared_parent_leaves_enabled() const {
    return shared_parent_leaves_;
  }

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
    add_scaled_rows(mean.const_data_ptr<T>(), mean.stride(0), shift.const_data_ptr<T>(), scale.const_data_ptr<double>(),
                    c, m, out.mutable_data_ptr<T>());
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
    if (!renormalise) {
      std::copy(parent, parent + r.size(1), scale);
      return;
    }
    // Each node is read (and maybe scaled) on its own: nodes split over the threads, a few at a time.
    const int64_t n = r.size(0), m = r.size(2), nodes_per_task = std::max<int64_t>(1, 16384 / (n * m));
    at::parallel_for(0, r.size(1), nodes_per_task, [&](int64_t first, int64_t last) {
      for (int64_t k = first; k < last; ++k) {
        scale[k] = parent[k] * renormalise_node(nodes + k * m, n, m, r.stride(0));
      }
    });
  }

  // The heads leaf kernel's CPU harness: the GPU's program thread by thread, for the tests of the
  // engine's "heads_*" leaf kernels (slow; the Python layer sends the CPU "simt").
  std::tuple<at::Tensor, at::Tensor> heads_leaf_norms(const HeadsLeafOperands& ops) {
    return heads_leaf_norms_on_host(ops);
  }

  // Every head's leaves of parents R' [n, count, m] (row stride of their level, unit column stride)
  // that all H heads share, by blocks of p parents: the column means of the block's H·p children
  // from one GEMM, μ_h = μ + s·R'ᵀa_h ([H, n] @ [n, p·m]; float64: the product accumulated onto μ,
  // as child_operands does), then head by head the leaves C(A_h) R' and their norms while they are
  // in cache. The threads share the (block, head) items in equal contiguous ranges, so a block
  // split between two threads has its means computed by both. Leaf (k, h) reports at h·count + k.
  // Each element is computed as the per-head blocks compute it (gemm_cpu.h's rule, add_scaled's and
  // reduce's), so the bits are theirs.
  template <typename T>
  void shared_parent_leaves(const at::Tensor& attn, const at::Tensor& attn_mean, const engine::Nodes& parents,
                            int64_t leaf_block, bool renormalises, double* residual, double* norm) {
    const at::Tensor& r = parents.residual;
    TORCH_INTERNAL_ASSERT(attn.is_contiguous() && attn_mean.is_contiguous() && r.stride(2) == 1 &&
                          r.stride(1) == r.size(2) && parents.mean.stride(1) == 1 && parents.scale.is_contiguous());
    const int64_t heads = attn.size(0), n = r.size(0), count = r.size(1), m = r.size(2), ldr = r.stride(0);
    const int64_t per_block = parents_per_block(count, n, heads, leaf_block);
    const int64_t blocks = (count + per_block - 1) / per_block;
    const T* a = attn.const_data_ptr<T>();
    const T* a_mean = attn_mean.const_data_ptr<T>();
    const T* right = r.const_data_ptr<T>();
    const T* parent_mean = parents.mean.const_data_ptr<T>();
    const int64_t mean_stride = parents.mean.stride(0);
    const double* scale = parents.scale.const_data_ptr<double>();
    at::parallel_for(0, blocks * heads, 1, [&](int64_t first, int64_t last) {
      // Scratch written before it is read: not zero-filled, as a std::vector would.
      const std::unique_ptr<T[]> leaves(new T[n * per_block * m]);
      const std::unique_ptr<T[]> means(new T[heads * per_block * m]);
      int64_t means_of = -1;  // the block whose means `means` holds
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / heads, h = item % heads;
        const int64_t k0 = b * per_block, p = std::min(per_block, count - k0), width = p * m;
        const T* block = right + k0 * m;
        if (means_of != b) {
          block_means(a_mean, heads, n, block, ldr, parent_mean + k0 * mean_stride, mean_stride, scale + k0, p, m,
                      renormalises, means.get());
          means_of = b;
        }
        gemm(n, width, n, a + h * n * n, n, block, ldr, leaves.get(), width, false);
        reduce_leaves(reduction_isa_, leaves.get(), n, p, m, width, means.get() + h * width, m, scale + k0,
                      residual + h * count + k0, norm + h * count + k0);
      }
    });
  }

  // The children's column means of every head for p parents (shared_parent_leaves): means [H, p·m]
  // = μ + s·(a_h R'), as add_scaled computes it, or, unscaled, a_h R' accumulated onto μ.
  template <typename T>
  static void block_means(const T* a_mean, int64_t heads, int64_t n, const T* block, int64_t ldr,
                          const T* parent_mean, int64_t mean_stride, const double* scale, int64_t p, int64_t m,
                          bool renormalises, T* means) {
    const int64_t width = p * m;
    if (!renormalises) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t k = 0; k < p; ++k) {
          std::copy_n(parent_mean + k * mean_stride, m, means + h * width + k * m);
        }
      }
    }
    gemm(heads, width, n, a_mean, n, block, ldr, means, width, !renormalises);
    if (renormalises) {
      for (int64_t h = 0; h < heads; ++h) {
        add_scaled_rows(parent_mean, mean_stride, means + h * width, scale, p, m, means + h * width);
      }
    }
  }

  // leaves [n, c, m] (any row stride, unit column stride), means [c, m], scales [c] (double).
  template <typename T>
  void reduce(const engine::Nodes& leaves, double* residual, double* norm) {
    reduce_leaves(reduction_isa_, leaves.residual.const_data_ptr<T>(), leaves.residual.size(0), leaves.residual.size(1),
                  leaves.residual.size(2), leaves.residual.stride(0), leaves.mean.const_data_ptr<T>(),
                  leaves.mean.stride(0), leaves.scale.const_data_ptr<double>(), residual, norm);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("path_chunk_norms", &engine::path_chunk_norms<CpuBackend>);
}

}  // namespace pathkernels
