// Every decoder layer of a step in one op call, for any step (decodes, prefill chunks or
// both): attention treats every query token as one row of the decode kernel, with its own
// block table row and context length (engine/attention.py builds them once per step).
//
// Why: at decode batch sizes a layer is ~18 Python-level calls (module calls, views, the
// kernels below), and on 2 cores their interpreter and dispatch time between the kernels is
// a large share of a batch-1 step. One call per layer still pays Python glue and argument
// conversion (18 weight slots) for every layer; one call for the whole stack pays it once
// a step. This runs exactly the kernels the Python layer runs on the cpu backend, in the
// same order on the same inputs, so its output is bitwise the same (tested); only the glue
// moves to C++.
//
// It also does what the Python forward did around the layers, for the same reason: after the
// weights have streamed by, each Python-level op costs many times what it costs hot, in
// cache misses on the interpreter's and the dispatcher's code and data. The call looks up
// the embeddings and the RoPE rows of its tokens, and with `logits` (a step whose every row
// is a sequence's last token) ends with the final norm and the head.
//
// The kernels write into buffers allocated once per call (Buffers), not a new tensor each:
// between two ops the step streams megabytes of weights, which evicts the allocator's code
// and data, so each allocation there pays cache misses that a kernel of a decode step's
// size notices (and larger activations are mmap'ed fresh, page faults included). Steps
// measured faster at every batch size with the buffers.

#include <ATen/ops/empty.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <exception>

#include "contention.h"
#include "ops.h"
#include "stack.h"
#include "team.h"

