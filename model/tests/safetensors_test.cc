// safetensors reader tests on tiny files written here: a valid file with several dtypes, corrupt
// and truncated headers, and single-file and sharded checkpoint directories.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/model/safetensors.h"

namespace kvr::model {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// resize + memcpy rather than vector::insert, which GCC 12 flags with false -Warray-bounds.
void Append(std::vector<uint8_t>& out, const void* data, size_t n) {
  const size_t old = out.size();
  out.resize(old + n);
  if (n > 0) std::memcpy(out.data() + old, data, n);
}

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Serialises like safetensors' Python writer: u64 header length, JSON header padded with
// spaces to a multiple of 8, then the tensors back to back.
std::vector<uint8_t> Serialize(const std::vector<RawTensor>& tensors,
                               const nlohmann::json& metadata = nullptr) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const RawTensor& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::vector<uint8_t> out(8);
  const uint64_t n = text.size();
  std::memcpy(out.data(), &n, 8);
  Append(out, text.data(), text.size());
  for (const RawTensor& t : tensors) Append(out, t.data.data(), t.data.size());
  return out;
}

std::vector<uint8_t> RawFile(const std::string& header_text, size_t data_bytes) {
  std::vector<uint8_t> out(8);
  const uint64_t n = header_text.size();
  std::memcpy(out.data(), &n, 8);
  Append(out, header_text.data(), header_text.size());
  out.resize(out.size() + data_bytes);
  return out;
}

