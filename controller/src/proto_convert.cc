#include "proto_convert.h"

#include <string>
#include <variant>

namespace kvr::controller {

namespace cv1 = ::kvr::cluster::v1;
namespace v1 = ::kvr::v1;

namespace {

NodeRole FromProto(cv1::NodeRole role) {
  switch (role) {
    case cv1::NODE_ROLE_DECODE:
      return NodeRole::kDecode;
    case cv1::NODE_ROLE_STORE:
      return NodeRole::kStore;
    default:
      return NodeRole::kPrefill;
  }
}

}  // namespace

NodeLoad FromProto(const cv1::NodeLoad& load) {
  return NodeLoad{load.queued_prefill_tokens(), load.running_sequences(), load.free_memory_bytes()};
}

NodeRegistration FromProto(const cv1::RegisterRequest& request) {
  NodeRegistration r;
  r.role = FromProto(request.role());
  r.name = request.name();
  r.instance_id = request.instance_id();
  r.host_id = request.host_id();
  r.needs_local_store = request.needs_local_store();
  r.endpoints.grpc_address = request.endpoints().grpc_address();
  r.endpoints.ucx_worker_address = request.endpoints().ucx_worker_address();
  r.endpoints.metrics_port = request.endpoints().metrics_port();
  const cv1::Capacity& c = request.capacity();
  r.capacity.memory_bytes = c.memory_bytes();
  r.capacity.batch_slots = c.batch_slots();
  r.capacity.max_queued_prefill_tokens = c.max_queued_prefill_tokens();
  for (const cv1::ModelInfo& m : c.models()) {
    ModelInfo info{m.name(), m.context_length(), m.kv_bytes_per_token(), {}};
    for (const cv1::RetrievalMethodInfo& method : m.retrieval_methods()) {
      info.retrieval_methods.push_back({method.name(), method.summary_bytes_per_token()});
    }
    r.capacity.models.push_back(std::move(info));
  }
  r.load = FromProto(request.load());
  return r;
}

void ToProto(const NodeSnapshot& node, cv1::NodeRef* out) {
  out->set_node_id(node.id);
  out->set_instance_id(node.registration.instance_id);
  out->mutable_endpoints()->set_grpc_address(node.registration.endpoints.grpc_address);
  out->mutable_endpoints()->set_ucx_worker_address(node.registration.endpoints.ucx_worker_address);
  out->mutable_endpoints()->set_metrics_port(node.registration.endpoints.metrics_port);
}

cv1::PrefillRequest ToPrefillRequest(const PrefillCall& call) {
  const GenerateParams& p = *call.params;
  cv1::PrefillRequest r;
  r.set_request_id(p.request_id);
  r.set_sequence_id(call.sequence_id);
  r.set_sequence_capability(call.sequence_capability);
  r.set_model(p.model);
  if (const auto* text = std::get_if<std::string>(&p.prompt)) {
    r.set_prompt(*text);
  } else if (const auto* ids = std::get_if<std::vector<uint32_t>>(&p.prompt)) {
    r.mutable_token_ids()->mutable_ids()->Add(ids->begin(), ids->end());
  } else {
    for (const ChatMessage& m : std::get<std::vector<ChatMessage>>(p.prompt)) {
      v1::ChatMessage* out = r.mutable_chat()->add_messages();
      out->set_role(m.role);
      out->set_content(m.content);
    }
  }
  v1::SamplingParams* s = r.mutable_sampling();
  s->set_max_tokens(p.sampling.max_tokens);
  s->set_temperature(p.sampling.temperature);
  s->set_top_p(p.sampling.top_p);
  s->set_top_k(p.sampling.top_k);
  if (p.sampling.seed) s->set_seed(*p.sampling.seed);
  for (const std::string& stop : p.sampling.stop) s->add_stop(stop);
  s->set_ignore_eos(p.sampling.ignore_eos);
  v1::RetrievalParams* rp = r.mutable_retrieval();
  rp->set_method(p.retrieval.method);
  rp->set_budget(p.retrieval.budget);
  rp->set_n_sink(p.retrieval.n_sink);
  rp->set_local_window(p.retrieval.local_window);
  for (const auto& [k, v] : p.retrieval.options) (*rp->mutable_options())[k] = v;
  ToProto(call.decode, r.mutable_decode());
  ToProto(call.store, r.mutable_store());
  if (call.deadline != absl::InfiniteFuture()) SetTimestamp(call.deadline, r.mutable_deadline());
  r.set_attempt(call.attempt);
  if (call.prefix.tokens > 0) {
    cv1::PrefixRef* prefix = r.mutable_prefix();
    prefix->set_sequence_id(call.prefix.sequence_id);
    prefix->set_capability(call.prefix.capability);
    prefix->set_tokens(call.prefix.tokens);
  }
  if (call.retain > absl::ZeroDuration()) SetDuration(call.retain, r.mutable_retain());
  return r;
}

FinishReason FromProto(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_EOS:
      return FinishReason::kEos;
    case v1::FINISH_REASON_STOP_STRING:
      return FinishReason::kStopString;
    case v1::FINISH_REASON_LENGTH:
      return FinishReason::kLength;
    default:
      return FinishReason::kUnspecified;
  }
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kStopString:
      return v1::FINISH_REASON_STOP_STRING;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kUnspecified:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

PrefillResult FromProto(const cv1::PrefillResponse& response) {
  PrefillResult r;
  r.prompt_tokens = response.prompt_tokens();
  r.first_token = response.first_token();
  r.first_text = response.first_text();
  r.finish_reason = FromProto(response.finish_reason());
  r.matched_stop = response.matched_stop();
  r.prefill_time = FromProtoDuration(response.stats().prefill_time());
  r.kv_bytes_shipped = response.stats().kv_bytes_shipped();
  r.handoff_bytes = response.stats().handoff_bytes();
  r.cached_tokens = response.cached_tokens();
  return r;
}

Completion FromProto(const v1::Completion& c) {
  Completion out;
  out.finish_reason = FromProto(c.finish_reason());
  out.matched_stop = c.matched_stop();
  out.prompt_tokens = c.usage().prompt_tokens();
  out.completion_tokens = c.usage().completion_tokens();
  out.retrieval.bytes_fetched = c.retrieval().bytes_fetched();
  out.retrieval.rows_fetched = c.retrieval().rows_fetched();
  out.retrieval.hot_cache_hits = c.retrieval().hot_cache_hits();
  out.retrieval.hot_cache_misses = c.retrieval().hot_cache_misses();
  out.retrieval.bytes_shipped = c.retrieval().bytes_shipped();
  return out;
}

v1::GenerateResponse ToGenerateResponse(const GenerateEvent& event, const GenerateParams& params) {
  v1::GenerateResponse r;
  r.set_request_id(params.request_id);
  if (!params.stream.skip_token_ids) {
    r.mutable_token_ids()->Add(event.chunk.token_ids.begin(), event.chunk.token_ids.end());
  }
  if (!params.stream.skip_text) r.set_text(event.chunk.text);
  if (params.stream.continuous_usage || event.final) {
    r.mutable_usage()->set_prompt_tokens(event.prompt_tokens);
    r.mutable_usage()->set_completion_tokens(event.completion_tokens);
    if (event.final) r.mutable_usage()->set_cached_tokens(event.final->completion.cached_tokens);
  }
  if (event.final) {
    const FinalReport& f = *event.final;
    v1::Completion* c = r.mutable_completion();
    c->set_finish_reason(ToProto(f.completion.finish_reason));
    c->set_matched_stop(f.completion.matched_stop);
    c->mutable_usage()->set_prompt_tokens(f.completion.prompt_tokens);
    c->mutable_usage()->set_completion_tokens(f.completion.completion_tokens);
    c->mutable_usage()->set_cached_tokens(f.completion.cached_tokens);
    SetDuration(f.queue, c->mutable_timings()->mutable_queue());
    SetDuration(f.time_to_first_token, c->mutable_timings()->mutable_time_to_first_token());
    SetDuration(f.decode, c->mutable_timings()->mutable_decode());
    SetDuration(f.prefill, c->mutable_timings()->mutable_prefill());
    v1::RetrievalStats* rs = c->mutable_retrieval();
    rs->set_method(params.retrieval.method);
    rs->set_budget(params.retrieval.budget);
    rs->set_bytes_fetched(f.completion.retrieval.bytes_fetched);
    rs->set_rows_fetched(f.completion.retrieval.rows_fetched);
    rs->set_hot_cache_hits(f.completion.retrieval.hot_cache_hits);
    rs->set_hot_cache_misses(f.completion.retrieval.hot_cache_misses);
    rs->set_bytes_shipped(f.completion.retrieval.bytes_shipped);
    c->set_prefill_node(f.prefill_node);
    c->set_decode_node(f.decode_node);
    c->set_store_node(f.store_node);
    c->set_attempts(f.attempts);
  }
  return r;
}

v1::ListModelsResponse ToListModelsResponse(const std::vector<ModelSummary>& models) {
  v1::ListModelsResponse out;
  for (const ModelSummary& m : models) {
    v1::ModelCard* card = out.add_models();
    card->set_name(m.info.name);
    card->set_context_length(m.info.context_length);
    for (const RetrievalMethodInfo& method : m.info.retrieval_methods) {
      card->add_retrieval_methods(method.name);
    }
    card->set_prefill_nodes(m.prefill_nodes);
    card->set_decode_nodes(m.decode_nodes);
  }
  return out;
}

}  // namespace kvr::controller
