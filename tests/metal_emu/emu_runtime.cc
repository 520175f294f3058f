// The emulator's fiber scheduler (see emu_runtime.h). One Scheduler per
// dispatch; each lane of the current threadgroup is a fiber on a stack from a
// process-wide pool (mmap'd, a guard page below each, reused across
// threadgroups and dispatches).
//
// A threadgroup runs in rounds. A round runs every runnable lane, in the
// dispatch's lane order, until it blocks (barrier, collective) or finishes;
// a blocking lane switches straight to the next lane of the round (the last
// one back to the scheduler), so a round over n lanes is n + 1 switches. When
// no lane is runnable the scheduler resolves the synchronisation points: a
// SIMD group whose lanes all wait in the same collective completes it, a
// threadgroup barrier that every lane reached is released, anything else is
// an EmulatorError.
#include "emu_runtime.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#if defined(__x86_64__) && !defined(METAL_EMU_NO_ASM_SWITCH)
#define METAL_EMU_ASM_SWITCH 1
#else
#define METAL_EMU_ASM_SWITCH 0
#endif

#if METAL_EMU_ASM_SWITCH
// Minimal x86-64 System V context switch. glibc's swapcontext makes a
// sigprocmask system call on every switch (0.2-0.4 us measured here, more
// under load); this is a few nanoseconds (about 12 ns per switch including
// the scheduler's work, Dispatch.SwitchCost in test_emulator.cc). Only what the ABI makes callee-saved survives a call, so that
// is all a switch has to keep: rbx, rbp, r12-r15, the stack pointer, and the
// MXCSR / x87 control words (rounding modes, exception masks).
//
// metal_emu_switch_context(void** save_sp, void* load_sp): pushes the
// callee-saved registers and the control words on the current stack, stores
// the stack pointer in *save_sp, loads load_sp and pops the same layout from
// there; `ret` then resumes whatever called metal_emu_switch_context on that
// stack (or, for a fresh fiber, metal_emu_fiber_start, see init_context).
//
// metal_emu_fiber_start: the first code a fiber runs; calls the entry in r13
// (which never returns). .cfi_undefined rip ends backtraces here.
extern "C" void metal_emu_switch_context(void** save_sp, void* load_sp);
extern "C" void metal_emu_fiber_start();
asm(R"(
  .pushsection .text
  .globl metal_emu_switch_context
  .hidden metal_emu_switch_context
  .type metal_emu_switch_context, @function
  .p2align 4
metal_emu_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size metal_emu_switch_context, .-metal_emu_switch_context

  .globl metal_emu_fiber_start
  .hidden metal_emu_fiber_start
  .type metal_emu_fiber_start, @function
  .p2align 4
metal_emu_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  callq *%r13
  ud2
  .cfi_endproc
  .size metal_emu_fiber_start, .-metal_emu_fiber_start
  .popsection
)");
#endif

