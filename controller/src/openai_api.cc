#include "kvr/controller/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace kvr::controller::openai {
namespace {

using json = nlohmann::json;

// The OpenAI error code a parse error carries (as a status payload), when it has one.
constexpr char kCodePayload[] = "type.kvr.dev/openai-error-code";

absl::Status Invalid(const std::string& param, const std::string& message,
                     const char* code = nullptr) {
  absl::Status s = absl::InvalidArgumentError(absl::StrCat(param, ": ", message));
  if (code != nullptr) s.SetPayload(kCodePayload, absl::Cord(code));
  return s;
}

absl::Status Unsupported(const std::string& param, const std::string& why) {
  return Invalid(param, absl::StrCat("not supported by kvr (", why, ")"), "unsupported_parameter");
}

// The members of a request object, read once each; what is left unread at the end is an
// unknown field. A JSON null counts as absent, as the OpenAI API treats it.
class Fields {
 public:
  explicit Fields(const json& object) : object_(object) {}
  const json* Get(const std::string& name) {
    read_.insert(name);
    auto it = object_.find(name);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::optional<std::string> FirstUnread() const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (!read_.contains(it.key())) return it.key();
    }
    return std::nullopt;
  }

 private:
  const json& object_;
  std::set<std::string> read_;
};

absl::StatusOr<double> Number(const json& v, const std::string& param) {
  if (!v.is_number()) return Invalid(param, "expected a number");
  const double x = v.get<double>();
  if (!std::isfinite(x)) return Invalid(param, "expected a finite number");
  return x;
}

absl::StatusOr<int64_t> Integer(const json& v, const std::string& param) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid(param, "out of range");
    }
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return Invalid(param, "expected an integer");
}

absl::StatusOr<uint32_t> Count(const json& v, const std::string& param) {
  absl::StatusOr<int64_t> x = Integer(v, param);
  if (!x.ok()) return x.status();
  if (*x < 0 || *x > std::numeric_limits<uint32_t>::max()) {
    return Invalid(param, "must be a non-negative 32-bit integer");
  }
  return static_cast<uint32_t>(*x);
}

// A field kvr cannot honour is refused unless it holds the value that means "off".
absl::Status RefuseUnlessNeutral(Fields& f, const std::string& name, const std::string& why,
                                 const std::function<bool(const json&)>& neutral) {
  const json* v = f.Get(name);
  if (v != nullptr && !neutral(*v)) return Unsupported(name, why);
  return absl::OkStatus();
}

bool IsFalse(const json& v) { return v.is_boolean() && !v.get<bool>(); }
bool IsZero(const json& v) { return v.is_number() && v.get<double>() == 0; }
bool IsOne(const json& v) { return v.is_number_integer() && v.get<int64_t>() == 1; }
bool IsEmptyObject(const json& v) { return v.is_object() && v.empty(); }

absl::Status ParseSampling(Endpoint endpoint, Fields& f, kvr::v1::SamplingParams* sp) {
  std::optional<uint32_t> max_tokens;
  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    if (endpoint == Endpoint::kCompletions && absl::string_view(name) != "max_tokens") continue;
    if (const json* v = f.Get(name)) {
      absl::StatusOr<uint32_t> n = Count(*v, name);
      if (!n.ok()) return n.status();
      if (max_tokens && *max_tokens != *n) {
        return Invalid(name, "differs from max_tokens; set one of them");
      }
      max_tokens = *n;
    }
  }
  if (max_tokens) sp->set_max_tokens(*max_tokens);
  // OpenAI's default temperature is 1 (kvr's own API defaults to greedy).
  sp->set_temperature(1.0f);
  if (const json* v = f.Get("temperature")) {
    absl::StatusOr<double> t = Number(*v, "temperature");
    if (!t.ok()) return t.status();
    sp->set_temperature(static_cast<float>(*t));
  }
  if (const json* v = f.Get("top_p")) {
    absl::StatusOr<double> p = Number(*v, "top_p");
    if (!p.ok()) return p.status();
    sp->set_top_p(static_cast<float>(*p));
  }
  if (const json* v = f.Get("top_k")) {
    absl::StatusOr<int64_t> k = Integer(*v, "top_k");
    if (!k.ok()) return k.status();
    // vLLM spells "off" -1; kvr 0.
    if (*k < -1 || *k > std::numeric_limits<uint32_t>::max()) {
      return Invalid("top_k", "must be -1 or 0 (off) or a positive integer");
    }
    sp->set_top_k(*k < 0 ? 0 : static_cast<uint32_t>(*k));
  }
  if (const json* v = f.Get("seed")) {
    absl::StatusOr<int64_t> seed = Integer(*v, "seed");
    if (!seed.ok()) return seed.status();
    if (*seed < 0) return Invalid("seed", "must be >= 0");
    sp->set_seed(static_cast<uint64_t>(*seed));
  }
  if (const json* v = f.Get("stop")) {
    if (v->is_string()) {
      sp->add_stop(v->get<std::string>());
    } else if (v->is_array()) {
      for (const json& s : *v) {
        if (!s.is_string()) return Invalid("stop", "expected a string or a list of strings");
        sp->add_stop(s.get<std::string>());
      }
    } else {
      return Invalid("stop", "expected a string or a list of strings");
    }
  }
  if (const json* v = f.Get("ignore_eos")) {
    if (!v->is_boolean()) return Invalid("ignore_eos", "expected a boolean");
    sp->set_ignore_eos(v->get<bool>());
  }
  return absl::OkStatus();
}

