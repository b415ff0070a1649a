// softmax.cu: row softmax in CUDA C++, forward and backward, the ladder of notebook 05a.
//
//   y = exp(x - max) / sum(exp(x - max)),   dx = y * (dy - sum(dy * y))
//
// x, dy: (rows, D), unit stride along D, any row stride; outputs contiguous; float32 accumulation, one rounding to
// x's dtype. Steps 0-6 and kBest's rule by width are described in notebook 05a; the helpers they share are in
// device.cuh, hopper.cuh and launch.cuh.

#include "kernels.h"
#include "launch.cuh"

namespace kernel_lib_cuda {
namespace {

// =====================================================================================================================
// Softmax forward
// =====================================================================================================================

// Step 0. One thread per row: max, sum of exp(x - max), output; three scalar passes over the row.
template <typename T>
__global__ void softmax_fwd_naive_kernel(const SoftmaxFwd<T> p) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.rows) return;
  const T* xr = p.x.row(row);
  float m = -INFINITY;
  for (int c = 0; c < p.D; ++c) m = fmaxf(m, static_cast<float>(xr[c]));
  double s = 0.0;  // a sequential sum of D terms: float32 would lose accuracy as D grows (see the RMSNorm above)
  for (int c = 0; c < p.D; ++c) s += exp_for<T>(static_cast<float>(xr[c]) - m);
  const float inv = float(1.0 / s);  // a row of only -inf: m = -inf, s = NaN, y = NaN, as in PyTorch
  T* yr = p.y + row * p.D;
  for (int c = 0; c < p.D; ++c) yr[c] = static_cast<T>(exp_for<T>(static_cast<float>(xr[c]) - m) * inv);
}

// Steps 1-3. One block per row (grid: rows), N elements per access, reductions R: pass 1 the max, pass 2 the sum of
// exp(x - max), pass 3 the output; x is read three times. Dynamic shared memory: max(blockDim.x, 32) floats.
template <typename T, Reduce R, int N>
__global__ void __launch_bounds__(1024) softmax_fwd_rows_kernel(const SoftmaxFwd<T> p) {
  extern __shared__ float smem[];
  const RowIO<T> io = row_io(p.x, p.y, p.D, blockIdx.x);
  const int step = blockDim.x * N;
  float m = -INFINITY;
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float f[N];
    load_n<N>(io.in, c, p.D, io.in_vec, -INFINITY, f);
#pragma unroll
    for (int j = 0; j < N; ++j) m = fmaxf(m, f[j]);
  }
  m = block_reduce<R>(m, Max{}, smem);
  float s = 0.f;
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float f[N];
    load_n<N>(io.in, c, p.D, io.in_vec, -INFINITY, f);
#pragma unroll
    for (int j = 0; j < N; ++j) s += exp_for<T>(f[j] - m);
  }
  s = block_reduce<R>(s, Sum{}, smem);
  const float inv = 1.f / s;
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float f[N];
    load_n<N>(io.in, c, p.D, io.in_vec, -INFINITY, f);
#pragma unroll
    for (int j = 0; j < N; ++j) f[j] = exp_for<T>(f[j] - m) * inv;
    store_n<N>(io.out, c, p.D, io.out_vec, f);
  }
}

// Step 4. Rows held in registers (layout as rms_norm_fwd_registers_kernel): max and sum from registers, exp computed
// once and kept, one read of x. Padding loads -inf, which adds exp(-inf) = 0 to the sum.
template <typename T, int VPT>
__global__ void __launch_bounds__(1024) softmax_fwd_registers_kernel(const SoftmaxFwd<T> p) {
  constexpr int N = kVec<T>;
  __shared__ float red[kMaxRowsPerBlock * 32];
  float v[VPT][N];
  const RegRow row = load_reg_row(p.x, p.rows, p.D, -INFINITY, v);
  const float m = block_reduce_warp(max_regs(v), Max{}, red);
  const float s = block_reduce_warp(exp_regs<T>(v, m), Sum{}, red);
  if (!row.valid) return;
  store_slice(p.y + row.index * p.D, 0, p.D, 1.f / s, v);
}