namespace metal_emu {

namespace {

using detail::kSimdWidth;
using detail::kSlotBytes;
using detail::SimdOp;
using detail::SimdView;

constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;

// ---------------------------------------------------------------------------
// Contexts. The assembly switch on x86-64 unless METAL_EMU_CONTEXT_SWITCH=
// ucontext is set in the environment when a dispatch starts (the self-tests
// run the portable path that way too); ucontext elsewhere.

struct Context {
  void* sp = nullptr;  // assembly switch: the saved stack pointer
  ucontext_t uc;       // ucontext switch
};

bool use_asm_switch() {
#if METAL_EMU_ASM_SWITCH
  const char* e = std::getenv("METAL_EMU_CONTEXT_SWITCH");
  return !(e && std::string(e) == "ucontext");
#else
  return false;
#endif
}

// The calling thread's MXCSR and x87 control word, as a fresh fiber starts with them.
uint64_t fp_control_words() {
#if METAL_EMU_ASM_SWITCH
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  return mxcsr | (uint64_t{fpucw} << 32);
#else
  return 0;
#endif
}

// Prepares `c` to run entry() on the stack [lo, lo + size) when switched to
// (control: fp_control_words() for the assembly switch).
void init_context(Context& c, bool asm_switch, void* lo, size_t size, void (*entry)(), uint64_t control) {
#if METAL_EMU_ASM_SWITCH
  if (asm_switch) {
    // The frame metal_emu_switch_context pops, lowest address first:
    // control words, r15, r14, r13 (= entry), r12, rbx, rbp, return address
    // (= metal_emu_fiber_start). frame is 16-byte aligned, so the stack
    // pointer is too when metal_emu_fiber_start runs, as a call needs.
    const uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t{15};
    auto* frame = reinterpret_cast<uint64_t*>(top - 16 - 8 * sizeof(uint64_t));
    frame[0] = control;
    frame[1] = 0;                                      // r15
    frame[2] = 0;                                      // r14
    frame[3] = reinterpret_cast<uint64_t>(entry);      // r13
    frame[4] = 0;                                      // r12
    frame[5] = 0;                                      // rbx
    frame[6] = 0;                                      // rbp
    frame[7] = reinterpret_cast<uint64_t>(&metal_emu_fiber_start);
    c.sp = frame;
    return;
  }
#endif
  (void)asm_switch;
  (void)control;
  if (getcontext(&c.uc) != 0) throw EmulatorError("metal_emu: getcontext failed");
  c.uc.uc_stack.ss_sp = lo;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}

inline void switch_context(bool asm_switch, Context& from, Context& to) {
#if METAL_EMU_ASM_SWITCH
  if (asm_switch) {
    metal_emu_switch_context(&from.sp, to.sp);
    return;
  }
#endif
  (void)asm_switch;
  swapcontext(&from.uc, &to.uc);
}

// ---------------------------------------------------------------------------
// Fiber stacks: `bytes` usable, a PROT_NONE guard page below (a lane that
// overflows its stack faults there instead of corrupting its neighbour).
class StackPool {
 public:
  ~StackPool() { release(); }

