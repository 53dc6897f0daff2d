// Input checks shared by every backend. Messages start with the public op name and say what was
// expected and what was got; TORCH_CHECK_VALUE / TORCH_CHECK_TYPE surface in Python as
// ValueError / TypeError.
#pragma once

#include <ATen/ATen.h>

#include <cstdio>
#include <string>

namespace pathkernels {

// Messages are built from strings only: integers through std::to_string, shapes through
// shape_string, dtypes through dtype_name (docs/DESIGN.md §6 says why). "[2, 0, 3]":
inline std::string shape_string(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return out + "]";
}

// A floating-point value as Python's repr writes it, shortest round trip aside: 17 significant
// digits, "nan", "inf". (Streamed into a message it would take the path that crashed.)
inline std::string number_string(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.17g", value);
  return buffer;
}

// A dtype as Python writes it ("torch.float32"), so that the ops' messages read like the wrappers'.
inline std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(dtype);
  }
}

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

inline void check_floating(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), op, ": expected ", arg,
                   " to be a floating-point tensor (float32, float64, float16 or bfloat16), got ",
                   dtype_name(t.scalar_type()));
}

inline void check_min_dim(const at::Tensor& t, int64_t min_dim, const char* op, const char* arg,
                          const char* layout) {
  TORCH_CHECK_VALUE(t.dim() >= min_dim, op, ": expected ", arg, " to have at least ",
                    std::to_string(min_dim), " dimensions ", layout, ", got ", std::to_string(t.dim()), " (shape ",
                    shape_string(t.sizes()), ")");
}

// Every entry of the integer tensor `index` in [low, high): op inputs that index into another tensor
// are checked before a kernel reads through them. One min/max reduction (a host sync on CUDA); the
// callers pass small tensors (one entry per matrix).
inline void check_index_range(const at::Tensor& index, int64_t low, int64_t high, const char* op, const char* arg) {
  if (index.numel() == 0) {
    return;
  }
  const auto [smallest, largest] = at::aminmax(index);
  const int64_t lo = smallest.item<int64_t>(), hi = largest.item<int64_t>();
  TORCH_CHECK_INDEX(lo >= low && hi < high, op, ": expected every entry of ", arg, " in [", std::to_string(low), ", ",
                    std::to_string(high), "), got entries from ", std::to_string(lo), " to ", std::to_string(hi));
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const char* arg_a, const char* arg_b) {
  TORCH_CHECK_VALUE(a.device() == b.device(), op, ": expected ", arg_a, " and ", arg_b,
                    " on the same device, got ", a.device(), " and ", b.device());
}

}  // namespace pathkernels
