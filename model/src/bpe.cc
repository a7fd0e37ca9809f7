#include "bpe.h"

#include <algorithm>
#include <mutex>
#include <queue>
#include <shared_mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvr::model::internal {

// Words seen before are looked up rather than merged again: text repeats words a lot. The
// cache stops growing at kMaxEntries (as Hugging Face's BPE cache does) so that adversarial
// input cannot grow memory without bound, and long words are never cached.
// std::shared_mutex rather than absl::Mutex: Debian's Abseil runs absl::Mutex's deadlock
// detector on every acquisition (GraphCycles::GetId showed up in perf profiles of Encode).
struct BpeModel::Cache {
  static constexpr size_t kMaxEntries = 1 << 16;
  static constexpr size_t kMaxWordBytes = 64;
  std::shared_mutex mu;
  absl::flat_hash_map<std::string, std::vector<int32_t>> words;  // guarded by mu
};

BpeModel::BpeModel() : cache_(std::make_unique<Cache>()) { std::fill_n(byte_to_id_, 256, -1); }
BpeModel::BpeModel(BpeModel&&) noexcept = default;
BpeModel& BpeModel::operator=(BpeModel&&) noexcept = default;
BpeModel::~BpeModel() = default;

absl::StatusOr<BpeModel> BpeModel::Create(
    const std::vector<std::string>& tokens,
    const std::vector<std::pair<std::string, std::string>>& merges, const Options& options) {
  BpeModel model;
  model.options_ = options;
  model.token_to_id_.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    // The first of duplicate strings wins, as in a Python dict built in id order.
    model.token_to_id_.try_emplace(tokens[i], static_cast<int32_t>(i));
  }
  for (int b = 0; b < 256; ++b) {
    model.byte_to_id_[b] = model.Find(model.alphabet_.Encode(static_cast<uint8_t>(b)));
  }
  model.merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const int32_t left_id = model.Find(left);
    const int32_t right_id = model.Find(right);
    const int32_t merged_id = model.Find(absl::StrCat(left, right));
    if (left_id < 0 || right_id < 0 || merged_id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("merge ", rank, " (\"", left, " ", right,
                                                     "\") refers to ",
                                                     left_id < 0    ? left
                                                     : right_id < 0 ? right
                                                                    : absl::StrCat(left, right),
                                                     ", which is not in the vocabulary"));
    }
    // A repeated pair keeps its first (best) rank.
    model.merges_.try_emplace(PairKey(left_id, right_id),
                              Merge{static_cast<int32_t>(rank), merged_id});
  }
  return model;
}

int32_t BpeModel::Find(std::string_view piece) const {
  auto it = token_to_id_.find(absl::string_view(piece.data(), piece.size()));
  return it == token_to_id_.end() ? -1 : it->second;
}

void BpeModel::EncodeWord(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= Cache::kMaxWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_->mu);
    auto it = cache_->words.find(absl::string_view(word.data(), word.size()));
    if (it != cache_->words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  MergeWord(word, out);
  if (cacheable) {
    std::unique_lock lock(cache_->mu);
    if (cache_->words.size() < Cache::kMaxEntries) {
      cache_->words.try_emplace(std::string(word), out.begin() + static_cast<ptrdiff_t>(first),
                                out.end());
    }
  }
}

void BpeModel::MergeWord(std::string_view word, std::vector<int32_t>& out) const {
  if (options_.ignore_merges) {
    std::string spelled;
    spelled.reserve(word.size() * 2);
    for (char c : word) spelled.append(alphabet_.Encode(static_cast<uint8_t>(c)));
    if (const int32_t id = Find(spelled); id >= 0) {
      out.push_back(id);
      return;
    }
  }

  // Symbols form a doubly linked list over the word's bytes; a merge folds the right symbol
  // into the left one. Candidate merges sit in a min-heap ordered by (rank, position), which
  // reproduces "lowest rank first, leftmost first" (tokenizers/src/models/bpe/word.rs).
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (char c : word) {
    const int32_t id = byte_to_id_[static_cast<uint8_t>(c)];
    const int32_t token = id >= 0 ? id : options_.unk_id;
    if (token < 0) continue;  // no entry and no unk: the byte is dropped
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({token, index - 1, index + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank;
    int32_t pos;  // left symbol
    int32_t merged_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push_pair = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    auto it = merges_.find(PairKey(symbols[left].id, symbols[right].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.merged_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    // Stale entry: one side has merged since this candidate was queued.
    auto it = merges_.find(PairKey(left.id, right.id));
    if (it == merges_.end() || it->second.merged_id != top.merged_id) continue;
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    push_pair(left.prev);
    push_pair(top.pos);
  }
  for (const Symbol& s : symbols) {
    if (s.alive) out.push_back(s.id);
  }
}

}  // namespace kvr::model::internal
