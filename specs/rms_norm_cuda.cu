// RMSNorm forward in CUDA C++, written plainly: the search's CUDA starting point (specs/rms_norm_cuda.json).
//
// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w. One block per row; each thread strides over the row with
// scalar float loads, the partial sums meet in shared memory through a tree of __syncthreads() steps (no warp
// shuffles), and the row is read again to write y. BLOCK (threads per block, a power of two) comes from the launch
// configuration as a -D define, so the search can change it.
#ifndef BLOCK
#define BLOCK 64
#endif

extern "C" __global__ void rms_norm_fwd(const float* x, const float* w, float* y, int N, float eps) {
    extern __shared__ float partial[];  // BLOCK floats (launch shared_mem = 4 * BLOCK)
    const long long row = blockIdx.x;
    const float* xr = x + row * N;
    float acc = 0.0f;
    for (int c = threadIdx.x; c < N; c += BLOCK) {
        float v = xr[c];
        acc += v * v;
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int step = BLOCK / 2; step > 0; step >>= 1) {
        if (threadIdx.x < step) partial[threadIdx.x] += partial[threadIdx.x + step];
        __syncthreads();
    }
    const float rstd = rsqrtf(partial[0] / N + eps);
    for (int c = threadIdx.x; c < N; c += BLOCK) y[row * N + c] = xr[c] * rstd * w[c];
}
