// Portable spellings of the few CUDA features the scan kernels use, and (without nvcc) a host
// emulation of them, so that the SAME .cu file runs on the CPU in tests (no GPU is needed):
//
//   g++ -std=c++20 -pthread -x c++ scan.cu -shared -fPIC      (one OS thread per CUDA thread)
//
// Emulated: grid and block indices, per-block shared memory (dynamic, and static through
// BPPSA_SHARED), __syncthreads as a futex barrier, the warp collectives the kernels use (__ballot_sync,
// __shfl_sync, __syncwarp; masks honoured: a calling lane outside the mask is an error, lanes outside
// it vote nothing, a shuffle from a lane outside it is an error) through a per-warp exchange buffer
// and barrier, asynchronous global -> shared copies (bppsa::copy_async / copy_async_commit /
// copy_async_wait, cp.async on sm_80+: each copy lands, by a seeded coin, either at once or only when a
// wait makes it due, the two ends of what a GPU may do, so a read of a ring slot before its wait or a copy
// into a slot still being read shows; copies still pending when a block ends are an error), 16-byte
// shared-memory vector loads (bppsa::load_shared_vector: a misaligned address is an error), the ticket atomic and the flags (bppsa::take_ticket / reset_ticket /
// load_relaxed / fence_acq_rel / store_release, 64-bit words) through std::atomic_ref, and a bound on the blocks
// resident at once, which is what a kernel with inter-block waits needs for forward progress.
// Thread-block clusters (sm_90+; bppsa_emu_launch_clusters): the blocks of a cluster are resident together,
// bppsa::cluster_sync is a barrier over all their threads and bppsa::store_cluster writes into a peer
// block's shared memory at the writer's own offset (a store into a block that has ended is an error).
// Blocks are dispatched in a seeded random order (a GPU promises no order: a kernel that assumes
// blockIdx order deadlocks or goes wrong here), and the thread of every release store can stall for a
// seeded random time after it (jitter), which opens the windows between a block's announcements.
// Not emulated: lock-step warps (every lane of a warp must reach a warp collective), the GPU memory
// model's weaker orderings (x86 is stronger: PTX cache operators are checked statically instead),
// bank conflicts, occupancy, FMA contraction. Only what scan.cu uses is here. Build with
// -fsanitize=thread to look for races (there a relaxed flag poll is an acquire: ThreadSanitizer does
// not model fences).
//
// Launch from the host with bppsa_emu_launch(entry, args, grid, block, shared_bytes, resident,
// timeout, seed, jitter_us): `entry` is a kernel's host trampoline (BPPSA_ENTRY below), `args` its
// arguments as 64-bit words; seed 0 dispatches blocks in index order. A launch that deadlocks is
// aborted after `timeout` seconds (every wait checks a flag) and returns BPPSA_EMU_TIMEOUT instead of
// hanging the caller; an error inside a kernel (say a bad warp mask) returns BPPSA_EMU_ERROR.
#pragma once

#ifdef __CUDACC__  // ------------------------------------------------------------------- real CUDA

#define BPPSA_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#define BPPSA_SHARED(T, name, count) __shared__ T name[count]

namespace bppsa {
using u64 = unsigned long long;
// A flag poll: relaxed (no L1 invalidation per poll); one fence_acq_rel() after the polls orders them.
__device__ __forceinline__ u64 load_relaxed(const u64* flag) {
    u64 v;
    asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
    return v;
}
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void store_release(u64* flag, u64 v) {
    asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(flag), "l"(v) : "memory");
}
__device__ __forceinline__ u64 take_ticket(u64* counter) { return atomicAdd(counter, 1ull); }
// The counter back to 0 for the next launch on the stream (the kernel's end orders it before that launch).
__device__ __forceinline__ void reset_ticket(u64* counter) { atomicExch(counter, 0ull); }
// A broken invariant (a ticket beyond the grid: the counter was not 0 at the launch): stop loudly, never
// write out of bounds.
__device__ __forceinline__ void fail() { __trap(); }
__device__ __forceinline__ void spin_pause() { __nanosleep(64); }
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.L1 [%0];" ::"l"(p)); }
// Data published by another block: read through L2 (no stale L1 line), write through to L2.
template <class T> __device__ __forceinline__ T load_shared_global(const T* p) { return __ldcg(p); }
template <class T> __device__ __forceinline__ void store_shared_global(T* p, T v) { __stcg(p, v); }