namespace pagedserve_cpu {

namespace {

// The step profile (step_profile / step_profile_read; benchmarks/step_profile.py): the wall
// time of each kernel of the fused stack, summed over the layers and steps run while it is
// on. Why: the stack is one call, and a batch-1 step's time past its floor is spread over
// its kernels (the matmuls' streaming rate against the machine's, attention reading K/V
// from memory, the small ops); the profile says which. Off, it costs one predictable branch
// a kernel. It is owned by the thread that runs steps (the engine's): the C++ side takes no
// lock. The order of StepKernel is the order of kernels.cpu.STEP_KERNELS.
enum StepKernel {
  kInputNormK, kQkvK, kRopeStoreK, kAttentionK, kOK, kPostNormK, kGateUpK, kSiluMulK, kDownK,
  kHeadK,  // the final norm and the head, once a call (with `logits`)
  kNumStepKernels
};
struct StepProfile {
  bool on = false;
  double seconds[kNumStepKernels] = {};
  double calls_seconds = 0;  // whole decoder_layers calls: what the kernels leave is the stack's own
  int64_t layers = 0;  // layer calls timed: seconds / layers is a kernel's mean per layer
};
StepProfile g_profile;

// Adds the time since the previous lap (or since construction) to a kernel, when profiling.
class Laps {
 public:
  Laps() : on_(g_profile.on), last_(on_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point()) {}
  void lap(StepKernel k) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    g_profile.seconds[k] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

// The order of each layer's slots in the `weights` list, layer after layer (engine/backends/cpu.py:
// LayerSlots, whose field order is asserted against this enum, read by kernels.cpu.stack_slots()).
// Keep both enums plain lists that end in their count: that reader parses them.
enum Slot {
  kInputNorm, kPostNorm,
  kQkvW, kQkvPacked, kQkvQuant, kQkvBias,
  kOW, kOPacked, kOQuant, kOBias,
  kGateUpW, kGateUpPacked, kGateUpQuant, kGateUpBias,
  kDownW, kDownPacked, kDownQuant, kDownBias,
  kNumSlots
};
// After the layers' slots, the model's own (engine/backends/cpu.py: HeadSlots).
enum HeadSlot { kEmbed, kFinalNorm, kHeadW, kHeadPacked, kHeadQuant, kHeadBias, kNumHeadSlots };

// A step's activations, allocated once per call and reused by every layer: the kernels write
// into them (ops.h says why that matters), and the query is a view made here once, not a
// narrow and a view a layer.
struct Buffers {
  at::Tensor h;        // [t, hidden]: the normed input of attention, then of the MLP
  at::Tensor qkv;      // [t, (heads + 2 kv_heads) * head_dim]
  at::Tensor q;        // view of qkv's query columns, [t, heads, head_dim]
  at::Tensor attn;     // [t, heads, head_dim]
  at::Tensor attn2d;   // the same, [t, heads * head_dim], o_proj's input
  at::Tensor o;        // [t, hidden]
  at::Tensor gate_up;  // [t, 2 * intermediate]
  at::Tensor act;      // [t, intermediate]
  at::Tensor out;      // [t, hidden]: the layer's output, before the residual add
  Buffers(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, int64_t num_heads, int64_t head_dim) {
    const int64_t t = x.size(0), hidden = x.size(1);
    const auto opts = x.options();
    h = at::empty({t, hidden}, opts);
    qkv = at::empty({t, w.get(kQkvW)->size(1)}, opts);
    q = qkv.narrow(1, 0, num_heads * head_dim).view({t, num_heads, head_dim});
    attn2d = at::empty({t, num_heads * head_dim}, opts);
    attn = attn2d.view({t, num_heads, head_dim});
    o = at::empty({t, hidden}, opts);
    gate_up = at::empty({t, w.get(kGateUpW)->size(1)}, opts);
    act = at::empty({t, gate_up.size(1) / 2}, opts);
    out = at::empty({t, hidden}, opts);
  }
};

// linear_into for the matmul whose weight, packed copy, GGUF blocks and bias start at `slot`.
void linear_at(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, size_t slot, at::Tensor& y) {
  linear_into(x, *w.get(slot), w.get(slot + 1), w.get(slot + 2), w.get(slot + 3), y);
}

// One decoder layer, its tensors at w[base + Slot]: its output (not yet added to the residual
// stream) goes to b.out. `x` is the previous layer's output, or for the first layer (no
// residual stream yet) the embeddings, which the residual stream then starts as.
void layer_forward(const at::Tensor& x, at::Tensor& residual, bool first, const c10::List<c10::optional<at::Tensor>>& w,
                   size_t base, Buffers& b, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                   at::Tensor& value_cache, const c10::optional<at::Tensor>& key_offset,
                   const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  Laps laps;
  if (first) rms_norm_into(x, *w.get(base + kInputNorm), eps, b.h);
  else add_rms_norm_into(x, residual, *w.get(base + kInputNorm), eps, b.h);
  laps.lap(kInputNormK);
  linear_at(b.h, w, base + kQkvW, b.qkv);
  laps.lap(kQkvK);
  rope_and_store_(b.qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads, key_offset);
  laps.lap(kRopeStoreK);
  paged_attention_decode_into(b.q, key_cache, value_cache, block_tables, seq_lens, scale, b.attn);
  laps.lap(kAttentionK);
  linear_at(b.attn2d, w, base + kOW, b.o);
  laps.lap(kOK);
  add_rms_norm_into(b.o, residual, *w.get(base + kPostNorm), eps, b.h);
  laps.lap(kPostNormK);
  linear_at(b.h, w, base + kGateUpW, b.gate_up);
  laps.lap(kGateUpK);
  silu_mul_into(b.gate_up, b.act);
  laps.lap(kSiluMulK);
  linear_at(b.act, w, base + kDownW, b.out);
  laps.lap(kDownK);
  if (g_profile.on) ++g_profile.layers;
}

// Steps of at most this many rows run in a team (team.h); 0: none (larger steps, and with 0
// every step, run in a team only while narrowed: contention.h). Why a limit: inside a team
// an ATen op runs on one thread, and every matmul of up to max_packed_rows() rows (at least
// 64) is this extension's own; and past a few rows a step is long enough that the cost of
// its parallel regions (a few per layer) is a negligible share of it.
std::atomic<int64_t> g_team_rows{16};

// How many of the team's threads a step runs while other processes hold some of this
// process's CPUs (contention.h); PAGEDSERVE_CPU_ADAPT_THREADS=0 (set_stack_adapt_threads)
// always runs the whole team.
CpuContention g_contention;

// Sets the OpenMP thread count of the regions the calling thread opens (omp_set_num_threads:
// the calling thread's own setting, which at::get_num_threads() reads and at::parallel_for
// sizes its regions by) for its scope, and restores it. Why not at::set_num_threads: that
// also resizes ATen's other thread pools and clears oneDNN's caches, for the whole process.
class OmpThreadsOnCaller {
 public:
  explicit OmpThreadsOnCaller(int64_t threads) : before_(omp_get_max_threads()) { omp_set_num_threads(int(threads)); }
  ~OmpThreadsOnCaller() { omp_set_num_threads(before_); }
  OmpThreadsOnCaller(const OmpThreadsOnCaller&) = delete;
  OmpThreadsOnCaller& operator=(const OmpThreadsOnCaller&) = delete;

