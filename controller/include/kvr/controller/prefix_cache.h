#pragma once
// PrefixCache: which store sequences hold the KV of which token prefixes, so that a request
// whose prompt starts with tokens an earlier request already ran (a multi-turn conversation
// resending its history, many requests over one long document or system prompt) is prefilled
// from those rows instead of from scratch.
//
// An entry is a finished request's sequence: its store, id, capability and the tokens whose
// rows it offers (RequestRunner records the prompt). Entries are
// found by chained hashes of fixed-size token blocks, scoped by (model, salt): block i's hash
// covers the scope and every token of blocks 0..i, so one map lookup per block finds the entry
// with the longest shared run of whole blocks. The match is then checked token by token (a hash
// collision never reuses the wrong rows) and extended past the last whole block, to the first
// token that differs. At least one prompt token is always left to compute (its logits give the
// first token).
//
// An entry lives until its expiry (the time its store keeps the sequence: the request's retain
// period), until a newer entry covers all its blocks, until Forget (its store no longer has the
// sequence) or until the cache holds max_entries and it is the least recently used. The store
// may drop a cached sequence earlier (capacity); the prefill node then finds it gone and
// prefills cold, and the controller forgets the entry.
//
// Thread-safe. Memory: the entries' tokens plus one map slot per block.

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvr::controller {

struct PrefixCacheOptions {
  // Tokens per hashed block; prefixes shorter than one block are not looked up.
  uint32_t block_tokens = 16;
  size_t max_entries = 4096;
};

struct PrefixMatch {
  std::string store_id;
  uint64_t sequence_id = 0;
  std::string capability;
  // Prompt tokens whose rows the sequence holds: 1 <= tokens < the prompt's length.
  uint32_t tokens = 0;
};

struct PrefixCacheStats {
  uint64_t lookups = 0;
  uint64_t hits = 0;
  uint64_t entries = 0;
};

class PrefixCache {
 public:
  explicit PrefixCache(PrefixCacheOptions options);

  // The longest cached prefix of `prompt` in (model, salt), or none.
  std::optional<PrefixMatch> Lookup(const std::string& model, const std::string& salt,
                                    std::span<const uint32_t> prompt, absl::Time now);

  // Records that store `store_id` holds the rows of `tokens` in sequence `sequence_id` until
  // `expiry`. Sequences shorter than one block are not recorded.
  void Insert(const std::string& model, const std::string& salt, const std::string& store_id,
              uint64_t sequence_id, const std::string& capability,
              std::vector<uint32_t> tokens, absl::Time expiry, absl::Time now);

  // The store no longer has this sequence (a prefill found it gone).
  void Forget(uint64_t sequence_id);

  PrefixCacheStats Stats() const;

 private:
  struct Entry {
    uint64_t sequence_id = 0;
    std::string store_id;
    std::string capability;
    std::vector<uint32_t> tokens;
    std::vector<uint64_t> block_hashes;
    absl::Time expiry;
  };
  using Lru = std::list<Entry>;  // most recently used first

  // Hash of block `index` of `tokens`, chained on the previous block's hash.
  uint64_t BlockHash(uint64_t previous, std::span<const uint32_t> block) const;
  uint64_t ScopeHash(const std::string& model, const std::string& salt) const;
  void Remove(Lru::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PrefixCacheOptions options_;
  mutable absl::Mutex mu_;
  Lru lru_ ABSL_GUARDED_BY(mu_);
  // Block hash -> the newest entry holding that block.
  absl::flat_hash_map<uint64_t, Lru::iterator> by_block_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Lru::iterator> by_sequence_ ABSL_GUARDED_BY(mu_);
  uint64_t lookups_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvr::controller