absl::Status ParseKvrExtension(Fields& f, kvr::v1::GenerateRequest* request) {
  kvr::v1::RetrievalParams* rp = request->mutable_retrieval();
  const json* v = f.Get("kvr");
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_object()) return Invalid("kvr", "expected an object");
  Fields k(*v);
  if (const json* m = k.Get("method")) {
    if (!m->is_string()) return Invalid("kvr.method", "expected a string");
    rp->set_method(m->get<std::string>());
  }
  struct Counted {
    const char* name;
    void (kvr::v1::RetrievalParams::*set)(uint32_t);
  };
  for (const Counted c : {Counted{"budget", &kvr::v1::RetrievalParams::set_budget},
                          Counted{"n_sink", &kvr::v1::RetrievalParams::set_n_sink},
                          Counted{"local_window", &kvr::v1::RetrievalParams::set_local_window}}) {
    if (const json* x = k.Get(c.name)) {
      absl::StatusOr<uint32_t> n = Count(*x, absl::StrCat("kvr.", c.name));
      if (!n.ok()) return n.status();
      (rp->*c.set)(*n);
    }
  }
  if (const json* r = k.Get("resume_on_failure")) {
    if (!r->is_boolean()) return Invalid("kvr.resume_on_failure", "expected a boolean");
    request->set_resume_on_failure(r->get<bool>());
  }
  if (const json* r = k.Get("prefix_cache")) {
    if (!r->is_boolean()) return Invalid("kvr.prefix_cache", "expected a boolean");
    request->set_prefix_cache(r->get<bool>());
  }
  if (const json* o = k.Get("options")) {
    if (!o->is_object()) return Invalid("kvr.options", "expected an object of strings");
    for (auto it = o->begin(); it != o->end(); ++it) {
      if (!it->is_string()) {
        return Invalid(absl::StrCat("kvr.options.", it.key()), "expected a string");
      }
      (*rp->mutable_options())[it.key()] = it->get<std::string>();
    }
  }
  if (std::optional<std::string> unknown = k.FirstUnread()) {
    return Invalid(absl::StrCat("kvr.", *unknown),
                   "unknown field; kvr takes method, budget, n_sink, local_window, options, "
                   "resume_on_failure, prefix_cache",
                   "unknown_parameter");
  }
  return absl::OkStatus();
}

absl::Status ParsePrompt(Fields& f, kvr::v1::GenerateRequest* r) {
  const json* v = f.Get("prompt");
  if (v == nullptr) return Invalid("prompt", "required");
  if (v->is_string()) {
    r->set_prompt(v->get<std::string>());
    return absl::OkStatus();
  }
  if (!v->is_array()) return Invalid("prompt", "expected a string or a list of token ids");
  // A list of one string is the same prompt; a list of token ids is kvr's token_ids input.
  if (v->size() == 1 && (*v)[0].is_string()) {
    r->set_prompt((*v)[0].get<std::string>());
    return absl::OkStatus();
  }
  if (!v->empty() && (*v)[0].is_string()) {
    return Unsupported("prompt", "several prompts in one request; send one request each");
  }
  for (const json& id : *v) {
    if (id.is_array()) return Unsupported("prompt", "several prompts in one request");
    absl::StatusOr<int64_t> x = Integer(id, "prompt");
    if (!x.ok() || *x < 0 || *x > std::numeric_limits<uint32_t>::max()) {
      return Invalid("prompt", "expected a string or a list of token ids");
    }
    r->mutable_token_ids()->add_ids(static_cast<uint32_t>(*x));
  }
  return absl::OkStatus();
}