  void reserve(size_t count, size_t bytes) {
    const size_t pg = page();
    bytes = std::max<size_t>((bytes + pg - 1) / pg * pg, 4 * pg);
    if (bytes != bytes_) {
      release();
      bytes_ = bytes;
    }
    while (stacks_.size() < count) {
      void* p = mmap(nullptr, bytes_ + pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (p == MAP_FAILED) throw EmulatorError("metal_emu: cannot map a fiber stack");
      if (mprotect(p, pg, PROT_NONE) != 0) {
        munmap(p, bytes_ + pg);
        throw EmulatorError("metal_emu: cannot protect a fiber stack's guard page");
      }
      stacks_.push_back(p);
    }
  }
  void* low(size_t i) const { return static_cast<char*>(stacks_[i]) + page(); }
  size_t bytes() const { return bytes_; }

 private:
  static size_t page() {
    static const size_t bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return bytes;
  }
  void release() {
    for (void* p : stacks_) munmap(p, bytes_ + page());
    stacks_.clear();
  }
  std::vector<void*> stacks_;
  size_t bytes_ = 0;
};

StackPool& stack_pool() {
  static StackPool pool;
  return pool;
}

// Thrown at a lane's synchronisation point to unwind it when its threadgroup
// is abandoned. Not a std::exception, so kernel-side catch (std::exception&)
// does not swallow it.
struct LaneCancelled {};

// ---------------------------------------------------------------------------
// "float" from detail::type_name<float>()'s "const char *...type_name() [T = float]".
std::string type_of(const char* pretty) {
  if (!pretty) return "";
  std::string s(pretty);
  const size_t b = s.find("[T = ");
  if (b == std::string::npos) return s;
  const size_t e = s.rfind(']');
  return s.substr(b + 5, e == std::string::npos || e < b + 5 ? std::string::npos : e - b - 5);
}

bool same_type(const char* a, const char* b) { return a == b || (a && b && std::strcmp(a, b) == 0); }

const char* op_name(SimdOp op) {
  switch (op) {
    case SimdOp::kBarrier: return "simdgroup_barrier";
    case SimdOp::kSum: return "simd_sum";
    case SimdOp::kProduct: return "simd_product";
    case SimdOp::kMax: return "simd_max";
    case SimdOp::kMin: return "simd_min";
    case SimdOp::kAnd: return "simd_and";
    case SimdOp::kOr: return "simd_or";
    case SimdOp::kXor: return "simd_xor";
    case SimdOp::kPrefixInclusiveSum: return "simd_prefix_inclusive_sum";
    case SimdOp::kPrefixExclusiveSum: return "simd_prefix_exclusive_sum";
    case SimdOp::kAll: return "simd_all";
    case SimdOp::kAny: return "simd_any";
    case SimdOp::kShuffle: return "simd_shuffle";
    case SimdOp::kShuffleXor: return "simd_shuffle_xor";
    case SimdOp::kShuffleUp: return "simd_shuffle_up";
    case SimdOp::kShuffleDown: return "simd_shuffle_down";
    case SimdOp::kBroadcast: return "simd_broadcast";
    case SimdOp::kBroadcastFirst: return "simd_broadcast_first";
  }
  return "simd collective";
}

// "0-15, 17, 20-31"
std::string lane_list(const std::vector<uint32_t>& lanes) {
  std::ostringstream os;
  for (size_t i = 0; i < lanes.size();) {
    size_t j = i;
    while (j + 1 < lanes.size() && lanes[j + 1] == lanes[j] + 1) ++j;
    if (i) os << ", ";
    os << lanes[i];
    if (j > i) os << "-" << lanes[j];
    i = j + 1;
  }
  return os.str();
}

enum class LaneState : uint8_t { kRunnable, kAtBarrier, kAtSimd, kFinished };

struct Lane {
  Context ctx;
  ThreadPosition pos{};
  LaneState state = LaneState::kRunnable;
  bool started = false;
  // The collective it waits in (kAtSimd).
  SimdOp op = SimdOp::kBarrier;
  const char* type = nullptr;  // detail::type_name<T>()
  uint32_t arg = 0;
};

struct SimdGroup {
  uint32_t first = 0, count = 0;
  uint64_t generation = 0;  // completed collectives; deposits go to buffer generation & 1
  unsigned char* buffers = nullptr;  // 2 x kSimdWidth slots of kSlotBytes
  unsigned char* buffer(uint64_t gen) const { return buffers + (gen & 1) * kSimdWidth * kSlotBytes; }
};

class Scheduler;
thread_local Scheduler* g_active = nullptr;  // the dispatch running on this thread
std::atomic<bool> g_busy{false};            // a dispatch is running in this process
DispatchStats g_last_stats;

void lane_main();

class Scheduler {
 public:
  Scheduler(Grid tgs, Grid tpt, const DispatchOptions& options, const std::function<void(const ThreadPosition&)>& body)
      : tgs_(tgs), tpt_(tpt), order_(options.order), rng_(options.seed), body_(&body),
        asm_switch_(use_asm_switch()) {
    n_ = tpt.x * tpt.y * tpt.z;
    stack_pool().reserve(n_, options.stack_bytes);
    lanes_ = std::make_unique<Lane[]>(n_);
    const uint32_t num_groups = (n_ + kSimdWidth - 1) / kSimdWidth;
    groups_.resize(num_groups);
    // All-ones bytes: what a lane that does not exist (partial SIMD group) "holds".
    exchange_.assign(static_cast<size_t>(num_groups) * 2 * kSimdWidth * kSlotBytes, 0xff);
    for (uint32_t g = 0; g < num_groups; ++g) {
      groups_[g].first = g * kSimdWidth;
      groups_[g].count = std::min(kSimdWidth, n_ - g * kSimdWidth);
      groups_[g].buffers = exchange_.data() + static_cast<size_t>(g) * 2 * kSimdWidth * kSlotBytes;
    }
    run_.reserve(n_);
  }