// Asynchronous copies of one 4- or 8-byte element from global to shared memory (cp.async.ca, sm_80+):
// copy_async queues one, copy_async_commit closes this thread's current group, copy_async_wait<N> waits
// until at most the N most recent groups of this thread are pending. A thread waits for its own copies
// only: a warp barrier after the wait shares them with the other lanes. Before sm_80: a plain load and
// store, complete at once (correct, not overlapped).
template <class T>
__device__ __forceinline__ void copy_async(T* shared_dst, const T* global_src) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "copy_async: 4- or 8-byte elements");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(__cvta_generic_to_global(global_src)),
                 "n"(sizeof(T))
                 : "memory");
#else
    *shared_dst = *global_src;
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
// 16 bytes of shared memory (p 16-byte aligned) in one load: 4 floats or 2 doubles.
__device__ __forceinline__ void load_shared_vector(const float* p, float (&v)[4]) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ __forceinline__ void load_shared_vector(const double* p, double (&v)[2]) {
    const double2 x = *reinterpret_cast<const double2*>(p);
    v[0] = x.x, v[1] = x.y;
}
// ... and its store.
__device__ __forceinline__ void store_shared_vector(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_shared_vector(double* p, const double (&v)[2]) {
    *reinterpret_cast<double2*>(p) = make_double2(v[0], v[1]);
}
// Thread-block clusters (sm_90+; a kernel declares its size with BPPSA_CLUSTER_DIMS): the block's rank in its
// cluster, a barrier over the cluster's threads whose arrival releases and whose wait acquires (what a peer
// stored into this block's shared memory is visible after it), and a float stored at `local`'s offset in the
// shared memory of the cluster's block `rank` (distributed shared memory). Before sm_90 no cluster launches
// (recurrent_cuda refuses them): one block, its own shared memory, __syncthreads.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BPPSA_CLUSTER_DIMS(Q) __cluster_dims__(Q, 1, 1)
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}
// The arrival releases (ptxas: a GPU-scope MEMBAR, which waits for the thread's stores, global ones included:
// a kernel issues the stores no peer reads after its arrival), the wait acquires.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}
__device__ __forceinline__ void store_cluster(float* local, unsigned rank, float v) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}
#else
#define BPPSA_CLUSTER_DIMS(Q)
__device__ __forceinline__ unsigned cluster_rank() { return 0; }
__device__ __forceinline__ void cluster_arrive() {}
__device__ __forceinline__ void cluster_wait() { __syncthreads(); }
__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
__device__ __forceinline__ void store_cluster(float* local, unsigned, float v) { *local = v; }
#endif
}  // namespace bppsa

#define BPPSA_ENTRY(name, params, call_args)

#else  // ---------------------------------------------------------------------- host emulation

