// rms_norm.cu: RMSNorm in CUDA C++, forward and backward, the ladder of notebook 05a.
//
//   y = x * rstd * w,  rstd = 1/sqrt(mean(x^2) + eps)
//   dx = r * g - x * (r^3 * mean(g * x)),  g = w * dy,  r = rstd;   dweight = sum over rows of dy * x * r
//
// x, dy: (rows, D), unit stride along D, any row stride; outputs contiguous; float32 accumulation, one rounding to
// x's dtype. Steps 0-6 of the forward and the backward's paths, and kBest's rule by width, are described in
// notebook 05a; the helpers they share are in device.cuh, hopper.cuh and launch.cuh.

#include "kernels.h"
#include "launch.cuh"

namespace kernel_lib_cuda {
namespace {

// =====================================================================================================================
// RMSNorm forward
// =====================================================================================================================

// Step 0. One thread per row: the sum of squares over the row, then the output, both with scalar loads.
// Grid: ceil(rows / blockDim.x) blocks of blockDim.x threads.
template <typename T>
__global__ void rms_norm_fwd_naive_kernel(const NormFwd<T> p) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.rows) return;
  const T* xr = p.x.row(row);
  double ss = 0.0;  // one thread adds D squares in a row: in float32 the error grows with D (7x PyTorch's at 4097)
  for (int c = 0; c < p.D; ++c) {
    const float v = static_cast<float>(xr[c]);
    ss += v * v;
  }
  const float r = 1.f / sqrtf(float(ss) * p.inv_D + p.eps);
  p.rstd[row] = r;
  T* yr = p.y + row * p.D;
  for (int c = 0; c < p.D; ++c) yr[c] = static_cast<T>(static_cast<float>(xr[c]) * r * static_cast<float>(p.w[c]));
}

// Steps 1-3 (and the two-pass path for rows too wide for registers). One block per row (grid: rows): its threads
// stride along the row N elements at a time (N = 1: scalar; N = kVec<T>: 128-bit), sum the squares, reduce with R
// (tree or warp shuffles), then read x again (L1/L2 when the row is recent enough) to write y.
// Dynamic shared memory: max(blockDim.x, 32) floats.
template <typename T, Reduce R, int N>
__global__ void __launch_bounds__(1024) rms_norm_fwd_rows_kernel(const NormFwd<T> p) {
  extern __shared__ float smem[];
  const int64_t row = blockIdx.x;
  const RowIO<T> io = row_io(p.x, p.y, p.D, row);
  const bool wv = aligned16(p.w);
  const int step = blockDim.x * N;
  float ss = 0.f;
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float f[N];
    load_n<N>(io.in, c, p.D, io.in_vec, 0.f, f);
#pragma unroll
    for (int j = 0; j < N; ++j) ss += f[j] * f[j];
  }
  ss = block_reduce<R>(ss, Sum{}, smem);
  const float r = 1.f / sqrtf(ss * p.inv_D + p.eps);
  if (threadIdx.x == 0) p.rstd[row] = r;
  for (int c = threadIdx.x * N; c < p.D; c += step) {
    float f[N], wf[N];
    load_n<N>(io.in, c, p.D, io.in_vec, 0.f, f);
    load_n<N>(p.w, c, p.D, wv, 0.f, wf);
#pragma unroll
    for (int j = 0; j < N; ++j) f[j] = f[j] * r * wf[j];
    store_n<N>(io.out, c, p.D, io.out_vec, f);
  }
}

// Step 4. Rows held in registers. Block (threads, rows_per_block): row blockIdx.x * blockDim.y + threadIdx.y; thread
// t holds the VPT vectors starting at elements (t + i * blockDim.x) * N, so each warp-wide load is contiguous. All VPT
// loads are issued before the first use; x is read once.
template <typename T, int VPT>
__global__ void __launch_bounds__(1024) rms_norm_fwd_registers_kernel(const NormFwd<T> p) {
  constexpr int N = kVec<T>;
  __shared__ float red[kMaxRowsPerBlock * 32];
  float v[VPT][N];
  const RegRow row = load_reg_row(p.x, p.rows, p.D, 0.f, v);
  const float ss = block_reduce_warp(dot_regs(v, v), Sum{}, red);
  if (!row.valid) return;  // after the last barrier
  const float r = 1.f / sqrtf(ss * p.inv_D + p.eps);
  if (threadIdx.x == 0) p.rstd[row.index] = r;
  store_scaled<VPT, N>(p.y + row.index * p.D, p.w, threadIdx.x * N, blockDim.x * N, p.D, r, v);
}

