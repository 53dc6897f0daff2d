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
  const ValuesShape s = check_values(rho, phi, source);
  const at::Tensor rows = at::mm(rho.reshape({-1, s.tokens}), source).view({s.nodes, s.positions, s.features});
  return at::bmm(rows, phi.transpose(1, 2));
}

std::tuple<at::Tensor, at::Tensor> heads_aten(const at::Tensor& rho, const at::Tensor& phi,
                                              const at::Tensor& token_maps, const at::Tensor& feature_in,
                                              const std::optional<at::Tensor>& feature_out) {
  const HeadsShape s = check_heads(rho, phi, token_maps, feature_in, feature_out);
  // Every head in one GEMM against the heads' maps side by side ([n, H·n] and [d, H·e]), never a
  // broadcast batch (which would copy the nodes once per head), then head-major.
  const at::Tensor maps_side_by_side = token_maps.permute({1, 0, 2}).reshape({s.tokens, s.heads * s.tokens});
  at::Tensor rho_heads = at::mm(rho.reshape({-1, s.tokens}), maps_side_by_side)
                             .view({s.nodes, s.positions, s.heads, s.tokens})
                             .permute({2, 0, 1, 3});
  const at::Tensor in_side_by_side = feature_in.permute({1, 0, 2}).reshape({s.features, s.heads * s.head_dim});
  at::Tensor phi_heads = at::mm(phi.reshape({-1, s.features}), in_side_by_side)
                             .view({s.nodes * s.readouts, s.heads, s.head_dim})
                             .transpose(0, 1);  // [H, N·R, e]
  if (feature_out.has_value()) {
    phi_heads = at::bmm(phi_heads, *feature_out);  // [H, N·R, d']
  }
  return {rho_heads.contiguous(), phi_heads.reshape({s.heads, s.nodes, s.readouts, s.out_features}).contiguous()};
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CompositeExplicitAutograd, m) {
  m.impl("_readout_values", &values_aten);
  m.impl("_readout_heads", &heads_aten);
}

}  // namespace pathkernels::readout
