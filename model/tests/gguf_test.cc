// GGUF reader tests on files written byte by byte (gguf_builder.h): every metadata type, v2 and v3,
// custom alignment, and crafted corrupt files that must give a clear error (never a crash).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gguf_builder.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/gguf.h"

namespace kvr::model {
namespace {

using gguf_test::GgufBuilder;
using ::testing::HasSubstr;

std::string WriteFile(const std::string& name, const std::vector<uint8_t>& bytes) {
  const std::string path = ::testing::TempDir() + "/kvr_gguf_test_" + name + ".gguf";
  gguf_test::WriteBytes(path, bytes);
  return path;
}

// A valid v3 file with every metadata type and three tensors (F32, F16, Q8_0), alignment 64.
std::vector<uint8_t> ValidFile(uint32_t version = 3) {
  GgufBuilder b(version);
  b.Counts(3, 18);
  b.Kv<uint8_t>("t.u8", GgufValueType::kUint8, 200);
  b.Kv<int8_t>("t.i8", GgufValueType::kInt8, -100);
  b.Kv<uint16_t>("t.u16", GgufValueType::kUint16, 60000);
  b.Kv<int16_t>("t.i16", GgufValueType::kInt16, -30000);
  b.Kv<uint32_t>("t.u32", GgufValueType::kUint32, 4000000000u);
  b.Kv<int32_t>("t.i32", GgufValueType::kInt32, -2000000000);
  b.Kv<float>("t.f32", GgufValueType::kFloat32, 1.5f);
  b.Kv<uint8_t>("t.bool", GgufValueType::kBool, 1);
  b.KvStr("t.string", "héllo");
  b.Kv<uint64_t>("t.u64", GgufValueType::kUint64, 18000000000000000000ull);
  b.Kv<int64_t>("t.i64", GgufValueType::kInt64, -9000000000000000000ll);
  b.Kv<double>("t.f64", GgufValueType::kFloat64, 100000.25);
  // array of strings
  b.Str("t.strings").Pod<uint32_t>(9).Pod<uint32_t>(8).Pod<uint64_t>(3);
  b.Str("a").Str("").Str("ccc");
  // array of f32
  b.Str("t.floats")
      .Pod<uint32_t>(9)
      .Pod<uint32_t>(6)
      .Pod<uint64_t>(2)
      .Pod<float>(0.5f)
      .Pod<float>(-2.f);
  // array of i32
  b.Str("t.ints").Pod<uint32_t>(9).Pod<uint32_t>(5).Pod<uint64_t>(3);
  b.Pod<int32_t>(1).Pod<int32_t>(-2).Pod<int32_t>(300);
  // nested: array of 2 arrays of u16
  b.Str("t.nested").Pod<uint32_t>(9).Pod<uint32_t>(9).Pod<uint64_t>(2);
  b.Pod<uint32_t>(2).Pod<uint64_t>(2).Pod<uint16_t>(1).Pod<uint16_t>(2);
  b.Pod<uint32_t>(2).Pod<uint64_t>(1).Pod<uint16_t>(3);
  // array of u64, one above INT64_MAX
  b.Str("t.u64s").Pod<uint32_t>(9).Pod<uint32_t>(10).Pod<uint64_t>(2);
  b.Pod<uint64_t>(18000000000000000000ull).Pod<uint64_t>(5);
  b.Kv<uint32_t>("general.alignment", GgufValueType::kUint32, 64);
  // tensors: f32 [2, 3] (dims {3, 2}), f16 {4}, q8_0 {32, 2}
  b.TensorInfo("w.f32", {3, 2}, 0, 0);
  b.TensorInfo("w.f16", {4}, 1, 64);
  b.TensorInfo("w.q8_0", {32, 2}, 8, 128);
  b.Align(64);
  const float f32[6] = {1, 2, 3, -4, 5.5f, -6.25f};
  b.Raw(f32, sizeof(f32)).Align(64);
  const uint16_t f16[4] = {FloatToFp16(1.f), FloatToFp16(-0.5f), FloatToFp16(65504.f), 0x0001};
  b.Raw(f16, sizeof(f16)).Align(64);
  for (int blk = 0; blk < 2; ++blk) {
    b.Pod<uint16_t>(FloatToFp16(blk == 0 ? 0.5f : -0.25f));
    for (int j = 0; j < 32; ++j) b.Pod<int8_t>(static_cast<int8_t>(j - 16));
  }
  return b.bytes();
}

TEST(GgufTest, ReadsEveryMetadataTypeAndTensors) {
  auto file = GgufFile::Open(WriteFile("valid", ValidFile()));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->version(), 3u);
  EXPECT_EQ(file->alignment(), 64u);
  EXPECT_EQ(file->metadata().size(), 18u);
  EXPECT_EQ(file->metadata()[0].first, "t.u8");

