// A fake kvr node for the controller's integration test: a real process with a real gRPC
// server that registers with the controller, heartbeats, and speaks the prefill or decode
// protocol with a known token stream (no model):
//   prefill: first token 100; hands off to the chosen decode node with DecodeService.Handoff.
//   decode:  streams tokens 101, 102, ... until max_tokens, `--token-delay-ms` apart.
//   store:   only registers (no data plane).
// It prints one line per event on stdout ("registered <id>", "prefill-started <request>",
// "cancelled <request>", ...) for the test to wait on.

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <atomic>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/store/v1/store.grpc.pb.h"

namespace {

namespace cv1 = ::kvr::cluster::v1;

struct Options {
  std::string controller;
  std::string role = "prefill";
  std::string model = "smollm2";
  uint32_t context_length = 256;
  uint64_t kv_bytes_per_token = 1000;
  uint64_t memory_bytes = 1ull << 30;
  uint32_t batch_slots = 4;
  int prefill_delay_ms = 0;
  int token_delay_ms = 10;
};

// Prints one event line; stdout is a pipe read by the test, so flush every line.
void Say(const std::string& line) {
  static absl::Mutex mu(absl::kConstInit);
  absl::MutexLock lock(&mu);
  std::cout << line << std::endl;
}

absl::Time DeadlineOf(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return absl::InfiniteFuture();
  return absl::FromUnixSeconds(t.seconds()) + absl::Nanoseconds(t.nanos());
}

class FakePrefill final : public cv1::PrefillService::Service {
 public:
  explicit FakePrefill(const Options& options) : options_(options) {}

  grpc::Status Prefill(grpc::ServerContext* context, const cv1::PrefillRequest* request,
                       cv1::PrefillResponse* response) override {
    Say(absl::StrCat("prefill-started ", request->request_id(), " attempt ", request->attempt()));
    absl::SleepFor(absl::Milliseconds(options_.prefill_delay_ms));
    // Hand off to D, as a real prefill node does.
    auto channel = grpc::CreateChannel(request->decode().endpoints().grpc_address(),
                                       grpc::InsecureChannelCredentials());
    auto stub = cv1::DecodeService::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(context->deadline());
    cv1::HandoffResponse handoff_response;
    auto writer = stub->Handoff(&ctx, &handoff_response);
    cv1::HandoffChunk header;
    cv1::HandoffHeader* h = header.mutable_header();
    h->set_request_id(request->request_id());
    h->set_sequence_id(request->sequence_id());
    h->set_model(request->model());
    *h->mutable_sampling() = request->sampling();
    *h->mutable_retrieval() = request->retrieval();
    *h->mutable_store() = request->store();
    *h->mutable_deadline() = request->deadline();
    h->set_first_token(100);
    h->set_n_layers(2);
    bool ok = writer->Write(header);
    for (uint32_t layer = 0; ok && layer < 2; ++layer) {
      cv1::HandoffChunk chunk;
      chunk.mutable_layer()->set_layer(layer);
      chunk.mutable_layer()->set_summaries(std::string(64, 's'));
      ok = writer->Write(chunk);
    }
    writer->WritesDone();
    grpc::Status handoff = writer->Finish();
    if (!handoff.ok()) {
      context->AddTrailingMetadata("kvr-failed-node", request->decode().node_id());
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("handoff to ", request->decode().node_id(),
                                       " failed: ", handoff.error_message()));
    }
    const uint32_t prompt_tokens = request->has_token_ids()
                                       ? request->token_ids().ids_size()
                                       : static_cast<uint32_t>(request->prompt().size());
    response->set_prompt_tokens(prompt_tokens);
    response->set_first_token(100);
    response->set_first_text("t100 ");
    response->mutable_stats()->set_kv_bytes_shipped(prompt_tokens * options_.kv_bytes_per_token);
    response->mutable_stats()->mutable_prefill_time()->set_nanos(1000);
    if (request->sampling().max_tokens() == 1) {
      response->set_finish_reason(kvr::v1::FINISH_REASON_LENGTH);
    }
    Say(absl::StrCat("prefill-done ", request->request_id()));
    return grpc::Status::OK;
  }