// Step 4 for rows wider than a block (Hopper, sm_90+). A cluster of C blocks per row (grid: rows * C, cluster dims
// (C, 1, 1)); block `rank` holds columns [rank * slice, (rank + 1) * slice) in registers as in the kernel above. Each
// block's sum of squares goes to its shared memory; after a cluster barrier every block reads all C partials through
// DSMEM and adds them in rank order (cluster_sum: the same total, bit for bit, in every block); a second barrier
// (arrive there, wait before exiting) keeps each block's shared memory alive until the others have read it.
template <typename T, int VPT>
__global__ void __launch_bounds__(1024) rms_norm_fwd_cluster_kernel(const NormFwd<T> p, int slice) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int N = kVec<T>;
  __shared__ float red[32];
  __shared__ float part;
  const cg::cluster_group cluster = cg::this_cluster();
  float v[VPT][N];
  const ClusterSlice s = load_cluster_slice(cluster, p.x, p.D, slice, 0.f, v);
  const float total = cluster_sum(cluster, block_reduce_warp(dot_regs(v, v), Sum{}, red), &part);
  const float r = 1.f / sqrtf(total * p.inv_D + p.eps);
  if (s.rank == 0 && threadIdx.x == 0) p.rstd[s.row] = r;
  store_scaled<VPT, N>(p.y + s.row * p.D, p.w, s.begin + threadIdx.x * N, blockDim.x * N, s.end, r, v);
  cluster.barrier_wait();  // no block exits while another may still read its `part`
#else
  __trap();  // the host launches this only for a binary built for sm_90+
#endif
}

// Step 6 (sm_90+): tma_rows. Grid: G persistent clusters of C blocks (the host's launch_tma), dynamic shared memory:
// `stages` buffers of `slice` elements.
template <typename T, int VPT, bool HOLD>
__global__ void __launch_bounds__(kTmaMaxThreads) rms_norm_fwd_tma_kernel(const NormFwd<T> p, int slice, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  tma_rows<T, VPT, HOLD, true>(p.x, p.w, p.y, p.rstd, p.rows, p.D, p.inv_D, p.eps, slice, stages);
#else
  __trap();
#endif
}


// =====================================================================================================================
// RMSNorm backward: dx = r * g - x * (r^3 * mean(g * x)), g = w * dy, r = rstd;  dweight = sum_rows dy * x * r
// =====================================================================================================================

// Registers path (D <= 16,384). Persistent blocks of blockDim.x threads, block b taking rows [b * rows_per_block, ...).
// Per row, each thread loads its VPT vectors of dy and x into registers (VPT * N <= 16 floats each), adds dy * x * r
// to its float32 dweight partials, reduces sum(w * dy * x) and writes dx; w is re-read from L1. The partials live in
// shared memory, not registers (a third row-sized array would spill): each thread owns kAcc = VPT * N + 4 floats at
// acc + threadIdx.x * kAcc, read and written 128 bits at a time (the 4 floats of padding put the 8 threads of a
// 128-bit access on distinct banks), touched by no other thread. At the end block b writes them to partial row b.
// Dynamic shared memory: kAcc * blockDim.x floats.
template <typename T, int VPT>
__global__ void __launch_bounds__(1024) rms_norm_bwd_registers_kernel(const NormBwd<T> p) {
  constexpr int N = kVec<T>, kAcc = VPT * N + 4;
  __shared__ float red[32];
  extern __shared__ float4 acc_smem[];
  float4* acc = acc_smem + threadIdx.x * (kAcc / 4);  // element j of vector i: acc[(i * N + j) / 4], lane j % 4
#pragma unroll
  for (int q = 0; q < VPT * N / 4; ++q) acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool wv = aligned16(p.w);
  const int64_t first = int64_t(blockIdx.x) * p.rows_per_block;
  const int64_t last = min(p.rows, first + p.rows_per_block);
  for (int64_t row = first; row < last; ++row) {
    const T* dyr = p.dy.row(row);
    const T* xr = p.x.row(row);
    const bool dyv = aligned16(dyr), xv = aligned16(xr);
    const float r = p.rstd[row];
    float g[VPT][N], xs[VPT][N];
    load_vectors2<VPT, N>(dyr, dyv, xr, xv, threadIdx.x * N, blockDim.x * N, p.D, g, xs);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      float wf[N];
      load_n<N>(p.w, (threadIdx.x + i * blockDim.x) * N, p.D, wv, 0.f, wf);
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        float4 a = acc[(i * N) / 4 + q];
        const float* gq = &g[i][4 * q];
        const float* xq = &xs[i][4 * q];
        a.x += gq[0] * xq[0] * r;
        a.y += gq[1] * xq[1] * r;
        a.z += gq[2] * xq[2] * r;
        a.w += gq[3] * xq[3] * r;
        acc[(i * N) / 4 + q] = a;
      }
#pragma unroll
      for (int j = 0; j < N; ++j) {
        g[i][j] *= wf[j];  // g = w * dy from here on
        dot += g[i][j] * xs[i][j];
      }
    }
    dot = block_reduce_warp(dot, Sum{}, red);
    const float k = r * r * r * dot * p.inv_D;
    T* dxr = p.dx + row * p.D;
    const bool dxv = aligned16(dxr);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
