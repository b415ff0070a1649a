// launch.cuh: host code both ops share: launch configurations (threads per row, the registers layout, cluster
// splits, occupancy queries), the launchers of the steps alike in both ops, and the argument checks.
#pragma once

#include "hopper.cuh"

namespace kernel_lib_cuda {
namespace {

// =====================================================================================================================
// Host: launch configurations
// =====================================================================================================================
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Threads per row for the strided kernels (steps 1-3, online, the wide backward): a power of two (the tree needs
// one) between 32 and max_threads, about one access of N elements per thread.
int strided_threads(int D, int N, int max_threads) {
  return std::max(32, std::min(max_threads, next_pow2(ceil_div(D, N))));
}

// Registers layout: VPT vectors per thread, `threads` per row (a multiple of 32) and rows per block. The smallest VPT
// in 1, 2, 4, 8 with at most 128 * VPT threads (enough work per thread to amortize the reduction), else the one with
// the fewest threads under max_threads; VPT * N <= max_values. vpt == 0: the row does not fit.
struct RegConfig {
  int vpt = 0, threads = 0, rows_per_block = 1;
};
RegConfig reg_config(int64_t D, int N, int max_threads, int max_values = kMaxValues) {
  const int64_t nvec = ceil_div(D, N);
  RegConfig cfg;
  for (int vpt = 1; vpt * N <= max_values; vpt *= 2) {
    const int64_t threads = round_up(ceil_div(nvec, vpt), 32);
    if (threads > max_threads) continue;
    cfg.vpt = vpt;
    cfg.threads = int(threads);
    cfg.rows_per_block = int(std::max<int64_t>(1, std::min<int64_t>(kMaxRowsPerBlock, 128 / threads)));
    if (threads <= 128 * vpt) break;
  }
  return cfg;
}

// Calls f(std::integral_constant<int, vpt>) for a runtime vpt: each VPT is its own kernel instantiation.
template <class F>
void with_vpt(int vpt, F&& f) {
  switch (vpt) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "kernel_lib_cuda: internal error: no kernel for ", vpt, " vectors per thread");
  }
}

int sm_count() {
  int dev = 0, n = 0;
  KL_CUDA_CHECK(cudaGetDevice(&dev), "cudaGetDevice");
  KL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  return n;
}

// Cluster split: C blocks per row, `slice` columns each (a multiple of N), and each block's registers layout.
struct ClusterConfig {
  int cluster = 0, slice = 0;
  RegConfig reg;
};
ClusterConfig cluster_config(int D, int N) {
  for (const int limit : {kClusterSlice, 2 * kClusterSlice}) {
    for (int c = 2; c <= kClusterMax; c *= 2) {
      const int slice = int(round_up(ceil_div(D, c), N));
      if (slice > limit) continue;
      const RegConfig reg = reg_config(slice, N, 1024);
      if (reg.vpt > 0) return {c, slice, reg};
    }
  }
  return {};
}

cudaLaunchConfig_t cluster_launch_config(int64_t blocks, int threads, int cluster, cudaStream_t stream,
                                         cudaLaunchAttribute* attr, int smem = 0) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// How many clusters of `cluster` blocks of `threads` with `smem` bytes of dynamic shared memory `kernel` runs at once
// here; 0 if none, or if it cannot run: the device lacks cluster launch, or the kernel's binary is not for sm_90+ (a
// PTX/SASS fallback whose body is __trap()). Past 48 KiB of shared memory, the kernel's static bytes included, it
// first allows the kernel kTmaMaxSliceBytes (a ceiling, always the same value: two threads launching different widths
// cannot undo each other's setting); counting only the dynamic bytes, 48 KiB of them plus a few hundred static bytes
// crashed the process with a segmentation fault on an H100 (2026-11-25) instead of returning an error. Past 8 blocks
// it allows a non-portable cluster size. Nothing is enqueued, so this is fine during graph capture.
template <typename Kernel>
int active_clusters(Kernel kernel, int cluster, int threads, int smem = 0) {
  int dev = 0, has = 0, active = 0;
  cudaFuncAttributes attr{};
  cudaLaunchAttribute launch_attr[1];
  const cudaLaunchConfig_t cfg = cluster_launch_config(cluster, threads, cluster, nullptr, launch_attr, smem);
  const bool ok = cudaGetDevice(&dev) == cudaSuccess &&
                  cudaDeviceGetAttribute(&has, cudaDevAttrClusterLaunch, dev) == cudaSuccess && has &&
                  cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion >= 90 &&
                  (smem + int(attr.sharedSizeBytes) <= 48 * 1024 ||
                   (smem <= kTmaMaxSliceBytes &&
                    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaMaxSliceBytes) ==
                        cudaSuccess)) &&
                  (cluster <= kClusterMax ||
                   cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) &&
                  cudaOccupancyMaxActiveClusters(&active, kernel, &cfg) == cudaSuccess && active > 0;
  if (!ok) (void)cudaGetLastError();  // a failed query is an answer (none), not an error for the next launch to report
  return ok ? active : 0;
}


