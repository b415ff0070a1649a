// kernels.cu: RMSNorm (forward, backward) and row softmax (forward, backward) in CUDA C++, the ladder of notebook 05a.
//
//   RMSNorm:  y = x * rstd * w,   rstd = 1/sqrt(mean(x^2) + eps)        softmax: y = exp(x - max) / sum(exp(x - max))
//
// Every kernel reads rows of x, (rows, D) with unit stride along D and any row stride, writes y contiguous, accumulates
// in float32 and rounds y once to x's dtype (float32, bfloat16 or float16). The floor is a copy: read x once and write
// y once, 4 bytes per element in bf16. Each step of the ladder gets closer to it:
//
//  0 naive         One thread per row, scalar loads. The 32 threads of a warp read 32 different rows, so each 32-byte
//                  sector fetched serves one element, and the grid is as small as the row count: 512 threads for
//                  2^27 elements at D = 262,144, on a GPU that needs ~100,000 in flight. x is read 2x (RMSNorm)
//                  or 3x (softmax: max, sum, output).
//  1 block_shared  One block per row. Threads stride along the row, so a warp reads 32 adjacent elements (coalesced)
//                  and every SM has work. The row statistic is a shared-memory tree: log2(threads) barriers.
//                  x is still read 2-3 times; the repeats hit L1/L2 for narrow rows, DRAM for wide ones.
//  2 warp_shuffle  The same, reduced with __shfl_xor_sync inside each warp and one value per warp through shared
//                  memory: two barriers per reduction instead of log2(threads) + 1.
//  3 vectorized    128-bit loads and stores (8 bf16 or 4 fp32 per instruction): 8x fewer memory instructions in
//                  bf16 and 16 bytes in flight per instruction. A row whose start is not 16-byte aligned (row stride
//                  not a multiple of the vector, or an offset view) and the tail of D use scalar accesses.
//  4 registers     The row held in registers: each thread issues its VPT vector loads (VPT a compile-time constant)
//                  back to back, with no branch between them (load_packs), before using any; then the statistic and
//                  the output come from registers: x is read once, the copy's 4 bytes per element. One block holds
//                  up to 32,768 elements (1024 threads x 32 floats). Wider rows, on Hopper: the row is split over a
//                  cluster of 2-8 blocks, each holding a slice in its registers, the partial statistics exchanged
//                  through distributed shared memory (DSMEM), still one read of x, up to 8 x 32,768 = 262,144
//                  elements. Without clusters, or wider still, kRegisters runs the two-pass kernel (step 3 for
//                  RMSNorm, step 5 for softmax).
//  5 online        Softmax: one pass keeps a running (max, sum of exp(x - max)) per thread, rescaling the sum when the
//                  max grows, combines them over the block, then one pass writes y: two reads of x at any width
//                  (the second from L2 when the rows in flight fit in it). RMSNorm's kOnline is step 3, already
//                  one statistics pass and one output pass.
//  6 tma           Hopper (sm_90+): persistent clusters of 1-16 blocks, as many as run at once, cluster g taking
//                  rows g, g + G, ...; each block owns a slice of every row it takes (16 KiB for RMSNorm, 32 KiB
//                  for softmax). The slices arrive by bulk copies of the Tensor Memory Accelerator (cp.async.bulk,
//                  completion counted by an mbarrier), one instruction instead of a load per 16 bytes, into two
//                  shared-memory buffers: the next row's copy is in flight while this one is used. Each thread
//                  copies its vectors of the slice into registers (RMSNorm 4, softmax 8), which frees the buffer for
//                  the next copy at once; the partials cross the cluster by st.async into every block's shared
//                  memory, counted on that block's mbarrier, with no cluster barrier per row. Softmax in bf16/fp16
//                  computes one exponential per element (against the thread's own max, rescaled once). x is read
//                  once. Slices too wide for 512 threads' registers (rows past 16 x 16,384 elements for RMSNorm,
//                  16 x 32,768 for softmax, in bf16) are read from shared memory in each pass; rows wider than 16
//                  x 225 KiB take step 4's path. Needs 16-byte aligned rows (start and row stride) whose byte width
//                  is a multiple of 16 (the bulk copy's rules); otherwise, or without sm_90, kTma runs step 4's path.
//
// kBest, by width (in elements, the same for every dtype):
//   D <= 32,768                          registers, one block per row (1-4 rows per block below 128 threads a row).
//   D > 32,768 on Hopper, aligned rows   tma: shared memory of a cluster (step 6).
//   32,768 < D <= 262,144 on Hopper,     registers of a cluster: the smallest cluster (2, 4, 8) whose slice is at most
//   rows tma cannot take                 16,384 elements, else 32,768; used when the device has cluster launch and the
//                                        kernel was built for sm_90+ (queried at run time). Softmax up to 131,072.
//   wider, or no clusters                softmax: online; RMSNorm: vectorized two-pass (2nd read partly from L2).
// Why: holding the row is the only way to read x once. Up to 32,768 elements one block does it; past that no block
// can (1024 threads x 64 registers) and a cluster is the only one-read option. Without clusters a second read (from L2
// at best) is unavoidable. Measured on an H100 (benchmarks/NOTES.md): on 2026-11-24, at 32,768 one 1024-thread block
// beat a cluster of two 16,384-element blocks (RMSNorm 96.7% of the copy against 84.0%), and at 262,144 the softmax
// registers cluster (8 blocks of 32,768) fell below the online kernel (58.8% against 62.6%); on 2026-11-25, from
// 65,536 to 262,144, the registers clusters read 65-80% (RMSNorm) and 58-70% (softmax) where the tma step read
// 89-95% and 80-87% in its first form (one row per cluster, five runs) and 91-94% and 88-89% in this file's
// persistent, pipelined form (two runs). The thresholds count elements, not bytes, for every dtype: float32 has 4
// elements a vector instead of 8, so VPT doubles and the budget of 32 floats a thread is the same.
//
// Backward. RMSNorm, D <= 16,384: persistent blocks, one float32 dweight partial row each, one read of dy and x. With
// kTma (and kBest from 1,024 elements) on Hopper, for rows the bulk copy can take (as step 6's) and whose two stages
// fit 225 KiB (float32 up to 14,400 elements), each block's rows of dy and x arrive by bulk copies into two
// shared-memory stages, the next row's in flight while one is reduced and written, w and the partials in registers;
// with kRegisters, and where the copy cannot run, dy and x of one row sit in registers and the partials in shared
// memory. Other variants, and wider rows: two streaming kernels, a per-row coefficient then column
// tiles computing dx and the dweight partials (dy and x read twice). Either way a last kernel sums the partial rows
// in a fixed order: deterministic, no atomics. Softmax backward (no variants): registers up to D = 16,384, a
// vectorized two-pass block per row beyond.
//
// All launches go to the current stream; temporaries come from PyTorch's caching allocator; nothing synchronizes with
// the host, so every path can be captured in a CUDA graph. A launch error is reported with the kernel's name.

