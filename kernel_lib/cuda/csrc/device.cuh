// device.cuh: what every kernel of kernels.h shares: the error checks, the sizes, the device helpers (128-bit
// packs, loads with a scalar fallback, warp and block reductions, the online softmax's state), the kernel argument
// structs and the row helpers. Notebook 05a walks through them.
#pragma once

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


}  // namespace
}  // namespace kernel_lib_cuda