#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <cstring>
#include <memory>
#include <latch>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define BPPSA_CLUSTER_DIMS(Q)

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace bppsa_emu {

struct Aborted {};  // thrown out of every wait once a launch is aborted (timeout)
inline std::atomic<bool> aborted{false};

inline void check_abort() {
    if (aborted.load(std::memory_order_relaxed)) throw Aborted{};
}

// A reusable barrier for `count` threads: the last to arrive bumps a generation word that the others
// sleep on (futex), waking every 50 ms to check for an abort. arrive() and wait_for() split it (a thread may
// work between its arrival and its wait, as with barrier.cluster.arrive / wait).
class Barrier {
  public:
    explicit Barrier(unsigned count) : count_(count) {}
    void wait() { wait_for(arrive()); }
    // The generation this arrival belongs to.
    uint32_t arrive() {
        const uint32_t generation = generation_.load(std::memory_order_acquire);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
            arrived_.store(0, std::memory_order_relaxed);
            generation_.fetch_add(1, std::memory_order_release);
            syscall(SYS_futex, word(), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
        }
        return generation;
    }
    void wait_for(uint32_t generation) {
        const timespec tick{0, 50'000'000};
        while (generation_.load(std::memory_order_acquire) == generation) {
            check_abort();
            syscall(SYS_futex, word(), FUTEX_WAIT_PRIVATE, generation, &tick, nullptr, 0);
        }
    }

  private:
    uint32_t* word() { return reinterpret_cast<uint32_t*>(&generation_); }
    std::atomic<uint32_t> arrived_{0};
    std::atomic<uint32_t> generation_{0};
    unsigned count_;
};

// What the threads of one resident block share.
struct Block {
    explicit Block(unsigned threads, size_t shared_bytes)
        : barrier(threads), shared(shared_bytes + kStaticBytes) {
        for (unsigned w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::make_unique<Warp>());
    }
    struct Warp {
        Barrier barrier{32};
        uint64_t exchange[32];
    };
    // BPPSA_SHARED arrays live before the dynamic part, which ends the allocation: under AddressSanitizer an
    // access past the dynamic shared memory a launch asked for is a heap overflow, not a silent slack
    static constexpr size_t kStaticBytes = 4096;
    Barrier barrier;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<unsigned char> shared;
    dim3 index;
    std::atomic<unsigned> ended{0};  // threads of the current block that have returned from the kernel
};

// The blocks of one resident cluster (a lone block: a cluster of one) and the barrier over their threads.
struct Cluster {
    Cluster(unsigned size, unsigned threads, size_t shared_bytes) : barrier(size * threads) {
        for (unsigned q = 0; q < size; ++q) blocks.emplace_back(std::make_unique<Block>(threads, shared_bytes));
    }
    Barrier barrier;
    std::vector<std::unique_ptr<Block>> blocks;
};

struct ThreadState {
    Block* block = nullptr;
    Cluster* cluster = nullptr;
    unsigned rank = 0;  // of the block in its cluster
    int64_t arrival = -1;  // the cluster barrier's generation this thread arrived at and has not waited for
    size_t static_offset = 0;  // bump allocator for BPPSA_SHARED, reset when a block starts
    std::minstd_rand random;   // jitter of this thread's release stores, seeded per (launch, block, thread)
    double jitter_us = 0;
    // asynchronous copies not landed yet: the open group, then the committed groups (oldest first)
    struct Copy {
        void* dst;
        const void* src;
        size_t bytes;
    };
    std::vector<Copy> open;
    std::deque<std::vector<Copy>> committed;
};
inline thread_local ThreadState self;

}  // namespace bppsa_emu

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

inline void __syncthreads() { bppsa_emu::self.block->barrier.wait(); }

inline bppsa_emu::Block::Warp& bppsa_emu_warp() {
    return *bppsa_emu::self.block->warps[threadIdx.x / 32];
}

// Every lane of the warp exchanges its vote (lock step is not emulated); a calling lane must be in
// `mask` (undefined on a GPU: an error here) and only the lanes of `mask` vote.
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    const unsigned lane = threadIdx.x % 32;
    if (!(mask >> lane & 1u)) throw std::logic_error("__ballot_sync: the calling lane is not in the mask");
    auto& warp = bppsa_emu_warp();
    warp.exchange[lane] = predicate ? 1 : 0;
    warp.barrier.wait();
    unsigned votes = 0;
    for (unsigned l = 0; l < 32; ++l) votes |= unsigned(warp.exchange[l]) << l;
    warp.barrier.wait();
    return votes & mask;
}

