// A linear layer over a few rows through a weight packed once, by the kernel measured fastest
// for that many rows: the op compiled graphs call for float32 linears on a CPU
// (specforge/engine/row_buckets.py). Built with decode_attention.cpp into one module by
// specforge/engine/decode_kernel.py.
//
// Inside a compiled graph PyTorch's default product (MKL's sgemm) repacks the weight on every
// call of 4 or more rows on some CPUs, and on others reads it at half the memory bandwidth of
// oneDNN's product over a weight reordered once. `plan[min(rows, plan.size() - 1)]` names the
// kernel for a call of `rows` rows:
//   0: PyTorch's default product;
//   1: MKL's product over the weight packed for a fixed row count, the rows padded with zeros to
//      the smallest bucket that holds them (small_rows or large_rows);
//   2: oneDNN's product over the reordered weight (`onednn`); a one-row call runs as two rows
//      where pad_one_row says oneDNN's one-row kernel rounds otherwise, so a token gets the
//      bits alone that it gets beside others.
// A row's result never depends on the rows beside it in the call. An op of its own, registered
// in C++, because a graph calls it once per linear layer and a Python kernel cost ~0.1 ms a
// call.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace {

using MklLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, int64_t);
using OnednnLinear = at::Tensor(const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, std::string_view,
                                c10::List<std::optional<c10::Scalar>>,
                                std::optional<std::string_view>);

constexpr int64_t kDefault = 0, kMklBucket = 1, kOnednn = 2;

at::Tensor mkl_bucket(const at::Tensor& x2d, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& packed_small,
                      int64_t small_rows, const at::Tensor& packed_large, int64_t large_rows) {
  static const auto mkl_linear = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("mkl::_mkl_linear", "")
                                     .typed<MklLinear>();
  const int64_t rows = x2d.size(0);
  TORCH_CHECK(rows <= large_rows, "bucket_linear: ", rows, " rows exceed the largest bucket (",
              large_rows, ")");
  TORCH_CHECK(packed_small.defined() && packed_large.defined(),
              "bucket_linear: the plan names MKL buckets the layer was not given");
  const bool small = rows <= small_rows;
  const int64_t bucket = small ? small_rows : large_rows;
  at::Tensor padded = at::zeros({bucket, x2d.size(1)}, x2d.options());
  padded.narrow(0, 0, rows).copy_(x2d);
  at::Tensor out = mkl_linear.call(padded, small ? packed_small : packed_large, weight, bias,
                                   bucket);
  return out.narrow(0, 0, rows);
}

at::Tensor onednn(const at::Tensor& x2d, const std::optional<at::Tensor>& bias,
                  const at::Tensor& packed, bool pad_one_row) {
  static const auto linear = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                                 .typed<OnednnLinear>();
  TORCH_CHECK(packed.defined(), "bucket_linear: the plan names oneDNN's kernel the layer was "
                                "not given");
  const bool twice = pad_one_row && x2d.size(0) == 1;
  const at::Tensor input = twice ? x2d.expand({2, x2d.size(1)}).contiguous() : x2d.contiguous();
  at::Tensor out = linear.call(input, packed, bias, "none",
                               c10::List<std::optional<c10::Scalar>>(), std::nullopt);
  return twice ? out.narrow(0, 0, 1) : out;
}

at::Tensor bucket_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, at::IntArrayRef plan,
                         const std::optional<at::Tensor>& packed_onednn, bool pad_one_row,
                         const std::optional<at::Tensor>& packed_small, int64_t small_rows,
                         const std::optional<at::Tensor>& packed_large, int64_t large_rows) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "bucket_linear: x has ",
              x.size(-1), " features, the weight takes ", weight.size(1));
  TORCH_CHECK(plan.size() >= 2, "bucket_linear: the plan needs a kernel for 1 row and more");
  TORCH_CHECK(0 < small_rows && small_rows < large_rows, "bucket_linear: buckets must grow, got ",
              small_rows, " and ", large_rows);
  const int64_t features = x.size(-1);
  const int64_t rows = features ? x.numel() / features : 0;
  const int64_t kernel = plan[std::min<int64_t>(rows, plan.size() - 1)];
  if (rows == 0 || kernel == kDefault) return at::linear(x, weight, bias);
  const at::Tensor x2d = x.reshape({rows, features});
  at::Tensor out;
  if (kernel == kMklBucket) {
    out = mkl_bucket(x2d, weight, bias, packed_small.value_or(at::Tensor()), small_rows,
                     packed_large.value_or(at::Tensor()), large_rows);
  } else {
    TORCH_CHECK(kernel == kOnednn, "bucket_linear: unknown kernel ", kernel, " in the plan");
    out = onednn(x2d, bias, packed_onednn.value_or(at::Tensor()), pad_one_row);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return out.reshape(sizes);
}

}  // namespace

// Defines and implements specforge::bucket_linear once per process, when called (not when the
// module loads: a process that loads a second build of the module, as the build tests do, must
// not register the op twice, which aborts). Every backend: the packed weights are MKL and
// oneDNN tensors, which dispatch as MkldnnCPU.
void register_bucket_linear() {
  static std::unique_ptr<torch::Library> definition, implementation;
  if (c10::Dispatcher::singleton().findSchema({"specforge::bucket_linear", ""}).has_value()) {
    return;
  }
  definition = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "specforge",
                                                std::nullopt, __FILE__, __LINE__);
  definition->def(
      "bucket_linear(Tensor x, Tensor weight, Tensor? bias, int[] plan, Tensor? packed_onednn, "
      "bool pad_one_row, Tensor? packed_small, int small_rows, Tensor? packed_large, "
      "int large_rows) -> Tensor");
  implementation = std::make_unique<torch::Library>(
      torch::Library::IMPL, "specforge", c10::DispatchKey::CompositeExplicitAutograd, __FILE__,
      __LINE__);
  implementation->impl("bucket_linear", &bucket_linear);
}