#include "kernels.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // at::cuda::getCurrentCUDAStream; ATen/cuda/CUDAContext.h would add cuBLAS headers
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace cg = cooperative_groups;

// A launch that failed (bad configuration, no kernel image for the device, too many resources) raises here, naming the
// kernel, instead of surfacing at a later, unrelated CUDA call.
#define KL_LAUNCH_CHECK(name)                                                                                  \
  do {                                                                                                         \
    const cudaError_t kl_err_ = cudaGetLastError();                                                            \
    TORCH_CHECK(kl_err_ == cudaSuccess, "kernel_lib_cuda: launching ", name, " failed: ", cudaGetErrorName(kl_err_), \
                " (", cudaGetErrorString(kl_err_), ")");                                                        \
  } while (0)

// The same for a runtime call that returns its error (cudaLaunchKernelEx).
#define KL_CUDA_CHECK(expr, name)                                                                              \
  do {                                                                                                         \
    const cudaError_t kl_err_ = (expr);                                                                        \
    TORCH_CHECK(kl_err_ == cudaSuccess, "kernel_lib_cuda: ", name, " failed: ", cudaGetErrorName(kl_err_), " (", \
                cudaGetErrorString(kl_err_), ")");                                                              \
  } while (0)

// float32, bfloat16, float16 (not float64: the kernels accumulate in float32).
#define KL_DISPATCH(dtype, fn, ...)                                                                 \
  AT_DISPATCH_SWITCH(dtype, fn, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                           \
                                    AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)                    \
                                        AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace kernel_lib_cuda {
namespace {

constexpr int kMaxValues = 32;            // floats a thread holds of a row: fits a 1024-thread block's 64 registers
constexpr int kMaxRowsPerBlock = 4;       // narrow rows: up to 4 rows per block (blockDim.y), >= 128 threads a block
constexpr int kOneBlockMaxD = 32768;      // widest row one block holds in registers: 1024 threads x 32 floats
constexpr int kClusterSlice = 16384;      // a cluster block's preferred slice (<= 512 threads: 2 blocks per SM)
constexpr int kBestSoftmaxClusterMaxD = 131072;  // kBest softmax: wider rows take the online kernel (measured)
constexpr int kClusterMax = 8;            // portable cluster size: clusters reach 8 x 32,768 = 262,144 elements
constexpr int kTmaNormSliceBytes = 16384;    // step 6's slice a block, RMSNorm (measured: 16-64 KiB, 2026-11-25)
constexpr int kTmaSoftmaxSliceBytes = 32768;  // softmax: more work a row, larger slices (measured: 16-64 KiB)
constexpr int kTmaNormVectors = 4;           // 128-bit vectors a thread holds of its slice, RMSNorm (w's too)
constexpr int kTmaSoftmaxVectors = 8;        // softmax (measured: 4 and 8)
constexpr int kTmaStages = 2;                // row buffers a block: one in use, one in flight (measured)
constexpr int kTmaMaxThreads = 512;          // a step-6 block, at most (its launch bound: up to 128 registers)
constexpr int kTmaMaxSliceBytes = 225 * 1024;  // a block's dynamic shared memory on Hopper (227 KiB, less the static)
constexpr int kTmaMaxCluster = 16;         // the non-portable cluster size Hopper allows (8 is portable)
constexpr int kTmaVectorsPerThread = 8;    // slices too wide to hold: vectors a thread visits in each pass
constexpr int kBwdRegMaxD = 16384;        // backward registers paths: RMSNorm 1024 x 16 floats, softmax 512 x 32
constexpr int kNormBwdMaxValues = 16;     // RMSNorm backward: dy and x held, 16 floats each per thread
constexpr int kBwdTmaStages = 2;          // RMSNorm TMA backward: rows a block has in flight or ready (3: no faster)
constexpr int kBwdTmaThreads = 1024;      // its threads a block, at most: one vector a thread where it can (measured)
constexpr int kBwdTmaBlocksPerSm = 4;     // its blocks an SM, at most: each adds a dweight partial row (measured)
constexpr int kBwdTmaBestMinD = 1024;     // kBest takes it from here (measured from 1,024; narrower rows: registers)
constexpr int64_t kMaxD = int64_t(1) << 30;  // column indices are int: col + a stride step stays below 2^31

// =====================================================================================================================
// Device helpers: 128-bit packs, loads with scalar fallback, reductions
// =====================================================================================================================
template <typename T>
constexpr int kVec = 16 / sizeof(T);  // elements in 128 bits: 4 fp32, 8 bf16/fp16

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {  // N elements loaded or stored by one instruction
  T v[N];
};

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Elements [col, col + N) of a row into f as float, `fill` at and past `end`. One 128-bit load when vec_ok (the row
// start is 16-byte aligned; col is a multiple of N) and the N elements are all before `end`; scalar loads otherwise.
template <int N, typename T>
__device__ __forceinline__ void load_n(const T* row, int col, int end, bool vec_ok, float fill, float (&f)[N]) {
  if (N > 1 && vec_ok && col + N <= end) {
    const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(row + col);
#pragma unroll
    for (int j = 0; j < N; ++j) f[j] = static_cast<float>(pack.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) f[j] = col + j < end ? static_cast<float>(row[col + j]) : fill;
  }
}

// A thread's VPT vectors of a row, at columns first + i * step (i < VPT), kept in T: when the row start is 16-byte
// aligned and all VPT vectors end before `end`, VPT 128-bit loads issued back to back, nothing between them; else
// element by element (`fill` past `end`). Calling load_n vector by vector instead puts a branch (vector or scalar)
// between the loads, and each vector's conversion, which waits for its load, comes before the next branch: the loads
// go out one round trip at a time. Nsight Compute saw that: the registers kernels stalled 10.4 cycles an instruction
// on loads against 5.4 for Triton's kernel at the same launch shape and occupancy (benchmarks/NOTES.md).
template <int VPT, int N, typename T>
__device__ __forceinline__ void load_packs(const T* row, int first, int step, int end, bool vec_ok, float fill,
                                           Pack<T, N> (&out)[VPT]) {
  if (N > 1 && vec_ok && first + (VPT - 1) * step + N <= end) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) out[i] = *reinterpret_cast<const Pack<T, N>*>(row + first + i * step);
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const int col = first + i * step + j;
        out[i].v[j] = col < end ? row[col] : static_cast<T>(fill);
      }
  }
}