  const DispatchStats& stats() const { return stats_; }

  void run_threadgroup(uint32_t x, uint32_t y, uint32_t z) {
    tg_ = metal::uint3{x, y, z};
    finished_ = 0;
    const uint64_t control = fp_control_words();
    lane_error_ = nullptr;
    for (uint32_t i = 0; i < n_; ++i) {
      Lane& l = lanes_[i];
      const uint32_t tx = i % tpt_.x, ty = (i / tpt_.x) % tpt_.y, tz = i / (tpt_.x * tpt_.y);
      ThreadPosition& p = l.pos;
      p.threadgroup_position_in_grid = metal::uint3{x, y, z};
      p.threadgroups_per_grid = metal::uint3{tgs_.x, tgs_.y, tgs_.z};
      p.thread_position_in_threadgroup = metal::uint3{tx, ty, tz};
      p.threads_per_threadgroup = metal::uint3{tpt_.x, tpt_.y, tpt_.z};
      p.thread_index_in_threadgroup = i;
      p.simdgroup_index_in_threadgroup = i / kSimdWidth;
      p.thread_index_in_simdgroup = i % kSimdWidth;
      p.threads_per_simdgroup = kSimdWidth;
      p.thread_position_in_grid = metal::uint3{x * tpt_.x + tx, y * tpt_.y + ty, z * tpt_.z + tz};
      p.simdgroups_per_threadgroup = static_cast<uint32_t>(groups_.size());
      l.state = LaneState::kRunnable;
      l.started = false;
      init_context(l.ctx, asm_switch_, stack_pool().low(i), stack_pool().bytes(), &lane_main, control);
    }
    for (SimdGroup& g : groups_) g.generation = 0;

    try {
      for (;;) {
        run_.clear();
        for (uint32_t i = 0; i < n_; ++i)
          if (lanes_[i].state == LaneState::kRunnable) run_.push_back(i);
        if (run_.empty()) {
          if (finished_ == n_) break;
          resolve();  // makes lanes runnable, or throws
          continue;
        }
        if (order_ == LaneOrder::kReverse) {
          std::reverse(run_.begin(), run_.end());
        } else if (order_ == LaneOrder::kShuffled) {
          std::shuffle(run_.begin(), run_.end(), rng_);
        }
        run_pos_ = 0;
        current_ = run_[0];
        lanes_[current_].started = true;
        ++stats_.switches;
        switch_context(asm_switch_, main_, lanes_[current_].ctx);
        if (lane_error_) std::rethrow_exception(lane_error_);
      }
    } catch (...) {
      abandon();
      throw;
    }
  }

  // --- on a lane's stack ---------------------------------------------------

  void run_current_body() {
    Lane& me = lanes_[current_];
    try {
      (*body_)(me.pos);
    } catch (const LaneCancelled&) {
    } catch (...) {
      if (!lane_error_ && !cancelling_) lane_error_ = std::current_exception();
    }
  }

  [[noreturn]] void finish_current() {
    Lane& me = lanes_[current_];
    me.state = LaneState::kFinished;
    ++finished_;
    leave(me);
    std::abort();  // a finished lane is never resumed
  }

  void barrier() {
    if (cancelling_) throw LaneCancelled{};
    Lane& me = lanes_[current_];
    me.state = LaneState::kAtBarrier;
    suspend(me);
  }