absl::Status ParseMessages(Fields& f, kvr::v1::GenerateRequest* r) {
  const json* v = f.Get("messages");
  if (v == nullptr) return Invalid("messages", "required");
  if (!v->is_array()) return Invalid("messages", "expected a list of messages");
  kvr::v1::ChatMessages* chat = r->mutable_chat();
  for (size_t i = 0; i < v->size(); ++i) {
    const std::string at = absl::StrCat("messages[", i, "]");
    const json& m = (*v)[i];
    if (!m.is_object()) return Invalid(at, "expected an object");
    Fields mf(m);
    const json* role = mf.Get("role");
    if (role == nullptr || !role->is_string()) return Invalid(at + ".role", "required string");
    const std::string role_name = role->get<std::string>();
    if (role_name != "system" && role_name != "user" && role_name != "assistant") {
      return Unsupported(at + ".role",
                         absl::StrCat("role '", role_name, "'; kvr takes system, user, assistant"));
    }
    std::string content;
    const json* c = mf.Get("content");
    if (c == nullptr) return Invalid(at + ".content", "required");
    if (c->is_string()) {
      content = c->get<std::string>();
    } else if (c->is_array()) {
      // Content parts: text parts are joined; images, audio and files are refused.
      for (size_t j = 0; j < c->size(); ++j) {
        const std::string part_at = absl::StrCat(at, ".content[", j, "]");
        const json& part = (*c)[j];
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
          return Invalid(part_at, "expected a content part object with a type");
        }
        if (part["type"] != "text") {
          return Unsupported(part_at + ".type",
                             absl::StrCat("content part '", part["type"].get<std::string>(),
                                          "'; kvr takes text only"));
        }
        if (!part.contains("text") || !part["text"].is_string()) {
          return Invalid(part_at + ".text", "required string");
        }
        content += part["text"].get<std::string>();
      }
    } else {
      return Invalid(at + ".content", "expected a string or a list of text parts");
    }
    if (std::optional<std::string> unknown = mf.FirstUnread()) {
      return Unsupported(absl::StrCat(at, ".", *unknown), "message field");
    }
    kvr::v1::ChatMessage* out = chat->add_messages();
    out->set_role(role_name);
    out->set_content(std::move(content));
  }
  return absl::OkStatus();
}

