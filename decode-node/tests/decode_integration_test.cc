// Real processes: kvr-controller, kvr-store and kvr-decode; this test plays the prefill node
// (SmolLM2 prefill in-process, rows to the store over UCX, Handoff over gRPC) and the
// controller's Stream/Cancel calls. Checks: kvr-decode registers; with `full` the streamed
// greedy tokens equal single-process dense decoding, from f32 and from bf16 store rows, and
// from fp8 store rows they run to the end and mostly equal the bf16 run's; the store sequence
// is released at the end; a cancelled Stream frees it within a second; Stream
// without handoff is NOT_FOUND.

#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <filesystem>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/common/half.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/decode/local_handoff.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/all_methods.h"
#include "kvr/v1/generation.grpc.pb.h"
#include "subprocess.h"
#include "test_util.h"

namespace kvr::decode {
namespace {

namespace cv1 = ::kvr::cluster::v1;
using controller::testing::Subprocess;

std::string AfterPrefix(const std::string& line, const std::string& prefix) {
  return line.size() > prefix.size() ? line.substr(prefix.size()) : "";
}

std::vector<cv1::HandoffChunk> ToChunks(const Handoff& h, const std::string& store_address) {
  std::vector<cv1::HandoffChunk> chunks(1);
  cv1::HandoffHeader* header = chunks[0].mutable_header();
  header->set_request_id(h.request_id);
  header->set_sequence_id(h.sequence_id);
  header->set_sequence_capability(h.store_capability.ToBytes());
  header->mutable_sampling()->set_max_tokens(h.sampling.max_tokens);
  header->mutable_sampling()->set_ignore_eos(true);
  header->mutable_retrieval()->set_method(h.method);
  header->mutable_retrieval()->set_budget(static_cast<uint32_t>(h.budget));
  header->mutable_retrieval()->set_n_sink(static_cast<uint32_t>(h.n_sink));
  header->mutable_retrieval()->set_local_window(static_cast<uint32_t>(h.local_window));
  header->mutable_store()->mutable_endpoints()->set_grpc_address(store_address);
  header->set_prompt_tokens(static_cast<uint32_t>(h.prompt_tokens));
  header->set_first_token(static_cast<uint32_t>(h.first_token));
  header->set_n_layers(static_cast<uint32_t>(h.layers.size()));
  for (const HandoffLayerData& l : h.layers) {
    cv1::HandoffLayer* out = chunks.emplace_back().mutable_layer();
    out->set_layer(static_cast<uint32_t>(l.layer));
    out->set_summaries(l.summaries);
    out->set_sink_kv(l.sink_kv);
    for (int64_t p : l.sink_positions) out->add_sink_positions(static_cast<uint32_t>(p));
    out->set_local_kv(l.local_kv);
    for (int64_t p : l.local_positions) out->add_local_positions(static_cast<uint32_t>(p));
  }
  return chunks;
}

class DecodeIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(TestModelPath())) {
      GTEST_SKIP() << "no test model at " << TestModelPath();
    }
    controller_ = std::make_unique<Subprocess>(std::vector<std::string>{
        KVR_CONTROLLER_BIN, "--listen", "127.0.0.1:0", "--lease-seconds", "5"});
    const std::string c = controller_->WaitForLine("kvr-controller listening on ");
    ASSERT_FALSE(c.empty()) << "controller did not start";
    controller_address_ = AfterPrefix(c, "kvr-controller listening on ");
    store_ = std::make_unique<Subprocess>(std::vector<std::string>{
        KVR_STORE_BIN, "--listen", "127.0.0.1:0", "--capacity-bytes", "256MiB"});
    const std::string s = store_->WaitForLine("kvr-store listening port=");
    ASSERT_FALSE(s.empty()) << "store did not start";
    std::string port = AfterPrefix(s, "kvr-store listening port=");
    port = port.substr(0, port.find(' '));
    store_address_ = absl::StrCat("127.0.0.1:", port);
    decode_ = std::make_unique<Subprocess>(std::vector<std::string>{
        KVR_DECODE_BIN, "--model", TestModelPath(), "--controller", controller_address_, "--listen",
        "127.0.0.1:0", "--threads", "2", "--batch-slots", "4", "--hot-cache-bytes", "64000000"});
    const std::string d = decode_->WaitForLine("kvr-decode listening on ", absl::Seconds(120));
    ASSERT_FALSE(d.empty()) << "kvr-decode did not start";
    decode_address_ = AfterPrefix(d, "kvr-decode listening on ");
    ASSERT_FALSE(decode_->WaitForLine("kvr-decode registered", absl::Seconds(60)).empty());
    decode_stub_ = cv1::DecodeService::NewStub(
        grpc::CreateChannel(decode_address_, grpc::InsecureChannelCredentials()));