// load_packs, converted to float after all loads are issued.
template <int VPT, int N, typename T>
__device__ __forceinline__ void load_vectors(const T* row, int first, int step, int end, bool vec_ok, float fill,
                                             float (&v)[VPT][N]) {
  Pack<T, N> raw[VPT];
  load_packs<VPT, N>(row, first, step, end, vec_ok, fill, raw);
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) v[i][j] = static_cast<float>(raw[i].v[j]);
}

// The same for two rows read together (a backward's dy and x): all 2 * VPT loads before any conversion.
template <int VPT, int N, typename T>
__device__ __forceinline__ void load_vectors2(const T* row_a, bool a_ok, const T* row_b, bool b_ok, int first, int step,
                                              int end, float (&a)[VPT][N], float (&b)[VPT][N]) {
  Pack<T, N> ra[VPT], rb[VPT];
  if (a_ok && b_ok) {  // one branch for both, so the 2 * VPT loads are in one block
    load_packs<VPT, N>(row_a, first, step, end, true, 0.f, ra);
    load_packs<VPT, N>(row_b, first, step, end, true, 0.f, rb);
  } else {
    load_packs<VPT, N>(row_a, first, step, end, a_ok, 0.f, ra);
    load_packs<VPT, N>(row_b, first, step, end, b_ok, 0.f, rb);
  }
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) {
      a[i][j] = static_cast<float>(ra[i].v[j]);
      b[i][j] = static_cast<float>(rb[i].v[j]);
    }
}

// f rounded to T into elements [col, min(col + N, end)) of a row; the same vector/scalar rule as load_n.
template <int N, typename T>
__device__ __forceinline__ void store_n(T* row, int col, int end, bool vec_ok, const float (&f)[N]) {
  if (N > 1 && vec_ok && col + N <= end) {
    Pack<T, N> pack;
#pragma unroll
    for (int j = 0; j < N; ++j) pack.v[j] = static_cast<T>(f[j]);
    *reinterpret_cast<Pack<T, N>*>(row + col) = pack;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (col + j < end) row[col + j] = static_cast<T>(f[j]);
  }
}