  EXPECT_EQ(*file->GetInt("t.u8"), 200);
  EXPECT_EQ(*file->GetInt("t.i8"), -100);
  EXPECT_EQ(*file->GetInt("t.u16"), 60000);
  EXPECT_EQ(*file->GetInt("t.i16"), -30000);
  EXPECT_EQ(*file->GetInt("t.u32"), 4000000000ll);
  EXPECT_EQ(*file->GetInt("t.i32"), -2000000000);
  EXPECT_EQ(*file->GetFloat("t.f32"), 1.5);
  EXPECT_EQ(*file->GetBool("t.bool"), true);
  EXPECT_EQ(*file->GetString("t.string"), "héllo");
  EXPECT_EQ(*file->GetInt("t.i64"), -9000000000000000000ll);
  EXPECT_EQ(*file->GetFloat("t.f64"), 100000.25);
  EXPECT_EQ(*file->GetFloat("t.i32"), -2e9);  // integers widen to float
  EXPECT_EQ((*file->Get("t.u64"))->type(), GgufValueType::kUint64);
  EXPECT_EQ(std::get<uint64_t>((*file->Get("t.u64"))->storage()), 18000000000000000000ull);
  EXPECT_THAT(*file->GetStringArray("t.strings"), ::testing::ElementsAre("a", "", "ccc"));
  EXPECT_THAT(*file->GetArray<float>("t.floats"), ::testing::ElementsAre(0.5f, -2.f));
  EXPECT_THAT(*file->GetArray<int32_t>("t.ints"), ::testing::ElementsAre(1, -2, 300));
  EXPECT_THAT(*file->GetArray<double>("t.ints"), ::testing::ElementsAre(1.0, -2.0, 300.0));
  EXPECT_THAT(*file->GetArray<uint64_t>("t.u64s"),
              ::testing::ElementsAre(18000000000000000000ull, 5));
  EXPECT_FALSE(file->GetArray<int64_t>("t.u64s").ok());

  const GgufArray* nested = *(*file->Get("t.nested"))->AsArray();
  ASSERT_EQ(nested->items.size(), 2u);
  EXPECT_EQ(nested->element_type, GgufValueType::kArray);
  const GgufArray* first = *nested->items[0].AsArray();
  EXPECT_EQ(first->element_type, GgufValueType::kUint16);
  ASSERT_EQ(first->items.size(), 2u);
  EXPECT_EQ(*first->items[1].AsInt(), 2);
  EXPECT_EQ(*(*nested->items[1].AsArray())->items[0].AsInt(), 3);

