// kernel_lib_cuda: RMSNorm and row softmax as PyTorch operators, with a CPU implementation in plain C++.
//
// The schemas (TORCH_LIBRARY) are what torch.compile, torch.library.opcheck and autograd see; the CUDA kernels live
// in rms_norm.cu and softmax.cu (the ladder of notebook 05a) and are compiled in only when the extension is built with CUDA
// (KL_WITH_CUDA). The CPU implementation computes the same formulas in float32, one row at a time, so the op, its
// registration and its gradients are tested on a machine without a GPU.
//
//   rms_norm_fwd(x, weight, eps, variant) -> (y, rstd)     rstd = 1 / sqrt(mean(x^2) + eps),  y = x * rstd * weight
//   rms_norm_bwd(dy, x, weight, rstd, variant) -> (dx, dweight)
//                                                           g = dy * weight,  dx = rstd * (g - x * rstd^2 * mean(g * x))
//                                                           dweight = sum over rows of dy * x * rstd
//   softmax_fwd(x, variant) -> y                            y = exp(x - max) / sum(exp(x - max)), per row
//   softmax_bwd(y, dy) -> dx                                dx = y * (dy - sum(dy * y)), per row
//
// x and dy are (rows, D) with unit stride along D (the Python wrapper flattens leading dims and copies otherwise);
// outputs are contiguous in x's dtype; rstd is float32; dweight is float32 (the wrapper casts it to weight's dtype).
// `variant` picks a step of the CUDA ladder (-1: the best for the width); the CPU implementation ignores it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>

#ifdef KL_WITH_CUDA
#include "kernels.h"
#endif

namespace {

using at::Tensor;

// ---- argument checks: each names the op, the argument and the rule -----------------------------------------------
// Numbers, shapes and devices enter the messages as strings made here. On the GPU machine (torch 2.11.0+cu130) the
// process died with a segmentation fault instead of raising whenever a message streamed an integer, a double or a
// shape into TORCH_CHECK from this library, while text and dtypes printed fine; the CPU build (torch 2.13) raised
// normally. The cause was not found (benchmarks/NOTES.md, 2026-11-24); std::to_string keeps numbers off that path.
std::string text(int64_t v) { return std::to_string(v); }
std::string text(double v) { return std::to_string(v); }
std::string text(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}
std::string text(const at::Device& device) { return device.str(); }

void check_rows(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D (rows, D), got ", text(t.dim()), " dimensions");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, ": ", name, " must have unit stride along its last dim, got ",
              text(t.stride(1)));
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": ", name,
              " must be float32, bfloat16 or float16, got ", dt);
}

void check_like(const Tensor& t, const Tensor& ref, const char* op, const char* name, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name, "'s dtype ",
              ref.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device ", text(ref.device()),
              ", got ", text(t.device()));
}

void check_weight(const Tensor& weight, const Tensor& x, const char* op) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), op, ": weight must have shape (", text(x.size(1)),
              ",) to match x's last dim, got ", text(weight.sizes()));
  check_like(weight, x, op, "weight", "x");
}

void check_rstd(const Tensor& rstd, const Tensor& x, const char* op) {
  TORCH_CHECK(rstd.scalar_type() == at::kFloat, op, ": rstd must be float32, got ", rstd.scalar_type());
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == x.size(0), op, ": rstd must have shape (", text(x.size(0)),
              ",), one per row, got ", text(rstd.sizes()));
  TORCH_CHECK(rstd.device() == x.device(), op, ": rstd must be on x's device ", text(x.device()));
}

// ---- CPU implementation: one row per task ---------------------------------------------------------------------------
// Sums run in double: a sequential float32 sum over thousands of values errs several times more than PyTorch's
// blocked sums (a GPU kernel's tree or warp reduction is blocked too, so it can stay in float32).
template <typename T>
void rms_norm_fwd_rows(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const int64_t rows = x.size(0), D = x.size(1), sx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  float* rp = rstd.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * sx;
      double ss = 0.0;
      for (int64_t j = 0; j < D; ++j) {
        const double v = static_cast<float>(row[j]);
        ss += v * v;
      }
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
      rp[r] = inv;
      for (int64_t j = 0; j < D; ++j) {
        yp[r * D + j] = static_cast<T>(static_cast<float>(row[j]) * inv * static_cast<float>(wp[j]));
      }
    }
  });
}

