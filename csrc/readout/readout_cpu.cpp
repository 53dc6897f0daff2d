// The readout ops on the CPU (readout.h): blocks of nodes, each product by the engine's GEMM and
// dot, whose every element is one fixed chain whatever the block, so the bits do not depend on
// how many nodes a call holds or which thread computes them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "paths/gemm_cpu.h"
#include "readout/readout.h"

namespace pathkernels::readout {
namespace {

// Nodes per task: enough rows for the GEMM's tiles, few enough that a block of phi stays in L2
// (128 nodes of one readout at d = 768 are 768 KiB).
constexpr int64_t kBlockNodes = 128;

at::Tensor values_cpu(const at::Tensor& rho_in, const at::Tensor& phi_in, const at::Tensor& source_in) {
  const ValuesShape s = check_values(rho_in, phi_in, source_in);
  const at::Tensor rho = rho_in.contiguous(), phi = phi_in.contiguous(), source = source_in.contiguous();
  at::Tensor values = at::empty({s.nodes, s.positions, s.readouts}, rho.options());
  const double* rho_data = rho.const_data_ptr<double>();
  const double* phi_data = phi.const_data_ptr<double>();
  const double* source_data = source.const_data_ptr<double>();
  double* out = values.mutable_data_ptr<double>();
  const int64_t blocks = (s.nodes + kBlockNodes - 1) / kBlockNodes;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<double> rows;  // rho K of a block: [nodes · P, d]
    for (int64_t block = first; block < last; ++block) {
      const int64_t begin = block * kBlockNodes, count = std::min(kBlockNodes, s.nodes - begin);
      rows.resize(static_cast<size_t>(count * s.positions * s.features));
      cpu::gemm<double>(count * s.positions, s.features, s.tokens, rho_data + begin * s.positions * s.tokens, s.tokens,
                        source_data, s.features, rows.data(), s.features, false);
      for (int64_t i = 0; i < count; ++i) {
        const double* phi_node = phi_data + (begin + i) * s.readouts * s.features;
        for (int64_t p = 0; p < s.positions; ++p) {
          const double* row = rows.data() + (i * s.positions + p) * s.features;
          double* value = out + ((begin + i) * s.positions + p) * s.readouts;
          for (int64_t r = 0; r < s.readouts; ++r) {
            value[r] = cpu::dot<double>(s.features, row, phi_node + r * s.features);
          }
        }
      }
    }
  });
  return values;
}

std::tuple<at::Tensor, at::Tensor> heads_cpu(const at::Tensor& rho_in, const at::Tensor& phi_in,
                                             const at::Tensor& token_maps_in, const at::Tensor& feature_in_in,
                                             const std::optional<at::Tensor>& feature_out_in) {
  const HeadsShape s = check_heads(rho_in, phi_in, token_maps_in, feature_in_in, feature_out_in);
  const at::Tensor rho = rho_in.contiguous(), phi = phi_in.contiguous();
  const at::Tensor token_maps = token_maps_in.contiguous(), feature_in = feature_in_in.contiguous();
  const at::Tensor feature_out = feature_out_in.has_value() ? feature_out_in->contiguous() : at::Tensor();
  at::Tensor rho_heads = at::empty({s.heads, s.nodes, s.positions, s.tokens}, rho.options());
  at::Tensor phi_heads = at::empty({s.heads, s.nodes, s.readouts, s.out_features}, rho.options());
  const double* rho_data = rho.const_data_ptr<double>();
  const double* phi_data = phi.const_data_ptr<double>();
  const double* maps = token_maps.const_data_ptr<double>();
  const double* f_in = feature_in.const_data_ptr<double>();
  const double* f_out = feature_out.defined() ? feature_out.const_data_ptr<double>() : nullptr;
  double* rho_out = rho_heads.mutable_data_ptr<double>();
  double* phi_out = phi_heads.mutable_data_ptr<double>();
  const int64_t n = s.tokens, d = s.features, e = s.head_dim, P = s.positions, R = s.readouts;
  const int64_t d_out = s.out_features;
  const int64_t blocks = (s.nodes + kBlockNodes - 1) / kBlockNodes;
  // One task per (head, block of nodes): the head's children of those nodes, written where the
  // [H, N, ...] outputs keep them, so that a head's children are one contiguous run.
  at::parallel_for(0, s.heads * blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<double> narrow;  // phi F_in of a block: [nodes · R, e]
    for (int64_t task = first; task < last; ++task) {
      const int64_t head = task / blocks, begin = (task % blocks) * kBlockNodes;
      const int64_t count = std::min(kBlockNodes, s.nodes - begin);
      const int64_t child = head * s.nodes + begin;
      cpu::gemm<double>(count * P, n, n, rho_data + begin * P * n, n, maps + head * n * n, n, rho_out + child * P * n,
                        n, false);
      const double* phi_block = phi_data + begin * R * d;
      if (!feature_out.defined()) {  // (an empty feature_out, e = 0, has a null data pointer too)
        cpu::gemm<double>(count * R, e, d, phi_block, d, f_in + head * d * e, e, phi_out + child * R * e, e, false);
        continue;
      }
      narrow.resize(static_cast<size_t>(count * R * e));
      cpu::gemm<double>(count * R, e, d, phi_block, d, f_in + head * d * e, e, narrow.data(), e, false);
      cpu::gemm<double>(count * R, d_out, e, narrow.data(), e, f_out + head * e * d_out, d_out,
                        phi_out + child * R * d_out, d_out, false);
    }
  });
  return {rho_heads, phi_heads};
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("_readout_values", &values_cpu);
  m.impl("_readout_heads", &heads_cpu);
}

}  // namespace pathkernels::readout
