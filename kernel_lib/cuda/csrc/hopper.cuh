// hopper.cuh: the Hopper (sm_90+) helpers of both ops: a cluster block's part of a row and the rank-ordered sum
// over distributed shared memory, the Tensor Memory Accelerator's bulk copies and mbarriers, and step 6's
// persistent kernel body (tma_rows). Compiled to nothing below sm_90.
#pragma once

#include "device.cuh"

namespace kernel_lib_cuda {
namespace {

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

}  // namespace
}  // namespace kernel_lib_cuda
