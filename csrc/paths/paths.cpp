#include "paths/paths.h"

#include "common/checks.h"

namespace pathkernels {

PathChunk check_path_chunk(const at::Tensor& attn, const at::Tensor& attn_mean, const at::Tensor& root,
                           const at::Tensor& root_mean, const std::optional<at::Tensor>& w_v,
                           const std::optional<at::Tensor>& w_o, at::TensorList parents, at::TensorList heads,
                           int64_t leaf_block) {
  constexpr const char* op = "pathkernels.path_chunk_norms";
  TORCH_CHECK_VALUE(attn.dim() == 5, op, ": expected attn [B, L, H, n, n], got shape ", attn.sizes());
  const int64_t batch = attn.size(0), layers = attn.size(1), num_heads = attn.size(2), n = attn.size(3);
  TORCH_CHECK_VALUE(attn.size(4) == n, op, ": expected square attention [B, L, H, n, n], got ", attn.sizes());
  TORCH_CHECK_TYPE(attn.scalar_type() == at::kFloat || attn.scalar_type() == at::kDouble, op,
                   ": expected attn to be float32 or float64, got ", attn.scalar_type());
  TORCH_CHECK_VALUE(attn_mean.sizes() == at::IntArrayRef({batch, layers, num_heads, n}), op,
                    ": expected attn_mean [B, L, H, n] = ", at::IntArrayRef({batch, layers, num_heads, n}),
                    ", got ", attn_mean.sizes());
  TORCH_CHECK_VALUE(root.dim() == 3 && root.size(0) == batch && root.size(1) == n, op,
                    ": expected root [B, n, m] with B = ", batch, " and n = ", n, ", got ", root.sizes());
  const int64_t m = root.size(2);
  TORCH_CHECK_VALUE(root_mean.sizes() == at::IntArrayRef({batch, m}), op, ": expected root_mean [B, m] = ",
                    at::IntArrayRef({batch, m}), ", got ", root_mean.sizes());
  for (const at::Tensor* t : {&attn_mean, &root, &root_mean}) {
    TORCH_CHECK_TYPE(t->scalar_type() == attn.scalar_type(), op, ": expected every input in ", attn.scalar_type(),
                     ", got ", t->scalar_type());
    check_same_device(*t, attn, op, "every input", "attn");
  }
  TORCH_CHECK_VALUE(w_v.has_value() == w_o.has_value(), op, ": expected both w_v and w_o, or neither");
  if (w_v.has_value()) {
    const int64_t d_head = w_v->size(-1);
    TORCH_CHECK_VALUE(w_v->sizes() == at::IntArrayRef({layers, num_heads, m, d_head}), op,
                      ": expected w_v [L, H, d, d_head] with L, H, d = ", layers, ", ", num_heads, ", ", m, ", got ",
                      w_v->sizes());
    TORCH_CHECK_VALUE(w_o->sizes() == at::IntArrayRef({layers, num_heads, d_head, m}), op,
                      ": expected w_o [L, H, d_head, d] = ", at::IntArrayRef({layers, num_heads, d_head, m}),
                      ", got ", w_o->sizes());
    TORCH_CHECK_TYPE(w_v->scalar_type() == attn.scalar_type() && w_o->scalar_type() == attn.scalar_type(), op,
                     ": expected w_v and w_o in ", attn.scalar_type());
  } else {
    TORCH_CHECK_VALUE(m == n, op, ": without w_v and w_o the root must be [B, n, n], got ", root.sizes());
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(parents.size()) == layers && static_cast<int64_t>(heads.size()) == layers,
                    op, ": expected ", layers, " levels of parents and heads, got ", parents.size(), " and ",
                    heads.size());
  TORCH_CHECK_VALUE(leaf_block > 0, op, ": expected leaf_block > 0, got ", leaf_block);

  PathChunk chunk;
  int64_t previous = 1;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor parent = parents[l].to(at::kCPU, at::kLong).contiguous();
    at::Tensor head = heads[l].to(at::kCPU, at::kLong).contiguous();
    TORCH_CHECK_VALUE(parent.dim() == 1 && head.sizes() == parent.sizes(), op, ": level ", l + 1,
                      ": expected parents and heads of one shape [N], got ", parent.sizes(), " and ", head.sizes());
    if (parent.numel() > 0) {
      TORCH_CHECK_VALUE(parent.min().item<int64_t>() >= 0 && parent.max().item<int64_t>() < previous, op,
                        ": level ", l + 1, ": parent positions must lie in [0, ", previous, ")");
      TORCH_CHECK_VALUE(head.min().item<int64_t>() >= -1 && head.max().item<int64_t>() < num_heads, op, ": level ",
                        l + 1, ": heads must lie in [-1, ", num_heads, ")");
      TORCH_CHECK_VALUE(parent.numel() == 1 || (head.diff() >= 0).all().item<bool>(), op, ": level ", l + 1,
                        ": nodes must be sorted by head");
    }
    previous = parent.numel();
    chunk.parents.push_back(parent);
    chunk.heads.push_back(head);
  }
  return chunk;
}

}  // namespace pathkernels
