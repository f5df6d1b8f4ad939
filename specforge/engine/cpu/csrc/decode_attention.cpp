// Decode attention on CPU with AVX-512: one query position per row, grouped-query heads, the
// keys/values read in place from (B, H_kv, S, D) buffer views, a boolean mask per row.
// Built on first use by specforge/engine/decode_kernel.py (torch.utils.cpp_extension).
//
// Only the kernel below is compiled for AVX-512 (a target pragma around it), so the module
// imports on any x86-64 CPU; the entry point checks every shape relation and the CPU before it
// calls into AVX-512 code, so a bad call is an error, never a read out of bounds or a crash.
//
// Per (row, key head), in float32: the group's G query heads against every unmasked key (each
// key row converted once), a softmax, then the values weighted in (each value row converted
// once). PyTorch's CPU flash kernel runs this shape as many tiny GEMMs; here it is bound by the
// memory it reads.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,fma")

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> f32 is a 16-bit shift
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

inline void store16(c10::BFloat16* p, __m512 x) {  // round to nearest even, as c10 does
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, x);
  for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(tmp[i]);
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 (Cephes' expf polynomial, ~1e-7 relative)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// softmax in place over row[0:n] (row has room for n rounded up to 16); returns 1 / sum, or 0
// for a row with no key (its output is zeros)
inline float softmax_row(float* row, int64_t n) {
  if (n == 0) return 0.f;
  const float low = -std::numeric_limits<float>::infinity();
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t i = n; i < padded; ++i) row[i] = low;
  __m512 best = _mm512_set1_ps(low);
  for (int64_t i = 0; i < padded; i += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(row + i));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < padded; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), top));
    _mm512_storeu_ps(row + i, e);
    total = _mm512_add_ps(total, e);
  }
  return 1.f / _mm512_reduce_add_ps(total);
}

// G query heads per key head, D = 16 * J
template <typename T, int G, int J>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
            float scale, at::Tensor& out) {
  constexpr int D = 16 * J;
  const int64_t heads = q.size(1), S = k.size(2);
  const int64_t width = (S + 15) / 16 * 16;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, q.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * width);
    std::vector<int64_t> live(S);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const T* keys = kp + b * k.stride(0) + h * k.stride(1);
      const T* values = vp + b * v.stride(0) + h * v.stride(1);
      const bool* m = mp + b * mask.stride(0);
      int64_t n = 0;
      for (int64_t s = 0; s < S; ++s)
        if (m[s * mask.stride(1)]) live[n++] = s;
      __m512 query[G][J];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < J; ++j)
          query[g][j] = _mm512_mul_ps(load16(qp + (bh * G + g) * D + 16 * j), _mm512_set1_ps(scale));
      for (int64_t i = 0; i < n; ++i) {
        const T* key = keys + live[i] * k.stride(2);
        __m512 row[J];
        for (int j = 0; j < J; ++j) row[j] = load16(key + 16 * j);
        for (int g = 0; g < G; ++g) {
          __m512 dot = _mm512_mul_ps(query[g][0], row[0]);
          for (int j = 1; j < J; ++j) dot = _mm512_fmadd_ps(query[g][j], row[j], dot);
          scores[g * width + i] = _mm512_reduce_add_ps(dot);
        }
      }
      float norm[G];
      for (int g = 0; g < G; ++g) norm[g] = softmax_row(scores.data() + g * width, n);
      __m512 acc[G][J];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < J; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        const T* value = values + live[i] * v.stride(2);
        __m512 row[J];
        for (int j = 0; j < J; ++j) row[j] = load16(value + 16 * j);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * width + i]);
          for (int j = 0; j < J; ++j) acc[g][j] = _mm512_fmadd_ps(p, row[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < J; ++j)
          store16(op + (bh * G + g) * D + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(norm[g])));
    }
  });
}