  SimdView exchange(SimdOp op, const char* type, const void* value, uint32_t size, uint32_t arg) {
    if (cancelling_) throw LaneCancelled{};
    Lane& me = lanes_[current_];
    const uint32_t lane = me.pos.thread_index_in_simdgroup;
    SimdGroup& g = groups_[me.pos.simdgroup_index_in_threadgroup];
    // Peers may still read the previous collective's buffer; this one cannot
    // complete before they all deposit here, i.e. before they are done reading.
    unsigned char* buf = g.buffer(g.generation);
    if (size) std::memcpy(buf + lane * kSlotBytes, value, size);
    me.op = op;
    me.type = type;
    me.arg = arg;
    me.state = LaneState::kAtSimd;
    suspend(me);
    return SimdView{buf, lane, g.count};
  }

 private:
  void suspend(Lane& me) {
    leave(me);
    if (cancelling_) throw LaneCancelled{};
  }

  // Switches from `me` to the next lane of the round, or to the scheduler.
  void leave(Lane& me) {
    Context* to = &main_;
    if (!cancelling_ && !lane_error_ && ++run_pos_ < run_.size()) {
      current_ = run_[run_pos_];
      lanes_[current_].started = true;
      to = &lanes_[current_].ctx;
    }
    ++stats_.switches;
    switch_context(asm_switch_, me.ctx, *to);
  }

  // --- on the scheduler's stack -------------------------------------------

  std::string where() const {
    std::ostringstream os;
    os << "metal_emu: threadgroup (" << tg_.x << ", " << tg_.y << ", " << tg_.z << ") of " << n_ << " lanes: ";
    return os.str();
  }

  std::string waits_at(const Lane& l) const {
    switch (l.state) {
      case LaneState::kRunnable: return "runnable";
      case LaneState::kFinished: return "finished the kernel";
      case LaneState::kAtBarrier: return "wait at threadgroup_barrier";
      case LaneState::kAtSimd: {
        std::string s = std::string("wait at ") + op_name(l.op);
        const std::string t = type_of(l.type);
        if (!t.empty()) s += "<" + t + ">";
        if (l.op == SimdOp::kShuffle || l.op == SimdOp::kShuffleXor || l.op == SimdOp::kShuffleUp ||
            l.op == SimdOp::kShuffleDown || l.op == SimdOp::kBroadcast)
          s += "(.., " + std::to_string(l.arg) + ")";
        return s;
      }
    }
    return "?";
  }

  // "lanes 0-15 wait at simd_sum<float>; lanes 16-31 finished the kernel"
  std::string describe(uint32_t first, uint32_t count, bool with_args) const {
    std::map<std::string, std::vector<uint32_t>> by;
    std::vector<std::string> order;
    for (uint32_t i = first; i < first + count; ++i) {
      std::string w = waits_at(lanes_[i]);
      if (!with_args) w = w.substr(0, w.find("(.., "));
      auto [it, fresh] = by.try_emplace(w);
      if (fresh) order.push_back(w);
      it->second.push_back(i);
    }
    std::string s;
    for (const std::string& w : order) {
      if (!s.empty()) s += "; ";
      s += (by[w].size() == 1 ? "lane " : "lanes ") + lane_list(by[w]) + " " + w;
    }
    return s;
  }

  [[noreturn]] void fail(const std::string& what) const { throw EmulatorError(where() + what); }

