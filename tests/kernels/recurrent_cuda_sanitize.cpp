// A torch-free driver of kernels/recurrent.cu on the host emulation, built by
// tests/kernels/test_recurrent_cuda_emulated.py under AddressSanitizer + UBSan (every global buffer is an
// exact-size heap block: an out-of-bounds access aborts) and under ThreadSanitizer (a missing barrier
// between the state buffers' writes and reads is a data race; so is a gi-ring copy landing in a slot another
// lane still reads; so is a backward kernel reading a gate-gradient buffer the next step writes). Exit
// status: 0 when every launch finished. The per-H float32 kernels are compiled for a few H beside the
// shared-memory ones, with a ring of 3 slots so that 7 steps wrap it twice; and two layouts of clusters of 4
// blocks (recurrent_cuda.cluster_layout at 8 / 48 KiB a block: GRU H = 130 in registers, LSTM H = 150 in part
// in shared memory), where a block's stores into its peers' state or row buffers race with the peers' reads
// unless the cluster barrier orders them.
#define BPPSA_REC_RING 3
#define BPPSA_REC_HIDDEN_LIST(X) X(1) X(7) X(32)
#define BPPSA_REC_CLUSTER_FORWARD_LIST(X) X(gru, 130, 4, 9, 4) X(lstm, 150, 4, 7, 4)
#define BPPSA_REC_CLUSTER_LIST(X) X(gru, 130, 4, 25, 4) X(lstm, 150, 4, 27, 4)
#include "recurrent.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

template <class T>
T* filled(std::vector<void*>& owned, long count) {  // random values in [-0.5, 0.5)
    T* p = static_cast<T*>(std::malloc(count * sizeof(T) + (count == 0)));
    for (long i = 0; i < count; ++i) p[i] = T(std::rand() % 2000 - 1000) / T(2000);
    owned.push_back(p);
    return p;
}

// A launch of a cluster kernel: threads a block, dynamic shared memory a block (recurrent_cuda's), blocks a
// cluster (0: not a cluster kernel).
struct ClusterLaunch {
    unsigned threads;
    size_t shared;
    unsigned size;
};

// One launch of `entry` for a cell with `gates` gates and factor outputs of widths factor_widths[i] * H.
template <class T>
int launch(void (*entry)(const uint64_t*), int gates, std::vector<int> factor_widths, bool lstm, bool bias,
           long batch, long steps, long hidden, bool per_hidden = false, ClusterLaunch cluster = {0, 0, 0}) {
    std::vector<void*> owned;
    const long gh = gates * hidden;
    T* factors[3] = {nullptr, nullptr, nullptr};
    for (size_t i = 0; i < factor_widths.size(); ++i) factors[i] = filled<T>(owned, batch * steps * factor_widths[i] * hidden);
    const uint64_t args[12] = {
        (uint64_t)filled<T>(owned, batch * steps * gh), (uint64_t)filled<T>(owned, gh * hidden),
        (uint64_t)(bias ? filled<T>(owned, gh) : nullptr), (uint64_t)filled<T>(owned, batch * hidden),
        (uint64_t)(lstm ? filled<T>(owned, batch * hidden) : nullptr), (uint64_t)filled<T>(owned, batch * steps * hidden),
        (uint64_t)factors[0], (uint64_t)factors[1], (uint64_t)factors[2], (uint64_t)batch, (uint64_t)steps, (uint64_t)hidden};
    // as recurrent_cuda.py's shared_bytes and threads: the per-H RNN's state buffers a value a lane and its ring
    // gi's rows, one warp; the per-H gated cells' padded state and their ring a word a thread, 32 / G units a warp
    // (group_threads); the shared-memory kernels W_hh and the state, a thread a unit
    const long width = 16 / sizeof(T), padded = (hidden + width - 1) / width * width;
    const long group_threads = 32 * ((hidden + 32 / gates - 1) / (32 / gates));
    const long threads = per_hidden ? (gates == 1 ? 32 : group_threads) : (hidden + 31) / 32 * 32;
    const long fixed = gates == 1 ? 2 * 32 + BPPSA_REC_RING * hidden : 2 * padded + BPPSA_REC_RING * threads;
    const size_t shared = (per_hidden ? fixed : (gh + 2) * padded) * sizeof(T);
    const int status = cluster.size
        ? bppsa_emu_launch_clusters(entry, args, batch * cluster.size, cluster.threads, cluster.shared, batch, 60.0, 1,
                                    0.0, cluster.size)
        : bppsa_emu_launch(entry, args, batch, threads, shared, batch, 60.0, 1, 0.0);
    for (void* p : owned) std::free(p);
    return status;
}