absl::StatusOr<ParsedRequest> ParseObject(Endpoint endpoint, const json& body) {
  if (!body.is_object()) return Invalid("body", "expected a JSON object");
  ParsedRequest out;
  out.endpoint = endpoint;
  Fields f(body);
  const json* model = f.Get("model");
  if (model == nullptr || !model->is_string()) return Invalid("model", "required string");
  out.request.set_model(model->get<std::string>());

  absl::Status s = endpoint == Endpoint::kCompletions ? ParsePrompt(f, &out.request)
                                                      : ParseMessages(f, &out.request);
  if (!s.ok()) return s;
  if (s = ParseSampling(endpoint, f, out.request.mutable_sampling()); !s.ok()) return s;
  if (s = ParseKvrExtension(f, &out.request); !s.ok()) return s;

  if (const json* v = f.Get("stream")) {
    if (!v->is_boolean()) return Invalid("stream", "expected a boolean");
    out.stream = v->get<bool>();
  }
  if (const json* v = f.Get("stream_options")) {
    if (!out.stream) return Invalid("stream_options", "only allowed with \"stream\": true");
    if (!v->is_object()) return Invalid("stream_options", "expected an object");
    Fields so(*v);
    if (const json* u = so.Get("include_usage")) {
      if (!u->is_boolean()) return Invalid("stream_options.include_usage", "expected a boolean");
      out.include_usage = u->get<bool>();
    }
    if (std::optional<std::string> unknown = so.FirstUnread()) {
      return Unsupported(absl::StrCat("stream_options.", *unknown), "stream option");
    }
  }
  // Metadata that does not change the output.
  (void)f.Get("user");
  // The prefix-reuse scope, as vLLM spells it.
  if (const json* v = f.Get("cache_salt")) {
    if (!v->is_string()) return Invalid("cache_salt", "expected a string");
    out.request.set_cache_salt(v->get<std::string>());
  }

  // What kvr cannot honour: refused unless set to the value that means "off".
  const auto refuse = [&](const std::string& name, const std::string& why,
                          const std::function<bool(const json&)>& neutral) {
    return RefuseUnlessNeutral(f, name, why, neutral);
  };
  const auto never = [](const json&) { return false; };
  struct Rule {
    const char* name;
    const char* why;
    std::function<bool(const json&)> neutral;
  };
  std::vector<Rule> rules = {
      {"n", "one choice per request; only n=1", IsOne},
      {"logit_bias", "logit bias", IsEmptyObject},
      {"presence_penalty", "penalties", IsZero},
      {"frequency_penalty", "penalties", IsZero},
  };
  if (endpoint == Endpoint::kCompletions) {
    rules.push_back({"logprobs", "log probabilities", IsZero});
    rules.push_back({"best_of", "one choice per request; only best_of=1", IsOne});
    rules.push_back({"echo", "echoing the prompt", IsFalse});
    rules.push_back({"suffix", "insertion with a suffix",
                     [](const json& v) { return v.is_string() && v.get<std::string>().empty(); }});
  } else {
    rules.push_back({"logprobs", "log probabilities", IsFalse});
    rules.push_back({"top_logprobs", "log probabilities", IsZero});
    rules.push_back({"tools", "tool calls", never});
    rules.push_back({"tool_choice", "tool calls", never});
    rules.push_back({"parallel_tool_calls", "tool calls", never});
    rules.push_back({"functions", "function calls", never});
    rules.push_back({"function_call", "function calls", never});
    rules.push_back(
        {"response_format", "structured output; only {\"type\": \"text\"}", [](const json& v) {
           return v.is_object() && v.size() == 1 && v.contains("type") && v["type"] == "text";
         }});
  }
  for (const Rule& rule : rules) {
    if (s = refuse(rule.name, rule.why, rule.neutral); !s.ok()) return s;
  }
  if (std::optional<std::string> unknown = f.FirstUnread()) {
    return Invalid(*unknown, "unrecognized request argument", "unknown_parameter");
  }
  return out;
}

// The OpenAI name of a kvr field path.
std::string OpenAiParam(absl::string_view path, Endpoint endpoint) {
  if (absl::ConsumePrefix(&path, "sampling.")) return std::string(path);
  if (absl::ConsumePrefix(&path, "retrieval.")) return absl::StrCat("kvr.", path);
  if (absl::ConsumePrefix(&path, "chat.")) return std::string(path);
  if (path == "token_ids") return "prompt";
  if (path == "prompt" && endpoint == Endpoint::kChatCompletions) return "messages";
  return std::string(path);
}

// The field path a status message starts with ("top_p: must be ..."), if it does.
std::string LeadingField(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return "";
  const absl::string_view field = message.substr(0, colon);
  for (char c : field) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' ||
          c == ']')) {
      return "";
    }
  }
  return std::string(field);
}

const char* FinishReasonName(FinishReason reason) {
  return reason == FinishReason::kLength ? "length" : "stop";
}