    auto loaded = model::LoadModel(TestModelPath(), {}, &pool_);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = std::move(*loaded);
    registry_ = *retrieval::AllMethods();
    auto client = kv_store::UcxKvStoreClient::Connect(store_address_);
    ASSERT_TRUE(client.ok()) << client.status();
    store_client_ = std::move(*client);
  }

  // Dense prefill of `prompt`; greedy continuation of `n` tokens (the first included).
  std::vector<int32_t> DenseGreedy(const std::vector<int32_t>& prompt, int n,
                                   model::KvCache* prefilled) {
    model::DenseAttention dense(&pool_);
    const model::Model& m = *loaded_.model;
    // Float32 storage (the tests read float rows) of the model's half-rounded values.
    model::KvCache cache = m.NewCache(model::KvDType::kF32);
    auto logits = m.Prefill(1, cache, prompt, dense);
    EXPECT_TRUE(logits.ok());
    std::vector<int32_t> out{model::ArgMax(*logits)};
    model::KvCache copy = m.NewCache(model::KvDType::kF32);
    for (int l = 0; l < m.config().n_layers; ++l) {
      const model::KvView v = cache.View(l);
      EXPECT_TRUE(copy.Append(l, v.n_rows, v.k, v.v, v.row_stride).ok());
    }
    *prefilled = std::move(copy);
    return GreedyFrom(std::move(cache), out[0], n);
  }

  // Dense greedy continuation of a prefilled `cache` whose first token is `first`: `n` tokens,
  // the first included.
  std::vector<int32_t> GreedyFrom(model::KvCache cache, int32_t first, int n) {
    model::DenseAttention dense(&pool_);
    const model::Model& m = *loaded_.model;
    std::vector<int32_t> out{first};
    std::vector<float> step(m.config().vocab);
    while (static_cast<int>(out.size()) < n) {
      model::ForwardSequence s{1, &cache, std::span(&out.back(), 1)};
      EXPECT_TRUE(m.Forward(std::span(&s, 1), dense, model::LogitsMode::kLast, step).ok());
      out.push_back(model::ArgMax(step));
    }
    return out;
  }

  // Streams sequence `id` to its end: the tokens after the first, and the completion.
  void StreamToEnd(uint64_t id, std::vector<int32_t>* tokens, kvr::v1::Completion* completion) {
    grpc::ClientContext ctx;
    auto reader = OpenStream(ctx, id, std::chrono::seconds(60));
    cv1::StreamResponse msg;
    while (reader->Read(&msg)) {
      tokens->insert(tokens->end(), msg.token_ids().begin(), msg.token_ids().end());
      if (msg.has_completion()) *completion = msg.completion();
    }
    EXPECT_TRUE(reader->Finish().ok());
  }

  // The Stream of sequence `id` on `ctx`, whose deadline is `timeout` from now.
  std::unique_ptr<grpc::ClientReader<cv1::StreamResponse>> OpenStream(
      grpc::ClientContext& ctx, uint64_t id, std::chrono::milliseconds timeout) {
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    cv1::StreamRequest req;
    req.set_sequence_id(id);
    return decode_stub_->Stream(&ctx, req);
  }

  grpc::Status SendHandoff(const Handoff& h) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    cv1::HandoffResponse response;
    auto writer = decode_stub_->Handoff(&ctx, &response);
    for (const cv1::HandoffChunk& c : ToChunks(h, store_address_)) writer->Write(c);
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    if (s.ok() && !response.accepted()) return grpc::Status(grpc::StatusCode::INTERNAL, "refused");
    return s;
  }

  uint64_t StoreSequences() {
    auto stats = store_client_->Stats();
    EXPECT_TRUE(stats.ok());
    return stats.ok() ? stats->sequences : 999;
  }

  // The store holds no sequence within a second (a finished stream releases its sequence).
  void ExpectStoreEmptiesSoon() {
    for (int i = 0; i < 100 && StoreSequences() != 0; ++i) absl::SleepFor(absl::Milliseconds(10));
    EXPECT_EQ(StoreSequences(), 0u);
  }

  // Hands `cache` off to the decode node as `o` says and streams sequence o.sequence_id to its
  // end: the tokens after the first, and the completion.
  void HandoffAndStream(const model::KvCache& cache, const LocalHandoffOptions& o,
                        std::vector<int32_t>* tokens, kvr::v1::Completion* completion) {
    ASSERT_NO_FATAL_FAILURE(SendLocalHandoff(cache, o));
    StreamToEnd(o.sequence_id, tokens, completion);
  }

  // Hands `cache` off to the decode node as `o` says.
  void SendLocalHandoff(const model::KvCache& cache, const LocalHandoffOptions& o) {
    auto h = MakeLocalHandoff(*loaded_.model, cache, registry_, *store_client_, o);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(SendHandoff(*h).ok());
  }

  ThreadPool pool_{2};
  std::unique_ptr<Subprocess> controller_, store_, decode_;
  std::string controller_address_, store_address_, decode_address_;
  std::unique_ptr<cv1::DecodeService::Stub> decode_stub_;
  model::LoadedModel loaded_;
  retrieval::MethodRegistry registry_;
  std::unique_ptr<kv_store::KvStoreClient> store_client_;
};

