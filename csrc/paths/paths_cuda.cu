// CUDA backend of the path-tree engine (engine.h): the same algorithm as the tested CPU backend.
// Internal levels are GEMMs through ATen (cuBLAS), one block of nodes after another on the current
// stream. Leaves of n <= 128 rows take a fused leaf kernel: each CTA computes a column tile of one
// leaf on chip and leaves only its abs sums, so no leaf matrix is ever stored. The product runs on
// CUDA cores (fused_leaf.h, "simt") or on TF32 tensor cores (tensor_leaf.h, "tf32x3" at float32
// accuracy, "tf32" with one pass; sm_80 and later). Larger n (and leaf_kernel "gemm") runs cuBLAS
// into the block's scratch buffer and reduces it with three small kernels that mirror the norm
// kernels: column sums, row sums, maxima.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <string>

#include "common/cuda_reduce.cuh"
#include "paths/engine.h"
#include "paths/tensor_leaf.h"

namespace pathkernels {
namespace {

using namespace cuda;

constexpr int kColumnThreads = 128;
constexpr int kRowWarps = 8;
constexpr int kFinishThreads = 256;
constexpr int kLeafStats = fused_leaf::kStats;  // Σ|R| (the residual) and Σ|R + μ| (the product 1μᵀ + R)

// A block of `count` leaves stored as [rows, count, cols]: element (i, j) of leaf k's R' sits at
// k·cols + i·row_stride + j; leaf k's column means at k·mean_stride + j, its scale at scales[k]
// (R = scales[k] · R', engine.h). The outputs are float64.
struct LeafBlockParams {
  const void* leaves = nullptr;
  int64_t rows = 0;
  int64_t count = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  const void* means = nullptr;
  int64_t mean_stride = 0;
  const double* scales = nullptr;  // [count]
  double* residual = nullptr;      // [count]
  double* norm = nullptr;          // [count]
  int64_t row_tiles = 1;     // row sums come in this many shares per leaf (column tiles), to be added
};

// Thread (k, j) owns column j of leaf k: both abs sums over rows 0..n−1 in order.
template <typename T, typename A>
__global__ void leaf_columns_kernel(LeafBlockParams p, A* col_stats) {
  const int64_t k = blockIdx.x;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= p.cols) {
    return;
  }
  const T* col = static_cast<const T*>(p.leaves) + k * p.cols + j;
  const A mu = static_cast<A>(static_cast<const T*>(p.means)[k * p.mean_stride + j]);
  const A scale = static_cast<A>(p.scales[k]);
  A residual = A(0);
  A product = A(0);
  for (int64_t i = 0; i < p.rows; ++i) {
    const A v = static_cast<A>(col[i * p.row_stride]);
    residual += ::fabs(v);
    product += ::fabs(v * scale + mu);
  }
  A* out = col_stats + (k * p.cols + j) * kLeafStats;
  out[0] = residual;
  out[1] = product;
}

// Warp (k, i) owns row i of leaf k: lanes stride over columns, then a shuffle tree sums.
template <typename T, typename A>
__global__ void leaf_rows_kernel(LeafBlockParams p, A* row_stats) {
  const int64_t k = blockIdx.x;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.y) * kRowWarps + threadIdx.x / kWarpSize;
  if (i >= p.rows) {
    return;
  }
  const T* row = static_cast<const T*>(p.leaves) + k * p.cols + i * p.row_stride;
  const T* mean = static_cast<const T*>(p.means) + k * p.mean_stride;
  const A scale = static_cast<A>(p.scales[k]);
  A residual = A(0);
  A product = A(0);
  for (int64_t j = lane; j < p.cols; j += kWarpSize) {
    const A v = static_cast<A>(row[j]);
    residual += ::fabs(v);
    product += ::fabs(v * scale + static_cast<A>(mean[j]));
  }
  residual = warp_sum(residual);
  product = warp_sum(product);
  if (lane == 0) {
    A* out = row_stats + (k * p.rows + i) * kLeafStats;
    out[0] = residual;
    out[1] = product;
  }
}

