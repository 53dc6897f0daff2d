// The dtypes every op accepts: float32 and float64, float16 and bfloat16 (float32 accumulation).
#pragma once

#include <ATen/Dispatch.h>

#define PATHKERNELS_DISPATCH_FLOATING(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, __VA_ARGS__)