// y = v * r * w for a thread's VPT vectors of a row (RMSNorm's output), stored at columns first + i * step. When the
// row, w and every vector are in bounds and aligned, one branch-free block whose w loads go through the read-only
// path (__ldg), so the compiler may issue them ahead of the stores (a store to y cannot change w); else load_n and
// store_n vector by vector.
template <int VPT, int N, typename T>
__device__ __forceinline__ void store_scaled(T* y, const T* w, int first, int step, int end, float r,
                                             float (&v)[VPT][N]) {
  if (N > 1 && aligned16(y) && aligned16(w) && first + (VPT - 1) * step + N <= end) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const float4 raw = __ldg(reinterpret_cast<const float4*>(w + first + i * step));
      const Pack<T, N> wp = *reinterpret_cast<const Pack<T, N>*>(&raw);
      Pack<T, N> out;
#pragma unroll
      for (int j = 0; j < N; ++j) out.v[j] = static_cast<T>(v[i][j] * r * static_cast<float>(wp.v[j]));
      *reinterpret_cast<Pack<T, N>*>(y + first + i * step) = out;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      float wf[N];
      load_n<N>(w, first + i * step, end, aligned16(w), 0.f, wf);
#pragma unroll
      for (int j = 0; j < N; ++j) v[i][j] = v[i][j] * r * wf[j];
      store_n<N>(y, first + i * step, end, aligned16(y), v[i]);
    }
  }
}

struct Sum {
  static constexpr float kIdentity = 0.f;
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
  static constexpr float kIdentity = -INFINITY;
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Butterfly over the 32 lanes: every lane ends with the warp's result (the ops are commutative, so bit-identical).
template <class Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Step 1's reduction over a row's blockDim.x threads (a power of two; blockDim.y == 1): halve through shared memory,
// one barrier per halving. smem: blockDim.x floats. Every thread gets the result.
template <class Op>
__device__ float block_reduce_tree(float v, Op op, float* smem) {
  __syncthreads();  // the previous reduction may still be reading smem[0]
  smem[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) smem[threadIdx.x] = op(smem[threadIdx.x], smem[threadIdx.x + s]);
    __syncthreads();
  }
  return smem[0];
}

// Steps 2+: shuffles within each warp, one value per warp through shared memory, shuffles again. Reduces over the
// blockDim.x threads (a multiple of 32) of row threadIdx.y; smem: 32 floats per row of the block. Every thread of
// the block must call it (it has barriers); every thread gets its row's result.
template <class Op>
__device__ float block_reduce_warp(float v, Op op, float* smem) {
  v = warp_reduce(v, op);
  if (blockDim.x == 32) return v;
  float* s = smem + threadIdx.y * 32;
  const int lane = threadIdx.x & 31;
  __syncthreads();  // the previous reduction may still be reading s
  if (lane == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  return warp_reduce(lane < int(blockDim.x >> 5) ? s[lane] : Op::kIdentity, op);
}

enum class Reduce { kTree, kWarp };

template <Reduce R, class Op>
__device__ __forceinline__ float block_reduce(float v, Op op, float* smem) {
  if constexpr (R == Reduce::kTree) return block_reduce_tree(v, op, smem);
  else return block_reduce_warp(v, op, smem);
}

// exp for a row of T: in float32 the output keeps 24 bits, so expf (about 1 ulp, as PyTorch); in bf16/fp16 the
// output keeps 8-11 bits and the hardware's __expf (a few ulp of float32, a few instructions fewer) is far below that.
template <typename T>
__device__ __forceinline__ float exp_for(float x) {
  if constexpr (std::is_same_v<T, float>) return expf(x);
  else return __expf(x);
}

// The online softmax's state: a running max m and the sum s of exp(x - m) over the elements seen.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};  // only -inf seen: exp(-inf - -inf) would be NaN
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};  // a few calls a thread: the accurate exp
}
__device__ __forceinline__ MaxSum warp_reduce(MaxSum v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = combine(v, {__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)});
  return v;
}
__device__ MaxSum block_reduce(MaxSum v, float2* smem) {  // blockDim.y == 1; smem: 32 float2
  v = warp_reduce(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) smem[threadIdx.x >> 5] = make_float2(v.m, v.s);
  __syncthreads();
  const float2 t = lane < int(blockDim.x >> 5) ? smem[lane] : make_float2(-INFINITY, 0.f);
  return warp_reduce(MaxSum{t.x, t.y});
}

// =====================================================================================================================
// Kernel arguments (one struct per op, passed by value)
// =====================================================================================================================
// An input of (rows, D), unit stride along D, any row stride: the same layout as a pointer and a stride side by side.
template <typename T>
struct Rows {
  const T* data;   // row 0
  int64_t stride;  // elements between the starts of consecutive rows
  __device__ __forceinline__ const T* row(int64_t r) const { return data + r * stride; }
};

template <typename T>
struct NormFwd {
  Rows<T> x;         // input rows (rows, D)
  const T* w;        // weight (D,)
  T* y;              // output (rows, D), contiguous
  float* rstd;       // output (rows,): 1 / sqrt(mean(x^2) + eps), saved for backward
  int64_t rows;      // number of rows
  int D;             // row width
  float inv_D;       // 1 / D, rounded once on the host
  float eps;         // added to the mean square
};