// Block k owns leaf k's two outputs: the maxima of its column and row sums, combined. Row sums
// [count, row_tiles, rows, kLeafStats] are first completed in place across their tiles.
template <typename A>
__global__ void leaf_finish_kernel(LeafBlockParams p, const A* col_stats, A* row_stats) {
  __shared__ A s_value[kFinishThreads];
  __shared__ int64_t s_index[kFinishThreads];
  const int64_t k = blockIdx.x;
  row_stats += k * p.row_tiles * p.rows * kLeafStats;
  if (p.row_tiles > 1) {
    for (int64_t e = threadIdx.x; e < p.rows * kLeafStats; e += blockDim.x) {
      fused_leaf::fold_row_tiles(row_stats, p.row_tiles, p.rows, e);
    }
    __syncthreads();
  }
  double* outputs[kLeafStats] = {p.residual, p.norm};
  for (int target = 0; target < kLeafStats; ++target) {
    A l1, linf;
    int64_t col, row;
    block_argmax(col_stats + k * p.cols * kLeafStats + target, p.cols, kLeafStats, s_value, s_index, l1, col);
    block_argmax(row_stats + target, p.rows, kLeafStats, s_value, s_index, linf, row);
    if (threadIdx.x == 0) {
      outputs[target][k] = fused_leaf::leaf_report(composite_from_parts(l1, linf), target, p.scales[k]);
    }
  }
}

template <typename A>
void launch_leaf_finish(const LeafBlockParams& p, const A* col_stats, A* row_stats, cudaStream_t stream) {
  leaf_finish_kernel<A><<<p.count, kFinishThreads, 0, stream>>>(p, col_stats, row_stats);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One mma.sync m16n8k8 on TF32 operands, float32 accumulation in place (tensor_leaf.h's layout).
struct TensorCoreMma {
  __device__ void operator()(float (&acc)[4], const fused_leaf::MmaFragments& f) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(f.a[0]), "r"(f.a[1]), "r"(f.a[2]), "r"(f.a[3]), "r"(f.b[0]), "r"(f.b[1]));
#else
    __trap();  // the host refuses tensor-core kernels below sm_80 (check_tensor_cores)
#endif
  }
};

// One CTA per (leaf, column tile): the steps of a fused_leaf tile (Tile or TensorTile), separated
// by barriers, in the order fused_leaf_cpu.cpp's harness runs them.
template <typename Cta>
__global__ void __launch_bounds__(fused_leaf::kThreads) fused_leaf_kernel(fused_leaf::Params p) {
  __shared__ typename Cta::Shared shared;
  typename Cta::Registers registers;
  const int tid = threadIdx.x;
  const int64_t leaf = blockIdx.x;
  const int64_t tile = blockIdx.y;
  Cta::clear(registers);
  fused_leaf::load_mean<typename Cta::Element>(p, shared.mean, tid, leaf, tile);
  for (int64_t k0 = 0; k0 < p.n; k0 += fused_leaf::kTileDepth) {
    Cta::load(p, shared, tid, leaf, tile, k0);
    __syncthreads();
    if constexpr (Cta::kTensorCores) {
      Cta::multiply(shared, registers, tid, TensorCoreMma{});
    } else {
      Cta::multiply(shared, registers, tid);
    }
    __syncthreads();  // the next load, or the sums, overwrite the staged operands
  }
  Cta::partial_sums(p, shared, registers, tid, leaf, tile);
  __syncthreads();
  fused_leaf::write_sums(p, shared.sums, tid, leaf, tile);
}

// Tensor-core kernels need TF32 mma (sm_80 and later) on the current device.
void check_tensor_cores(LeafKernel kernel) {
  if (kernel != LeafKernel::kTf32x3 && kernel != LeafKernel::kTf32) {
    return;
  }
  int device = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  TORCH_CHECK_VALUE(major >= 8, "pathkernels: the tensor-core leaf kernels ('tf32x3', 'tf32') need TF32 tensor ",
                    "cores (compute capability 8.0 or later); device ", std::to_string(device), " has ",
                    std::to_string(major), ".", std::to_string(minor), ": use 'simt'");
}

