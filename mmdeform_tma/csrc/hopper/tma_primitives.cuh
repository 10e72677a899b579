// sm_90a building blocks: mbarriers with transaction counts, TMA tensor copies and reductions, bulk
// groups, proxy fences.
// Device code here is only emitted for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); the kernels that use it
// compile to a trap on every other target, and their launchers refuse non-Hopper GPUs.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MMDEFORM_TMA_HOPPER_DEVICE 1
#else
#define MMDEFORM_TMA_HOPPER_DEVICE 0
#endif

namespace mmdeform_tma {
namespace hopper {

__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

#if MMDEFORM_TMA_HOPPER_DEVICE

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}

// Makes initialised mbarriers visible to the other threads and to the async (TMA) proxy.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Arrives and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred complete;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, complete;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Waits until the phase with this parity has completed (acquire: its TMA data is visible).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// A barrier of `threads` threads (whole warps) on hardware barrier 1: __syncthreads keeps 0, and
// the roles of a warp-specialized CTA synchronise apart.
__device__ __forceinline__ void consumer_barrier(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses before later async-proxy (TMA) ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// 2-D tile copy global -> shared; completes `bytes` of `bar`'s transaction count. The box may lie
// partly outside the tensor: those elements arrive as zeros and still count.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int32_t x, int32_t y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_address(bar))
      : "memory");
}

// The same to a shared-memory address held as 32 bits (no 64-bit pointer kept live for it).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int32_t x, int32_t y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_address(bar))
      : "memory");
}

// 2-D tile reduction shared -> global: adds the box at `src` (laid out as the map's box, swizzle
// included) element-wise into the tensor at (x, y), atomically per element; elements outside the
// tensor are dropped. Completes through this thread's bulk groups (bulk_commit_group).
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, uint32_t src, int32_t x, int32_t y) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(x), "r"(y)
               : "memory");
}

// Closes this thread's bulk operations issued so far into one group.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until every bulk group of this thread has read its shared-memory source (it may be rewritten).
__device__ __forceinline__ void bulk_wait_group_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Waits until every bulk group of this thread has completed, its global writes included.
__device__ __forceinline__ void bulk_wait_group_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

#endif  // MMDEFORM_TMA_HOPPER_DEVICE

}  // namespace hopper
}  // namespace mmdeform_tma