// A lane's value, read by every lane: the calling lane and the source lane must both be in `mask` (the
// source outside it is undefined on a GPU: an error here, like a caller outside it). srcLane is taken
// modulo width, as on a GPU (width = 32 only: the kernels shuffle over the whole warp).
template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "__shfl_sync: 4- or 8-byte values");
    const unsigned lane = threadIdx.x % 32, source = static_cast<unsigned>(srcLane) % 32;
    if (width != 32) throw std::logic_error("__shfl_sync: only width 32 is emulated");
    if (!(mask >> lane & 1u)) throw std::logic_error("__shfl_sync: the calling lane is not in the mask");
    if (!(mask >> source & 1u)) throw std::logic_error("__shfl_sync: the source lane is not in the mask");
    auto& warp = bppsa_emu_warp();
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    warp.exchange[lane] = bits;
    warp.barrier.wait();
    T value;
    bits = warp.exchange[source];
    std::memcpy(&value, &bits, sizeof(T));
    warp.barrier.wait();  // every lane has read before the buffer is reused
    return value;
}

// A warp barrier; the calling lane must be in `mask` (every lane of the warp must call: lock step is not
// emulated, so a mask of part of the warp is refused rather than half-honoured).
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (!(mask >> (threadIdx.x % 32) & 1u)) throw std::logic_error("__syncwarp: the calling lane is not in the mask");
    if (mask != 0xffffffffu) throw std::logic_error("__syncwarp: only the full mask is emulated");
    bppsa_emu_warp().barrier.wait();
}

inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

namespace bppsa {
using u64 = unsigned long long;
inline u64 load_relaxed(const u64* flag) {
#ifdef __SANITIZE_THREAD__  // ThreadSanitizer does not model fences: let the poll itself acquire
    constexpr auto order = std::memory_order_acquire;
#else
    constexpr auto order = std::memory_order_relaxed;
#endif
    return std::atomic_ref<u64>(*const_cast<u64*>(flag)).load(order);
}
inline void fence_acq_rel() { std::atomic_thread_fence(std::memory_order_acq_rel); }
// The announcing thread then stalls (jitter): its block stays at what it just announced for a while,
// which is the window where a reader may wrongly take an announcement for the next one.
inline void store_release(u64* flag, u64 v) {
    std::atomic_ref<u64>(*flag).store(v, std::memory_order_release);
    auto& self = bppsa_emu::self;
    if (self.jitter_us > 0) {
        std::uniform_real_distribution<double> delay(0, self.jitter_us);
        std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(delay(self.random)));
    }
}
inline u64 take_ticket(u64* counter) {
    return std::atomic_ref<u64>(*counter).fetch_add(1u, std::memory_order_relaxed);
}
inline void reset_ticket(u64* counter) { std::atomic_ref<u64>(*counter).exchange(0u, std::memory_order_relaxed); }
inline void fail() { throw std::logic_error("bppsa: a kernel invariant failed (a ticket beyond the grid)"); }
inline void spin_pause() {
    bppsa_emu::check_abort();
    std::this_thread::sleep_for(std::chrono::microseconds(20));  // 2 cores: let the others run
}
inline void prefetch_l1(const void*) {}
template <class T> inline T load_shared_global(const T* p) { return *p; }
template <class T> inline void store_shared_global(T* p, T v) { *p = v; }
// A copy lands at once or when a wait makes it due (a seeded coin per copy): both are what a GPU may do.
template <class T>
inline void copy_async(T* shared_dst, const T* global_src) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "copy_async: 4- or 8-byte elements");
    auto& self = bppsa_emu::self;
    if ((self.random() >> 8) & 1u)
        *shared_dst = *global_src;
    else
        self.open.push_back({shared_dst, global_src, sizeof(T)});
}
inline void copy_async_commit() {
    auto& self = bppsa_emu::self;
    self.committed.push_back(std::move(self.open));
    self.open.clear();
}
template <int N>
inline void copy_async_wait() {
    auto& self = bppsa_emu::self;
    while (self.committed.size() > static_cast<size_t>(N)) {
        for (const auto& copy : self.committed.front()) std::memcpy(copy.dst, copy.src, copy.bytes);
        self.committed.pop_front();
    }
}
template <class T, int N>
inline void load_shared_vector(const T* p, T (&v)[N]) {
    static_assert(N * sizeof(T) == 16, "load_shared_vector: 16 bytes");
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw std::logic_error("load_shared_vector: address not 16-byte aligned");
    for (int i = 0; i < N; ++i) v[i] = p[i];
}
template <class T, int N>
inline void store_shared_vector(T* p, const T (&v)[N]) {
    static_assert(N * sizeof(T) == 16, "store_shared_vector: 16 bytes");
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw std::logic_error("store_shared_vector: address not 16-byte aligned");
    for (int i = 0; i < N; ++i) p[i] = v[i];
}
inline unsigned cluster_rank() { return bppsa_emu::self.rank; }
inline void cluster_arrive() {
    auto& self = bppsa_emu::self;
    if (self.arrival >= 0) throw std::logic_error("cluster_arrive: arrived twice without a wait");
    self.arrival = self.cluster->barrier.arrive();
}
inline void cluster_wait() {
    auto& self = bppsa_emu::self;
    if (self.arrival < 0) throw std::logic_error("cluster_wait: no arrival to wait for");
    self.cluster->barrier.wait_for(static_cast<uint32_t>(self.arrival));
    self.arrival = -1;
}
inline void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}
inline void store_cluster(float* local, unsigned rank, float v) {
    auto& self = bppsa_emu::self;
    auto& blocks = self.cluster->blocks;
    const auto offset = reinterpret_cast<unsigned char*>(local) - self.block->shared.data();
    if (rank >= blocks.size()) throw std::logic_error("store_cluster: a rank beyond the cluster");
    if (offset < 0 || static_cast<size_t>(offset) + sizeof(float) > self.block->shared.size())
        throw std::logic_error("store_cluster: not an address of this block's shared memory");
    if (blocks[rank]->ended.load(std::memory_order_acquire) != 0)
        throw std::logic_error("store_cluster: the peer block has ended (no cluster barrier before its exit)");
    std::memcpy(blocks[rank]->shared.data() + offset, &v, sizeof(float));
}
}  // namespace bppsa