#pragma unroll
      for (int j = 0; j < N; ++j) g[i][j] = r * g[i][j] - k * xs[i][j];
      store_n<N>(dxr, (threadIdx.x + i * blockDim.x) * N, p.D, dxv, g[i]);
    }
  }
  float* pr = p.partial + int64_t(blockIdx.x) * p.D;
  const float* own = reinterpret_cast<const float*>(acc);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int col = (threadIdx.x + i * blockDim.x) * N;
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (col + j < p.D) pr[col + j] = own[i * N + j];
  }
}

// TMA path (kTma and kBest, sm_90+, D <= 16,384, rows of whole aligned 16-byte vectors). Persistent blocks as above,
// but a row's dy and x arrive by two bulk copies (step 6's) into one of two shared-memory stages, and the copies of
// row k + S are issued as soon as row k is done with its stage (S = kBwdTmaStages): the next rows' loads fly while
// this one is reduced and written, holding no registers. (Loading the next row into registers instead took
// registers, hence blocks, and was slower: benchmarks/NOTES.md, 2026-11-25.) Thread t owns the columns
// (t + i * blockDim.x) * N, i < VPT; its w and its float32 dweight partials stay in registers throughout. Dynamic
// shared memory: S stages x (dy, x) x D.
template <typename T, int VPT>
__global__ void __launch_bounds__(1024) rms_norm_bwd_tma_kernel(const NormBwd<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int N = kVec<T>;
  __shared__ float red[32];
  constexpr int S = kBwdTmaStages;
  __shared__ uint64_t bar[S];
  T* const stage = tma_slice_buffer<T>();  // stage s: dy at stage + 2 s D, x right after it
  const int64_t first = int64_t(blockIdx.x) * p.rows_per_block;
  const int64_t last = min(p.rows, first + p.rows_per_block);
  const uint32_t row_bytes = uint32_t(p.D) * sizeof(T);
  const auto fetch = [&](int64_t row, int s) {  // one thread: the row's dy and x into stage s, counted by bar[s]
    T* dst = stage + 2 * s * p.D;
    mbarrier_arrive_expect(&bar[s], 2 * row_bytes);
    bulk_copy_to_shared(dst, p.dy.row(row), row_bytes, &bar[s]);
    bulk_copy_to_shared(dst + p.D, p.x.row(row), row_bytes, &bar[s]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbarrier_init(&bar[s]);
    for (int s = 0; s < S && first + s < last; ++s) fetch(first + s, s);
  }
  float wf[VPT][N], acc[VPT][N];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    load_n<N>(p.w, (threadIdx.x + i * blockDim.x) * N, p.D, true, 0.f, wf[i]);  // the host checked w's alignment
#pragma unroll
    for (int j = 0; j < N; ++j) acc[i][j] = 0.f;
  }
  __syncthreads();  // the barriers are initialized before anyone waits on them
  float r_next = first < last ? p.rstd[first] : 0.f;
  for (int64_t row = first; row < last; ++row) {
    const int k = int(row - first), s = k % S;
    const float r = r_next;
    if (row + 1 < last) r_next = p.rstd[row + 1];  // its latency hides behind this row
    mbarrier_wait(&bar[s], (k / S) & 1);           // the stage's (k / S)-th fill has landed
    const T* dys = stage + 2 * s * p.D;
    const T* xs = dys + p.D;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (threadIdx.x + i * blockDim.x) * N;
      if (col >= p.D) continue;
      const Pack<T, N> g = *reinterpret_cast<const Pack<T, N>*>(dys + col);
      const Pack<T, N> xv = *reinterpret_cast<const Pack<T, N>*>(xs + col);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float gx = static_cast<float>(g.v[j]) * static_cast<float>(xv.v[j]);
        acc[i][j] += gx * r;
        dot += gx * wf[i][j];
      }
    }
    dot = block_reduce_warp(dot, Sum{}, red);
    const float kc = r * r * r * dot * p.inv_D;
    T* dxr = p.dx + row * p.D;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int col = (threadIdx.x + i * blockDim.x) * N;
      if (col >= p.D) continue;
      const Pack<T, N> g = *reinterpret_cast<const Pack<T, N>*>(dys + col);
      const Pack<T, N> xv = *reinterpret_cast<const Pack<T, N>*>(xs + col);
      Pack<T, N> out;
