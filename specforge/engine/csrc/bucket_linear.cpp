// A linear layer over a few rows through MKL's weight packed for a fixed row count: the op
// compiled graphs call for float32 calls of 2-16 rows on a CPU (specforge/engine/row_buckets.py).
// Built with decode_attention.cpp into one module by specforge/engine/decode_kernel.py.
//
// MKL's packed product reads a weight once when called with exactly the rows it was packed
// for, where PyTorch's default product repacks the weight on every call of 4 or more rows.
// The rows are padded with zeros to the smallest bucket that holds them; a row's result does
// not depend on the rows beside it. Calls of at most default_rows rows (where the default reads
// the weight once too) or of more rows than the larger bucket take PyTorch's default. An op of its own, registered in C++, because a graph calls it once
// per linear layer and a Python kernel cost ~0.1 ms a call.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <vector>

namespace {

using MklLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, int64_t);

at::Tensor bucket_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, int64_t default_rows,
                         const at::Tensor& packed_small, int64_t small_rows,
                         const at::Tensor& packed_large, int64_t large_rows) {
  static const auto mkl_linear = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("mkl::_mkl_linear", "")
                                     .typed<MklLinear>();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "bucket_linear: x has ",
              x.size(-1), " features, the weight takes ", weight.size(1));
  TORCH_CHECK(0 <= default_rows && default_rows < small_rows && small_rows < large_rows,
              "bucket_linear: rows must grow, got ", default_rows, ", ", small_rows, " and ",
              large_rows);
  const int64_t features = x.size(-1);
  const int64_t rows = features ? x.numel() / features : 0;
  if (rows <= default_rows || rows > large_rows) return at::linear(x, weight, bias);
  const bool small = rows <= small_rows;
  const int64_t bucket = small ? small_rows : large_rows;
  at::Tensor padded = at::zeros({bucket, features}, x.options());
  padded.narrow(0, 0, rows).copy_(x.reshape({rows, features}));
  at::Tensor out = mkl_linear.call(padded, small ? packed_small : packed_large, weight, bias,
                                   bucket);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return out.narrow(0, 0, rows).reshape(sizes);
}

}  // namespace

// Defines and implements specforge::bucket_linear once per process, when called (not when the
// module loads: a process that loads a second build of the module, as the build tests do, must
// not register the op twice, which aborts). Every backend: the packed weights are MKL tensors,
// which dispatch as MkldnnCPU.
void register_bucket_linear() {
  static std::unique_ptr<torch::Library> definition, implementation;
  if (c10::Dispatcher::singleton().findSchema({"specforge::bucket_linear", ""}).has_value()) {
    return;
  }
  definition = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "specforge",
                                                std::nullopt, __FILE__, __LINE__);
  definition->def(
      "bucket_linear(Tensor x, Tensor weight, Tensor? bias, int default_rows, "
      "Tensor packed_small, int small_rows, Tensor packed_large, int large_rows) -> Tensor");
  implementation = std::make_unique<torch::Library>(
      torch::Library::IMPL, "specforge", c10::DispatchKey::CompositeExplicitAutograd, __FILE__,
      __LINE__);
  implementation->impl("bucket_linear", &bucket_linear);
}
