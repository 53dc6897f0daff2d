// Device helpers shared by the CUDA kernels: warp sums, block-wide max/argmax with the shared tie rule
// (norm_math.h), the write of one norm target, and grid sizing.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/norm_math.h"

namespace pathkernels::cuda {

constexpr int kWarpSize = 32;
constexpr int64_t kMaxGridY = 65535;

// Sum of v over the 32 lanes of a warp, valid on lane 0 (a shuffle tree).
template <typename A>
__device__ inline A warp_sum(A v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Max/argmax of values[k * stride] over k < count, by the whole block; the result is valid on
// thread 0. The tree uses the shared order (max_beats), so it picks what a sequential scan does.
template <typename A>
__device__ inline void block_argmax(const A* values, int64_t count, int64_t stride, A* s_value, int64_t* s_index,
                             A& best, int64_t& best_index) {
  A local = A(0);
  int64_t local_index = 0;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    max_update(values[k * stride], k, local, local_index);
  }
  s_value[threadIdx.x] = local;
  s_index[threadIdx.x] = local_index;
  __syncthreads();
  for (int width = blockDim.x / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      max_update(s_value[threadIdx.x + width], s_index[threadIdx.x + width], s_value[threadIdx.x],
                 s_index[threadIdx.x]);
    }
    __syncthreads();
  }
  best = s_value[0];
  best_index = s_index[0];
  __syncthreads();
}

template <typename T, typename A>
__device__ inline void write_target(T* parts, int64_t* argmax, A l1, int64_t col, A linf, int64_t row) {
  parts[kPartL1] = static_cast<T>(l1);
  parts[kPartLinf] = static_cast<T>(linf);
  parts[kPartComposite] = static_cast<T>(composite_from_parts(l1, linf));
  argmax[kArgColumn] = col;
  argmax[kArgRow] = row;
}

// Blocks of `per_block` for `count` items along grid y (at least one block), within CUDA's limit.
inline int64_t blocks_for(int64_t count, int64_t per_block, const char* what) {
  const int64_t blocks = std::max<int64_t>(1, (count + per_block - 1) / per_block);
  TORCH_CHECK_VALUE(blocks <= kMaxGridY, "pathkernels: too many ", what, " (", std::to_string(count),
                    ") for one CUDA launch");
  return blocks;
}

}  // namespace pathkernels::cuda
