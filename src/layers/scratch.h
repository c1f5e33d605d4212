// Grow-only scratch for the layers, safe for a model object shared by threads.
//
// A layer keeps its scratch in a ScratchPool. Each forward call borrows one Scratch set for its
// duration (ScratchPool::Lease): calls from different threads at once get different sets, the
// nested calls of one thread (an EncoderLayer calling its MultiHeadAttention, layers sharing a
// pool) share the set that thread already holds, and a set goes back to the pool when the call
// ends, so a thread that calls again finds it warm (sized for the largest shape seen: once warm,
// no call allocates). The pool holds as many sets as calls ever ran at once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "core/aligned_buffer.h"

namespace qkv::layers {

// At least `floats` floats of `buffer`, reallocating (contents lost) only when it is too small.
inline float* scratch_floats(AlignedBuffer& buffer, std::int64_t floats) {
  const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(floats > 0 ? floats : 1);
  if (buffer.bytes() < bytes) buffer = AlignedBuffer(bytes);
  return buffer.as<float>();
}

// At least `count` 16-bit elements (bf16 or f16 bits) of `buffer`, as scratch_floats.
inline std::uint16_t* scratch_halves(AlignedBuffer& buffer, std::int64_t count) {
  return reinterpret_cast<std::uint16_t*>(scratch_floats(buffer, (count + 1) / 2));
}

// The buffers of one call, by role. Roles never overlap within one call: EncoderLayer uses a, h,
// n; MultiHeadAttention the rest.
struct Scratch {
  AlignedBuffer a, h, n;                // EncoderLayer: sub-layer output, FFN hidden, Pre-LN input
  AlignedBuffer qkv, k, v, ctx, probs;  // MultiHeadAttention: projections, core output, weights
  AlignedBuffer q_half;                 // MultiHeadAttention: q in a bf16/f16 cache's dtype
  // Training's backward (reused from step to step, not allocated and first touched each time),
  // gradients of: EncoderLayer's FFN hidden activations, a sub-layer's input and output, and
  // Post-LN's LayerNorm input; MultiHeadAttention's core output, the projection's rows [dq |
  // dk | dv] (the core writes them in place), and the projection's weight and bias.
  AlignedBuffer d_hidden, d_in, d_sub, d_z;
  AlignedBuffer d_ctx, d_qkv, d_w, d_b;
};

class ScratchPool {
 public:
  // The set this thread uses for the pool while the lease lives.
  class Lease {
   public:
    explicit Lease(ScratchPool& pool) : pool_(pool) {
      for (const auto& [held_pool, set] : held()) {
        if (held_pool == &pool) {  // a nested call on this thread: share the caller's set
          scratch_ = set;
          return;
        }
      }
      owner_ = true;
      scratch_ = pool.take();
      held().emplace_back(&pool, scratch_);
    }
    ~Lease() {
      if (!owner_) return;
      auto& leases = held();
      leases.erase(std::find(leases.begin(), leases.end(),
                             std::pair<const ScratchPool*, Scratch*>(&pool_, scratch_)));
      pool_.give_back(scratch_);
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    Scratch* operator->() const { return scratch_; }

   private:
    // (pool, set) of the leases this thread holds as owner, innermost last.
    static std::vector<std::pair<const ScratchPool*, Scratch*>>& held() {
      thread_local std::vector<std::pair<const ScratchPool*, Scratch*>> leases;
      return leases;
    }

    ScratchPool& pool_;
    Scratch* scratch_ = nullptr;
    bool owner_ = false;
  };

 private:
  Scratch* take() {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (idle_.empty()) {
      sets_.push_back(std::make_unique<Scratch>());
      return sets_.back().get();
    }
    Scratch* set = idle_.back();  // the most recently used: warmest
    idle_.pop_back();
    return set;
  }
  void give_back(Scratch* set) {
    const std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(set);
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<Scratch>> sets_;
  std::vector<Scratch*> idle_;
};

inline std::shared_ptr<ScratchPool> make_scratch_pool() { return std::make_shared<ScratchPool>(); }

}  // namespace qkv::layers