// Norms of the leaves scale_k · C(A) · right_k into residual[k], norm[k] (device pointers, float64).
template <typename T>
void fused_leaf_norms_into(const FusedLeafOperands& ops, double* residual, double* norm) {
  using A = norm_acc_t<T>;
  if (ops.right.size(1) == 0) {
    return;
  }
  auto [col_stats, row_stats] = fused_leaf_buffers(ops);
  const fused_leaf::Params p = fused_leaf_params(ops, col_stats, row_stats);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK_VALUE(p.count <= std::numeric_limits<int32_t>::max(), "pathkernels: too many leaves (",
                    std::to_string(p.count), ") for one CUDA launch");
  const dim3 grid(p.count, blocks_for(p.cols, fused_leaf::kTileCols, "column tiles"));
  check_tensor_cores(ops.kernel);
  fused_leaf::dispatch_tile_rows(p.n, [&](auto rows) {
    constexpr int kRows = decltype(rows)::value;
    const auto launch = [&](auto kernel) {
      kernel<<<grid, fused_leaf::kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if constexpr (std::is_same_v<T, float>) {
      if (ops.kernel == LeafKernel::kTf32x3) {
        return launch(fused_leaf_kernel<fused_leaf::TensorTile<kRows, 3>>);
      }
      if (ops.kernel == LeafKernel::kTf32) {
        return launch(fused_leaf_kernel<fused_leaf::TensorTile<kRows, 1>>);
      }
    }
    TORCH_INTERNAL_ASSERT(ops.kernel == LeafKernel::kSimt);
    launch(fused_leaf_kernel<fused_leaf::Tile<T, A, kRows>>);
  });
  LeafBlockParams finish;
  finish.rows = p.n;
  finish.count = p.count;
  finish.cols = p.cols;
  finish.scales = p.scales;
  finish.residual = residual;
  finish.norm = norm;
  finish.row_tiles = p.tiles;
  launch_leaf_finish(finish, col_stats.const_data_ptr<A>(), row_stats.mutable_data_ptr<A>(), stream);
}

constexpr int kScaleThreads = 256;

// Thread e owns element e = (k, j) of out [c, m]: mean[k, j] + T(scale[k]) · shift[k, j] (the
// CPU backend's loop). A scale below T's range gives 0, as there.
template <typename T>
__global__ void add_scaled_kernel(const T* mean, int64_t mean_stride, const T* shift, const double* scale, T* out,
                                  int64_t count, int64_t m) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= count * m) {
    return;
  }
  const int64_t k = e / m;
  out[e] = mean[k * mean_stride + e % m] + static_cast<T>(scale[k]) * shift[e];
}

// Block k owns node k of `nodes` ([n, c, m]: row stride given, node stride m) and its scale:
// scale[k] = parent[k], then, with `renormalise`, scales.h's rule: the block's largest |R'| (an
// integer maximum of the magnitude bits, as on the CPU), then every element times 2^-e in place
// and the scale times 2^e.
template <typename T>
__global__ void carry_scales_kernel(T* nodes, int64_t n, int64_t m, int64_t row_stride, const double* parent,
                                    double* scale, bool renormalise) {
  using Bits = scales::MagnitudeBits<T>;
  __shared__ Bits warp_largest[kScaleThreads / kWarpSize];
  __shared__ int exponent;
  const int64_t k = blockIdx.x;
  T* node = nodes + k * m;
  if (!renormalise) {
    if (threadIdx.x == 0) {
      scale[k] = parent[k];
    }
    return;
  }
  Bits largest = 0;
  for (int64_t e = threadIdx.x; e < n * m; e += blockDim.x) {
    largest = max(largest, scales::magnitude_bits(node[(e / m) * row_stride + e % m]));
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    largest = max(largest, static_cast<Bits>(__shfl_down_sync(0xffffffffu, largest, offset)));
  }
  if (threadIdx.x % kWarpSize == 0) {
    warp_largest[threadIdx.x / kWarpSize] = largest;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kScaleThreads / kWarpSize; ++w) {
      largest = max(largest, warp_largest[w]);
    }
    exponent = scales::renormalise_exponent(scales::from_magnitude_bits<T>(largest));
    scale[k] = parent[k] * ::ldexp(1.0, exponent);
  }
  __syncthreads();
  if (exponent != 0) {
    const T factor = static_cast<T>(::ldexp(1.0, -exponent));
    for (int64_t e = threadIdx.x; e < n * m; e += blockDim.x) {
      node[(e / m) * row_stride + e % m] *= factor;
    }
  }
}