template <typename T>
void rms_norm_bwd_rows(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, Tensor& dx,
                       Tensor& dw) {
  const int64_t rows = x.size(0), D = x.size(1), sx = x.stride(0), sdy = dy.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* dyp = dy.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const float* rp = rstd.data_ptr<float>();
  T* dxp = dx.data_ptr<T>();
  // dweight: one float32 partial row per thread chunk, summed in chunk order (deterministic for a thread count)
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  Tensor partial = at::zeros({chunks, D}, x.options().dtype(at::kDouble));
  double* pp = partial.data_ptr<double>();
  const int64_t per = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      double* acc = pp + c * D;
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const T* xr = xp + r * sx;
        const T* gr = dyp + r * sdy;
        const float inv = rp[r];
        double dot = 0.0;  // mean over the row of (dy * w) * x
        for (int64_t j = 0; j < D; ++j) {
          dot += static_cast<double>(static_cast<float>(gr[j]) * static_cast<float>(wp[j])) * static_cast<float>(xr[j]);
        }
        const float m = static_cast<float>(dot / static_cast<double>(D));
        for (int64_t j = 0; j < D; ++j) {
          const float xv = static_cast<float>(xr[j]);
          const float g = static_cast<float>(gr[j]) * static_cast<float>(wp[j]);
          dxp[r * D + j] = static_cast<T>(inv * (g - xv * inv * inv * m));
          acc[j] += static_cast<double>(static_cast<float>(gr[j]) * xv * inv);
        }
      }
    }
  });
  dw.copy_(partial.sum(0));  // double -> float32
}

template <typename T>
void softmax_fwd_rows(const Tensor& x, Tensor& y) {
  const int64_t rows = x.size(0), D = x.size(1), sx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * sx;
      float mx = -INFINITY;
      for (int64_t j = 0; j < D; ++j) mx = std::max(mx, static_cast<float>(row[j]));
      double sum = 0.0;
      for (int64_t j = 0; j < D; ++j) sum += std::exp(static_cast<float>(row[j]) - mx);
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t j = 0; j < D; ++j) yp[r * D + j] = static_cast<T>(std::exp(static_cast<float>(row[j]) - mx) * inv);
    }
  });
}

template <typename T>
void softmax_bwd_rows(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t rows = y.size(0), D = y.size(1), sy = y.stride(0), sdy = dy.stride(0);
  const T* yp = y.data_ptr<T>();
  const T* dyp = dy.data_ptr<T>();
  T* dxp = dx.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      double dot = 0.0;
      for (int64_t j = 0; j < D; ++j) {
        dot += static_cast<double>(static_cast<float>(yp[r * sy + j]) * static_cast<float>(dyp[r * sdy + j]));
      }
      for (int64_t j = 0; j < D; ++j) {
        const float yv = static_cast<float>(yp[r * sy + j]);
        dxp[r * D + j] = static_cast<T>(yv * (static_cast<float>(dyp[r * sdy + j]) - static_cast<float>(dot)));
      }
    }
  });
}

#define KL_DISPATCH(dtype, name, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, name, __VA_ARGS__)