template <typename T>
struct SoftmaxFwd {
  Rows<T> x;         // input rows (rows, D)
  T* y;              // output (rows, D), contiguous
  int64_t rows;      // number of rows
  int D;             // row width
};

template <typename T>
struct NormBwd {
  Rows<T> dy;              // upstream gradient (rows, D)
  Rows<T> x;               // forward input (rows, D)
  const T* w;              // weight (D,)
  const float* rstd;       // (rows,) saved by the forward
  T* dx;                   // output (rows, D), contiguous
  float* partial;          // output (partial rows, D) float32: each block's (or row chunk's) share of dweight
  float* coef;             // (rows,) float32: rstd^3 * mean(w*dy*x) per row (streaming path only)
  int64_t rows;            // number of rows
  int D;                   // row width
  float inv_D;             // 1 / D
  int64_t rows_per_block;  // rows per persistent block or per row chunk
};

template <typename T>
struct SoftmaxBwd {
  Rows<T> y;          // forward output (rows, D)
  Rows<T> dy;         // upstream gradient (rows, D)
  T* dx;              // output (rows, D), contiguous
  int64_t rows;       // number of rows
  int D;              // row width
};

// =====================================================================================================================
// Row helpers: one block per row, and the registers layout (thread t holds the VPT vectors of N elements at columns
// begin + (t + i * blockDim.x) * N, i < VPT, in v[i]: each warp-wide access is contiguous)
// =====================================================================================================================

// Row `row` of an input and of a contiguous output, and whether each allows 128-bit accesses (16-byte aligned start).
template <typename T>
struct RowIO {
  const T* in;
  T* out;
  bool in_vec, out_vec;
};
template <typename T>
__device__ __forceinline__ RowIO<T> row_io(const Rows<T>& in, T* out, int D, int64_t row) {
  const T* in_row = in.row(row);
  T* out_row = out + row * D;
  return {in_row, out_row, aligned16(in_row), aligned16(out_row)};
}

// A registers kernel's row: blockDim.y rows per block. A block's last rows may be past the end: they address row 0
// with no columns (end = 0), so they load nothing, and store nothing.
struct RegRow {
  int64_t index;  // blockIdx.x * blockDim.y + threadIdx.y
  bool valid;     // index < rows
  int64_t read;   // the row to address: index, or 0 past the end
  int end;        // columns to load: D, or 0 past the end
};
__device__ __forceinline__ RegRow reg_row(int64_t rows, int D) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  return {row, valid, valid ? row : 0, valid ? D : 0};
}

// A thread's vectors of columns [begin, end) of a row, `fill` past end (load_vectors in the registers layout).
template <int VPT, int N, typename T>
__device__ __forceinline__ void load_slice(const T* row, int begin, int end, float fill, float (&v)[VPT][N]) {
  load_vectors<VPT, N>(row, begin + threadIdx.x * N, blockDim.x * N, end, aligned16(row), fill, v);
}

// reg_row's row of x into registers.
template <int VPT, int N, typename T>
__device__ __forceinline__ RegRow load_reg_row(const Rows<T>& x, int64_t rows, int D, float fill, float (&v)[VPT][N]) {
  const RegRow r = reg_row(rows, D);
  load_slice(x.row(r.read), 0, r.end, fill, v);
  return r;
}

// v * scale rounded to T into a thread's vectors of columns [begin, end) of a row (softmax's output).
template <int VPT, int N, typename T>
__device__ __forceinline__ void store_slice(T* row, int begin, int end, float scale, float (&v)[VPT][N]) {
  const bool vec_ok = aligned16(row);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[i][j] *= scale;
    store_n<N>(row, begin + (threadIdx.x + i * blockDim.x) * N, end, vec_ok, v[i]);
  }
}

// The sum of a[i][j] * b[i][j] over a thread's registers, in loop order (RMSNorm: a = b = x).
template <int VPT, int N>
__device__ __forceinline__ float dot_regs(const float (&a)[VPT][N], const float (&b)[VPT][N]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) s += a[i][j] * b[i][j];
  return s;
}

template <int VPT, int N>
__device__ __forceinline__ float max_regs(const float (&v)[VPT][N]) {
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) m = fmaxf(m, v[i][j]);
  return m;
}

// v = exp(v - shift) in place, kept for the output; returns the sum of the new values.
template <typename T, int VPT, int N>
__device__ __forceinline__ float exp_regs(float (&v)[VPT][N], float shift) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) s += (v[i][j] = exp_for<T>(v[i][j] - shift));
  return s;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A cluster block's part of a row (sm_90+): the C blocks of a cluster share row blockIdx.x / C; block `rank` holds
// columns [begin, end), from rank * slice, in registers.
struct ClusterSlice {
  int C, rank;     // blocks in the cluster, this block's rank
  int64_t row;     // the row
  int begin, end;  // this block's columns
};
template <int VPT, int N, typename T>
__device__ __forceinline__ ClusterSlice load_cluster_slice(const cg::cluster_group& cluster, const Rows<T>& x, int D,
                                                           int slice, float fill, float (&v)[VPT][N]) {
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int begin = rank * slice;
  const ClusterSlice s{C, rank, blockIdx.x / C, begin, min(D, begin + slice)};
  load_slice(x.row(s.row), s.begin, s.end, fill, v);
  return s;
}