// Token counts as the node that finished the sequence reports them (kvr.v1 Completion.usage).
json UsageJson(const Completion& c) {
  return {{"prompt_tokens", c.prompt_tokens},
          {"completion_tokens", c.completion_tokens},
          {"total_tokens", c.prompt_tokens + c.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", c.cached_tokens}}}};
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// What the request ran with and where: kvr's report, beside OpenAI's fields.
json KvrJson(const std::string& request_id, const RetrievalParams& retrieval,
             const FinalReport& r) {
  const RetrievalStats& s = r.completion.retrieval;
  json out = {{"request_id", request_id},
              {"method", retrieval.method},
              {"budget", retrieval.budget},
              {"n_sink", retrieval.n_sink},
              {"local_window", retrieval.local_window},
              {"bytes_fetched", s.bytes_fetched},
              {"rows_fetched", s.rows_fetched},
              {"hot_cache_hits", s.hot_cache_hits},
              {"hot_cache_misses", s.hot_cache_misses},
              {"bytes_shipped", s.bytes_shipped},
              {"prefill_node", r.prefill_node},
              {"decode_node", r.decode_node},
              {"store_node", r.store_node},
              {"attempts", r.attempts},
              {"timings",
               {{"queue_s", Seconds(r.queue)},
                {"time_to_first_token_s", Seconds(r.time_to_first_token)},
                {"decode_s", Seconds(r.decode)},
                {"prefill_s", Seconds(r.prefill)}}}};
  if (!r.completion.matched_stop.empty()) out["matched_stop"] = r.completion.matched_stop;
  return out;
}

std::string Dump(const json& j) {
  // Invalid UTF-8 (which the decode path never sends) is replaced rather than thrown.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string Sse(const json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

}  // namespace

absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, absl::string_view body) {
  const json parsed = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return Invalid("body", "not valid JSON");
  // The accessors above check types before every get<>(), so nothing below should throw;
  // this is the boundary that guarantees it.
  try {
    return ParseObject(endpoint, parsed);
  } catch (const json::exception& e) {
    return Invalid("body", e.what());
  }
}

namespace {

// How a status code reaches an OpenAI client: HTTP status, error type, error code ("": null)
// and Retry-After seconds (0: none).
struct ErrorKind {
  absl::StatusCode status;
  int http_status;
  const char* type;
  const char* code;
  int retry_after_seconds;
};
constexpr ErrorKind kErrorKinds[] = {
    {absl::StatusCode::kInvalidArgument, 400, "invalid_request_error", "", 0},
    {absl::StatusCode::kUnauthenticated, 401, "invalid_request_error", "invalid_api_key", 0},
    {absl::StatusCode::kNotFound, 404, "invalid_request_error", "model_not_found", 0},
    {absl::StatusCode::kAlreadyExists, 409, "invalid_request_error", "conflict", 0},
    {absl::StatusCode::kResourceExhausted, 429, "rate_limit_error", "rate_limit_exceeded", 1},
    // nginx's "client closed request": the client is usually gone and never reads it.
    {absl::StatusCode::kCancelled, 499, "cancelled", "cancelled", 0},
    {absl::StatusCode::kUnavailable, 503, "service_unavailable", "service_unavailable", 0},
    {absl::StatusCode::kDeadlineExceeded, 504, "timeout", "deadline_exceeded", 0},
};
// Every other code.
constexpr ErrorKind kServerError = {absl::StatusCode::kInternal, 500, "server_error",
                                    "internal_error", 0};

}  // namespace

ApiError ErrorFromStatus(const absl::Status& status, Endpoint endpoint) {
  ErrorKind kind = kServerError;
  for (const ErrorKind& k : kErrorKinds) {
    if (k.status == status.code()) kind = k;
  }
  ApiError e;
  e.message = std::string(status.message());
  e.http_status = kind.http_status;
  e.type = kind.type;
  e.code = kind.code;
  e.retry_after_seconds = kind.retry_after_seconds;
  if (status.code() == absl::StatusCode::kInvalidArgument ||
      status.code() == absl::StatusCode::kNotFound) {
    const std::string field = LeadingField(status.message());
    if (!field.empty()) e.param = OpenAiParam(field, endpoint);
  }
  if (auto code = status.GetPayload(kCodePayload)) {
    e.code = std::string(*code);
  }
  return e;
}

std::string ErrorBody(const ApiError& error) {
  const auto or_null = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
  return Dump(json{{"error",
                    {{"message", error.message},
                     {"type", error.type},
                     {"param", or_null(error.param)},
                     {"code", or_null(error.code)}}}});
}

absl::Status CheckModelFound(absl::string_view model, const ModelPresence& presence) {
  if (presence.any_model_served && !presence.ever_registered) {
    return absl::NotFoundError(absl::StrCat("model: the model '", model,
                                            "' does not exist; GET /v1/models lists the served "
                                            "ones"));
  }
  return absl::OkStatus();
}

absl::Status CheckApiKey(absl::string_view api_key, const char* authorization) {
  if (api_key.empty()) return absl::OkStatus();
  if (authorization == nullptr) {
    return absl::UnauthenticatedError(
        "missing API key: send the header 'Authorization: Bearer <key>'");
  }
  absl::string_view given(authorization);
  if (!absl::ConsumePrefix(&given, "Bearer ")) {
    return absl::UnauthenticatedError("the Authorization header is not 'Bearer <key>'");
  }
  // Compares every byte whatever the first difference, so the time taken says nothing of the
  // key's prefix.
  unsigned char diff = given.size() == api_key.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ api_key[i % api_key.size()]);
  }
  if (diff != 0) return absl::UnauthenticatedError("incorrect API key");
  return absl::OkStatus();
}