// Step 4 on a cluster (sm_90+; layout as rms_norm_fwd_cluster_kernel). Each block computes its slice's max m and
// s = sum exp(x - m) and publishes (m, s); every block combines the C pairs, M = max m_q, S = sum s_q exp(m_q - M),
// and writes exp(x - m) * exp(m - M) / S. A slice of only -inf (m = -inf) keeps exp(x - 0) = 0 and scale 0; a row of
// only -inf gives S = NaN, hence NaN, as in PyTorch.
template <typename T, int VPT>
__global__ void __launch_bounds__(1024) softmax_fwd_cluster_kernel(const SoftmaxFwd<T> p, int slice) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int N = kVec<T>;
  __shared__ float red[32];
  __shared__ float2 part;
  const cg::cluster_group cluster = cg::this_cluster();
  float v[VPT][N];
  const ClusterSlice slc = load_cluster_slice(cluster, p.x, p.D, slice, -INFINITY, v);
  const float m = block_reduce_warp(max_regs(v), Max{}, red);
  const float s = block_reduce_warp(exp_regs<T>(v, m == -INFINITY ? 0.f : m), Sum{}, red);
  const float2 MS = cluster_max_sum(cluster, m, s, &part);
  store_slice(p.y + slc.row * p.D, slc.begin, slc.end, (m == -INFINITY ? 0.f : expf(m - MS.x)) / MS.y, v);
  cluster.barrier_wait();
#else
  __trap();
#endif
}

// Step 6 (sm_90+): tma_rows, as rms_norm_fwd_tma_kernel.
template <typename T, int VPT, bool HOLD>
__global__ void __launch_bounds__(kTmaMaxThreads) softmax_fwd_tma_kernel(const SoftmaxFwd<T> p, int slice, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  tma_rows<T, VPT, HOLD, false>(p.x, nullptr, p.y, nullptr, p.rows, p.D, 0.f, 0.f, slice, stages);
#else
  __trap();
#endif
}

// Step 5. Online softmax, one block per row (grid: rows), 128-bit accesses: pass 1 keeps each thread's (max, sum)
// and rescales the sum by exp(m_old - m_new) when the max grows, then the block combines the pairs; pass 2 reads x
// again and writes exp(x - M) / S. Two reads of x at any width; no register limit on D.
template <typename T, int N>
__global__ void __launch_bounds__(1024) softmax_fwd_online_kernel(const SoftmaxFwd<T> p) {
  __shared__ float2 red[32];
  const RowIO<T> io = row_io(p.x, p.y, p.D, blockIdx.x);
  const int step = blockDim.x * N;
  MaxSum ms{-INFINITY, 0.f};
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float f[N];
    load_n<N>(io.in, c, p.D, io.in_vec, -INFINITY, f);
    float m_new = ms.m;
#pragma unroll
    for (int j = 0; j < N; ++j) m_new = fmaxf(m_new, f[j]);
    if (m_new == -INFINITY) continue;  // only -inf so far: nothing to add
    float add = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) add += exp_for<T>(f[j] - m_new);
    ms.s = ms.s * exp_for<T>(ms.m - m_new) + add;
    ms.m = m_new;
  }
  ms = block_reduce(ms, red);
  const float inv = 1.f / ms.s;  // a row of only -inf: (m, s) = (-inf, 0), exp(NaN) * inf = NaN
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float f[N];
    load_n<N>(io.in, c, p.D, io.in_vec, -INFINITY, f);
#pragma unroll
    for (int j = 0; j < N; ++j) f[j] = exp_for<T>(f[j] - ms.m) * inv;
    store_n<N>(io.out, c, p.D, io.out_vec, f);
  }
}


// =====================================================================================================================
// Softmax backward: dx = y * (dy - sum(dy * y))
// =====================================================================================================================