  ASSERT_EQ(file->tensors().size(), 3u);
  const GgufTensorInfo* f32 = *file->FindTensor("w.f32");
  EXPECT_THAT(f32->dims, ::testing::ElementsAre(3, 2));
  EXPECT_EQ(f32->row_length(), 3);
  EXPECT_EQ(f32->n_rows(), 2);
  EXPECT_EQ(f32->n_bytes, 24u);
  EXPECT_EQ(file->data_offset() % 64, 0u);
  EXPECT_THAT(*file->DequantizeTensor("w.f32"), ::testing::ElementsAre(1, 2, 3, -4, 5.5f, -6.25f));
  const auto f16 = *file->DequantizeTensor("w.f16");
  EXPECT_THAT(f16, ::testing::ElementsAre(1.f, -0.5f, 65504.f, std::ldexp(1.f, -24)));
  const auto q8 = *file->DequantizeTensor("w.q8_0");
  ASSERT_EQ(q8.size(), 64u);
  EXPECT_EQ(q8[0], -16 * 0.5f);
  EXPECT_EQ(q8[31], 15 * 0.5f);
  EXPECT_EQ(q8[32], -16 * -0.25f);
  EXPECT_EQ((*file->TensorData("w.q8_0")).size(), 68u);
}

TEST(GgufTest, ReadsVersion2) {
  auto file = GgufFile::Open(WriteFile("v2", ValidFile(2)));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->version(), 2u);
  EXPECT_EQ(*file->GetString("t.string"), "héllo");
}

TEST(GgufTest, AccessorErrorsNameKeyAndType) {
  auto file = GgufFile::Open(WriteFile("valid_acc", ValidFile()));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->GetInt("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file->GetInt("missing").status().message(), HasSubstr("'missing'"));
  auto s = file->GetString("t.i32");
  EXPECT_THAT(s.status().message(), HasSubstr("t.i32"));
  EXPECT_THAT(s.status().message(), HasSubstr("i32"));
  EXPECT_FALSE(file->GetInt("t.u64").ok());              // 1.8e19 does not fit int64
  EXPECT_FALSE(file->GetArray<uint8_t>("t.ints").ok());  // -2 is out of range
  EXPECT_FALSE(file->GetStringArray("t.floats").ok());
  EXPECT_FALSE(file->DequantizeTensor("nope").ok());
  EXPECT_TRUE(file->Has("t.u8"));
  EXPECT_FALSE(file->Has("t.u9"));
}

absl::Status OpenBytes(const std::string& name, const std::vector<uint8_t>& bytes) {
  return GgufFile::Open(WriteFile(name, bytes)).status();
}

TEST(GgufTest, BadMagic) {
  GgufBuilder b(0x46554746u, 3);  // "FGUF"
  b.Counts(0, 0);
  absl::Status s = OpenBytes("magic", b.bytes());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("bad magic"));
}

TEST(GgufTest, UnsupportedVersion) {
  for (uint32_t v : {1u, 4u}) {
    GgufBuilder b(v);
    b.Counts(0, 0);
    absl::Status s = OpenBytes("version", b.bytes());
    EXPECT_THAT(s.message(), HasSubstr("unsupported GGUF version " + std::to_string(v)));
  }
}

TEST(GgufTest, TruncatedHeader) {
  GgufBuilder b(3);
  b.Pod<uint64_t>(0);  // tensor count; the kv count is missing
  absl::Status s = OpenBytes("header", b.bytes());
  EXPECT_THAT(s.message(), HasSubstr("truncated GGUF"));
  EXPECT_THAT(s.message(), HasSubstr("metadata key/value count"));
  EXPECT_THAT(s.message(), HasSubstr("at byte 16"));
}

TEST(GgufTest, TruncatedMetadataString) {
  GgufBuilder b(3);
  b.Counts(0, 1).Str("general.name").Pod<uint32_t>(8).Pod<uint64_t>(1000);
  b.Raw("short", 5);
  absl::Status s = OpenBytes("string", b.bytes());
  EXPECT_THAT(s.message(), HasSubstr("truncated GGUF"));
  EXPECT_THAT(s.message(), HasSubstr("general.name"));
  EXPECT_THAT(s.message(), HasSubstr("length 1000"));
}

TEST(GgufTest, TruncatedTensorData) {
  std::vector<uint8_t> bytes = ValidFile();
  bytes.resize(bytes.size() - 10);  // cut into the last (q8_0) tensor
  absl::Status s = OpenBytes("data", bytes);
  EXPECT_THAT(s.message(), HasSubstr("truncated GGUF: tensor 'w.q8_0' data ends at byte"));
  EXPECT_THAT(s.message(), HasSubstr("but file has " + std::to_string(bytes.size()) + " bytes"));
}

