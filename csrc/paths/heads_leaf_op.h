// The host side of `_heads_leaf_norms` shared by its backends (heads_leaf_cpu.cpp, heads_leaf_cuda.cu):
// input checks, layout and the kernel's parameters. The kernel itself is heads_leaf.h.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

#include "paths/heads_leaf.h"

namespace pathkernels {

// The operands as the kernel reads them: attn C(A) [H, n, n] and attn_mean a [H, n] contiguous,
// right [n, c, m] with unit column stride and leaf stride m (any row stride), mean [c, m] with unit
// column stride, scale [c] float64 contiguous, all float32 but scale. `triton_precision`: where
// set ("tf32x3" or "tf32"), the Triton kernel of that precision takes them instead (triton_leaf_norms).
struct HeadsLeafOperands {
  at::Tensor attn;
  at::Tensor attn_mean;
  at::Tensor right;
  at::Tensor mean;
  at::Tensor scale;
  heads_leaf::Variant variant;
  const char* triton_precision = nullptr;
};

// Validates the inputs of _heads_leaf_norms (see registration.cpp), copying only operands that are
// not laid out as above. `scale` absent means 1 for every parent.
HeadsLeafOperands check_heads_leaf(const at::Tensor& attn, const at::Tensor& attn_mean, const at::Tensor& right,
                                   const at::Tensor& mean, const std::optional<at::Tensor>& scale,
                                   c10::string_view kernel);

// The outputs [c, H] (float64) and, where m spans several column tiles, the cross-tile buffers:
// column maxima and row sums per tile (float32) and the arrival counters (int32, zero).
struct HeadsLeafBuffers {
  at::Tensor residual;
  at::Tensor norm;
  at::Tensor col_shares;
  at::Tensor row_shares;
  at::Tensor arrivals;
};

// The name of `variant` in _heads_leaf_norms' `kernel` ("tf32x3", "tf32x3_128", "tf32", "tf32_128").
const char* variant_name(heads_leaf::Variant variant);

// Column tiles of m for `variant`.
int64_t heads_leaf_tiles(heads_leaf::Variant variant, int64_t m);

HeadsLeafBuffers heads_leaf_buffers(const HeadsLeafOperands& ops);

heads_leaf::Params heads_leaf_params(const HeadsLeafOperands& ops, HeadsLeafBuffers& buffers,
                                     int64_t parents_per_block);

// The kernel on operands already laid out as above (no checks, no host synchronisation): the
// residual and norm [c, H], float64. `_on_host` is the CPU harness (heads_leaf_cpu.cpp), `_on_device`
// the CUDA launch on the current stream (heads_leaf_cuda.cu, CUDA builds only).
std::tuple<at::Tensor, at::Tensor> heads_leaf_norms_on_host(const HeadsLeafOperands& ops);
std::tuple<at::Tensor, at::Tensor> heads_leaf_norms_on_device(const HeadsLeafOperands& ops);

// The Triton candidate of the same kernel (pathkernels/core/triton_leaf.py) on the same operands,
// at ops.triton_precision: the op `pathkernels::triton_leaf_norms`, which Python registers
// (torch.library.triton_op) and this calls through the dispatcher, on CUDA tensors or, under
// Triton's interpreter, CPU ones. Refuses, naming `op`, where the op is not registered.
std::tuple<at::Tensor, at::Tensor> triton_leaf_norms(const HeadsLeafOperands& ops, const char* op);

// path_chunk_norms' leaf_kernel "heads_" + a variant's name ("heads_tf32x3", "heads_tf32x3_128",
// "heads_tf32", "heads_tf32_128"): leaf levels at which every head takes the same parents go
// through the heads leaf kernel in one call (engine.h), any other leaf block through the per-head
// tensor-core kernel of the same precision, `per_head` ("tf32x3" or "tf32"). "triton_tf32x3" and
// "triton_tf32": the same levels through the Triton kernel of that precision (`triton_precision`).
struct EngineHeadsKernel {
  heads_leaf::Variant variant;
  const char* per_head;
  const char* triton_precision = nullptr;
};

// `leaf_kernel` as an EngineHeadsKernel; nullopt for a name without the "heads_" prefix. Refuses
// unknown variants and dtypes other than float32, naming `op` and its argument `leaf_kernel`.
std::optional<EngineHeadsKernel> engine_heads_kernel(c10::string_view leaf_kernel, at::ScalarType dtype,
                                                     const char* op);

}  // namespace pathkernels
