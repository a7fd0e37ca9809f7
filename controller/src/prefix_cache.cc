#include "kvr/controller/prefix_cache.h"

#include <algorithm>
#include <utility>

#include "absl/hash/hash.h"

namespace kvr::controller {

namespace {
PrefixCacheOptions Normalized(PrefixCacheOptions options) {
  options.block_tokens = std::max<uint32_t>(options.block_tokens, 1);
  return options;
}
}  // namespace

PrefixCache::PrefixCache(PrefixCacheOptions options) : options_(Normalized(options)) {}

uint64_t PrefixCache::ScopeHash(const std::string& model, const std::string& salt) const {
  return absl::HashOf(model, salt);
}

uint64_t PrefixCache::BlockHash(uint64_t previous, std::span<const uint32_t> block) const {
  return absl::HashOf(previous, absl::MakeSpan(block.data(), block.size()));
}

std::optional<PrefixMatch> PrefixCache::Lookup(const std::string& model, const std::string& salt,
                                               std::span<const uint32_t> prompt, absl::Time now) {
  const size_t B = options_.block_tokens;
  absl::MutexLock lock(&mu_);
  ++lookups_;
  // The deepest whole block of the prompt that some live entry holds: chained hashes make a
  // hit at block i a hit of blocks 0..i of that entry's chain.
  std::optional<Lru::iterator> best;
  uint64_t h = ScopeHash(model, salt);
  for (size_t end = B; end <= prompt.size(); end += B) {
    h = BlockHash(h, prompt.subspan(end - B, B));
    auto it = by_block_.find(h);
    if (it == by_block_.end()) break;
    Lru::iterator entry = it->second;
    if (entry->expiry <= now) {
      Remove(entry);
      break;
    }
    best = entry;
  }
  if (!best) return std::nullopt;
  // Checked token by token (a collision must never reuse another prompt's rows) and extended
  // to the first differing token; one token is left to compute.
  const std::vector<uint32_t>& tokens = (*best)->tokens;
  const size_t limit = std::min(tokens.size(), prompt.size() - 1);
  size_t n = 0;
  while (n < limit && tokens[n] == prompt[n]) ++n;
  if (n < B) return std::nullopt;
  lru_.splice(lru_.begin(), lru_, *best);
  ++hits_;
  return PrefixMatch{(*best)->store_id, (*best)->sequence_id, (*best)->capability,
                     static_cast<uint32_t>(n)};
}

void PrefixCache::Insert(const std::string& model, const std::string& salt,
                         const std::string& store_id, uint64_t sequence_id,
                         const std::string& capability, std::vector<uint32_t> tokens,
                         absl::Time expiry, absl::Time now) {
  const size_t B = options_.block_tokens;
  if (tokens.size() < B || expiry <= now) return;
  absl::MutexLock lock(&mu_);
  if (auto old = by_sequence_.find(sequence_id); old != by_sequence_.end()) Remove(old->second);
  lru_.push_front(Entry{sequence_id, store_id, capability, std::move(tokens), {}, expiry});
  Lru::iterator entry = lru_.begin();
  by_sequence_[sequence_id] = entry;
  // The new entry takes over every block it holds; an older entry left with none of its
  // blocks is wholly covered by this one and goes.
  absl::flat_hash_map<uint64_t, Lru::iterator> displaced;
  uint64_t h = ScopeHash(model, salt);
  for (size_t end = B; end <= entry->tokens.size(); end += B) {
    h = BlockHash(h, std::span<const uint32_t>(entry->tokens).subspan(end - B, B));
    entry->block_hashes.push_back(h);
    auto [it, inserted] = by_block_.try_emplace(h, entry);
    if (!inserted) {
      displaced.try_emplace(it->second->sequence_id, it->second);
      it->second = entry;
    }
  }
  for (auto& displaced_entry : displaced) {
    const Lru::iterator old = displaced_entry.second;
    const bool still_found = std::any_of(
        old->block_hashes.begin(), old->block_hashes.end(), [&](uint64_t bh) {
          auto it = by_block_.find(bh);
          return it != by_block_.end() && it->second == old;
        });
    if (!still_found) Remove(old);
  }
  while (lru_.size() > options_.max_entries) Remove(std::prev(lru_.end()));
}

void PrefixCache::Forget(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  if (auto it = by_sequence_.find(sequence_id); it != by_sequence_.end()) Remove(it->second);
}

void PrefixCache::Remove(Lru::iterator it) {
  for (uint64_t bh : it->block_hashes) {
    auto b = by_block_.find(bh);
    if (b != by_block_.end() && b->second == it) by_block_.erase(b);
  }
  by_sequence_.erase(it->sequence_id);
  lru_.erase(it);
}

PrefixCacheStats PrefixCache::Stats() const {
  absl::MutexLock lock(&mu_);
  return {lookups_, hits_, static_cast<uint64_t>(lru_.size())};
}

}  // namespace kvr::controller