template <typename T, int J>
void attend_group(int64_t group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& mask, float scale, at::Tensor& out) {
  switch (group) {
    case 1: return attend<T, 1, J>(q, k, v, mask, scale, out);
    case 2: return attend<T, 2, J>(q, k, v, mask, scale, out);
    case 3: return attend<T, 3, J>(q, k, v, mask, scale, out);
    case 4: return attend<T, 4, J>(q, k, v, mask, scale, out);
    case 5: return attend<T, 5, J>(q, k, v, mask, scale, out);
    case 6: return attend<T, 6, J>(q, k, v, mask, scale, out);
    case 7: return attend<T, 7, J>(q, k, v, mask, scale, out);
    case 8: return attend<T, 8, J>(q, k, v, mask, scale, out);
  }
  TORCH_CHECK(false, "decode_attention: ", group, " query heads per key head (1-8 supported)");
}

template <typename T>
void attend_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& mask, float scale, at::Tensor& out) {
  const int64_t dim = q.size(3), group = q.size(2);
  if (dim == 64) return attend_group<T, 4>(group, q, k, v, mask, scale, out);
  if (dim == 128) return attend_group<T, 8>(group, q, k, v, mask, scale, out);
  TORCH_CHECK(false, "decode_attention: head size ", dim, " (64 or 128 supported)");
}

}  // namespace

#pragma GCC pop_options

namespace {

// Every relation the kernel's indexing relies on, checked before any AVX-512 code runs.
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 2,
              "decode_attention: q, k, v of 4 dimensions and a mask of 2, got ", q.dim(), ", ",
              k.dim(), ", ", v.dim(), " and ", mask.dim());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
                  mask.device().is_cpu(),
              "decode_attention: every tensor on the CPU");
  const int64_t rows = q.size(0), kv_heads = q.size(1), group = q.size(2), dim = q.size(3);
  TORCH_CHECK(k.size(0) == rows && v.size(0) == rows && mask.size(0) == rows,
              "decode_attention: q has ", rows, " rows, k ", k.size(0), ", v ", v.size(0),
              ", the mask ", mask.size(0));
  TORCH_CHECK(k.size(1) == kv_heads && v.size(1) == kv_heads, "decode_attention: q has ",
              kv_heads, " key heads, k ", k.size(1), ", v ", v.size(1));
  TORCH_CHECK(k.size(3) == dim && v.size(3) == dim, "decode_attention: q's head size is ", dim,
              ", k's ", k.size(3), ", v's ", v.size(3));
  TORCH_CHECK(v.size(2) == k.size(2) && mask.size(1) == k.size(2), "decode_attention: k has ",
              k.size(2), " positions, v ", v.size(2), ", the mask ", mask.size(1));
  TORCH_CHECK(dim == 64 || dim == 128, "decode_attention: head size ", dim,
              " (64 or 128 supported)");
  TORCH_CHECK(group >= 1 && group <= 8, "decode_attention: ", group,
              " query heads per key head (1-8 supported)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: keys/values need unit stride along D");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "decode_attention: a boolean mask");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode_attention: q, k, v of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "decode_attention: float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"),
              "decode_attention: this CPU has no AVX-512F");
}

}  // namespace

// q (B, H_kv, G, D); k, v (B, H_kv, S, D) with unit stride along D; mask (B, S) bool, True where
// a row attends. Returns (B, H_kv, G, D) in q's dtype.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, double scale) {
  check_inputs(query, k, v, mask);
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) attend_dim<c10::BFloat16>(q, k, v, mask, s, out);
  else if (q.scalar_type() == at::kFloat) attend_dim<float>(q, k, v, mask, s, out);
  else TORCH_CHECK(false, "decode_attention: float32 or bfloat16, got ", q.scalar_type());
  return out;
}

void register_bucket_linear();  // bucket_linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "grouped-query decode attention (AVX-512)");
  m.def("register_bucket_linear", &register_bucket_linear,
        "define specforge::bucket_linear, once per process");
}
