// Checks of the readout ops and their ATen form, which runs on every device without a kernel of
// its own (CUDA through cuBLAS, meta for shapes); readout_cpu.cpp overrides it on the CPU.
#include "readout/readout.h"

#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/checks.h"

namespace pathkernels::readout {
namespace {

void check_float64(const at::Tensor& t, const at::Tensor& rho, const char* op, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kDouble, op, ": expected ", name, " in torch.float64, got ",
                   dtype_name(t.scalar_type()));
  check_same_device(t, rho, op, name, "rho");
}

void check_nodes(const at::Tensor& rho, const at::Tensor& phi, const char* op) {
  TORCH_CHECK_VALUE(rho.dim() == 3, op, ": expected rho [N, P, n], got shape ", shape_string(rho.sizes()));
  TORCH_CHECK_VALUE(phi.dim() == 3 && phi.size(0) == rho.size(0), op, ": expected phi [N, R, d] with N = ",
                    std::to_string(rho.size(0)), " (rho's), got shape ", shape_string(phi.sizes()));
  check_float64(rho, rho, op, "rho");
  check_float64(phi, rho, op, "phi");
}

}  // namespace

ValuesShape check_values(const at::Tensor& rho, const at::Tensor& phi, const at::Tensor& source) {
  constexpr const char* op = "pathkernels._readout_values";
  check_nodes(rho, phi, op);
  const std::vector<int64_t> source_shape{rho.size(2), phi.size(2)};
  TORCH_CHECK_VALUE(source.sizes() == at::IntArrayRef(source_shape), op, ": expected source [n, d] = ",
                    shape_string(source_shape), ", got ", shape_string(source.sizes()));
  check_float64(source, rho, op, "source");
  return {rho.size(0), rho.size(1), phi.size(1), rho.size(2), phi.size(2)};
}

HeadsShape check_heads(const at::Tensor& rho, const at::Tensor& phi, const at::Tensor& token_maps,
                       const at::Tensor& feature_in, const std::optional<at::Tensor>& feature_out) {
  constexpr const char* op = "pathkernels._readout_heads";
  check_nodes(rho, phi, op);
  const int64_t n = rho.size(2), d = phi.size(2);
  TORCH_CHECK_VALUE(token_maps.dim() == 3 && token_maps.size(1) == n && token_maps.size(2) == n, op,
                    ": expected token_maps [H, n, n] with n = ", std::to_string(n), ", got shape ",
                    shape_string(token_maps.sizes()));
  const int64_t heads = token_maps.size(0);
  TORCH_CHECK_VALUE(feature_in.dim() == 3 && feature_in.size(0) == heads && feature_in.size(1) == d, op,
                    ": expected feature_in [H, d, e] with H = ", std::to_string(heads), " and d = ", std::to_string(d),
                    ", got shape ", shape_string(feature_in.sizes()));
  const int64_t e = feature_in.size(2);
  int64_t out_features = e;
  if (feature_out.has_value()) {
    TORCH_CHECK_VALUE(feature_out->dim() == 3 && feature_out->size(0) == heads && feature_out->size(1) == e, op,
                      ": expected feature_out [H, e, d'] with H = ", std::to_string(heads), " and e = ",
                      std::to_string(e), ", got shape ", shape_string(feature_out->sizes()));
    check_float64(*feature_out, rho, op, "feature_out");
    out_features = feature_out->size(2);
  }
  check_float64(token_maps, rho, op, "token_maps");
  check_float64(feature_in, rho, op, "feature_in");
  return {rho.size(0), rho.size(1), phi.size(1), n, d, heads, e, out_features};
}

namespace {

at::Tensor values_aten(const at::Tensor& rho, const at::Tensor& phi, const at::Tensor& source) {
  check_values(rho, phi, source);
  return at::bmm(at::matmul(rho, source), phi.transpose(1, 2));
}

std::tuple<at::Tensor, at::Tensor> heads_aten(const at::Tensor& rho, const at::Tensor& phi,
                                              const at::Tensor& token_maps, const at::Tensor& feature_in,
                                              const std::optional<at::Tensor>& feature_out) {
  check_heads(rho, phi, token_maps, feature_in, feature_out);
  at::Tensor rho_heads = at::matmul(rho.unsqueeze(0), token_maps.unsqueeze(1));  // [H, N, P, n]
  at::Tensor phi_heads = at::matmul(phi.unsqueeze(0), feature_in.unsqueeze(1));  // [H, N, R, e]
  if (feature_out.has_value()) {
    phi_heads = at::matmul(phi_heads, feature_out->unsqueeze(1));
  }
  return {rho_heads.contiguous(), phi_heads.contiguous()};
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CompositeExplicitAutograd, m) {
  m.impl("_readout_values", &values_aten);
  m.impl("_readout_heads", &heads_aten);
}

}  // namespace pathkernels::readout