void Write(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

std::string TestDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("kvr_safetensors_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::vector<RawTensor> SampleTensors() {
  return {
      {"w.f32", "F32", {2, 3}, Bytes<float>({1, 2, 3, 4, 5, -6.5f})},
      {"w.f16", "F16", {2}, Bytes<uint16_t>({FloatToFp16(0.5f), FloatToFp16(-3.f)})},
      {"w.bf16",
       "BF16",
       {3},
       Bytes<uint16_t>({FloatToBf16(1.f), FloatToBf16(-2.f), FloatToBf16(256.f)})},
      {"ids", "I64", {2}, Bytes<int64_t>({-7, 123456})},
      {"scalar", "F64", {}, Bytes<double>({0.25})},
      {"empty", "F32", {0, 4}, {}},
  };
}

TEST(SafetensorsTest, ReadsTensorsAndMetadata) {
  const std::string path = TestDir("valid") + "/model.safetensors";
  Write(path, Serialize(SampleTensors(), {{"format", "pt"}}));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 6u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const SafetensorsTensorInfo* w = *file->FindTensor("w.f32");
  EXPECT_EQ(w->dtype, SafetensorsDtype::kF32);
  EXPECT_THAT(w->shape, ElementsAre(2, 3));
  EXPECT_EQ(w->n_elements, 6);
  EXPECT_EQ(w->end - w->begin, 24u);
  EXPECT_THAT(*file->ToFloat32("w.f32"), ElementsAre(1, 2, 3, 4, 5, -6.5f));
  EXPECT_THAT(*file->ToFloat32("w.f16"), ElementsAre(0.5f, -3.f));
  EXPECT_THAT(*file->ToFloat32("w.bf16"), ElementsAre(1.f, -2.f, 256.f));
  EXPECT_THAT(*file->ToFloat32("ids"), ElementsAre(-7.f, 123456.f));
  EXPECT_THAT(*file->ToFloat32("scalar"), ElementsAre(0.25f));
  EXPECT_EQ((*file->FindTensor("scalar"))->n_elements, 1);
  EXPECT_TRUE(file->ToFloat32("empty")->empty());
  const auto raw = *file->TensorData("ids");
  int64_t first;
  std::memcpy(&first, raw.data(), 8);
  EXPECT_EQ(first, -7);
  EXPECT_EQ(file->FindTensor("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsDtypeName(SafetensorsDtype::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(SafetensorsDtypeSize(SafetensorsDtype::kBF16), 2);
}

TEST(SafetensorsTest, CorruptAndTruncatedFilesGiveClearErrors) {
  const std::string dir = TestDir("corrupt");
  auto open_raw = [&](const std::vector<uint8_t>& bytes) {
    Write(dir + "/x.safetensors", bytes);
    return SafetensorsFile::Open(dir + "/x.safetensors").status();
  };
  EXPECT_THAT(open_raw({1, 2, 3}).message(), HasSubstr("too short"));
  // header length larger than the file
  std::vector<uint8_t> valid = Serialize(SampleTensors());
  std::vector<uint8_t> cut(valid.begin(), valid.begin() + 20);
  EXPECT_THAT(open_raw(cut).message(), HasSubstr("truncated: header length"));
  // data section cut short
  cut.assign(valid.begin(), valid.end() - 4);
  absl::Status s = open_raw(cut);
  EXPECT_THAT(s.message(), HasSubstr("fall outside the data section"));
  // corrupt JSON
  EXPECT_THAT(open_raw(RawFile("{\"a\": {\"dtype\": \"F32\",", 0)).message(),
              HasSubstr("corrupt JSON header"));
  EXPECT_THAT(open_raw(RawFile("[1, 2]", 0)).message(), HasSubstr("not an object"));
  EXPECT_THAT(
      open_raw(RawFile(R"({"a": {"dtype": "F17", "shape": [1], "data_offsets": [0, 4]}})", 4))
          .message(),
      HasSubstr("unknown safetensors dtype 'F17'"));
  EXPECT_THAT(
      open_raw(RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 4))
          .message(),
      HasSubstr("tensor 'a': shape holds 2 F32 elements but data_offsets span 4 bytes"));
  EXPECT_THAT(
      open_raw(RawFile(R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4))
          .message(),
      HasSubstr("non-negative"));
  EXPECT_THAT(open_raw(RawFile(R"({"a": {"dtype": "F32", "shape": [1]}})", 4)).message(),
              HasSubstr("data_offsets"));
  EXPECT_THAT(open_raw(RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                           "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                               8))
                  .message(),
              HasSubstr("overlap"));
  // Every prefix of a valid file fails cleanly.
  for (size_t n = 0; n < valid.size(); ++n) {
    std::vector<uint8_t> prefix(valid.begin(), valid.begin() + static_cast<std::ptrdiff_t>(n));
    ASSERT_FALSE(open_raw(prefix).ok()) << n;
  }
}

TEST(SafetensorsTest, UnsupportedConversionIsAnError) {
  const std::string path = TestDir("bool") + "/m.safetensors";
  Write(path, Serialize({{"mask", "BOOL", {2}, {1, 0}}}));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_THAT(file->ToFloat32("mask").status().message(), HasSubstr("BOOL"));
}

TEST(SafetensorsCheckpointTest, SingleFile) {
  const std::string dir = TestDir("single");
  WriteText(dir + "/config.json", R"({"model_type": "llama", "hidden_size": 8})");
  Write(dir + "/model.safetensors", Serialize(SampleTensors()));
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->config()["model_type"], "llama");
  EXPECT_EQ(ckpt->config()["hidden_size"].get<int>(), 8);
  EXPECT_EQ(ckpt->shards().size(), 1u);
  EXPECT_THAT(ckpt->TensorNames(),
              ElementsAre("empty", "ids", "scalar", "w.bf16", "w.f16", "w.f32"));
  EXPECT_THAT(*ckpt->ToFloat32("w.bf16"), ElementsAre(1.f, -2.f, 256.f));
}

TEST(SafetensorsCheckpointTest, ShardedIndexRoundTrip) {
  const std::string dir = TestDir("sharded");
  WriteText(dir + "/config.json", R"({"model_type": "qwen2"})");
  const std::vector<RawTensor> all = SampleTensors();
  Write(dir + "/model-00001-of-00002.safetensors", Serialize({all[0], all[1]}));
  Write(dir + "/model-00002-of-00002.safetensors", Serialize({all[2], all[3]}));
  const nlohmann::json index = {{"metadata", {{"total_size", 52}}},
                                {"weight_map",
                                 {{"w.f32", "model-00001-of-00002.safetensors"},
                                  {"w.f16", "model-00001-of-00002.safetensors"},
                                  {"w.bf16", "model-00002-of-00002.safetensors"},
                                  {"ids", "model-00002-of-00002.safetensors"}}}};
  WriteText(dir + "/model.safetensors.index.json", index.dump(2));
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->shards().size(), 2u);
  EXPECT_THAT(ckpt->TensorNames(), ElementsAre("ids", "w.bf16", "w.f16", "w.f32"));
  EXPECT_THAT(*ckpt->ToFloat32("w.f32"), ElementsAre(1, 2, 3, 4, 5, -6.5f));
  EXPECT_THAT(*ckpt->ToFloat32("ids"), ElementsAre(-7.f, 123456.f));
  EXPECT_EQ((*ckpt->FindTensor("w.bf16"))->dtype, SafetensorsDtype::kBF16);
  EXPECT_EQ((*ckpt->TensorData("w.f16")).size(), 4u);
  std::vector<float> into(2);
  ASSERT_TRUE(ckpt->ToFloat32Into("w.f16", into).ok());
  EXPECT_THAT(into, ElementsAre(0.5f, -3.f));
  into.resize(3);
  EXPECT_THAT(ckpt->ToFloat32Into("w.f16", into).message(), HasSubstr("has 2 elements"));
  EXPECT_EQ(ckpt->FindTensor("scalar").status().code(), absl::StatusCode::kNotFound);

  // The index names a tensor its shard does not hold.
  nlohmann::json bad = index;
  bad["weight_map"]["scalar"] = "model-00002-of-00002.safetensors";
  WriteText(dir + "/model.safetensors.index.json", bad.dump());
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir).status().message(),
              HasSubstr("maps tensor 'scalar' to 'model-00002-of-00002.safetensors'"));
  // A missing shard.
  bad = index;
  bad["weight_map"]["extra"] = "model-00003-of-00002.safetensors";
  WriteText(dir + "/model.safetensors.index.json", bad.dump());
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir).status().message(),
              HasSubstr("model-00003-of-00002.safetensors"));
  // A shard path escaping the directory.
  bad = index;
  bad["weight_map"]["w.f32"] = "../model.safetensors";
  WriteText(dir + "/model.safetensors.index.json", bad.dump());
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir).status().message(), HasSubstr("invalid shard"));
  // Not JSON.
  WriteText(dir + "/model.safetensors.index.json", "{\"weight_map\": ");
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir).status().message(), HasSubstr("invalid JSON"));
}

TEST(SafetensorsCheckpointTest, MissingFiles) {
  const std::string dir = TestDir("missing");
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir).status().message(), HasSubstr("config.json"));
  WriteText(dir + "/config.json", "{}");
  EXPECT_THAT(SafetensorsCheckpoint::Open(dir).status().message(),
              HasSubstr("neither model.safetensors nor model.safetensors.index.json"));
  EXPECT_EQ(SafetensorsCheckpoint::Open(dir + "/nope").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvr::model