  grpc::Status Cancel(grpc::ServerContext*, const cv1::CancelRequest* request,
                      cv1::CancelResponse*) override {
    Say(absl::StrCat("cancelled ", request->request_id()));
    return grpc::Status::OK;
  }

 private:
  const Options& options_;
};

class FakeDecode final : public cv1::DecodeService::Service {
 public:
  explicit FakeDecode(const Options& options) : options_(options) {}

  grpc::Status Handoff(grpc::ServerContext*, grpc::ServerReader<cv1::HandoffChunk>* reader,
                       cv1::HandoffResponse* response) override {
    cv1::HandoffChunk chunk;
    Sequence seq;
    uint64_t id = 0;
    uint32_t layers = 0;
    while (reader->Read(&chunk)) {
      if (chunk.has_header()) {
        id = chunk.header().sequence_id();
        seq.request_id = chunk.header().request_id();
        seq.max_tokens = chunk.header().sampling().max_tokens();
        seq.deadline = DeadlineOf(chunk.header().deadline());
      } else {
        ++layers;
      }
    }
    if (id == 0 || layers != 2) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "handoff: header or layers missing");
    }
    absl::MutexLock lock(&mu_);
    sequences_[id] = seq;
    response->set_accepted(true);
    Say(absl::StrCat("handoff ", seq.request_id));
    return grpc::Status::OK;
  }

  grpc::Status Stream(grpc::ServerContext* context, const cv1::StreamRequest* request,
                      grpc::ServerWriter<cv1::StreamResponse>* writer) override {
    Sequence seq;
    {
      absl::MutexLock lock(&mu_);
      auto it = sequences_.find(request->sequence_id());
      if (it == sequences_.end()) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("sequence ", request->sequence_id(), ": no handoff"));
      }
      seq = it->second;
      ++running_;
    }
    auto done = [&] {
      absl::MutexLock lock(&mu_);
      sequences_.erase(request->sequence_id());
      --running_;
    };
    for (uint32_t i = 1; i < seq.max_tokens; ++i) {
      absl::SleepFor(absl::Milliseconds(options_.token_delay_ms));
      if (context->IsCancelled() || Cancelled(request->sequence_id())) {
        Say(absl::StrCat("stream-cancelled ", request->request_id()));
        done();
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      }
      cv1::StreamResponse msg;
      msg.add_token_ids(100 + i);
      msg.set_text(absl::StrCat("t", 100 + i, " "));
      if (!writer->Write(msg)) {
        Say(absl::StrCat("stream-cancelled ", request->request_id()));
        done();
        return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
    }
    cv1::StreamResponse last;
    kvr::v1::Completion* c = last.mutable_completion();
    c->set_finish_reason(kvr::v1::FINISH_REASON_LENGTH);
    c->mutable_usage()->set_completion_tokens(seq.max_tokens);
    c->mutable_retrieval()->set_bytes_fetched(512 * seq.max_tokens);
    c->mutable_retrieval()->set_hot_cache_hits(3);
    c->mutable_retrieval()->set_hot_cache_misses(1);
    writer->Write(last);
    done();
    Say(absl::StrCat("stream-done ", request->request_id()));
    return grpc::Status::OK;
  }

  grpc::Status Cancel(grpc::ServerContext*, const cv1::CancelRequest* request,
                      cv1::CancelResponse* response) override {
    absl::MutexLock lock(&mu_);
    cancelled_[request->sequence_id()] = true;
    response->set_found(sequences_.contains(request->sequence_id()));
    Say(absl::StrCat("cancelled ", request->request_id()));
    return grpc::Status::OK;
  }

  uint32_t running() {
    absl::MutexLock lock(&mu_);
    return running_;
  }

 private:
  struct Sequence {
    std::string request_id;
    uint32_t max_tokens = 0;
    absl::Time deadline;
  };
  bool Cancelled(uint64_t id) {
    absl::MutexLock lock(&mu_);
    return cancelled_.contains(id);
  }

  const Options& options_;
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Sequence> sequences_;
  absl::flat_hash_map<uint64_t, bool> cancelled_;
  uint32_t running_ = 0;
};