#pragma unroll
      for (int j = 0; j < N; ++j)
        out.v[j] = static_cast<T>(r * (wf[i][j] * static_cast<float>(g.v[j])) - kc * static_cast<float>(xv.v[j]));
      *reinterpret_cast<Pack<T, N>*>(dxr + col) = out;
    }
    __syncthreads();  // every thread is done reading stage s
    if (threadIdx.x == 0 && row + S < last) {
      fence_proxy_async();
      fetch(row + S, s);
    }
  }
  float* pr = p.partial + int64_t(blockIdx.x) * p.D;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int col = (threadIdx.x + i * blockDim.x) * N;
    if (col >= p.D) continue;
#pragma unroll
    for (int j = 0; j < N; ++j) pr[col + j] = acc[i][j];
  }
#else
  __trap();  // the host launches this only for a binary built for sm_90+
#endif
}

// Streaming path, kernel 1 of 2. One block per row (grid: rows): coef[row] = r^3 * mean(w * dy * x).
template <typename T, int N>
__global__ void __launch_bounds__(1024) rms_norm_bwd_coef_kernel(const NormBwd<T> p) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const T* dyr = p.dy.row(row);
  const T* xr = p.x.row(row);
  const bool dyv = aligned16(dyr), xv = aligned16(xr), wv = aligned16(p.w);
  float dot = 0.f;
  for (int c = threadIdx.x * N; c < p.D; c += blockDim.x * N) {
    float g[N], xs[N], wf[N];
    load_n<N>(dyr, c, p.D, dyv, 0.f, g);
    load_n<N>(xr, c, p.D, xv, 0.f, xs);
    load_n<N>(p.w, c, p.D, wv, 0.f, wf);
#pragma unroll
    for (int j = 0; j < N; ++j) dot += g[j] * wf[j] * xs[j];
  }
  dot = block_reduce_warp(dot, Sum{}, red);
  if (threadIdx.x == 0) {
    const float r = p.rstd[row];
    p.coef[row] = r * r * r * dot * p.inv_D;
  }
}

// Streaming path, kernel 2 of 2. Grid (column tiles, row chunks): thread t of tile bx owns the N columns starting at
// (bx * blockDim.x + t) * N and walks the rows [by * rows_per_block, ...): dx = r * w * dy - coef * x, and its dweight
// partials in registers, written to partial row by at the end. Each row's tile is one contiguous segment per block.
template <typename T, int N>
__global__ void __launch_bounds__(256) rms_norm_bwd_columns_kernel(const NormBwd<T> p) {
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * N;
  if (col >= p.D) return;  // no barriers in this kernel
  const bool wv = aligned16(p.w);
  float wf[N], acc[N];
  load_n<N>(p.w, col, p.D, wv, 0.f, wf);
#pragma unroll
  for (int j = 0; j < N; ++j) acc[j] = 0.f;
  const int64_t first = int64_t(blockIdx.y) * p.rows_per_block;
  const int64_t last = min(p.rows, first + p.rows_per_block);
  for (int64_t row = first; row < last; ++row) {
    const T* dyr = p.dy.row(row);
    const T* xr = p.x.row(row);
    T* dxr = p.dx + row * p.D;
    float g[N], xs[N], out[N];
    load_n<N>(dyr, col, p.D, aligned16(dyr), 0.f, g);
    load_n<N>(xr, col, p.D, aligned16(xr), 0.f, xs);
    const float r = p.rstd[row], k = p.coef[row];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      acc[j] += g[j] * xs[j] * r;
      out[j] = r * (g[j] * wf[j]) - k * xs[j];
    }
    store_n<N>(dxr, col, p.D, aligned16(dxr), out);
  }
  float* pr = p.partial + int64_t(blockIdx.y) * p.D;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (col + j < p.D) pr[col + j] = acc[j];
}