// Registers path (D <= 16,384): y and dy of a row held in registers (layout as the forward's), one read of each.
template <typename T, int VPT>
__global__ void __launch_bounds__(512) softmax_bwd_registers_kernel(const SoftmaxBwd<T> p) {
  constexpr int N = kVec<T>;
  __shared__ float red[kMaxRowsPerBlock * 32];
  const RegRow row = reg_row(p.rows, p.D);
  const T* yr = p.y.row(row.read);
  const T* dyr = p.dy.row(row.read);
  float ys[VPT][N], g[VPT][N];
  load_vectors2<VPT, N>(yr, aligned16(yr), dyr, aligned16(dyr), threadIdx.x * N, blockDim.x * N, row.end, ys, g);
  const float dot = block_reduce_warp(dot_regs(ys, g), Sum{}, red);
  if (!row.valid) return;
  T* dxr = p.dx + row.index * p.D;
  const bool dxv = aligned16(dxr);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
#pragma unroll
    for (int j = 0; j < N; ++j) g[i][j] = ys[i][j] * (g[i][j] - dot);
    store_n<N>(dxr, (threadIdx.x + i * blockDim.x) * N, p.D, dxv, g[i]);
  }
}

// Wide rows: one block per row (grid: rows), 128-bit accesses, the dot product then the output (y, dy read twice).
template <typename T, int N>
__global__ void __launch_bounds__(1024) softmax_bwd_rows_kernel(const SoftmaxBwd<T> p) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const RowIO<T> io = row_io(p.dy, p.dx, p.D, row);  // dy in, dx out
  const T* yr = p.y.row(row);
  const bool yv = aligned16(yr);
  const int step = blockDim.x * N;
  float dot = 0.f;
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float ys[N], g[N];
    load_n<N>(yr, c, p.D, yv, 0.f, ys);
    load_n<N>(io.in, c, p.D, io.in_vec, 0.f, g);
#pragma unroll
    for (int j = 0; j < N; ++j) dot += ys[j] * g[j];
  }
  dot = block_reduce_warp(dot, Sum{}, red);
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float ys[N], g[N];
    load_n<N>(yr, c, p.D, yv, 0.f, ys);
    load_n<N>(io.in, c, p.D, io.in_vec, 0.f, g);
#pragma unroll
    for (int j = 0; j < N; ++j) g[j] = ys[j] * (g[j] - dot);
    store_n<N>(io.out, c, p.D, io.out_vec, g);
  }
}


// =====================================================================================================================
// Host: softmax's launchers
// =====================================================================================================================
template <typename T>
void launch_softmax_fwd_online(const SoftmaxFwd<T>& p, cudaStream_t stream) {
  // Up to 1024 threads, two vectors each: fewer rows in flight between the passes, so the second read hits L2.
  const int threads = strided_threads(p.D, 2 * kVec<T>, 1024);
  softmax_fwd_online_kernel<T, kVec<T>><<<unsigned(p.rows), threads, 0, stream>>>(p);
  KL_LAUNCH_CHECK("softmax_fwd_online");
}