  void resolve() {
    bool released = false;
    uint32_t at_barrier = 0;
    for (uint32_t i = 0; i < n_; ++i) at_barrier += lanes_[i].state == LaneState::kAtBarrier;

    for (uint32_t gi = 0; gi < groups_.size(); ++gi) {
      SimdGroup& g = groups_[gi];
      uint32_t at_simd = 0, finished = 0;
      for (uint32_t i = g.first; i < g.first + g.count; ++i) {
        at_simd += lanes_[i].state == LaneState::kAtSimd;
        finished += lanes_[i].state == LaneState::kFinished;
      }
      if (at_simd == 0) continue;
      const std::string group = "SIMD group " + std::to_string(gi) + " (lanes " + std::to_string(g.first) + "-" +
                                std::to_string(g.first + g.count - 1) + "): ";
      if (finished) {
        fail(group + "a lane finished the kernel while its SIMD peers wait in a collective (every lane of a SIMD "
                     "group must reach it): " +
             describe(g.first, g.count, false));
      }
      if (at_simd < g.count) continue;  // others wait at a threadgroup barrier: a deadlock unless that resolves
      const Lane& f = lanes_[g.first];
      for (uint32_t i = g.first + 1; i < g.first + g.count; ++i) {
        const Lane& l = lanes_[i];
        if (l.op != f.op || !same_type(l.type, f.type))
          fail(group + "lanes of one SIMD group meet different collectives: " + describe(g.first, g.count, false));
      }
      check_args(g, group);
      ++g.generation;
      ++stats_.simd_collectives;
      for (uint32_t i = g.first; i < g.first + g.count; ++i) lanes_[i].state = LaneState::kRunnable;
      released = true;
    }
    if (released) return;

    if (at_barrier && at_barrier + finished_ == n_) {
      if (finished_) {
        fail("threadgroup_barrier reached by only part of the threadgroup (every lane must reach it): " +
             describe(0, n_, false));
      }
      for (uint32_t i = 0; i < n_; ++i) lanes_[i].state = LaneState::kRunnable;
      ++stats_.threadgroup_barriers;
      return;
    }
    fail("deadlock: " + describe(0, n_, true));
  }

  void check_args(const SimdGroup& g, const std::string& group) const {
    const Lane& f = lanes_[g.first];
    for (uint32_t i = g.first; i < g.first + g.count; ++i) {
      const Lane& l = lanes_[i];
      const uint32_t lane = i - g.first;
      switch (l.op) {
        case SimdOp::kBroadcast:
          if (l.arg != f.arg)
            fail(group + "simd_broadcast with different lanes across the SIMD group: " + describe(g.first, g.count, true));
          if (l.arg >= g.count)
            fail(group + "simd_broadcast from lane " + std::to_string(l.arg) + ", which does not exist (the group has " +
                 std::to_string(g.count) + " lanes)");
          break;
        case SimdOp::kShuffleUp:
        case SimdOp::kShuffleDown:
          if (l.arg != f.arg)
            fail(group + std::string(op_name(l.op)) + " with different deltas across the SIMD group: " +
                 describe(g.first, g.count, true));
          break;
        case SimdOp::kShuffle:
          if (l.arg >= kSimdWidth)
            fail(group + "simd_shuffle from lane " + std::to_string(l.arg) + " (lane " + std::to_string(lane) +
                 "): not a lane of a 32-wide SIMD group");
          break;
        case SimdOp::kShuffleXor:
          if ((lane ^ l.arg) >= kSimdWidth)
            fail(group + "simd_shuffle_xor mask " + std::to_string(l.arg) + " (lane " + std::to_string(lane) +
                 "): reads lane " + std::to_string(lane ^ l.arg) + ", not a lane of a 32-wide SIMD group");
          break;
        default:
          break;
      }
    }
  }

  // Unwinds every started, unfinished lane (LaneCancelled from its
  // synchronisation point), so its stack can be reused and its destructors run.
  void abandon() {
    cancelling_ = true;
    for (uint32_t i = 0; i < n_; ++i) {
      Lane& l = lanes_[i];
      if (!l.started || l.state == LaneState::kFinished) continue;
      run_.clear();
      run_pos_ = 0;
      current_ = i;
      ++stats_.switches;
      switch_context(asm_switch_, main_, l.ctx);
    }
    cancelling_ = false;
    lane_error_ = nullptr;
  }

