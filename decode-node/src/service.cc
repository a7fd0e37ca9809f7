#include "kvr/decode/service.h"

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvr/proto/convert.h"
#include "spdlog/spdlog.h"

namespace kvr::decode {
namespace {

namespace cv1 = ::kvr::cluster::v1;

using ::kvr::proto::TimeOf;

using ::kvr::proto::ToGrpcStatus;

kvr::v1::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kEos:
      return kvr::v1::FINISH_REASON_EOS;
    case FinishReason::kStopString:
      return kvr::v1::FINISH_REASON_STOP_STRING;
    case FinishReason::kLength:
      return kvr::v1::FINISH_REASON_LENGTH;
    default:
      return kvr::v1::FINISH_REASON_UNSPECIFIED;
  }
}

}  // namespace

absl::StatusOr<Handoff> HandoffFromProto(const cv1::HandoffHeader& header,
                                         std::vector<cv1::HandoffLayer> layers,
                                         kv_store::KvStoreClient* store) {
  Handoff h;
  h.request_id = header.request_id();
  h.sequence_id = header.sequence_id();
  // Malformed: none, which the store refuses like a wrong one (the sequence then fails in
  // Prepare's check below rather than on its first gather).
  h.store_capability = kv_store::Capability::FromBytesOrNone(header.sequence_capability());
  h.model = header.model();
  const kvr::v1::SamplingParams& sp = header.sampling();
  h.sampling.max_tokens = sp.has_max_tokens() ? sp.max_tokens() : 16;
  h.sampling.temperature = sp.temperature();
  h.sampling.top_p = sp.has_top_p() ? sp.top_p() : 1.f;
  h.sampling.top_k = sp.top_k();
  // As the prefill node: an unset seed is derived from the request id.
  h.sampling.seed = sp.has_seed() ? sp.seed() : absl::HashOf(header.request_id());
  h.sampling.stop.assign(sp.stop().begin(), sp.stop().end());
  h.sampling.ignore_eos = sp.ignore_eos();
  const kvr::v1::RetrievalParams& rp = header.retrieval();
  h.method = rp.method().empty() ? "full" : rp.method();
  if (rp.has_budget()) h.budget = rp.budget();
  if (rp.has_n_sink()) h.n_sink = rp.n_sink();
  if (rp.has_local_window()) h.local_window = rp.local_window();
  for (const auto& [k, v] : rp.options()) h.options[k] = v;
  h.store = store;
  h.deadline = TimeOf(header.deadline());
  h.prompt_tokens = header.prompt_tokens();
  h.first_token = static_cast<int32_t>(header.first_token());
  h.text_so_far = header.text_so_far();
  h.pending_utf8 = header.pending_utf8();
  h.retain = ::kvr::proto::FromProto(header.retain());
  if (h.retain < absl::ZeroDuration() || h.retain > absl::Hours(24 * 7)) {
    return absl::InvalidArgumentError("handoff retain: must be between 0 and 7 days");
  }
  if (layers.size() != header.n_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("handoff of sequence ", h.sequence_id, ": ",
                                                   layers.size(), " layers arrived, header says ",
                                                   header.n_layers()));
  }
  for (cv1::HandoffLayer& l : layers) {
    HandoffLayerData& d = h.layers.emplace_back();
    d.layer = static_cast<int>(l.layer());
    d.summaries = std::move(*l.mutable_summaries());
    d.sink_kv = std::move(*l.mutable_sink_kv());
    d.sink_positions.assign(l.sink_positions().begin(), l.sink_positions().end());
    d.local_kv = std::move(*l.mutable_local_kv());
    d.local_positions.assign(l.local_positions().begin(), l.local_positions().end());
  }
  return h;
}

DecodeServiceImpl::DecodeServiceImpl(DecodeEngine* engine, StoreClients* stores)
    : engine_(engine), stores_(stores) {}

grpc::Status DecodeServiceImpl::Handoff(grpc::ServerContext* context,
                                        grpc::ServerReader<cv1::HandoffChunk>* reader,
                                        cv1::HandoffResponse* response) {
  cv1::HandoffChunk chunk;
  std::optional<cv1::HandoffHeader> header;
  std::vector<cv1::HandoffLayer> layers;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) {
      if (header) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "handoff: two headers");
      header = std::move(*chunk.mutable_header());
    } else if (chunk.has_layer()) {
      if (!header) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "handoff: a layer arrived before the header");
      }
      layers.push_back(std::move(*chunk.mutable_layer()));
    }
  }
  if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "handoff cancelled");
  if (!header) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "handoff: no header");
  // The instance check: a store that restarted since the prefill node wrote the sequence no
  // longer holds it, and a client connected before the restart cannot reach the new one.
  const cv1::NodeRef& store_ref = header->store();
  absl::StatusOr<std::shared_ptr<kv_store::KvStoreClient>> store =
      stores_->Get(store_ref.endpoints().grpc_address(), store_ref.instance_id());
  if (!store.ok()) {
    context->AddTrailingMetadata(kFailedNodeKey, store_ref.node_id());
    return ToGrpcStatus(store.status());
  }
  absl::StatusOr<kvr::decode::Handoff> h =
      HandoffFromProto(*header, std::move(layers), store->get());
  if (!h.ok()) return ToGrpcStatus(h.status());
  h->store_owner = *store;
  const std::string request_id = h->request_id;
  const uint64_t id = h->sequence_id;
  if (absl::Status s = engine_->Admit(std::move(*h)); !s.ok()) {
    spdlog::warn("handoff {} (sequence {}) refused: {}", request_id, id, s.ToString());
    return ToGrpcStatus(s);
  }
  Remember(id, {store_ref.node_id(), *store});
  spdlog::info("handoff {} (sequence {}, {} prompt tokens, method {}) admitted", request_id, id,
               header->prompt_tokens(), header->retrieval().method());
  response->set_accepted(true);
  return grpc::Status::OK;
}