struct CudaBackend {
  static constexpr bool kFusedLeaves = true;
  static constexpr bool kSharedParentLeaves = false;  // the heads leaf kernel takes such levels whole

  explicit CudaBackend(LeafKernel kernel) : kernel_(kernel) {}

  bool fuses_leaves(int64_t n) const {
    return kernel_ != LeafKernel::kGemm && n <= fused_leaf::kMaxRows;
  }

  // One launch over every parent and head (heads_leaf_cuda.cu), on the current stream.
  std::tuple<at::Tensor, at::Tensor> heads_leaf_norms(const HeadsLeafOperands& ops) {
    return heads_leaf_norms_on_device(ops);
  }

  template <typename T>
  void fused_leaf_norms(const at::Tensor& attn, const engine::ChildOperands& operands, double* residual,
                        double* norm) {
    fused_leaf_norms_into<T>({attn, operands.right, operands.mean, operands.scale.contiguous(), kernel_}, residual,
                             norm);
  }

  int workers() const {
    return 1;
  }

  // cuBLAS, whose algorithm follows the shapes: bits may change with the leaf block (unlike the CPU's).
  void matmul(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
    if (accumulate) {
      out.addmm_(a, b);
    } else {
      at::mm_out(out, a, b);
    }
  }

  // Every head's product in one batched cuBLAS call: right is shared (a batch stride of 0), out a
  // strided view of the level (row stride N·m, batch stride c·m); ATen copies an operand or the
  // result only where cuBLAS cannot take its layout.
  void head_products(const at::Tensor& out, const at::Tensor& attn, const at::Tensor& right) {
    at::Tensor target = out;
    at::bmm_out(target, attn, right.unsqueeze(0).expand({attn.size(0), right.size(0), right.size(1)}));
  }