// dweight[c] = sum over partial rows of partial[q][c], in a fixed order. Block (32, 32): threadIdx.x a column (a warp
// reads 128 contiguous bytes), threadIdx.y the partial rows y, y + 32, ...; the 32 sums then added in y order.
// Grid: ceil(D / 32).
__global__ void __launch_bounds__(1024) dweight_finish_kernel(const float* partial, int64_t n_partial, int D,
                                                              float* dweight) {
  __shared__ float sums[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float a = 0.f;
  if (c < D)
    for (int64_t q = threadIdx.y; q < n_partial; q += blockDim.y) a += partial[q * D + c];
  sums[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && c < D) {
    float t = 0.f;
    for (int i = 0; i < int(blockDim.y); ++i) t += sums[i][threadIdx.x];
    dweight[c] = t;
  }
}


// =====================================================================================================================
// Host: RMSNorm's launchers
// =====================================================================================================================
template <typename T>
void rms_norm_fwd_typed(const NormFwd<T>& p, int64_t variant, cudaStream_t stream) {
  constexpr int N = kVec<T>;
  static constexpr const char* kScalarNames[3] = {"rms_norm_fwd_naive", "rms_norm_fwd_block_shared",
                                                  "rms_norm_fwd_warp_shuffle"};
  const auto scalar_rows = [](auto reduce) { return rms_norm_fwd_rows_kernel<T, decltype(reduce)::value, 1>; };
  if (launch_scalar_steps(p, variant, rms_norm_fwd_naive_kernel<T>, scalar_rows, kScalarNames, stream)) return;
  const auto vectorized = rms_norm_fwd_rows_kernel<T, Reduce::kWarp, N>;
  switch (variant) {
    case kVectorized:
    case kOnline: return launch_rows(vectorized, p, N, "rms_norm_fwd_vectorized", stream);
    default:  // kRegisters, kBest, kTma
      if ((variant == kTma || (variant == kBest && p.D > kOneBlockMaxD)) &&
          launch_tma<T, kTmaNormVectors>(
              p, p.w, [](auto hold) { return rms_norm_fwd_tma_kernel<T, kTmaNormVectors, decltype(hold)::value>; },
              kTmaNormSliceBytes, "rms_norm_fwd_tma", stream))
        return;
      const auto reg_for = [](auto vpt) { return rms_norm_fwd_registers_kernel<T, decltype(vpt)::value>; };
      const auto cluster_for = [](auto vpt) { return rms_norm_fwd_cluster_kernel<T, decltype(vpt)::value>; };
      if (launch_one_pass<T>(p, reg_for, cluster_for, "rms_norm_fwd_registers", "rms_norm_fwd_cluster", stream))
        return;
      return launch_rows(vectorized, p, N, "rms_norm_fwd_vectorized", stream);
  }
}


// The TMA backward (rms_norm_bwd_tma_kernel) where it can run: D <= kBwdRegMaxD, rows of whole 16-byte vectors
// (dy's and x's starts and strides, w and dx aligned), its stages within kTmaMaxSliceBytes, a binary for sm_90+.
// Persistent: as many blocks as fit at once, at most kBwdTmaBlocksPerSm. False otherwise, launching nothing.
template <typename T>
bool launch_rms_norm_bwd_tma(NormBwd<T>& p, at::Tensor& partial, int64_t& n_partial, const at::TensorOptions& f32,
                             cudaStream_t stream) {
  constexpr int N = kVec<T>;
  const auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  const int64_t row_bytes = int64_t(p.D) * sizeof(T);
  const int64_t smem = 2 * kBwdTmaStages * row_bytes;
  if (p.D > kBwdRegMaxD || row_bytes % 16 != 0 || smem > kTmaMaxSliceBytes || !aligned(p.dy.data) ||
      !aligned(p.x.data) || (p.dy.stride * int64_t(sizeof(T))) % 16 != 0 ||
      (p.x.stride * int64_t(sizeof(T))) % 16 != 0 || !aligned(p.w) || !aligned(p.dx))
    return false;
  const int64_t nvec = p.D / N;
  int vpt = 1;
  while (vpt * N < kNormBwdMaxValues && ceil_div(nvec, vpt) > kBwdTmaThreads) vpt *= 2;
  const int threads = int(round_up(ceil_div(nvec, vpt), 32));
  if (threads > 1024) return false;
  bool launched = false;
  with_vpt(vpt, [&](auto v) {
    constexpr int VPT = decltype(v)::value;
    if constexpr (VPT * N <= kNormBwdMaxValues) {
      const auto kernel = rms_norm_bwd_tma_kernel<T, VPT>;
      cudaFuncAttributes attr{};
      int per_sm = 0;
      const bool ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion >= 90 &&
                      // the static bytes count too (active_clusters says why): 6,144 bf16 columns make 48 KiB
                      (smem + int64_t(attr.sharedSizeBytes) <= 48 * 1024 ||
                       cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTmaMaxSliceBytes) ==
                           cudaSuccess) &&
                      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, int(smem)) ==
                          cudaSuccess &&
                      per_sm > 0;
      if (!ok) {
        (void)cudaGetLastError();  // a failed query means "cannot", not an error for the next launch to report
        return;
      }
      const int64_t blocks = std::min<int64_t>(p.rows, int64_t(sm_count()) * std::min(per_sm, kBwdTmaBlocksPerSm));
      p.rows_per_block = ceil_div(p.rows, blocks);
      n_partial = ceil_div(p.rows, p.rows_per_block);
      partial = at::empty({n_partial, p.D}, f32);
      p.partial = partial.data_ptr<float>();
      kernel<<<unsigned(n_partial), threads, size_t(smem), stream>>>(p);
      KL_LAUNCH_CHECK("rms_norm_bwd_tma");
      launched = true;
    }
  });
  return launched;
}