namespace bppsa_emu {
// A block's thread ends: an asynchronous copy still pending would land in the next block's shared memory.
inline void end_block_thread() {
    bool pending = !self.open.empty();
    for (const auto& group : self.committed) pending = pending || !group.empty();
    self.open.clear();
    self.committed.clear();
    if (pending) throw std::logic_error("bppsa: asynchronous copies still pending when the block ended");
    if (self.arrival >= 0) {
        self.arrival = -1;
        throw std::logic_error("bppsa: a cluster barrier arrival without its wait when the block ended");
    }
}
}  // namespace bppsa_emu

#define BPPSA_DYNAMIC_SHARED(name) \
    unsigned char* name = bppsa_emu::self.block->shared.data() + bppsa_emu::Block::kStaticBytes

namespace bppsa_emu {
template <class T>
T* static_shared(size_t count) {
    Block& block = *self.block;
    size_t offset = (self.static_offset + alignof(T) - 1) / alignof(T) * alignof(T);
    self.static_offset = offset + count * sizeof(T);
    if (self.static_offset > Block::kStaticBytes) throw std::length_error("BPPSA_SHARED: static shared memory exhausted");
    return reinterpret_cast<T*>(block.shared.data() + offset);
}
}  // namespace bppsa_emu
#define BPPSA_SHARED(T, name, count) T* name = bppsa_emu::static_shared<T>(count)

// The host trampoline of a kernel: `extern "C" void <name>_host(const uint64_t* args)` unpacks the
// 64-bit argument words and calls the kernel (params/call_args are parenthesised lists).
#define BPPSA_ENTRY(name, params, call_args)                               \
    extern "C" void name##_host(const uint64_t* a) { name call_args; }

enum { BPPSA_EMU_OK = 0, BPPSA_EMU_TIMEOUT = 1, BPPSA_EMU_ERROR = 2 };