  // The scales' two per-node steps (engine.h): one launch each, on the current stream, no host sync.
  template <typename T>
  at::Tensor add_scaled(const at::Tensor& mean, const at::Tensor& shift, const at::Tensor& scale) {
    TORCH_INTERNAL_ASSERT(mean.stride(1) == 1 && shift.is_contiguous() && scale.is_contiguous() &&
                          scale.scalar_type() == at::kDouble);
    at::Tensor out = at::empty_like(shift);
    const int64_t elements = shift.numel();
    if (elements == 0) {
      return out;
    }
    const int64_t blocks = (elements + kScaleThreads - 1) / kScaleThreads;
    TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int32_t>::max(), "pathkernels: too many nodes for one launch");
    add_scaled_kernel<T><<<blocks, kScaleThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        mean.const_data_ptr<T>(), mean.stride(0), shift.const_data_ptr<T>(), scale.const_data_ptr<double>(),
        out.mutable_data_ptr<T>(), shift.size(0), shift.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }

  template <typename T>
  void carry_scales(const engine::Nodes& out, const at::Tensor& parent_scale, bool renormalise) {
    const at::Tensor& r = out.residual;
    TORCH_INTERNAL_ASSERT(r.stride(2) == 1 && (r.size(1) <= 1 || r.stride(1) == r.size(2)) &&
                          parent_scale.is_contiguous() && out.scale.is_contiguous());
    const int64_t count = r.size(1);
    if (count == 0) {
      return;
    }
    TORCH_CHECK_VALUE(count <= std::numeric_limits<int32_t>::max(), "pathkernels: too many nodes for one launch");
    carry_scales_kernel<T><<<count, kScaleThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        r.mutable_data_ptr<T>(), r.size(0), r.size(2), r.stride(0), parent_scale.const_data_ptr<double>(),
        out.scale.mutable_data_ptr<double>(), renormalise);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename Fn>
  void for_each_block(int64_t count, Fn&& fn) {
    for (int64_t k = 0; k < count; ++k) {
      fn(k, 0);
    }
  }

  // leaves: R' [n, c, m] with unit column stride and leaf stride m, means [c, m], scales [c];
  // outputs on device.
  template <typename T>
  void reduce(const engine::Nodes& nodes, double* residual, double* norm) {
    using A = norm_acc_t<T>;
    const at::Tensor& leaves = nodes.residual;
    const at::Tensor& means = nodes.mean;
    const at::Tensor scales = nodes.scale.contiguous();
    TORCH_INTERNAL_ASSERT(leaves.stride(2) == 1 && leaves.stride(1) == leaves.size(2) && means.stride(1) == 1);
    LeafBlockParams p;
    p.leaves = leaves.const_data_ptr();
    p.rows = leaves.size(0);
    p.count = leaves.size(1);
    p.cols = leaves.size(2);
    p.row_stride = leaves.stride(0);
    p.means = means.const_data_ptr();
    p.mean_stride = means.stride(0);
    p.scales = scales.const_data_ptr<double>();
    p.residual = residual;
    p.norm = norm;
    if (p.count == 0) {
      return;
    }
    const auto stats_options = leaves.options().dtype(c10::CppTypeToScalarType<A>::value);
    at::Tensor col_stats = at::empty({p.count, p.cols, kLeafStats}, stats_options);
    at::Tensor row_stats = at::empty({p.count, p.rows, kLeafStats}, stats_options);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const dim3 column_grid(p.count, blocks_for(p.cols, kColumnThreads, "columns"));
    const dim3 row_grid(p.count, blocks_for(p.rows, kRowWarps, "rows"));
    leaf_columns_kernel<T, A><<<column_grid, kColumnThreads, 0, stream>>>(p, col_stats.mutable_data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    leaf_rows_kernel<T, A><<<row_grid, kRowWarps * kWarpSize, 0, stream>>>(p, row_stats.mutable_data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_leaf_finish(p, col_stats.const_data_ptr<A>(), row_stats.mutable_data_ptr<A>(), stream);
  }

 private:
  LeafKernel kernel_;
};

std::tuple<at::Tensor, at::Tensor> path_chunk_norms_cuda(const at::Tensor& attn, const at::Tensor& attn_mean,
                                                         const at::Tensor& root, const at::Tensor& root_mean,
                                                         const std::optional<at::Tensor>& w_v,
                                                         const std::optional<at::Tensor>& w_o,
                                                         at::TensorList parents, at::TensorList heads,
                                                         int64_t leaf_block, c10::string_view leaf_kernel,
                                                         bool all_heads_levels) {
  const c10::cuda::CUDAGuard guard(attn.device());
  return engine::path_chunk_norms<CudaBackend>(attn, attn_mean, root, root_mean, w_v, w_o, parents, heads,
                                               leaf_block, leaf_kernel, all_heads_levels);
}

std::tuple<at::Tensor, at::Tensor> fused_leaf_norms_cuda(const at::Tensor& attn, const at::Tensor& right,
                                                         const at::Tensor& mean,
                                                         const std::optional<at::Tensor>& scale,
                                                         c10::string_view kernel) {
  const c10::cuda::CUDAGuard guard(attn.device());
  const FusedLeafOperands ops = check_fused_leaf(attn, right, mean, scale, kernel);
  at::Tensor residual = at::empty({ops.right.size(1)}, ops.right.options().dtype(at::kDouble));
  at::Tensor norm = at::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES(attn.scalar_type(), "_fused_leaf_norms", [&] {
    fused_leaf_norms_into<scalar_t>(ops, residual.mutable_data_ptr<double>(), norm.mutable_data_ptr<double>());
  });
  return {residual, norm};
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CUDA, m) {
  m.impl("path_chunk_norms", &path_chunk_norms_cuda);
  m.impl("_fused_leaf_norms", &fused_leaf_norms_cuda);
}

}  // namespace pathkernels