// The row's total of every block's `mine`, added in rank order through DSMEM (the same bits in every block of the
// cluster). Every thread of every block calls it; `part` is one float of the block's shared memory. It returns after
// arriving at a cluster barrier: the caller waits on it (cluster.barrier_wait()) before exiting, so no block's `part`
// goes away while another block may still read it.
__device__ __forceinline__ float cluster_sum(const cg::cluster_group& cluster, float mine, float* part) {
  if (threadIdx.x == 0) *part = mine;
  cluster.sync();  // every block's partial written and visible
  float total = 0.f;
  for (int q = 0; q < int(cluster.num_blocks()); ++q) total += *cluster.map_shared_rank(part, q);
  cluster.barrier_arrive();  // done reading the others' shared memory
  return total;
}

// Softmax's cluster_sum: each block's (m, s) = (its max, the sum of exp(x - m) over its slice) combined into the
// row's (M, S) = (max of the m, sum of s * exp(m - M)), the same bits in every block. Same barrier rule.
__device__ __forceinline__ float2 cluster_max_sum(const cg::cluster_group& cluster, float m, float s, float2* part) {
  if (threadIdx.x == 0) *part = make_float2(m, s);
  cluster.sync();
  const int C = int(cluster.num_blocks());
  float M = -INFINITY, S = 0.f;
  for (int q = 0; q < C; ++q) M = fmaxf(M, cluster.map_shared_rank(part, q)->x);
  for (int q = 0; q < C; ++q) {
    const float2 other = *cluster.map_shared_rank(part, q);
    S += other.y * expf(other.x - M);
  }
  cluster.barrier_arrive();
  return make_float2(M, S);
}

// Step 6's plumbing (sm_90+). An mbarrier counts the bytes the Tensor Memory Accelerator delivers; one thread arms it
// with the byte count and issues the bulk copy, every thread waits for the phase to complete (the barriers are
// reused row after row, phases 0, 1, 0, ...). Inline PTX: CUDA's C++ wrappers for these
// (cuda::device::memcpy_async_tx) appeared in CUDA 12.4 and change between versions.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// One thread: initialize the barrier (one arrival expected) and make it visible to the async proxy.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One thread: the barrier's one arrival of this phase, which will complete once `bytes` have arrived.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// One thread: copy `bytes` from global src to shared dst, counted on the barrier. src and dst 16-byte aligned, bytes a
// multiple of 16 (the bulk copy's rules; the host checks them).
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// One thread, before a bulk copy overwrites shared memory that threads read with ordinary loads (after a barrier
// that ends those reads): orders those reads before the copy's writes, which go through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Every thread: wait until the barrier's phase `parity` has completed (all expected bytes arrived).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
}

// The same for a barrier that other blocks of the cluster complete (step 6's exchange: their st.async signal it at
// cluster scope), so the wait acquires at cluster scope too.
__device__ __forceinline__ void mbarrier_wait_cluster(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
}

// A step-6 block's slice buffer: its dynamic shared memory, which the host sizes to the slice.
template <typename T>
__device__ __forceinline__ T* tma_slice_buffer() {
  extern __shared__ __align__(128) unsigned char tma_smem[];
  return reinterpret_cast<T*>(tma_smem);
}

// Step 6's exchange. The cluster address of `p` (this block's shared memory) in block `rank`, and one float2 stored
// there by st.async, counted on that block's mbarrier (complete_tx): the receiver waits on its own barrier. A cluster
// barrier instead (cluster.sync) would make every thread's earlier stores of y complete first (its arrive releases
// them), once per row.
__device__ __forceinline__ uint32_t cluster_addr(const void* p, int rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(smem_addr(p)), "r"(rank));
  return out;
}

__device__ __forceinline__ void st_async_float2(uint32_t dst, float2 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(dst),
               "f"(v.x), "f"(v.y), "r"(bar)
               : "memory");
}

// Step 6's shared memory besides the stages: the block reduction's scratch, the rows' bulk-copy barriers, and the
// exchange's two slots (row k uses slot k & 1: part[slot][q] holds block q's partial, pbar[slot] counts them).
struct TmaShared {
  float red[32];
  float2 part[2][kTmaMaxCluster];
  uint64_t bar[kTmaStages];
  uint64_t pbar[2];
};

// Every block of the cluster sends `mine` to every block (thread q sends to block q) and waits until all C partials
// of row k have arrived in its part[k & 1]. A slot is reused two rows later: a block sends row k + 2 only after it
// has received row k + 1 from every block, which each sends after it has read row k's partials.
__device__ __forceinline__ const float2* cluster_exchange(TmaShared& sh, float2 mine, int C, int rank, int k) {
  const int slot = k & 1;
  if (threadIdx.x == 0) mbarrier_arrive_expect(&sh.pbar[slot], uint32_t(C * sizeof(float2)));
  if (int(threadIdx.x) < C)
    st_async_float2(cluster_addr(&sh.part[slot][rank], threadIdx.x), mine, cluster_addr(&sh.pbar[slot], threadIdx.x));
  mbarrier_wait_cluster(&sh.pbar[slot], (k >> 1) & 1);  // the slot's (k >> 1)-th use
  return sh.part[slot];
}