// One launch of a backward kernel for a cell of `gates` gates; `given`: grad_out, grad_h (and grad_cn) given.
template <class T>
int launch_backward(void (*entry)(const uint64_t*), int gates, bool given, long batch, long steps, long hidden,
                    bool per_hidden = false, ClusterLaunch cluster = {0, 0, 0}) {
    std::vector<void*> owned;
    const long bt = batch * steps, gh = gates * hidden;
    const bool gru = gates == 3, lstm = gates == 4;
    const uint64_t args[14] = {
        (uint64_t)filled<T>(owned, bt * (gates == 1 ? hidden : gh)),  // out / scales / gates
        (uint64_t)(gates > 1 ? filled<T>(owned, bt * hidden) : nullptr),  // z / cells
        (uint64_t)(gru ? filled<T>(owned, bt * hidden) : lstm ? filled<T>(owned, batch * hidden) : nullptr),
        (uint64_t)filled<T>(owned, gh * hidden),
        (uint64_t)(given ? filled<T>(owned, bt * hidden) : nullptr),
        (uint64_t)(given ? filled<T>(owned, batch * hidden) : nullptr),
        (uint64_t)(given && lstm ? filled<T>(owned, batch * hidden) : nullptr),
        (uint64_t)filled<T>(owned, bt * gh), (uint64_t)(gru ? filled<T>(owned, bt * gh) : nullptr),
        (uint64_t)filled<T>(owned, batch * hidden), (uint64_t)(lstm ? filled<T>(owned, batch * hidden) : nullptr),
        (uint64_t)batch, (uint64_t)steps, (uint64_t)hidden};
    const long width = 16 / sizeof(T), padded = (gh + width - 1) / width * width;  // as recurrent_cuda.py
    const size_t shared = (2 + (per_hidden ? 0 : hidden)) * padded * sizeof(T);
    const int status = cluster.size
        ? bppsa_emu_launch_clusters(entry, args, batch * cluster.size, cluster.threads, cluster.shared, batch, 60.0, 1,
                                    0.0, cluster.size)
        : bppsa_emu_launch(entry, args, batch, (hidden + 31) / 32 * 32, shared, batch, 60.0, 1, 0.0);
    for (void* p : owned) std::free(p);
    return status;
}

}  // namespace

int main() {
    int status = 0;
    for (long hidden : {1L, 7L, 33L, 70L}) {  // one warp (__syncwarp) and several (__syncthreads)
        status |= launch<float>(bppsa_rnn_tanh_forward_f32_host, 1, {}, false, true, 2, 3, hidden);
        status |= launch<double>(bppsa_rnn_relu_forward_f64_host, 1, {}, false, false, 2, 3, hidden);
        status |= launch<float>(bppsa_gru_forward_f32_host, 3, {3, 1, 1}, false, true, 2, 3, hidden);
        status |= launch<double>(bppsa_gru_forward_f64_host, 3, {3, 1, 1}, false, false, 1, 4, hidden);
        status |= launch<float>(bppsa_lstm_forward_f32_host, 4, {1, 4}, true, false, 2, 3, hidden);
        status |= launch<double>(bppsa_lstm_forward_f64_host, 4, {1, 4}, true, false, 1, 4, hidden);
        status |= launch_backward<float>(bppsa_rnn_tanh_backward_f32_host, 1, true, 2, 3, hidden);
        status |= launch_backward<double>(bppsa_rnn_relu_backward_f64_host, 1, false, 1, 4, hidden);
        status |= launch_backward<float>(bppsa_gru_backward_f32_host, 3, false, 2, 3, hidden);
        status |= launch_backward<double>(bppsa_gru_backward_f64_host, 3, true, 1, 4, hidden);
        status |= launch_backward<float>(bppsa_lstm_backward_f32_host, 4, true, 2, 3, hidden);
        status |= launch_backward<double>(bppsa_lstm_backward_f64_host, 4, false, 1, 4, hidden);
    }
    // the per-H kernels: W_hh in registers, shared memory = state buffers + the gi ring
    for (long steps : {2L, 7L}) {
        status |= launch<float>(bppsa_rnn_tanh_forward_f32_h1_host, 1, {}, false, true, 2, steps, 1, true);
        status |= launch<float>(bppsa_rnn_relu_forward_f32_h7_host, 1, {}, false, true, 2, steps, 7, true);
        status |= launch<float>(bppsa_gru_forward_f32_h7_host, 3, {3, 1, 1}, false, true, 2, steps, 7, true);
        status |= launch<float>(bppsa_gru_forward_f32_h32_host, 3, {3, 1, 1}, false, false, 1, steps, 32, true);
        status |= launch<float>(bppsa_lstm_forward_f32_h7_host, 4, {1, 4}, true, false, 2, steps, 7, true);
        status |= launch<float>(bppsa_lstm_forward_f32_h32_host, 4, {1, 4}, true, false, 1, steps, 32, true);
        status |= launch_backward<float>(bppsa_rnn_relu_backward_f32_h1_host, 1, true, 2, steps, 1, true);
        status |= launch_backward<float>(bppsa_gru_backward_f32_h7_host, 3, false, 2, steps, 7, true);
        status |= launch_backward<float>(bppsa_lstm_backward_f32_h32_host, 4, true, 1, steps, 32, true);
    }
    // the cluster kernels (threads and shared memory a block as recurrent_cuda's for these layouts: 33 / 38 units
    // a block, 4 lanes a unit; the state buffers, and the LSTM's packs beyond 7 / 27 a lane in shared memory)
    for (long steps : {2L, 9L}) {
        status |= launch<float>(bppsa_gru_forward_f32_h130_c4_host, 3, {3, 1, 1}, false, true, 2, steps, 130, false,
                                {160, 2 * 36 * 16, 4});
        status |= launch<float>(bppsa_lstm_forward_f32_h150_c4_host, 4, {1, 4}, true, false, 1, steps, 150, false,
                                {160, 2 * 40 * 16 + 4 * 3 * 38 * 4 * 16, 4});
        status |= launch_backward<float>(bppsa_gru_backward_f32_h130_c4_host, 3, true, 2, steps, 130, false,
                                         {160, 2 * 100 * 16, 4});
        status |= launch_backward<float>(bppsa_lstm_backward_f32_h150_c4_host, 4, false, 1, steps, 150, false,
                                         {160, 2 * 152 * 16 + 11 * 38 * 4 * 16, 4});
    }
    std::printf("launch status %d\n", status);
    return status;
}
