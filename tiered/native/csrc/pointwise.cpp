// The decoder layer's row-wise steps in one pass each, for CPU tensors of float32 or bfloat16:
//
//   rms_norm(x [n, D], w [D], eps) -> w * cast(x32 * rsqrt(mean(x32^2) + eps))   (HF's Llama order)
//   silu_mul_(g [n, F], u [n, F]): g = cast(silu(g)) * u                          (F.silu_ then mul_)
//
// PyTorch computes each as a chain of ops, every one a pass over memory and most a fresh
// allocation; here a row is read once and written once, on ATen's threads. The rounding steps
// are PyTorch's: bf16 values are widened to fp32, every intermediate the PyTorch chain stores in
// bf16 is rounded to nearest-even here too, so outputs match it up to the fp32 sum's order and
// the exp's last bits. The row loops are plain C++ for the compiler to vectorize; target_clones
// builds an AVX-512, an AVX2 and a portable copy, and the loader picks the one this CPU runs.
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TIERED_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TIERED_CLONES
#endif

namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  uint32_t u = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp32 -> bf16 rounded to nearest-even, NaN kept a quiet NaN (c10::BFloat16's rule, branch-free).
inline c10::BFloat16 narrow_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  return out;
}

// What the PyTorch chain stores between its ops: fp32 values stay, bf16 ones are rounded.
inline float through(float v, float*) { return v; }
inline float through(float v, c10::BFloat16*) { return widen(narrow_bf16(v)); }
inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = narrow_bf16(v); }

// e^x as PyTorch's vectorized exp gives it to fp32 precision: x = k ln2 + r, |r| <= ln2 / 2, e^r
// by a degree-6 polynomial (relative error ~2e-7), 2^k put in the exponent bits; inf above
// 88.72, 0 below -87.3 (no subnormals). k is rounded by the 1.5 * 2^23 trick, plain arithmetic the
// compiler vectorizes.
inline float exp_fp32(float x) {
  const bool overflow = x > 88.7228394f;
  x = std::min(std::max(x, -88.f), 88.7f);
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t biased = std::max(int32_t(k) + 127, 0);
  const uint32_t bits = uint32_t(biased) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return overflow ? std::numeric_limits<float>::infinity() : p * scale;
}

template <typename T>
TIERED_CLONES void norm_row(const T* x, const T* w, T* out, int64_t D, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < D; ++d) {
    const float v = widen(x[d]);
    sum += v * v;
  }
  const float r = 1.f / std::sqrt(sum / float(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) store(out + d, widen(w[d]) * through(widen(x[d]) * r, out));
}

template <typename T>
TIERED_CLONES void silu_mul_row(T* g, const T* u, int64_t F) {
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) {
    const float v = widen(g[f]);
    store(g + f, through(v / (1.f + exp_fp32(-v)), g) * widen(u[f]));
  }
}

// Rows per ATen task: enough work per task to pay for its hand-off.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, "tiered pointwise: ", name, " must be 2-D, got ", t.dim(), " dims");
  TORCH_CHECK(t.stride(1) == 1, "tiered pointwise: ", name, "'s rows must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "tiered pointwise: float32 or bfloat16 only, got ", t.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), "tiered pointwise: w must be [D]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "tiered pointwise: w's dtype differs from x's");
  at::Tensor out = at::detail::empty_cpu({x.size(0), x.size(1)}, x.scalar_type(), false, std::nullopt);
  const int64_t D = x.size(1), xs = x.stride(0);
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.const_data_ptr<T>();
    const T* wp = w.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) norm_row(xp + i * xs, wp, op + i * D, D, float(eps));
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

void silu_mul_(const at::Tensor& g, const at::Tensor& u) {
  check_rows(g, "g");
  check_rows(u, "u");
  TORCH_CHECK(g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type(),
              "tiered pointwise: g and u differ in shape or dtype");
  const int64_t F = g.size(1), gs = g.stride(0), us = u.stride(0);
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* gp = g.data_ptr<T>();
    const T* up = u.const_data_ptr<T>();
    at::parallel_for(0, g.size(0), grain(F), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) silu_mul_row(gp + i * gs, up + i * us, F);
    });
  };
  if (g.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tiered_native, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul_(Tensor(a!) g, Tensor u) -> ()");
}

TORCH_LIBRARY_IMPL(tiered_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul_", &silu_mul_);
}