template <typename T>
void softmax_fwd_typed(const SoftmaxFwd<T>& p, int64_t variant, cudaStream_t stream) {
  constexpr int N = kVec<T>;
  static constexpr const char* kScalarNames[3] = {"softmax_fwd_naive", "softmax_fwd_block_shared",
                                                  "softmax_fwd_warp_shuffle"};
  const auto scalar_rows = [](auto reduce) { return softmax_fwd_rows_kernel<T, decltype(reduce)::value, 1>; };
  if (launch_scalar_steps(p, variant, softmax_fwd_naive_kernel<T>, scalar_rows, kScalarNames, stream)) return;
  switch (variant) {
    case kVectorized:
      return launch_rows(softmax_fwd_rows_kernel<T, Reduce::kWarp, N>, p, N, "softmax_fwd_vectorized", stream);
    case kOnline: return launch_softmax_fwd_online(p, stream);
    default:  // kRegisters, kBest, kTma
      if ((variant == kTma || (variant == kBest && p.D > kOneBlockMaxD)) &&
          launch_tma<T, kTmaSoftmaxVectors>(
              p, static_cast<const T*>(nullptr),
              [](auto hold) { return softmax_fwd_tma_kernel<T, kTmaSoftmaxVectors, decltype(hold)::value>; },
              kTmaSoftmaxSliceBytes, "softmax_fwd_tma", stream))
        return;
      const auto reg_for = [](auto vpt) { return softmax_fwd_registers_kernel<T, decltype(vpt)::value>; };
      const auto cluster_for = [](auto vpt) { return softmax_fwd_cluster_kernel<T, decltype(vpt)::value>; };
      if (variant == kBest && p.D > kBestSoftmaxClusterMaxD) return launch_softmax_fwd_online(p, stream);
      if (launch_one_pass<T>(p, reg_for, cluster_for, "softmax_fwd_registers", "softmax_fwd_cluster", stream))
        return;
      return launch_softmax_fwd_online(p, stream);
  }
}


template <typename T>
void softmax_bwd_typed(const SoftmaxBwd<T>& p, cudaStream_t stream) {
  const auto reg_for = [](auto vpt) { return softmax_bwd_registers_kernel<T, decltype(vpt)::value>; };
  if (p.D <= kBwdRegMaxD && launch_registers<kMaxValues, T>(p, 512, reg_for, "softmax_bwd_registers", stream)) return;
  softmax_bwd_rows_kernel<T, kVec<T>><<<unsigned(p.rows), strided_threads(p.D, kVec<T>, 1024), 0, stream>>>(p);
  KL_LAUNCH_CHECK("softmax_bwd_rows");
}


}  // namespace

// =====================================================================================================================
// The interface (kernels.h)
// =====================================================================================================================
const char* variant_name(int64_t variant) {
  switch (variant) {
    case kNaive: return "naive";
    case kBlockShared: return "block_shared";
    case kWarpShuffle: return "warp_shuffle";
    case kVectorized: return "vectorized";
    case kRegisters: return "registers";
    case kOnline: return "online";
    case kTma: return "tma";
    case kBest: return "best";
    default: return "unknown";
  }
}


void softmax_fwd(const at::Tensor& x, at::Tensor& y, int64_t variant) {
  const char* fn = "softmax_fwd";
  check_variant(fn, variant);
  check_rows(fn, "x", x);
  const int64_t rows = x.size(0), D = x.size(1);
  check_dense(fn, "y", y, {rows, D}, x.scalar_type(), x);
  if (rows == 0 || D == 0) return;
  on_device(x, [&](auto type, cudaStream_t stream) {
    using T = decltype(type);
    softmax_fwd_typed(SoftmaxFwd<T>{rows_of<T>(x), y.data_ptr<T>(), rows, int(D)}, variant, stream);
  });
}

void softmax_bwd(const at::Tensor& y, const at::Tensor& dy, at::Tensor& dx) {
  const char* fn = "softmax_bwd";
  check_rows(fn, "y", y);
  check_rows(fn, "dy", dy);
  check_like(fn, "dy", dy, "y", y);
  TORCH_CHECK(dy.sizes() == y.sizes(), fn, ": dy must have y's shape ", y.sizes(), ", got ", dy.sizes());
  const int64_t rows = y.size(0), D = y.size(1);
  check_dense(fn, "dx", dx, {rows, D}, y.scalar_type(), y);
  if (rows == 0 || D == 0) return;
  on_device(y, [&](auto type, cudaStream_t stream) {
    using T = decltype(type);
    softmax_bwd_typed(SoftmaxBwd<T>{rows_of<T>(y), rows_of<T>(dy), dx.data_ptr<T>(), rows, int(D)}, stream);
  });
}


}  // namespace kernel_lib_cuda
