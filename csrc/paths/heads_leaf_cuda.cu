// CUDA backend of `_heads_leaf_norms`: heads_leaf.h's CTA program, one launch for every parent and
// head. This file holds what only the GPU has: the executor of run_cta for the calling thread (the
// barrier, the shuffles, cp.async and mma.sync as inline PTX) and the launcher (variant, shared
// memory, parents per CTA). The CPU harness (heads_leaf_cpu.cpp) runs the same program.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <string>

#include "common/checks.h"
#include "common/cuda_reduce.cuh"
#include "paths/heads_leaf_op.h"

namespace pathkernels {
namespace {

using heads_leaf::MmaFragments;

constexpr unsigned kFullMask = 0xffffffffu;

// cp.async for the calling thread: 16 or 4 bytes, zero-filled where the source is outside
// (src-size 0: nothing is read); one group per stage, awaited whole (cp.async.wait_all).
struct DeviceCopier {
  __device__ __forceinline__ void copy16(float* dst, const float* src, bool inside) const {
#if __CUDA_ARCH__ >= 800
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src), "r"(inside ? 16 : 0));
#else
    __trap();
#endif
  }
  __device__ __forceinline__ void copy4(float* dst, const float* src, bool inside) const {
#if __CUDA_ARCH__ >= 800
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(src), "r"(inside ? 4 : 0));
#else
    __trap();
#endif
  }
  __device__ __forceinline__ void commit() const {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
  }
  __device__ __forceinline__ void wait_all() const {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
  }
};

// One mma.sync m16n8k8 on TF32 operands, float32 accumulation in place (MmaLayout's fragments).
struct DeviceMma {
  __device__ __forceinline__ void operator()(float (&acc)[4], const MmaFragments& f) const {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(f.a[0]), "r"(f.a[1]), "r"(f.a[2]), "r"(f.a[3]), "r"(f.b[0]), "r"(f.b[1]));
#else
    __trap();
#endif
  }
};

// run_cta's executor on the GPU: each step for the calling thread; the collectives by shuffles.
template <typename Cta>
struct DeviceCta {
  struct Thread {
    int tid;
    typename Cta::Registers& r;
    DeviceCopier copier;
    DeviceMma mma;
  };
  Thread thread;

  template <typename Step>
  __device__ __forceinline__ void threads(Step&& step) {
    step(thread);
  }

  __device__ __forceinline__ void sync() {
    __syncthreads();
  }

  template <typename Get>
  __device__ __forceinline__ void all_max(Get&& get) {
    auto& values = get(thread.r);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(values) / sizeof(values[0])); ++i) {
#pragma unroll
      for (int mask = cuda::kWarpSize / 2; mask > 0; mask /= 2) {
        values[i] = heads_leaf::nan_max(values[i], __shfl_xor_sync(kFullMask, values[i], mask));
      }
    }
  }

  template <int... kMasks, typename Get>
  __device__ __forceinline__ void reduce_scatter(Get&& get) {
    auto& values = get(thread.r);
    constexpr int kCount = static_cast<int>(sizeof(values) / sizeof(values[0]));
    scatter_rounds<kCount, kMasks...>(values);
  }

  template <int kCount, int kMask, int... kRest, int N>
  __device__ __forceinline__ void scatter_rounds(float (&values)[N]) {
    constexpr int kHalf = kCount / 2;
    const bool upper = (thread.tid & kMask) != 0;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float received = __shfl_xor_sync(kFullMask, heads_leaf::scatter_send(values, i, kHalf, upper), kMask);
      values[i] = heads_leaf::scatter_keep(values, i, kHalf, upper) + received;
    }
    if constexpr (sizeof...(kRest) > 0) {
      scatter_rounds<kHalf, kRest...>(values);
    }
  }
};