// Run a grid of clusters of `cluster` blocks (1: plain blocks): `resident` slots of one cluster each take
// clusters in a seeded random order (index order for seed 0); a cluster's blocks are blockIdx.x = c cluster
// + rank. A release store's thread then stalls up to `jitter_us` (seeded).
extern "C" int bppsa_emu_launch_clusters(void (*entry)(const uint64_t*), const uint64_t* args, unsigned grid_x,
                                         unsigned block_x, size_t shared_bytes, unsigned resident,
                                         double timeout_s, unsigned long long seed, double jitter_us,
                                         unsigned cluster) {
    using namespace bppsa_emu;
    if (cluster == 0 || grid_x % cluster != 0) return BPPSA_EMU_ERROR;  // as a GPU refuses the launch
    aborted.store(false);
    const unsigned clusters = grid_x / cluster;
    std::vector<unsigned> order(clusters);
    for (unsigned c = 0; c < clusters; ++c) order[c] = c;
    if (seed != 0) std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    std::atomic<unsigned> next_cluster{0};
    std::atomic<int> status{BPPSA_EMU_OK};
    std::mutex mutex;
    std::condition_variable finished;
    resident = resident == 0 ? 1 : (resident > clusters ? clusters : resident);
    std::vector<std::unique_ptr<Cluster>> slots;
    std::vector<std::thread> threads;
    std::vector<unsigned> slot_cluster(resident);
    for (unsigned s = 0; s < resident; ++s) slots.emplace_back(std::make_unique<Cluster>(cluster, block_x, shared_bytes));
    unsigned running = resident * cluster * block_x;  // threads still running (guarded by `mutex`)
    std::latch start(running);  // the resident blocks start together, not as their threads appear
    for (unsigned s = 0; s < resident; ++s) {
        for (unsigned q = 0; q < cluster; ++q) {
            for (unsigned t = 0; t < block_x; ++t) {
                threads.emplace_back([&, s, q, t] {
                    Cluster& slot = *slots[s];
                    Block& block = *slot.blocks[q];
                    self.block = &block;
                    self.cluster = &slot;
                    self.rank = q;
                    self.jitter_us = jitter_us;
                    threadIdx = {t, 0, 0};
                    blockDim = {block_x, 1, 1};
                    gridDim = {grid_x, 1, 1};
                    start.arrive_and_wait();
                    try {
                        for (;;) {
                            if (q == 0 && t == 0) {  // the next cluster of the dispatch order
                                const unsigned i = next_cluster.fetch_add(1);
                                slot_cluster[s] = i < clusters ? order[i] : clusters;
                            }
                            slot.barrier.wait();
                            const unsigned c = slot_cluster[s];
                            if (t == 0) block.ended.store(0, std::memory_order_release);
                            slot.barrier.wait();  // everyone has read it before thread 0 takes the next
                            if (c >= clusters) break;
                            blockIdx = {c * cluster + q, 0, 0};
                            self.static_offset = 0;
                            self.random.seed(static_cast<unsigned>(seed * 1000003u + (c * cluster + q) * 1024u + t));
                            entry(args);
                            block.ended.fetch_add(1, std::memory_order_acq_rel);
                            end_block_thread();
                            slot.barrier.wait();  // the cluster ends before its shared memory is reused
                        }
                    } catch (const Aborted&) {
                        int ok = BPPSA_EMU_OK;
                        status.compare_exchange_strong(ok, BPPSA_EMU_TIMEOUT);
                    } catch (...) {
                        status.store(BPPSA_EMU_ERROR);
                        aborted.store(true);
                    }
                    std::lock_guard<std::mutex> lock(mutex);
                    if (--running == 0) finished.notify_all();
                });
            }
        }
    }
    {
        std::unique_lock<std::mutex> lock(mutex);
        if (!finished.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return running == 0; })) {
            aborted.store(true);
        }
    }
    for (auto& thread : threads) thread.join();
    return status.load();
}

// Run a grid of plain blocks (clusters of one), as bppsa_emu_launch_clusters.
extern "C" int bppsa_emu_launch(void (*entry)(const uint64_t*), const uint64_t* args, unsigned grid_x,
                                unsigned block_x, size_t shared_bytes, unsigned resident, double timeout_s,
                                unsigned long long seed, double jitter_us) {
    return bppsa_emu_launch_clusters(entry, args, grid_x, block_x, shared_bytes, resident, timeout_s, seed,
                                     jitter_us, 1);
}

#endif  // __CUDACC__