std::string ModelsBody(const std::vector<ModelSummary>& models) {
  json data = json::array();
  for (const ModelSummary& m : models) {
    json methods = json::array();
    for (const RetrievalMethodInfo& r : m.info.retrieval_methods) methods.push_back(r.name);
    data.push_back({{"id", m.info.name},
                    {"object", "model"},
                    {"created", 0},
                    {"owned_by", "kvr"},
                    {"max_model_len", m.info.context_length},
                    {"kvr",
                     {{"retrieval_methods", methods},
                      {"prefill_nodes", m.prefill_nodes},
                      {"decode_nodes", m.decode_nodes}}}});
  }
  return Dump(json{{"object", "list"}, {"data", data}});
}

ResponseBuilder::ResponseBuilder(const ParsedRequest& request, const GenerateParams& params,
                                 int64_t created)
    : request_(request),
      request_id_(params.request_id),
      model_(params.model),
      retrieval_(params.retrieval),
      created_(created) {}

std::string ResponseBuilder::Chunk(const std::string& text, const GenerateEvent* final_event,
                                   bool first) const {
  const bool chat = request_.endpoint == Endpoint::kChatCompletions;
  json choice = {{"index", 0}, {"logprobs", nullptr}};
  if (chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  choice["finish_reason"] =
      final_event != nullptr ? json(FinishReasonName(final_event->final->completion.finish_reason))
                             : json(nullptr);
  json chunk = {{"id", absl::StrCat(chat ? "chatcmpl-" : "cmpl-", request_id_)},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created_},
                {"model", model_},
                {"system_fingerprint", nullptr},
                {"choices", json::array({choice})}};
  if (request_.include_usage) chunk["usage"] = nullptr;
  if (final_event != nullptr) chunk["kvr"] = KvrJson(request_id_, retrieval_, *final_event->final);
  return Sse(chunk);
}

std::string ResponseBuilder::StreamEvents(const GenerateEvent& event) {
  const bool chat = request_.endpoint == Endpoint::kChatCompletions;
  std::string out;
  // The chat stream opens with the assistant's role, as OpenAI's does.
  if (chat && !role_sent_) {
    out += Chunk("", nullptr, /*first=*/true);
    role_sent_ = true;
  }
  if (!event.chunk.text.empty()) out += Chunk(event.chunk.text, nullptr, false);
  if (event.final) {
    out += Chunk("", &event, false);
    if (request_.include_usage) {
      json usage_chunk = {{"id", absl::StrCat(chat ? "chatcmpl-" : "cmpl-", request_id_)},
                          {"object", chat ? "chat.completion.chunk" : "text_completion"},
                          {"created", created_},
                          {"model", model_},
                          {"system_fingerprint", nullptr},
                          {"choices", json::array()},
                          {"usage", UsageJson(event.final->completion)},
                          {"kvr", KvrJson(request_id_, retrieval_, *event.final)}};
      out += Sse(usage_chunk);
    }
    out += "data: [DONE]\n\n";
  }
  return out;
}

std::string ResponseBuilder::StreamError(const ApiError& error) {
  return absl::StrCat("data: ", ErrorBody(error), "\n\n");
}

void ResponseBuilder::Add(const GenerateEvent& event) {
  text_ += event.chunk.text;
  if (event.final) final_ = event;
}

std::string ResponseBuilder::Body() const {
  const bool chat = request_.endpoint == Endpoint::kChatCompletions;
  json choice = {{"index", 0}, {"logprobs", nullptr}};
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text_}};
  } else {
    choice["text"] = text_;
  }
  choice["finish_reason"] =
      final_ ? json(FinishReasonName(final_->final->completion.finish_reason)) : json(nullptr);
  json body = {{"id", absl::StrCat(chat ? "chatcmpl-" : "cmpl-", request_id_)},
               {"object", chat ? "chat.completion" : "text_completion"},
               {"created", created_},
               {"model", model_},
               {"system_fingerprint", nullptr},
               {"choices", json::array({choice})},
               {"usage", UsageJson(final_ ? final_->final->completion : Completion{})}};
  if (final_) body["kvr"] = KvrJson(request_id_, retrieval_, *final_->final);
  return Dump(body);
}

}  // namespace kvr::controller::openai