// =====================================================================================================================
// Host: per-dtype launchers
// =====================================================================================================================

// Rows in registers, one block per 1-4 rows. kernel_for(std::integral_constant<int, VPT>) names the instantiation;
// VPT * N <= MaxValues. False if a row does not fit in max_threads threads.
template <int MaxValues, typename T, typename P, typename KernelFor>
bool launch_registers(const P& p, int max_threads, KernelFor kernel_for, const char* name, cudaStream_t stream) {
  const RegConfig cfg = reg_config(p.D, kVec<T>, max_threads, MaxValues);
  if (cfg.vpt == 0) return false;
  with_vpt(cfg.vpt, [&](auto vpt) {
    if constexpr (decltype(vpt)::value * kVec<T> <= MaxValues) {
      const dim3 block(cfg.threads, cfg.rows_per_block);
      kernel_for(vpt)<<<unsigned(ceil_div(p.rows, cfg.rows_per_block)), block, 0, stream>>>(p);
      KL_LAUNCH_CHECK(name);
    }
  });
  return true;
}

// Rows in the registers of a cluster of blocks (Hopper). False if the width, the device or the binary rules it out.
template <typename T, typename P, typename KernelFor>
bool launch_cluster(const P& p, KernelFor kernel_for, const char* name, cudaStream_t stream) {
  const ClusterConfig cc = cluster_config(p.D, kVec<T>);
  if (cc.cluster == 0 || p.rows * cc.cluster > std::numeric_limits<int>::max()) return false;
  bool launched = false;
  with_vpt(cc.reg.vpt, [&](auto vpt) {
    if constexpr (decltype(vpt)::value * kVec<T> <= kMaxValues) {
      const auto kernel = kernel_for(vpt);
      if (active_clusters(kernel, cc.cluster, cc.reg.threads) == 0) return;
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg =
          cluster_launch_config(p.rows * cc.cluster, cc.reg.threads, cc.cluster, stream, attr);
      KL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, cc.slice), name);
      KL_LAUNCH_CHECK(name);
      launched = true;
    }
  });
  return launched;
}

// Step 6's split of a row of D elements of `elem` bytes: C blocks of `slice` elements, a multiple of the 128-bit
// vector, about `slice_bytes` each (rows wider than kTmaMaxCluster such slices take larger ones). The slice is held in
// registers (hold) when kTmaMaxThreads threads of `vpt` vectors cover it and kTmaStages buffers of it fit in shared
// memory; else each pass reads its buffer (kTmaStages of them where they fit, else one). cluster 0: a single buffer
// does not fit (rows wider than 16 x 225 KiB).
struct TmaConfig {
  int cluster = 0, slice = 0, threads = 0, stages = 0;
  bool hold = false;
};
TmaConfig tma_config(int64_t D, int elem, int slice_bytes, int vpt) {
  const int N = 16 / elem;
  int64_t C = std::min<int64_t>(ceil_div(D * elem, slice_bytes), kTmaMaxCluster);
  const int64_t slice = round_up(ceil_div(D, C), N);  // balanced: the last block is not left with a sliver
  const int64_t buffer = slice * elem;
  if (buffer > kTmaMaxSliceBytes) return {};
  C = ceil_div(D, slice);
  const int64_t hold_threads = round_up(ceil_div(slice / N, vpt), 32);
  if (hold_threads <= kTmaMaxThreads && kTmaStages * buffer <= kTmaMaxSliceBytes)
    return {int(C), int(slice), int(hold_threads), kTmaStages, true};
  const int64_t threads = std::min<int64_t>(round_up(ceil_div(slice / N, kTmaVectorsPerThread), 32), kTmaMaxThreads);
  return {int(C), int(slice), int(threads), kTmaStages * buffer <= kTmaMaxSliceBytes ? kTmaStages : 1, false};
}

// Step 6 (notebook 05a, and tma_rows in hopper.cuh): as many clusters as run at once, each taking every G-th row. False
// where it cannot run: x, y or the weight not 16-byte aligned (x's row stride included), a row's bytes not a multiple
// of 16, too wide, no sm_90+ binary or cluster launch. kernel_for(std::bool_constant<hold>) names the kernel.
template <typename T, int VPT, typename P, typename KernelFor>
bool launch_tma(const P& p, const T* weight, KernelFor kernel_for, int slice_bytes, const char* name,
                cudaStream_t stream) {
  const auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  if (!aligned(p.x.data) || !aligned(p.y) || (p.x.stride * int64_t(sizeof(T))) % 16 != 0 ||
      (int64_t(p.D) * sizeof(T)) % 16 != 0 || (weight != nullptr && !aligned(weight)))
    return false;
  const TmaConfig tc = tma_config(p.D, int(sizeof(T)), slice_bytes, VPT);
  if (tc.cluster == 0) return false;
  const int smem = tc.stages * tc.slice * int(sizeof(T));
  const auto launch = [&](auto kernel) {
    const int active = active_clusters(kernel, tc.cluster, tc.threads, smem);
    if (active == 0) return false;
    const int64_t clusters = std::min<int64_t>(p.rows, active);
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg =
        cluster_launch_config(clusters * tc.cluster, tc.threads, tc.cluster, stream, attr, smem);
    KL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, tc.slice, tc.stages), name);
    KL_LAUNCH_CHECK(name);
    return true;
  };
  return tc.hold ? launch(kernel_for(std::true_type{})) : launch(kernel_for(std::false_type{}));
}

