// The oneDNN-packed linear (mkldnn::_linear_pointwise) as an op registered from C++, for the
// compiled step: a Python custom op around it costs ~12 us per call in the dispatcher and the
// interpreter (49 linears a step on a 12-layer model), this one a boxed call. Same math, same
// packed weight (torch.ops.mkldnn._reorder_linear_weight), no copy.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <optional>
#include <string>

namespace {

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(stack);
  at::Tensor out = stack.back().toTensor();
  TORCH_CHECK(out.size(-1) == out_features, "onednn_linear: the packed weight has ",
              out.size(-1), " outputs, the layer ", out_features);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pd_cluster_cpu, m) {
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  // The packed weight is an opaque oneDNN tensor: its dispatch key is MkldnnCPU.
  m.impl("onednn_linear", c10::DispatchKey::CPU, &onednn_linear);
  m.impl("onednn_linear", c10::DispatchKey::MkldnnCPU, &onednn_linear);
}