  const Grid tgs_, tpt_;
  const LaneOrder order_;
  std::mt19937_64 rng_;
  const std::function<void(const ThreadPosition&)>* body_;
  const bool asm_switch_;
  uint32_t n_ = 0;
  std::unique_ptr<Lane[]> lanes_;
  std::vector<SimdGroup> groups_;
  std::vector<unsigned char> exchange_;
  Context main_;
  std::vector<uint32_t> run_;  // this round's lanes, in order
  size_t run_pos_ = 0;
  uint32_t current_ = 0;  // the lane running (or last run)
  uint32_t finished_ = 0;
  bool cancelling_ = false;
  std::exception_ptr lane_error_;
  metal::uint3 tg_{};
  DispatchStats stats_;
};

// A fiber's entry: the body, then the switch away for good. Nothing with a
// destructor is alive in this frame when the fiber leaves.
void lane_main() {
  Scheduler* s = g_active;
  s->run_current_body();
  s->finish_current();
}

Scheduler& active_lane_scheduler(const char* what) {
  Scheduler* s = g_active;
  if (!s) throw EmulatorError(std::string("metal_emu: ") + what + " called outside metal_emu::dispatch");
  return *s;
}

}  // namespace

namespace detail {

void threadgroup_barrier_wait() { active_lane_scheduler("threadgroup_barrier").barrier(); }

SimdView simd_exchange(SimdOp op, const char* type, const void* value, uint32_t size, uint32_t arg) {
  return active_lane_scheduler(op_name(op)).exchange(op, type, value, size, arg);
}

}  // namespace detail

void dispatch(Grid threadgroups, Grid threads_per_threadgroup, const DispatchOptions& options,
              const std::function<void(const ThreadPosition&)>& body) {
  const Grid& t = threads_per_threadgroup;
  if (g_active) throw EmulatorError("metal_emu: dispatch called from inside a kernel lane");
  if (t.x == 0 || t.y == 0 || t.z == 0 || uint64_t{t.x} * t.y * t.z > kMaxThreadsPerThreadgroup) {
    throw EmulatorError("metal_emu: threads_per_threadgroup (" + std::to_string(t.x) + ", " + std::to_string(t.y) +
                        ", " + std::to_string(t.z) + ") must be 1 to " + std::to_string(kMaxThreadsPerThreadgroup) +
                        " lanes");
  }
  if (!body) throw EmulatorError("metal_emu: dispatch of an empty function");
  if (g_busy.exchange(true)) {
    throw EmulatorError("metal_emu: another dispatch is running (threadgroup memory is process-wide: one at a time)");
  }
  g_last_stats = {};
  std::optional<Scheduler> s;
  struct Guard {  // declared after s: runs before s is destroyed
    std::optional<Scheduler>& s;
    ~Guard() {
      if (s) g_last_stats = s->stats();
      g_active = nullptr;
      g_busy = false;
    }
  } guard{s};
  if (threadgroups.x == 0 || threadgroups.y == 0 || threadgroups.z == 0) return;
  s.emplace(threadgroups, threads_per_threadgroup, options, body);
  g_active = &*s;
  for (uint32_t z = 0; z < threadgroups.z; ++z)
    for (uint32_t y = 0; y < threadgroups.y; ++y)
      for (uint32_t x = 0; x < threadgroups.x; ++x) s->run_threadgroup(x, y, z);
}

DispatchStats last_dispatch_stats() { return g_last_stats; }

const char* context_switch_kind() { return use_asm_switch() ? "x86-64 assembly" : "ucontext"; }

}  // namespace metal_emu

// float -> bfloat (and double -> bfloat) conversions: clang calls these
// compiler-runtime functions where the CPU has no instruction for them;
// libgcc has them only from GCC 13 on. Weak, so a runtime that has them wins.
// Round to nearest even; NaN stays a (quiet) NaN.
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  uint16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h = static_cast<uint16_t>((u >> 16) | 0x0040u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    h = static_cast<uint16_t>(u >> 16);
  }
  __bf16 b;
  std::memcpy(&b, &h, sizeof b);
  return b;
}
// Through float: may round twice (a double exactly halfway between two
// bfloats after rounding to float); kernels convert from float.
extern "C" __attribute__((weak)) __bf16 __truncdfbf2(double d) { return __truncsfbf2(static_cast<float>(d)); }