cv1::RegisterRequest Registration(const Options& o, const std::string& address) {
  cv1::RegisterRequest r;
  r.set_protocol_version(1);
  r.set_name(absl::StrCat("fake-", o.role, "-", getpid()));
  r.mutable_endpoints()->set_grpc_address(address);
  if (o.role == "store") {
    r.set_role(cv1::NODE_ROLE_STORE);
    r.mutable_endpoints()->set_ucx_worker_address("fake-ucx-address");
    r.mutable_capacity()->set_memory_bytes(o.memory_bytes);
    r.mutable_load()->set_free_memory_bytes(o.memory_bytes);
    return r;
  }
  r.set_role(o.role == "decode" ? cv1::NODE_ROLE_DECODE : cv1::NODE_ROLE_PREFILL);
  cv1::ModelInfo* m = r.mutable_capacity()->add_models();
  m->set_name(o.model);
  m->set_context_length(o.context_length);
  m->set_kv_bytes_per_token(o.kv_bytes_per_token);
  if (o.role == "decode") {
    r.mutable_capacity()->set_batch_slots(o.batch_slots);
    r.mutable_capacity()->set_memory_bytes(o.memory_bytes);
    r.mutable_load()->set_free_memory_bytes(o.memory_bytes);
    for (const char* method : {"full", "clusterkv"}) {
      cv1::RetrievalMethodInfo* info = m->add_retrieval_methods();
      info->set_name(method);
      info->set_summary_bytes_per_token(100);
    }
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fake kvr node for controller tests"};
  app.add_option("--controller", o.controller)->required();
  app.add_option("--role", o.role)->check(CLI::IsMember({"prefill", "decode", "store"}));
  app.add_option("--model", o.model);
  app.add_option("--context-length", o.context_length);
  app.add_option("--kv-bytes-per-token", o.kv_bytes_per_token);
  app.add_option("--memory-bytes", o.memory_bytes);
  app.add_option("--batch-slots", o.batch_slots);
  app.add_option("--prefill-delay-ms", o.prefill_delay_ms);
  app.add_option("--token-delay-ms", o.token_delay_ms);
  CLI11_PARSE(app, argc, argv);

  FakePrefill prefill(o);
  FakeDecode decode(o);
  // The store role serves kvr.store.v1.KvStore with every method UNIMPLEMENTED: the controller
  // only needs it registered (and a server needs one service to start).
  kvr::store::v1::KvStore::Service store;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  if (o.role == "prefill") builder.RegisterService(&prefill);
  if (o.role == "decode") builder.RegisterService(&decode);
  if (o.role == "store") builder.RegisterService(&store);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return 1;
  const std::string address = absl::StrCat("127.0.0.1:", port);

  auto membership = cv1::Membership::NewStub(
      grpc::CreateChannel(o.controller, grpc::InsecureChannelCredentials()));
  std::string node_id;
  absl::Duration interval = absl::Milliseconds(200);
  auto register_node = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    cv1::RegisterResponse response;
    grpc::Status s = membership->Register(&ctx, Registration(o, address), &response);
    if (!s.ok()) {
      std::cerr << "register failed: " << s.error_message() << "\n";
      return false;
    }
    node_id = response.node_id();
    interval = absl::Seconds(response.heartbeat_interval().seconds()) +
               absl::Nanoseconds(response.heartbeat_interval().nanos());
    Say(absl::StrCat("registered ", node_id, " ", address));
    return true;
  };
  if (!register_node()) return 1;
  // Heartbeats until killed; re-registers when the controller forgot the node.
  while (true) {
    absl::SleepFor(interval);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    cv1::HeartbeatRequest hb;
    hb.set_node_id(node_id);
    hb.mutable_load()->set_running_sequences(decode.running());
    hb.mutable_load()->set_free_memory_bytes(o.memory_bytes);
    cv1::HeartbeatResponse response;
    grpc::Status s = membership->Heartbeat(&ctx, hb, &response);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) register_node();
  }
}
