#pragma once
// Method registry, factory and the shipped byte format of an index.
//
// A `MethodRegistry` is a plain object (no global, no static registration): whoever needs
// indexes builds one and registers the methods it links:
//
//   MethodRegistry registry;
//   KVR_RETURN_IF_ERROR(RegisterCoreMethods(registry));    // kvr::retrieval_core
//   KVR_RETURN_IF_ERROR(RegisterQuantMethods(registry));   // kvr::retrieval_quant (pariskv, a2ats)
//
// or simply `AllMethods()` from kvr/retrieval/all_methods.h (target kvr::retrieval), which does
// both when the quant library is built.
//
// Byte format (all integers little-endian; floats IEEE-754 binary32 little-endian):
//   u32  magic        'K','V','R','I' (0x4952564b read as little-endian u32)
//   u16  version      kIndexFormatVersion
//   u16  reserved     0
//   u32  method name length, then the name bytes (ASCII, e.g. "clusterkv")
//   i32  n_heads, n_kv_heads, head_dim, layer, n_layers
//   u8   rope style, u8 x3 reserved, f32 rope theta, i32 rotary_dim
//   i64  size()       tokens indexed
//   u64  payload length, then the method payload (written by SerializePayload)
// Parsing is bounds-checked: truncated or corrupt bytes give InvalidArgument / DataLoss naming
// the field that failed, never a crash.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

inline constexpr uint32_t kIndexMagic = 0x4952564bu;  // "KVRI"
inline constexpr uint16_t kIndexFormatVersion = 1;

class MethodRegistry {
 public:
  // Creates an empty index (to be Built).
  using Factory = std::function<absl::StatusOr<std::unique_ptr<RetrievalIndex>>(
      const IndexShape& shape, const IndexParams& params)>;
  // Recreates an index from its payload; `size` is the header's token count, which the method
  // must check against its payload.
  using Deserializer = std::function<absl::StatusOr<std::unique_ptr<RetrievalIndex>>(
      const IndexShape& shape, const IndexParams& params, int64_t size, ByteReader& payload)>;

  MethodRegistry() = default;
  MethodRegistry(MethodRegistry&&) = default;
  MethodRegistry& operator=(MethodRegistry&&) = default;
  MethodRegistry(const MethodRegistry&) = delete;
  MethodRegistry& operator=(const MethodRegistry&) = delete;

  // AlreadyExists when the name is taken; InvalidArgument for an empty name.
  [[nodiscard]] absl::Status Register(std::string name, std::string description, Factory factory,
                                      Deserializer deserializer);

  // Validates shape and params, then calls the method's factory. Unknown names give
  // InvalidArgument listing the registered methods.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> Make(
      std::string_view method, const IndexShape& shape, const IndexParams& params) const;

  bool Has(std::string_view method) const;
  std::vector<std::string> Names() const;  // sorted
  // One line per method: "name: description".
  std::string Describe() const;

  // Used by DeserializeIndex.
  [[nodiscard]] absl::StatusOr<const Deserializer*> FindDeserializer(std::string_view method) const;

 private:
  struct Entry {
    std::string name;
    std::string description;
    Factory factory;
    Deserializer deserializer;
  };
  std::vector<Entry> entries_;
};

// Registers the core methods: full, exact, quest, streaming, clusterkv, ctkvr, keydiff.
// Defined by kvr::retrieval_core.
[[nodiscard]] absl::Status RegisterCoreMethods(MethodRegistry& registry);

// Registers pariskv and a2ats. Declared here (the one registration seam) but DEFINED by
// kvr::retrieval_quant (retrieval/quant.cmake): only call it when linking that library, or use
// AllMethods() from all_methods.h, which does the right thing.
[[nodiscard]] absl::Status RegisterQuantMethods(MethodRegistry& registry);

// The ids of every method, in the order the evaluator reports them.
// (Names only; whether a method is available depends on the registry.)
inline constexpr std::string_view kCoreMethodNames[] = {"full",      "exact", "quest",  "streaming",
                                                        "clusterkv", "ctkvr", "keydiff"};

// Header + payload, as described above.
[[nodiscard]] absl::StatusOr<std::vector<uint8_t>> SerializeIndex(const RetrievalIndex& index);

// Parses the header, checks magic/version/shape sanity, looks the method up in `registry` and
// hands the payload to its deserializer. `params` supplies what is not shipped (pool, assets,
// Select defaults). If `expected_shape` is given, a mismatch (another model or layer) is
// InvalidArgument.
[[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> DeserializeIndex(
    std::span<const uint8_t> bytes, const MethodRegistry& registry, const IndexParams& params,
    const IndexShape* expected_shape = nullptr);

}  // namespace kvr::retrieval