// RMSNorm backward: the dx kernels write p.partial (allocated here), then dweight_finish_kernel sums it into dweight.
template <typename T>
void rms_norm_bwd_typed(NormBwd<T> p, float* dweight, const at::TensorOptions& f32, int64_t variant,
                        cudaStream_t stream) {
  constexpr int N = kVec<T>;
  at::Tensor partial;  // (n_partial, D) float32, alive until the finish kernel is enqueued (stream-ordered reuse)
  int64_t n_partial = 0;
  const RegConfig cfg = reg_config(p.D, N, 1024, kNormBwdMaxValues);
  const bool tma = (variant == kTma || (variant == kBest && p.D >= kBwdTmaBestMinD)) &&
                   launch_rms_norm_bwd_tma(p, partial, n_partial, f32, stream);
  if (tma) {
    // dx and the partial rows are written
  } else if ((variant == kRegisters || variant == kBest || variant == kTma) && p.D <= kBwdRegMaxD && cfg.vpt > 0) {
    with_vpt(cfg.vpt, [&](auto vpt) {
      constexpr int VPT = decltype(vpt)::value;
      if constexpr (VPT * kVec<T> <= kNormBwdMaxValues) {
        auto kernel = rms_norm_bwd_registers_kernel<T, VPT>;
        const int smem = int(sizeof(float)) * (VPT * N + 4) * cfg.threads;  // the dweight partials, <= 80 KiB
        if (smem > 48 * 1024)
          KL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                        "cudaFuncSetAttribute(rms_norm_bwd_registers)");
        int per_sm = 0;  // persistent: as many blocks as fit at once, at most 8 per SM (fewer partial rows)
        KL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, cfg.threads, smem),
                      "cudaOccupancyMaxActiveBlocksPerMultiprocessor(rms_norm_bwd_registers)");
        const int64_t blocks = std::min<int64_t>(p.rows, int64_t(sm_count()) * std::clamp(per_sm, 1, 8));
        p.rows_per_block = ceil_div(p.rows, blocks);
        n_partial = ceil_div(p.rows, p.rows_per_block);
        partial = at::empty({n_partial, p.D}, f32);
        p.partial = partial.data_ptr<float>();
        kernel<<<unsigned(n_partial), cfg.threads, smem, stream>>>(p);
        KL_LAUNCH_CHECK("rms_norm_bwd_registers");
      }
    });
  } else {
    at::Tensor coef = at::empty({p.rows}, f32);
    p.coef = coef.data_ptr<float>();
    rms_norm_bwd_coef_kernel<T, N><<<unsigned(p.rows), strided_threads(p.D, N, 512), 0, stream>>>(p);
    KL_LAUNCH_CHECK("rms_norm_bwd_coef");
    const int threads = int(std::min<int64_t>(256, round_up(ceil_div(p.D, N), 32)));
    const int64_t tiles = ceil_div(ceil_div(p.D, N), threads);
    // Row chunks: about 8 blocks per SM in all, each chunk adding one partial row.
    const int64_t chunks =
        std::clamp<int64_t>(ceil_div(int64_t(sm_count()) * 8, tiles), 1, std::min<int64_t>(p.rows, 65535));
    p.rows_per_block = ceil_div(p.rows, chunks);
    n_partial = ceil_div(p.rows, p.rows_per_block);
    partial = at::empty({n_partial, p.D}, f32);
    p.partial = partial.data_ptr<float>();
    rms_norm_bwd_columns_kernel<T, N><<<dim3(unsigned(tiles), unsigned(n_partial)), threads, 0, stream>>>(p);
    KL_LAUNCH_CHECK("rms_norm_bwd_columns");
  }
  TORCH_INTERNAL_ASSERT(n_partial > 0 && p.partial != nullptr, "rms_norm_bwd: no dweight partials were written");
  dweight_finish_kernel<<<unsigned(ceil_div(p.D, 32)), dim3(32, 32), 0, stream>>>(p.partial, n_partial, p.D, dweight);
  KL_LAUNCH_CHECK("rms_norm_bwd_dweight_finish");
}


}  // namespace

