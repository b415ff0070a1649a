// kernel_lib_cuda: the CUDA kernels of RMSNorm (rms_norm.cu) and row softmax (softmax.cu), called by the operators in
// ops.cpp.
#pragma once
#include <ATen/ATen.h>

namespace kernel_lib_cuda {

// Ladder steps, in order; each is a complete kernel. kBest picks the best step for the width (documented rule).
enum Variant : int64_t {
  kNaive = 0, kBlockShared = 1, kWarpShuffle = 2, kVectorized = 3, kRegisters = 4, kOnline = 5, kTma = 6, kBest = -1
};

// x, y: (rows, D) with unit stride along D, row stride x.stride(0) / y.stride(0) (y is contiguous, allocated by the caller);
// weight (D,) contiguous, same dtype as x; rstd (rows,) float32 contiguous, written (1/sqrt(mean(x^2)+eps)).
void rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y, at::Tensor& rstd, int64_t variant);

// dy, x: (rows, D) unit stride along D; dx (rows, D) contiguous, x's dtype; dweight (D,) float32 contiguous: the caller
// casts it to weight's dtype. dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)); dweight = sum over rows of dy * x * rstd.
void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                  at::Tensor& dx, at::Tensor& dweight, int64_t variant);

// x: (rows, D) unit stride along D; y (rows, D) contiguous; softmax over D computed in float32.
void softmax_fwd(const at::Tensor& x, at::Tensor& y, int64_t variant);

// y, dy: (rows, D); dx = y * (dy - sum(dy * y)) per row, float32 accumulation.
void softmax_bwd(const at::Tensor& y, const at::Tensor& dy, at::Tensor& dx);

const char* variant_name(int64_t variant);

}  // namespace kernel_lib_cuda