// The registers step of both forward ops (kRegisters and kBest; rule in notebook 05a): one block up to
// kOneBlockMaxD, a cluster beyond. False if neither applies: the caller runs its two-pass kernel.
template <typename T, typename P, typename RegFor, typename ClusterFor>
bool launch_one_pass(const P& p, RegFor reg_for, ClusterFor cluster_for, const char* reg_name,
                     const char* cluster_name, cudaStream_t stream) {
  if (p.D <= kOneBlockMaxD) return launch_registers<kMaxValues, T>(p, 1024, reg_for, reg_name, stream);
  return launch_cluster<T>(p, cluster_for, cluster_name, stream);
}

// Steps 1-3 (one block per row, threads striding along it). Dynamic shared memory for the tree's reduction.
template <typename Kernel, typename P>
void launch_rows(Kernel kernel, const P& p, int N, const char* name, cudaStream_t stream) {
  const int threads = strided_threads(p.D, N, 512);
  kernel<<<unsigned(p.rows), threads, sizeof(float) * std::max(threads, 32), stream>>>(p);
  KL_LAUNCH_CHECK(name);
}

// Steps 0-2, alike in both forward ops: the naive kernel (one thread per row), then rows_for(Reduce::kTree) and
// rows_for(Reduce::kWarp) with scalar accesses; names: the three kernels' names. False for the later steps.
template <typename P, typename Naive, typename RowsFor>
bool launch_scalar_steps(const P& p, int64_t variant, Naive naive, RowsFor rows_for, const char* const (&names)[3],
                         cudaStream_t stream) {
  switch (variant) {
    case kNaive:
      naive<<<unsigned(ceil_div(p.rows, 128)), 128, 0, stream>>>(p);
      KL_LAUNCH_CHECK(names[0]);
      return true;
    case kBlockShared:
      launch_rows(rows_for(std::integral_constant<Reduce, Reduce::kTree>{}), p, 1, names[1], stream);
      return true;
    case kWarpShuffle:
      launch_rows(rows_for(std::integral_constant<Reduce, Reduce::kWarp>{}), p, 1, names[2], stream);
      return true;
    default: return false;
  }
}


// =====================================================================================================================
// Host: argument checks (each names the function, the argument and the rule)
// =====================================================================================================================
void check_variant(const char* fn, int64_t variant) {
  TORCH_CHECK(variant >= kBest && variant <= kTma, fn, ": variant must be -1 (best) or 0-6 (naive, block_shared, ",
              "warp_shuffle, vectorized, registers, online, tma), got ", variant);
}

void check_rows(const char* fn, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " must be a defined tensor");
  TORCH_CHECK(t.is_cuda(), fn, ": ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 2, fn, ": ", name, " must be 2-D (rows, D), got ", t.dim(), " dimensions");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, fn, ": ", name,
              " must have unit stride along its last dim, got stride ", t.stride(1));
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, fn, ": ", name,
              " must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(t.size(1) <= kMaxD, fn, ": ", name, " has rows of ", t.size(1), " elements, more than the ", kMaxD,
              " supported");
  TORCH_CHECK(t.size(0) <= std::numeric_limits<int>::max(), fn, ": ", name, " has ", t.size(0),
              " rows, more than the 2^31 - 1 supported");
}

void check_like(const char* fn, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " must be a defined tensor");
  TORCH_CHECK(t.device() == ref.device(), fn, ": ", name, " must be on ", ref_name, "'s device ", ref.device(),
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), fn, ": ", name, " must have ", ref_name, "'s dtype ",
              ref.scalar_type(), ", got ", t.scalar_type());
}

// A tensor the kernels index as dense: `shape`, contiguous, on ref's device, of dtype `dtype`.
void check_dense(const char* fn, const char* name, const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype,
                 const at::Tensor& ref) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " must be a defined tensor");
  TORCH_CHECK(t.device() == ref.device(), fn, ": ", name, " must be on the device ", ref.device(), ", got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == dtype, fn, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, fn, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous, got strides ", t.strides());
}

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {t.const_data_ptr<T>(), t.stride(0)};
}

// f(T{}, stream) for t's dtype T (checked by check_rows), on t's device and its current stream.
template <class F>
void on_device(const at::Tensor& t, F&& f) {
  const c10::cuda::OptionalCUDAGuard guard(t.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  KL_DISPATCH(t.scalar_type(), "kernel_lib_cuda", [&] { f(scalar_t{}, stream); });  // the name must be a constant
}


}  // namespace
}  // namespace kernel_lib_cuda