// ---- the ops: checks, outputs, then the device's implementation ---------------------------------------------------
std::tuple<Tensor, Tensor> rms_norm_fwd(const Tensor& x, const Tensor& weight, double eps, int64_t variant) {
  check_rows(x, "rms_norm_fwd", "x");
  check_weight(weight, x, "rms_norm_fwd");
  TORCH_CHECK(eps >= 0, "rms_norm_fwd: eps must be >= 0, got ", text(eps));
  Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  Tensor rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  const Tensor w = weight.contiguous();
  if (x.is_cuda()) {
#ifdef KL_WITH_CUDA
    kernel_lib_cuda::rms_norm_fwd(x, w, eps, y, rstd, variant);
#else
    TORCH_CHECK(false, "rms_norm_fwd: this build of kernel_lib_cuda has no CUDA kernels (built without nvcc)");
#endif
  } else {
    KL_DISPATCH(x.scalar_type(), "rms_norm_fwd", [&] { rms_norm_fwd_rows<scalar_t>(x, w, eps, y, rstd); });
  }
  return {y, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                        int64_t variant) {
  check_rows(x, "rms_norm_bwd", "x");
  check_rows(dy, "rms_norm_bwd", "dy");
  check_like(dy, x, "rms_norm_bwd", "dy", "x");
  TORCH_CHECK(dy.sizes() == x.sizes(), "rms_norm_bwd: dy must have x's shape ", text(x.sizes()), ", got ",
              text(dy.sizes()));
  check_weight(weight, x, "rms_norm_bwd");
  check_rstd(rstd, x, "rms_norm_bwd");
  Tensor dx = at::empty({x.size(0), x.size(1)}, x.options());
  Tensor dw = at::empty({x.size(1)}, x.options().dtype(at::kFloat));
  const Tensor w = weight.contiguous();
  const Tensor r = rstd.contiguous();
  if (x.is_cuda()) {
#ifdef KL_WITH_CUDA
    kernel_lib_cuda::rms_norm_bwd(dy, x, w, r, dx, dw, variant);
#else
    TORCH_CHECK(false, "rms_norm_bwd: this build of kernel_lib_cuda has no CUDA kernels (built without nvcc)");
#endif
  } else {
    KL_DISPATCH(x.scalar_type(), "rms_norm_bwd", [&] { rms_norm_bwd_rows<scalar_t>(dy, x, w, r, dx, dw); });
  }
  return {dx, dw};
}

Tensor softmax_fwd(const Tensor& x, int64_t variant) {
  check_rows(x, "softmax_fwd", "x");
  Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.is_cuda()) {
#ifdef KL_WITH_CUDA
    kernel_lib_cuda::softmax_fwd(x, y, variant);
#else
    TORCH_CHECK(false, "softmax_fwd: this build of kernel_lib_cuda has no CUDA kernels (built without nvcc)");
#endif
  } else {
    KL_DISPATCH(x.scalar_type(), "softmax_fwd", [&] { softmax_fwd_rows<scalar_t>(x, y); });
  }
  return y;
}

Tensor softmax_bwd(const Tensor& y, const Tensor& dy) {
  check_rows(y, "softmax_bwd", "y");
  check_rows(dy, "softmax_bwd", "dy");
  check_like(dy, y, "softmax_bwd", "dy", "y");
  TORCH_CHECK(dy.sizes() == y.sizes(), "softmax_bwd: dy must have y's shape ", text(y.sizes()), ", got ",
              text(dy.sizes()));
  Tensor dx = at::empty({y.size(0), y.size(1)}, y.options());
  if (y.is_cuda()) {
#ifdef KL_WITH_CUDA
    kernel_lib_cuda::softmax_bwd(y, dy, dx);
#else
    TORCH_CHECK(false, "softmax_bwd: this build of kernel_lib_cuda has no CUDA kernels (built without nvcc)");
#endif
  } else {
    KL_DISPATCH(y.scalar_type(), "softmax_bwd", [&] { softmax_bwd_rows<scalar_t>(y, dy, dx); });
  }
  return dx;
}

bool has_cuda_kernels() {
#ifdef KL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(kernel_lib_cuda, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps, int variant) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd, int variant) -> (Tensor, Tensor)");
  m.def("softmax_fwd(Tensor x, int variant) -> Tensor");
  m.def("softmax_bwd(Tensor y, Tensor dy) -> Tensor");
  m.def("has_cuda_kernels() -> bool", &has_cuda_kernels);
}

// One implementation for both devices: each op checks its arguments, then branches on the device itself.
TORCH_LIBRARY_IMPL(kernel_lib_cuda, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("softmax_fwd", &softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
}

TORCH_LIBRARY_IMPL(kernel_lib_cuda, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("softmax_fwd", &softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
}