// =====================================================================================================================
// The interface (kernels.h)
// =====================================================================================================================
void rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& y, at::Tensor& rstd,
                  int64_t variant) {
  const char* fn = "rms_norm_fwd";
  check_variant(fn, variant);
  check_rows(fn, "x", x);
  const int64_t rows = x.size(0), D = x.size(1);
  check_dense(fn, "weight", weight, {D}, x.scalar_type(), x);
  check_dense(fn, "y", y, {rows, D}, x.scalar_type(), x);
  check_dense(fn, "rstd", rstd, {rows}, at::kFloat, x);
  TORCH_CHECK(eps >= 0, fn, ": eps must be >= 0, got ", eps);
  if (rows == 0) return;
  if (D == 0) {  // the mean of no squares is NaN, as in PyTorch; y is empty
    rstd.fill_(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  on_device(x, [&](auto type, cudaStream_t stream) {
    using T = decltype(type);
    const NormFwd<T> p{rows_of<T>(x), weight.const_data_ptr<T>(), y.data_ptr<T>(), rstd.data_ptr<float>(), rows,
                       int(D), float(1.0 / double(D)), float(eps)};
    rms_norm_fwd_typed(p, variant, stream);
  });
}

void rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                  at::Tensor& dx, at::Tensor& dweight, int64_t variant) {
  const char* fn = "rms_norm_bwd";
  check_variant(fn, variant);
  check_rows(fn, "x", x);
  check_rows(fn, "dy", dy);
  check_like(fn, "dy", dy, "x", x);
  TORCH_CHECK(dy.sizes() == x.sizes(), fn, ": dy must have x's shape ", x.sizes(), ", got ", dy.sizes());
  const int64_t rows = x.size(0), D = x.size(1);
  check_dense(fn, "weight", weight, {D}, x.scalar_type(), x);
  check_dense(fn, "rstd", rstd, {rows}, at::kFloat, x);
  check_dense(fn, "dx", dx, {rows, D}, x.scalar_type(), x);
  check_dense(fn, "dweight", dweight, {D}, at::kFloat, x);
  if (D == 0) return;
  if (rows == 0) {  // a sum over no rows
    dweight.zero_();
    return;
  }
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  on_device(x, [&](auto type, cudaStream_t stream) {
    using T = decltype(type);
    const NormBwd<T> p{rows_of<T>(dy), rows_of<T>(x), weight.const_data_ptr<T>(), rstd.const_data_ptr<float>(),
                       dx.data_ptr<T>(), nullptr, nullptr, rows, int(D), float(1.0 / double(D)), 0};
    rms_norm_bwd_typed(p, dweight.data_ptr<float>(), f32, variant, stream);
  });
}


}  // namespace kernel_lib_cuda