// Step 6, both ops (NORM: RMSNorm, else softmax). Persistent clusters: cluster g of G takes rows g, g + G, ...; block
// `rank` of C owns columns [rank * slice, ...) of each. Its row slices arrive by bulk copies into `stages` buffers of
// dynamic shared memory, the next rows' copies in flight while one is used. HOLD (the slice fits the block's
// registers, VPT 128-bit vectors a thread): each thread copies its vectors into registers, and the buffer is refilled
// at once; else every pass reads the buffer, refilled after y is written. Partials cross the cluster by
// cluster_exchange. Softmax in bf16/fp16 with HOLD computes one exp per element: e = exp(x - m_t) against the
// thread's own max m_t, and y = e * exp(m_t - M) / S. The two-exp form exp(x - M) / S is kept for float32, whose
// outputs keep 24 bits; in bf16 it read 67% of the copy at 262,144 columns where one exp reads 86% (H100, 2026-11-25).
template <typename T, int VPT, bool HOLD, bool NORM>
__device__ __forceinline__ void tma_rows(const Rows<T>& x, const T* w, T* y, float* rstd, int64_t rows, int D,
                                         float inv_D, float eps, int slice, int stages) {
  constexpr int N = kVec<T>;
  constexpr bool kOneExp = HOLD && !NORM && sizeof(T) == 2;
  __shared__ TmaShared sh;
  const cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int64_t G = gridDim.x / C, g = blockIdx.x / C;
  const int begin = rank * slice, n = min(D, begin + slice) - begin;  // n: a multiple of N (the host's rule)
  const uint32_t bytes = uint32_t(n) * sizeof(T);
  T* const buf = tma_slice_buffer<T>();
  const auto fetch = [&](int64_t row, int s) {  // one thread: row's slice into buffer s
    mbarrier_arrive_expect(&sh.bar[s], bytes);
    bulk_copy_to_shared(buf + int64_t(s) * slice, x.row(row) + begin, bytes, &sh.bar[s]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&sh.bar[s]);
    mbarrier_init(&sh.pbar[0]);
    mbarrier_init(&sh.pbar[1]);
    for (int s = 0; s < stages && g + s * G < rows; ++s) fetch(g + s * G, s);
  }
  Pack<T, N> wv[NORM && HOLD ? VPT : 1];  // RMSNorm with HOLD: w's slice in registers for every row
  if constexpr (NORM && HOLD) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int c = (threadIdx.x + i * blockDim.x) * N;
      if (c < n) wv[i] = *reinterpret_cast<const Pack<T, N>*>(w + begin + c);
    }
  }
  cluster.sync();  // every block's barriers initialized before any partial is sent to it
  const float fill = NORM ? 0.f : -INFINITY;
  int k = 0;
  for (int64_t row = g; row < rows; row += G, ++k) {
    const int s = k % stages;
    mbarrier_wait(&sh.bar[s], (k / stages) & 1);  // buffer s's (k / stages)-th fill has landed
    const T* st = buf + int64_t(s) * slice;
    T* yr = y + row * D + begin;
    Pack<T, N> v[HOLD ? VPT : 1];
    if constexpr (HOLD) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = (threadIdx.x + i * blockDim.x) * N;
        if (c < n) {
          v[i] = *reinterpret_cast<const Pack<T, N>*>(st + c);
        } else {
#pragma unroll
          for (int e = 0; e < N; ++e) v[i].v[e] = static_cast<T>(fill);
        }
      }
      __syncthreads();  // every thread has its copy: refill the buffer now
      if (threadIdx.x == 0 && row + stages * G < rows) {
        fence_proxy_async();
        fetch(row + stages * G, s);
      }
    }
    // thread's vector i, at column c: from registers or from the buffer
    const auto vec = [&](int i, int c) -> Pack<T, N> {
      if constexpr (HOLD) return v[i];
      else return *reinterpret_cast<const Pack<T, N>*>(st + c);
    };
    // the thread's columns: HOLD, VPT fixed vectors (unrolled); else a loop striding over the slice
    const auto for_each = [&](auto&& f) {
      if constexpr (HOLD) {
#pragma unroll
        for (int i = 0; i < VPT; ++i) f(i, (threadIdx.x + i * blockDim.x) * N);
      } else {
        for (int c = threadIdx.x * N; c < n; c += blockDim.x * N) f(0, c);
      }
    };
    if constexpr (NORM) {
      float ss = 0.f;
      for_each([&](int i, int c) {
        const Pack<T, N> p = vec(i, c);
#pragma unroll
        for (int e = 0; e < N; ++e) ss += static_cast<float>(p.v[e]) * static_cast<float>(p.v[e]);
      });
      const float2* part = cluster_exchange(sh, make_float2(block_reduce_warp(ss, Sum{}, sh.red), 0.f), C, rank, k);
      float total = 0.f;
      for (int q = 0; q < C; ++q) total += part[q].x;  // rank order: the same bits in every block
      const float r = 1.f / sqrtf(total * inv_D + eps);
      if (rank == 0 && threadIdx.x == 0) rstd[row] = r;
      for_each([&](int i, int c) {
        if (c >= n) return;
        const Pack<T, N> p = vec(i, c);
        Pack<T, N> wp;
        if constexpr (HOLD) {
          wp = wv[i];
        } else {
          const float4 wraw = __ldg(reinterpret_cast<const float4*>(w + begin + c));
          wp = *reinterpret_cast<const Pack<T, N>*>(&wraw);
        }
        Pack<T, N> out;
#pragma unroll
        for (int e = 0; e < N; ++e)
          out.v[e] = static_cast<T>(static_cast<float>(p.v[e]) * r * static_cast<float>(wp.v[e]));
        *reinterpret_cast<Pack<T, N>*>(yr + c) = out;
      });
    } else if constexpr (kOneExp) {
      float m_t = -INFINITY;
#pragma unroll
      for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int e = 0; e < N; ++e) m_t = fmaxf(m_t, static_cast<float>(v[i].v[e]));
      const float shift = m_t == -INFINITY ? 0.f : m_t;  // a thread of only -inf: its e are 0, not NaN
      float ev[VPT][N], s_t = 0.f;
