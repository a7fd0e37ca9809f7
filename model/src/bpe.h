#pragma once
// Byte-level BPE merging (internal header).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "tokenizer_utf8.h"

namespace kvr::model::internal {

// The merge table of a byte-level BPE vocabulary. Immutable after Create except for its word
// cache, which is internally synchronised: EncodeWord may be called from many threads.
class BpeModel {
 public:
  struct Options {
    // Look a whole word up in the vocabulary before merging (Llama 3's "ignore_merges").
    bool ignore_merges = false;
    // Id for bytes without a vocabulary entry; -1 drops them (Hugging Face BPE without unk).
    int32_t unk_id = -1;
  };

  // `tokens` in byte-level spelling, `merges` as (left, right) pairs, rank = index. Errors name
  // the merge that refers to a string missing from the vocabulary.
  [[nodiscard]] static absl::StatusOr<BpeModel> Create(
      const std::vector<std::string>& tokens,
      const std::vector<std::pair<std::string, std::string>>& merges, const Options& options);

  BpeModel(BpeModel&&) noexcept;
  BpeModel& operator=(BpeModel&&) noexcept;
  ~BpeModel();

  // Appends the ids of one pre-tokenized word given as raw bytes.
  void EncodeWord(std::string_view word, std::vector<int32_t>& out) const;

  // Id of a vocabulary string in byte-level spelling, or -1.
  int32_t Find(std::string_view piece) const;

  const ByteLevelAlphabet& alphabet() const { return alphabet_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  struct Cache;

  BpeModel();
  void MergeWord(std::string_view word, std::vector<int32_t>& out) const;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  Options options_;
  ByteLevelAlphabet alphabet_;
  absl::flat_hash_map<std::string, int32_t> token_to_id_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  int32_t byte_to_id_[256];
  std::unique_ptr<Cache> cache_;
};

}  // namespace kvr::model::internal