TEST_F(DecodeIntegrationTest, FullStreamsDenseGreedyTokensAndCancelFreesTheStore) {
  // The controller lists the decode node's model and methods (a model is listed once a
  // prefill node serves it too: this test registers one for itself, as the prefill side).
  {
    auto membership = cv1::Membership::NewStub(
        grpc::CreateChannel(controller_address_, grpc::InsecureChannelCredentials()));
    cv1::RegisterRequest prefill;
    prefill.set_role(cv1::NODE_ROLE_PREFILL);
    prefill.set_protocol_version(1);
    prefill.set_name("test-prefill");
    prefill.mutable_endpoints()->set_grpc_address("127.0.0.1:1");
    cv1::ModelInfo* info = prefill.mutable_capacity()->add_models();
    info->set_name(std::filesystem::path(TestModelPath()).stem().string());
    info->set_context_length(8192);
    grpc::ClientContext rctx;
    rctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    cv1::RegisterResponse registered;
    ASSERT_TRUE(membership->Register(&rctx, prefill, &registered).ok());
    auto gen = kvr::v1::Generation::NewStub(
        grpc::CreateChannel(controller_address_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    kvr::v1::ListModelsResponse models;
    ASSERT_TRUE(gen->ListModels(&ctx, {}, &models).ok());
    ASSERT_EQ(models.models_size(), 1);
    EXPECT_EQ(models.models(0).decode_nodes(), 1u);
    const auto& methods = models.models(0).retrieval_methods();
    EXPECT_NE(std::find(methods.begin(), methods.end(), "full"), methods.end());
  }
  auto ids = loaded_.tokenizer->Encode(
      "The decode node keeps only the sink tokens and a local window of recent tokens on its "
      "own; every other key and value lives in the KV store and is fetched when the retrieval "
      "summaries select it. The quick brown fox jumps over the lazy dog, again and again, while "
      "the store answers gathers for many heads and sequences in one request.");
  ASSERT_TRUE(ids.ok());
  model::KvCache prefilled = loaded_.model->NewCache(model::KvDType::kF32);
  const int kTokens = 12;
  const std::vector<int32_t> expected = DenseGreedy(*ids, kTokens, &prefilled);

  LocalHandoffOptions o;
  o.sequence_id = 4242;
  o.method = "full";
  o.params.n_sink = 4;
  o.params.local_window = 16;  // most of the prompt (and soon generated rows) is fetched
  o.sampling.max_tokens = kTokens;
  o.first_token = expected[0];
  std::vector<int32_t> got;
  kvr::v1::Completion completion;
  ASSERT_NO_FATAL_FAILURE(HandoffAndStream(prefilled, o, &got, &completion));
  EXPECT_EQ(got, std::vector<int32_t>(expected.begin() + 1, expected.end()));
  EXPECT_EQ(completion.usage().completion_tokens(), static_cast<uint32_t>(kTokens));
  EXPECT_EQ(completion.usage().prompt_tokens(), ids->size());
  EXPECT_GT(completion.retrieval().bytes_fetched(), 0u);
  EXPECT_GT(completion.retrieval().hot_cache_hits(), 0u);
  ExpectStoreEmptiesSoon();

  // bf16 store rows (as a cuda prefill node writes them): the prompt's rows rounded to bf16
  // values, sink/local rows too (the handoff carries them as f32). With fewer tokens than the
  // local window every fetched row is a prompt row, so `full` equals dense decoding over the
  // rounded prompt, and the same rows are fetched in half the bytes.
  {
    const model::KvCache rounded = testing::RoundedToBf16(prefilled);
    const std::vector<int32_t> expected_bf16 = GreedyFrom(
        [&] {
          model::KvCache copy = loaded_.model->NewCache(model::KvDType::kF32);
          for (int l = 0; l < rounded.n_layers(); ++l) {
            const model::KvView v = rounded.View(l);
            EXPECT_TRUE(copy.Append(l, v.n_rows, v.k, v.v, v.row_stride).ok());
          }
          return copy;
        }(),
        expected[0], kTokens);
    // The handoff `o` as sequence `id`, its rows stored as `dtype`.
    const auto stored_as = [&o](uint64_t id, kv_store::DType dtype) {
      LocalHandoffOptions with = o;
      with.sequence_id = id;
      with.store_dtype = dtype;
      return with;
    };
    std::vector<int32_t> got_bf16;
    kvr::v1::Completion completion_bf16;
    ASSERT_NO_FATAL_FAILURE(HandoffAndStream(rounded, stored_as(4244, kv_store::DType::kBf16),
                                             &got_bf16, &completion_bf16));
    EXPECT_EQ(got_bf16, std::vector<int32_t>(expected_bf16.begin() + 1, expected_bf16.end()));
    EXPECT_EQ(completion_bf16.retrieval().rows_fetched(), completion.retrieval().rows_fetched());
    EXPECT_EQ(2 * completion_bf16.retrieval().bytes_fetched(),
              completion.retrieval().bytes_fetched());
    ExpectStoreEmptiesSoon();

    // fp8 store rows (kvr-prefill store_dtype fp8): the handoff puts bf16 rows, the store
    // encodes them, the decode node fetches the fp8 rows (136 bytes at SmolLM2's head_dim 64,
    // against bf16's 256) and decodes them. The same rows are fetched; the generation runs to
    // its end; the codec's error (about 2^-4 relative per element) may flip a near-tied
    // argmax, so the tokens are held to most of the bf16 run's, not all.
    std::vector<int32_t> got_fp8;
    kvr::v1::Completion completion_fp8;
    ASSERT_NO_FATAL_FAILURE(HandoffAndStream(rounded, stored_as(4245, kv_store::DType::kFp8E4m3),
                                             &got_fp8, &completion_fp8));
    ASSERT_EQ(got_fp8.size(), got_bf16.size());
    EXPECT_EQ(completion_fp8.usage().completion_tokens(), static_cast<uint32_t>(kTokens));
    EXPECT_EQ(completion_fp8.retrieval().rows_fetched(),
              completion_bf16.retrieval().rows_fetched());
    EXPECT_EQ(completion_fp8.retrieval().bytes_fetched() * 256,
              completion_bf16.retrieval().bytes_fetched() * 136);
    size_t same = 0;
    for (size_t i = 0; i < got_fp8.size(); ++i) same += got_fp8[i] == got_bf16[i] ? 1 : 0;
    std::printf("fp8 rows: %zu of %zu generated tokens equal the bf16 rows' run\n", same,
                got_fp8.size());
    EXPECT_GE(2 * same, got_fp8.size());
    EXPECT_EQ(got_fp8[0], got_bf16[0]);
    ExpectStoreEmptiesSoon();
  }

  // Cancel: the client goes away mid-stream; the store sequence is released within a second.
  o.sequence_id = 4343;
  o.sampling.max_tokens = 500;
  ASSERT_NO_FATAL_FAILURE(SendLocalHandoff(prefilled, o));
  {
    grpc::ClientContext ctx;
    auto reader = OpenStream(ctx, 4343, std::chrono::seconds(60));
    cv1::StreamResponse msg;
    ASSERT_TRUE(reader->Read(&msg));
    ctx.TryCancel();
    reader->Finish().IgnoreError();
  }
  const absl::Time cancelled = absl::Now();
  while (StoreSequences() != 0 && absl::Now() - cancelled < absl::Seconds(3)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(StoreSequences(), 0u);
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(1));

  // No handoff: NOT_FOUND at the Stream's deadline.
  grpc::ClientContext ctx;
  auto reader = OpenStream(ctx, 999, std::chrono::milliseconds(300));
  cv1::StreamResponse msg;
  while (reader->Read(&msg)) {
  }
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
}

}  // namespace
}  // namespace kvr::decode