 private:
  int before_;
};

// The stack itself: decoder_layers below runs it on its thread 0, in a team or not.
std::tuple<at::Tensor, at::Tensor> run_stack(
    const at::Tensor& input_ids, const at::Tensor& positions, const c10::intrusive_ptr<StackWeights>& weights,
    const c10::intrusive_ptr<StackCaches>& caches, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
    int64_t num_kv_heads, double eps, double scale, bool logits) {
  const c10::List<c10::optional<at::Tensor>>& w = weights->w;
  const size_t layers = caches->k.size();
  const size_t head = layers * kNumSlots;
  const at::Tensor x = w.get(head + kEmbed)->index_select(0, input_ids);  // [t, hidden]
  // The tables are float32, as the model on these kernels is (rope_and_store_ checks).
  const at::Tensor cos = cos_table.index_select(0, positions), sin = sin_table.index_select(0, positions);
  const int64_t head_dim = caches->k.get(0).size(-1);
  Buffers b(x, w, num_heads, head_dim);
  // The first layer has no residual stream yet: it starts as the embeddings themselves.
  at::Tensor residual = x;
  for (size_t l = 0; l < layers; ++l) {
    at::Tensor key_cache = caches->k.get(l), value_cache = caches->v.get(l);
    const c10::optional<at::Tensor> key_offset =
        caches->key_offsets.empty() ? c10::nullopt : c10::optional<at::Tensor>(caches->key_offsets.get(l));
    layer_forward(l == 0 ? x : b.out, residual, l == 0, w, l * kNumSlots, b, cos, sin, key_cache, value_cache,
                  key_offset, slot_mapping, block_tables, seq_lens, num_heads, num_kv_heads, eps, scale);
  }
  at::Tensor out = b.out;
  if (logits) {  // as the Python forward: add_rms_norm_ with the final norm, then the head
    Laps laps;
    add_rms_norm_into(b.out, residual, *w.get(head + kFinalNorm), eps, b.h);
    out = linear(b.h, *w.get(head + kHeadW), w.get(head + kHeadPacked), w.get(head + kHeadQuant),
                 w.get(head + kHeadBias));
    laps.lap(kHeadK);
  }
  return {out, residual};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& input_ids, const at::Tensor& positions, const c10::intrusive_ptr<StackWeights>& weights,
    const c10::intrusive_ptr<StackCaches>& caches, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& slot_mapping,
    const at::Tensor& block_tables,  // [num_tokens, max_blocks]: each token's sequence's table
    const at::Tensor& seq_lens,      // [num_tokens]: context each token sees (position + 1)
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale, bool logits) {
  const c10::List<c10::optional<at::Tensor>>& w = weights->w;
  const size_t layers = caches->k.size();
  TORCH_CHECK(layers > 0 && caches->v.size() == layers && w.size() == layers * kNumSlots + kNumHeadSlots,
              "decoder_layers: expected a key and a value cache and ", int(kNumSlots),
              " weight slots a layer, then ", int(kNumHeadSlots), " for the model");
  const auto called = std::chrono::steady_clock::now();
  const auto run = [&] {
    return run_stack(input_ids, positions, weights, caches, cos_table, sin_table, slot_mapping, block_tables, seq_lens,
                     num_heads, num_kv_heads, eps, scale, logits);
  };
  std::tuple<at::Tensor, at::Tensor> result;
  const int64_t threads = at::get_num_threads();
  const bool small = input_ids.size(0) <= g_team_rows.load(std::memory_order_relaxed);
  const bool parallel = threads > 1 && !at::in_parallel_region();
  // Threads to run: the whole team, or as many as other processes leave CPUs for. Asked for
  // every step: a larger step (a prefill) waits for each of its parallel regions' threads as
  // a team step does, so beside a neighbour it narrows too, and runs in a (narrowed) team.
  const int64_t active = parallel ? g_contention.threads_for_step(threads) : 1;
  const bool teamed = parallel && (small || active < threads);
  if (teamed && active == 1) {
    // The team's split on this thread alone: no region, the same chunks (bitwise the same).
    Team team(1);
    team.set_size(threads);
    team.set_solo(true);
    current_team() = &team;
    // An ATen op of the stack (the embedding and RoPE lookups, a copy) runs inline too.
    const OmpThreadsOnCaller one(1);
    try {
      result = run();
    } catch (...) {
      current_team() = nullptr;
      throw;
    }
    current_team() = nullptr;
  } else if (teamed) {
    // team.h: one OpenMP region for the whole call; thread 0 runs the stack, the others
    // help with its kernels' ranges. Exceptions cannot leave an OpenMP region: carried out.
    // A narrowed team (active < threads) keeps the whole team's split: its threads claim
    // the chunks of the missing ones, so the result is bitwise the same.
    std::exception_ptr error;
    Team team(std::max<int64_t>(threads, omp_get_max_threads()));
#pragma omp parallel num_threads(int(active))
    {
      const int64_t tid = omp_get_thread_num(), size = omp_get_num_threads();
      if (tid == 0) {
        // The split: the whole team's, or the threads OpenMP gave where it gave more.
        team.set_size(std::max(size, threads));
        current_team() = &team;
        try {
          result = run();
        } catch (...) {
          error = std::current_exception();
        }
        current_team() = nullptr;
        team.stop();
      } else {
        team.serve(tid);
      }
    }
    if (error) std::rethrow_exception(error);
  } else {
    result = run();
  }
  if (parallel) g_contention.step_done();
  if (g_profile.on)
    g_profile.calls_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - called).count();
  return result;
}

Team*& current_team() {
  thread_local Team* team = nullptr;
  return team;
}

int64_t solo_split() {
  // Forced (tests, A/B runs) it holds from the call on; otherwise the last step decided.
  const int64_t forced = g_contention.forced();
  if ((forced > 0 ? forced : g_contention.last_threads()) != 1 || at::in_parallel_region()) return 0;
  const int64_t threads = at::get_num_threads();
  return threads > 1 ? threads : 0;
}

int64_t set_stack_team_rows(int64_t rows) { return g_team_rows.exchange(rows); }

bool set_stack_adapt_threads(bool on) { return g_contention.set_enabled(on); }

int64_t set_stack_active_threads(int64_t threads) { return g_contention.force(threads); }

bool stack_narrowed() {
  const int64_t last = g_contention.last_threads();
  return last > 0 && last < at::get_num_threads();
}

at::Tensor stack_contention_read() {
  const std::vector<double> values = g_contention.read();
  auto out = at::empty({int64_t(values.size())}, at::kDouble);
  std::copy(values.begin(), values.end(), out.data_ptr<double>());
  return out;
}

void step_profile(bool on) { g_profile = StepProfile{on}; }

at::Tensor step_profile_read() {
  auto out = at::empty({kNumStepKernels + 2}, at::kDouble);
  double* p = out.data_ptr<double>();
  for (int k = 0; k < kNumStepKernels; ++k) p[k] = g_profile.seconds[k];
  p[kNumStepKernels] = g_profile.calls_seconds;
  p[kNumStepKernels + 1] = double(g_profile.layers);
  g_profile = StepProfile{g_profile.on};
  return out;
}

}  // namespace pagedserve_cpu