TEST(GgufTest, UnknownTensorType) {
  GgufBuilder b(3);
  b.Counts(1, 0).TensorInfo("w", {32}, 4, 0).Align(32).Raw(std::vector<uint8_t>(64).data(), 64);
  absl::Status s = OpenBytes("type4", b.bytes());
  EXPECT_THAT(s.message(), HasSubstr("tensor 'w' has unknown tensor type id 4"));
  GgufBuilder c(3);
  c.Counts(1, 0).TensorInfo("w", {32}, 99, 0).Align(32).Raw(std::vector<uint8_t>(64).data(), 64);
  EXPECT_THAT(OpenBytes("type99", c.bytes()).message(), HasSubstr("unknown tensor type id 99"));
}

TEST(GgufTest, HugeArrayLengthIsRejectedBeforeAllocating) {
  GgufBuilder b(3);
  b.Counts(0, 1).Str("tokenizer.ggml.tokens").Pod<uint32_t>(9).Pod<uint32_t>(8);
  b.Pod<uint64_t>(uint64_t{1} << 60);
  absl::Status s = OpenBytes("array", b.bytes());
  EXPECT_THAT(s.message(), HasSubstr("array 'tokenizer.ggml.tokens' claims 1152921504606846976"));
}

TEST(GgufTest, HugeCountsAndLengthsAreRejected) {
  GgufBuilder tensors(3);
  tensors.Counts(uint64_t{1} << 40, 0);
  EXPECT_THAT(OpenBytes("ntensors", tensors.bytes()).message(), HasSubstr("tensor count"));
  GgufBuilder kv(3);
  kv.Counts(0, ~uint64_t{0});
  EXPECT_THAT(OpenBytes("nkv", kv.bytes()).message(), HasSubstr("key/value count"));
  GgufBuilder key(3);
  key.Counts(0, 1).Pod<uint64_t>(~uint64_t{0}).Pod<uint64_t>(0);
  EXPECT_THAT(OpenBytes("keylen", key.bytes()).message(), HasSubstr("key of metadata entry 0"));
  GgufBuilder elems(3);  // tensor larger than the file
  elems.Counts(1, 0).TensorInfo("big", {1 << 30, 1 << 30}, 0, 0).Align(32);
  elems.Raw(std::vector<uint8_t>(32).data(), 32);
  // 2^60 f32 elements = 2^62 bytes, starting at the data section (byte 96).
  EXPECT_THAT(OpenBytes("bigtensor", elems.bytes()).message(),
              HasSubstr("truncated GGUF: tensor 'big' data ends at byte 4611686018427388000 but "
                        "file has 128 bytes"));
  GgufBuilder absurd(3);  // 2^62 f64 elements = 2^65 bytes
  absurd.Counts(1, 0).TensorInfo("absurd", {int64_t{1} << 31, int64_t{1} << 31}, 28, 0);
  EXPECT_THAT(OpenBytes("absurd", absurd.bytes()).message(),
              HasSubstr("'absurd' has an absurd size"));
}