// CTA (block, tile): parents block·P … of columns tile·kCols …, every head (heads_leaf.h).
template <typename Cta>
__global__ void __launch_bounds__(Cta::kThreads, Cta::kMinBlocks) heads_leaf_kernel(const heads_leaf::Params p) {
  extern __shared__ float4 shared_memory[];
  auto& shared = *reinterpret_cast<typename Cta::Shared*>(shared_memory);
  typename Cta::Registers registers;
  DeviceCta<Cta> ex{{static_cast<int>(threadIdx.x), registers, DeviceCopier{}, DeviceMma{}}};
  heads_leaf::run_cta<Cta>(p, shared, ex, blockIdx.x, blockIdx.y);
}

// Parents per CTA: as many CTAs as the GPU holds at once (or whole multiples of that), each with
// the same number of parents, at most kMaxParents.
int64_t parents_per_block(int64_t count, int64_t tiles, int64_t resident) {
  const int64_t work = count * tiles;
  const int64_t slots = std::max<int64_t>(1, resident);
  const int64_t most = slots * heads_leaf::kMaxParents;
  const int64_t waves = std::max<int64_t>(1, (work + most - 1) / most);
  const int64_t per_block = (work + slots * waves - 1) / (slots * waves);
  return std::clamp<int64_t>(per_block, 1, heads_leaf::kMaxParents);
}

template <typename Cta>
void launch(const HeadsLeafOperands& ops, HeadsLeafBuffers& buffers) {
  const auto kernel = heads_leaf_kernel<Cta>;
  const int bytes = static_cast<int>(sizeof(typename Cta::Shared));
  int device = 0, major = 0, minor = 0, processors = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK_VALUE(major >= 8, "pathkernels._heads_leaf_norms: the kernels need TF32 tensor cores ",
                    "(compute capability 8.0 or later), device ", std::to_string(device), " has ",
                    std::to_string(major), ".", std::to_string(minor));
  TORCH_CHECK_VALUE(bytes <= optin, "pathkernels._heads_leaf_norms: kernel '", variant_name(ops.variant), "' for n = ",
                    std::to_string(ops.attn.size(1)), " needs ", std::to_string(bytes),
                    " bytes of shared memory per block, device ", std::to_string(device), " has ",
                    std::to_string(optin));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Cta::kThreads, bytes));
  const int64_t tiles = heads_leaf_tiles(ops.variant, ops.right.size(2));
  const int64_t per_block =
      parents_per_block(ops.right.size(1), tiles, static_cast<int64_t>(per_sm) * processors);
  const heads_leaf::Params p = heads_leaf_params(ops, buffers, per_block);
  const int64_t blocks = (p.count + per_block - 1) / per_block;
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int32_t>::max() && tiles <= cuda::kMaxGridY,
                    "pathkernels._heads_leaf_norms: too many parents (", std::to_string(p.count), ") or columns (",
                    std::to_string(p.cols), ") for one CUDA launch");
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  kernel<<<grid, Cta::kThreads, bytes, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> heads_leaf_norms_on_device(const HeadsLeafOperands& ops) {
  const c10::cuda::CUDAGuard guard(ops.attn.device());
  HeadsLeafBuffers buffers = heads_leaf_buffers(ops);
  if (buffers.residual.numel() == 0) {
    return {buffers.residual, buffers.norm};
  }
  heads_leaf::dispatch_cta(ops.variant, ops.attn.size(1), [&](auto cta) {
    launch<typename decltype(cta)::type>(ops, buffers);
  });
  return {buffers.residual, buffers.norm};
}

namespace {

std::tuple<at::Tensor, at::Tensor> heads_leaf_norms_cuda(const at::Tensor& attn, const at::Tensor& attn_mean,
                                                         const at::Tensor& right, const at::Tensor& mean,
                                                         const std::optional<at::Tensor>& scale,
                                                         c10::string_view kernel) {
  const c10::cuda::CUDAGuard guard(attn.device());
  return heads_leaf_norms_on_device(check_heads_leaf(attn, attn_mean, right, mean, scale, kernel));
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CUDA, m) {
  m.impl("_heads_leaf_norms", &heads_leaf_norms_cuda);
}

}  // namespace pathkernels