void DecodeServiceImpl::Remember(uint64_t sequence_id, SequenceStore store) {
  absl::MutexLock lock(&mu_);
  // Sequences whose Stream never came (the controller gave up) are gone from the engine by
  // now; their entries go here rather than piling up.
  absl::erase_if(sequence_stores_, [&](const auto& kv) { return !engine_->Has(kv.first); });
  sequence_stores_[sequence_id] = std::move(store);
}

std::optional<DecodeServiceImpl::SequenceStore> DecodeServiceImpl::Forget(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto it = sequence_stores_.find(sequence_id);
  if (it == sequence_stores_.end()) return std::nullopt;
  SequenceStore store = std::move(it->second);
  sequence_stores_.erase(it);
  return store;
}

grpc::Status DecodeServiceImpl::Stream(grpc::ServerContext* context,
                                       const cv1::StreamRequest* request,
                                       grpc::ServerWriter<cv1::StreamResponse>* writer) {
  const uint64_t id = request->sequence_id();
  // Whatever the outcome, the sequence's store entry goes when the Stream ends.
  std::optional<SequenceStore> store;
  absl::Cleanup forget = [&] {
    if (!store) (void)Forget(id);
  };
  // The handoff may still be on its way. Give up a little before the call's deadline so that
  // the caller sees NOT_FOUND rather than its own DEADLINE_EXCEEDED.
  const absl::Time deadline = absl::FromChrono(context->deadline());
  const absl::Time give_up =
      deadline == absl::InfiniteFuture() ? deadline : deadline - absl::Milliseconds(50);
  while (!engine_->Has(id)) {
    if (context->IsCancelled() || absl::Now() >= give_up) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("sequence ", id, " (request ", request->request_id(),
                                       "): no handoff arrived"));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  while (true) {
    if (context->IsCancelled()) {
      engine_->Cancel(id, "stream cancelled (client went away or deadline)");
      return grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
    }
    // Short waits so that a cancelled call is noticed within one step or so.
    absl::StatusOr<StreamChunk> chunk = engine_->Next(id, absl::Now() + absl::Milliseconds(50));
    if (!chunk.ok()) {
      // A sequence that failed while its store's transport is down failed because of the
      // store: say so (UNAVAILABLE, the store named), so that the controller drops the store
      // and not this node, and the client may retry.
      store = Forget(id);
      if (store && store->client != nullptr && !store->client->Health().ok()) {
        context->AddTrailingMetadata(kFailedNodeKey, store->node_id);
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat("sequence ", id, ": its KV store ", store->node_id,
                                         " failed: ", chunk.status().message()));
      }
      return ToGrpcStatus(chunk.status());
    }
    cv1::StreamResponse msg;
    for (int32_t t : chunk->tokens) msg.add_token_ids(static_cast<uint32_t>(t));
    msg.set_text(std::move(chunk->text));
    if (chunk->completion) {
      const CompletionInfo& c = *chunk->completion;
      kvr::v1::Completion* out = msg.mutable_completion();
      out->set_finish_reason(ToProto(c.reason));
      out->set_matched_stop(c.matched_stop);
      out->mutable_usage()->set_prompt_tokens(static_cast<uint32_t>(c.prompt_tokens));
      out->mutable_usage()->set_completion_tokens(static_cast<uint32_t>(c.completion_tokens));
      kvr::v1::RetrievalStats* r = out->mutable_retrieval();
      r->set_method(c.method);
      r->set_budget(static_cast<uint32_t>(c.budget));
      r->set_bytes_fetched(static_cast<uint64_t>(c.retrieval.bytes_fetched));
      r->set_rows_fetched(static_cast<uint64_t>(c.retrieval.rows_fetched));
      r->set_hot_cache_hits(static_cast<uint64_t>(c.retrieval.hot_cache_hits));
      r->set_hot_cache_misses(static_cast<uint64_t>(c.retrieval.hot_cache_misses));
      writer->Write(msg);
      return grpc::Status::OK;
    }
    if (msg.token_ids_size() == 0 && msg.text().empty()) continue;
    if (!writer->Write(msg)) {
      engine_->Cancel(id, "stream write failed (client went away)");
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
  }
}

grpc::Status DecodeServiceImpl::Cancel(grpc::ServerContext*, const cv1::CancelRequest* request,
                                       cv1::CancelResponse* response) {
  response->set_found(engine_->Cancel(request->sequence_id(), request->reason()));
  (void)Forget(request->sequence_id());
  spdlog::info("cancel {} (sequence {}, {}): found {}", request->request_id(),
               request->sequence_id(), request->reason(), response->found());
  return grpc::Status::OK;
}

}  // namespace kvr::decode