TEST(GgufTest, OtherCorruptions) {
  GgufBuilder vt(3);
  vt.Counts(0, 1).Str("k").Pod<uint32_t>(13).Pod<uint32_t>(0);
  EXPECT_THAT(OpenBytes("valuetype", vt.bytes()).message(),
              HasSubstr("unknown metadata value type 13 for key 'k'"));
  GgufBuilder dup(3);
  dup.Counts(0, 2)
      .Kv<uint8_t>("k", GgufValueType::kUint8, 1)
      .Kv<uint8_t>("k", GgufValueType::kUint8, 2);
  EXPECT_THAT(OpenBytes("dup", dup.bytes()).message(), HasSubstr("duplicate metadata key 'k'"));
  GgufBuilder dims(3);
  dims.Counts(1, 0).TensorInfo("w", {1, 1, 1, 1, 1}, 0, 0);
  EXPECT_THAT(OpenBytes("dims", dims.bytes()).message(), HasSubstr("5 dimensions"));
  GgufBuilder align(3);
  align.Counts(1, 0).TensorInfo("w", {4}, 0, 8).Align(32).Raw(std::vector<uint8_t>(64).data(), 64);
  EXPECT_THAT(OpenBytes("align", align.bytes()).message(),
              HasSubstr("not a multiple of the alignment"));
  GgufBuilder block(3);
  block.Counts(1, 0)
      .TensorInfo("w", {33}, 8, 0)
      .Align(32)
      .Raw(std::vector<uint8_t>(128).data(), 128);
  EXPECT_THAT(OpenBytes("block", block.bytes()).message(), HasSubstr("block size 32"));
  GgufBuilder boolean(3);
  boolean.Counts(0, 1).Kv<uint8_t>("b", GgufValueType::kBool, 7);
  EXPECT_THAT(OpenBytes("bool", boolean.bytes()).message(), HasSubstr("not 0/1"));
  GgufBuilder deep(3);  // 20 nested array headers
  deep.Counts(0, 1).Str("deep").Pod<uint32_t>(9);
  for (int i = 0; i < 20; ++i) deep.Pod<uint32_t>(9).Pod<uint64_t>(1);
  deep.Pod<uint32_t>(0).Pod<uint64_t>(0);
  EXPECT_THAT(OpenBytes("deep", deep.bytes()).message(), HasSubstr("nested deeper"));
  GgufBuilder alignment(3);
  alignment.Counts(0, 1).Kv<uint32_t>("general.alignment", GgufValueType::kUint32, 48);
  EXPECT_THAT(OpenBytes("alignment", alignment.bytes()).message(), HasSubstr("power-of-two"));
  EXPECT_EQ(GgufFile::Open(::testing::TempDir() + "/kvr_no_such_file.gguf").status().code(),
            absl::StatusCode::kNotFound);
}

// Every proper prefix of a valid file is a truncated file: each must fail cleanly.
TEST(GgufTest, EveryPrefixOfAValidFileFails) {
  const std::vector<uint8_t> bytes = ValidFile();
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    absl::Status s = OpenBytes("prefix", prefix);
    ASSERT_FALSE(s.ok()) << "prefix of " << n << " bytes was accepted";
    ASSERT_THAT(s.message(), HasSubstr("at byte")) << s;
  }
}

// Random byte corruption may or may not be detected, but must never crash or hang.
TEST(GgufTest, RandomCorruptionDoesNotCrash) {
  const std::vector<uint8_t> valid = ValidFile();
  std::mt19937 rng(7);
  int rejected = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<uint8_t> bytes = valid;
    for (int k = 0; k < 3; ++k) bytes[rng() % bytes.size()] = static_cast<uint8_t>(rng());
    auto file = GgufFile::Open(WriteFile("fuzz", bytes));
    if (!file.ok()) {
      ++rejected;
      continue;
    }
    for (const GgufTensorInfo& t : file->tensors()) {
      auto values = file->DequantizeTensor(t.name);
      if (values.ok()) {
        EXPECT_EQ(values->size(), static_cast<size_t>(t.n_elements));
      }
    }
  }
  EXPECT_GT(rejected, 0);
}

// The real test model (scripts/fetch-model.sh); skipped when it has not been fetched.
class SmolLm2Test : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = TestModelPath();
    if (!std::ifstream(path_).good()) GTEST_SKIP() << "test model not found at " << path_;
  }
  std::string path_;
};