#pragma unroll
      for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int e = 0; e < N; ++e) s_t += (ev[i][e] = exp_for<T>(static_cast<float>(v[i].v[e]) - shift));
      const float m_b = block_reduce_warp(m_t, Max{}, sh.red);
      const float s_b = block_reduce_warp(m_t == -INFINITY ? 0.f : s_t * expf(m_t - m_b), Sum{}, sh.red);
      const float2* part = cluster_exchange(sh, make_float2(m_b, s_b), C, rank, k);
      float M = -INFINITY, S = 0.f;
      for (int q = 0; q < C; ++q) M = fmaxf(M, part[q].x);
      for (int q = 0; q < C; ++q) S += part[q].y * expf(part[q].x - M);  // a row of only -inf: NaN, as PyTorch
      const float scale = (m_t == -INFINITY ? 0.f : expf(m_t - M)) / S;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int c = (threadIdx.x + i * blockDim.x) * N;
        if (c >= n) continue;
        Pack<T, N> out;
#pragma unroll
        for (int e = 0; e < N; ++e) out.v[e] = static_cast<T>(ev[i][e] * scale);
        *reinterpret_cast<Pack<T, N>*>(yr + c) = out;
      }
    } else {
      float m = -INFINITY;
      for_each([&](int i, int c) {
        const Pack<T, N> p = vec(i, c);
#pragma unroll
        for (int e = 0; e < N; ++e) m = fmaxf(m, static_cast<float>(p.v[e]));
      });
      m = block_reduce_warp(m, Max{}, sh.red);
      const float shift = m == -INFINITY ? 0.f : m;  // a slice of only -inf: exp(-inf - 0) = 0, not NaN
      float sum = 0.f;
      for_each([&](int i, int c) {
        const Pack<T, N> p = vec(i, c);
#pragma unroll
        for (int e = 0; e < N; ++e) sum += exp_for<T>(static_cast<float>(p.v[e]) - shift);
      });
      const float2* part = cluster_exchange(sh, make_float2(m, block_reduce_warp(sum, Sum{}, sh.red)), C, rank, k);
      float M = -INFINITY, S = 0.f;
      for (int q = 0; q < C; ++q) M = fmaxf(M, part[q].x);
      for (int q = 0; q < C; ++q) S += part[q].y * expf(part[q].x - M);
      const float inv = 1.f / S;
      for_each([&](int i, int c) {
        if (c >= n) return;
        const Pack<T, N> p = vec(i, c);
        Pack<T, N> out;
#pragma unroll
        for (int e = 0; e < N; ++e) out.v[e] = static_cast<T>(exp_for<T>(static_cast<float>(p.v[e]) - M) * inv);
        *reinterpret_cast<Pack<T, N>*>(yr + c) = out;
      });
    }
    if constexpr (!HOLD) {
      __syncthreads();  // every thread is done with buffer s
      if (threadIdx.x == 0 && row + stages * G < rows) {
        fence_proxy_async();
        fetch(row + stages * G, s);
      }
    }
  }
}
#endif

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

// Step 6 (see the top of the file and tma_rows): as many clusters as run at once, each taking every G-th row. False
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

// The registers step of both forward ops (kRegisters and kBest; see the top of the file): one block up to
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

template <typename T>
void softmax_bwd_typed(const SoftmaxBwd<T>& p, cudaStream_t stream) {
  const auto reg_for = [](auto vpt) { return softmax_bwd_registers_kernel<T, decltype(vpt)::value>; };
  if (p.D <= kBwdRegMaxD && launch_registers<kMaxValues, T>(p, 512, reg_for, "softmax_bwd_registers", stream)) return;
  softmax_bwd_rows_kernel<T, kVec<T>><<<unsigned(p.rows), strided_threads(p.D, kVec<T>, 1024), 0, stream>>>(p);
  KL_LAUNCH_CHECK("softmax_bwd_rows");
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
