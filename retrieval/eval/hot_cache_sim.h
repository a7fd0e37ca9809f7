#pragma once
// HotCacheSim: `kvr eval retrieval`'s replay of the GPU decode path's hot cache on a run's
// selections (retrieval_eval.cc; a header so that eval_test checks its replacement policy on
// selections whose hits are known).

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <utility>
#include <vector>

namespace kvr::retrieval::eval {

// The GPU decode path's hot cache (retrieval/cuda/.../hot_cache.cuh, as CudaModel configures
// it) replayed on a run's selections: per (layer, KV head) `rows` row slots in sets of up to 8
// ways, token t in set t % n_sets, LRU at step granularity (a hit refreshes its way; the r-th
// miss of a set in a step takes the r-th least recent way not used this step, else it is not
// cached). Also counts the rows that the previous step of the same (layer, head) selected too.
class HotCacheSim {
 public:
  explicit HotCacheSim(int64_t rows)
      : ways_(static_cast<int>(std::clamp<int64_t>(rows, 1, 8))), n_sets_(rows / ways_) {}

  void Step(int layer, int kvh, std::span<const int64_t> picked) {
    Head& h = heads_[{layer, kvh}];
    if (h.tokens.empty()) {
      h.tokens.assign(static_cast<size_t>(n_sets_) * ways_, -1);
      h.stamps.assign(h.tokens.size(), -1);
    }
    const int64_t step = ++h.step;
    std::set<int64_t> now(picked.begin(), picked.end());
    for (int64_t t : now) overlap_ += h.previous.count(t);
    if (h.step > 1) previous_total_ += static_cast<int64_t>(now.size());
    h.previous = std::move(now);
    // Hits first (they claim their ways), then the misses of each set in id order.
    std::map<int64_t, std::vector<int64_t>> misses;  // set -> tokens
    for (int64_t t : h.previous) {
      const int64_t set = t % n_sets_;
      bool hit = false;
      for (int w = 0; w < ways_; ++w) {
        const size_t i = static_cast<size_t>(set * ways_ + w);
        if (h.tokens[i] == t) {
          h.stamps[i] = step;
          hit = true;
          break;
        }
      }
      ++lookups_;
      if (hit) {
        ++hits_;
      } else {
        misses[set].push_back(t);
      }
    }
    for (auto& [set, tokens] : misses) {
      std::vector<int> order(ways_);
      for (int w = 0; w < ways_; ++w) order[w] = w;
      auto stamp = [&](int w) { return h.stamps[static_cast<size_t>(set * ways_ + w)]; };
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return stamp(a) < stamp(b); });
      size_t r = 0;
      for (int w : order) {
        if (r == tokens.size() || stamp(w) == step) break;
        const size_t i = static_cast<size_t>(set * ways_ + w);
        h.tokens[i] = tokens[r++];
        h.stamps[i] = step;
      }
    }
  }
  double hit_rate() const { return lookups_ > 0 ? static_cast<double>(hits_) / lookups_ : 0; }
  double overlap() const {
    return previous_total_ > 0 ? static_cast<double>(overlap_) / previous_total_ : 0;
  }

 private:
  struct Head {
    std::vector<int64_t> tokens, stamps;
    std::set<int64_t> previous;
    int64_t step = 0;
  };
  int ways_;
  int64_t n_sets_;
  std::map<std::pair<int, int>, Head> heads_;
  int64_t hits_ = 0, lookups_ = 0, overlap_ = 0, previous_total_ = 0;
};

}  // namespace kvr::retrieval::eval