TEST_F(SmolLm2Test, MetadataAndTensorTable) {
  auto file = GgufFile::Open(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->version(), 3u);
  EXPECT_EQ(file->metadata().size(), 33u);
  EXPECT_EQ(*file->GetString("general.architecture"), "llama");
  EXPECT_EQ(*file->GetInt("llama.block_count"), 30);
  EXPECT_EQ(*file->GetInt("llama.embedding_length"), 576);
  EXPECT_EQ(*file->GetInt("llama.attention.head_count"), 9);
  EXPECT_EQ(*file->GetInt("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(*file->GetFloat("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(*file->GetFloat("llama.attention.layer_norm_rms_epsilon"), static_cast<double>(1e-5f));
  EXPECT_EQ(*file->GetBool("tokenizer.ggml.add_bos_token"), false);
  EXPECT_EQ(*file->GetString("tokenizer.ggml.pre"), "smollm");
  const auto tokens = *file->GetStringArray("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 49152u);
  EXPECT_EQ(tokens[1], "<|im_start|>");
  EXPECT_EQ(file->GetStringArray("tokenizer.ggml.merges")->size(), 48900u);
  EXPECT_EQ(file->GetArray<int32_t>("tokenizer.ggml.token_type")->size(), 49152u);
  EXPECT_THAT(*file->GetString("tokenizer.chat_template"), HasSubstr("<|im_start|>"));

  ASSERT_EQ(file->tensors().size(), 272u);
  int n_q4_1 = 0, n_f32 = 0, n_q8_0 = 0;
  for (const GgufTensorInfo& t : file->tensors()) {
    n_q4_1 += t.type == GgmlType::kQ4_1;
    n_f32 += t.type == GgmlType::kF32;
    n_q8_0 += t.type == GgmlType::kQ8_0;
  }
  EXPECT_EQ(n_q4_1, 210);
  EXPECT_EQ(n_f32, 61);
  EXPECT_EQ(n_q8_0, 1);
  const GgufTensorInfo* embd = *file->FindTensor("token_embd.weight");
  EXPECT_THAT(embd->dims, ::testing::ElementsAre(576, 49152));
  EXPECT_EQ(file->data_offset() + embd->offset, 1785664u);  // as gguf-py reports it
}

TEST_F(SmolLm2Test, ParallelDequantisationEqualsSerial) {
  auto file = GgufFile::Open(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  ThreadPool pool(2);
  for (const char* name : {"blk.0.ffn_down.weight", "token_embd.weight", "output_norm.weight"}) {
    auto serial = file->DequantizeTensor(name);
    auto parallel = file->DequantizeTensor(name, &pool);
    ASSERT_TRUE(serial.ok() && parallel.ok()) << name;
    ASSERT_EQ(serial->size(), parallel->size());
    EXPECT_EQ(std::memcmp(serial->data(), parallel->data(), serial->size() * sizeof(float)), 0)
        << name;
  }
}

// Cuts of the real file: inside the vocabulary and just after the start of the tensor data.
TEST_F(SmolLm2Test, TruncatedCopiesFailWithTheirPosition) {
  auto file = GgufFile::Open(path_);
  ASSERT_TRUE(file.ok()) << file.status();
  const std::span<const uint8_t> prefix_src = *file->TensorData("token_embd.weight");
  const uint8_t* base =
      prefix_src.data() - file->data_offset() - (*file->FindTensor("token_embd.weight"))->offset;
  for (size_t cut : {size_t{300000}, static_cast<size_t>(file->data_offset()) + 4096}) {
    std::vector<uint8_t> bytes(base, base + cut);
    absl::Status s = OpenBytes("smollm2_cut", bytes);
    ASSERT_FALSE(s.ok()) << cut;
    EXPECT_THAT(s.message(), HasSubstr("truncated GGUF")) << s;
    if (cut > file->data_offset()) {
      EXPECT_THAT(s.message(), HasSubstr("data ends at byte"));
      EXPECT_THAT(s.message(), HasSubstr("but file has " + std::to_string(cut) + " bytes"));
    } else {
      EXPECT_THAT(s.message(), HasSubstr("tokenizer.ggml")) << s;
    }
  }
}

}  // namespace
}  // namespace kvr::model
