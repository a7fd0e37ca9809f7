#include "kvr/controller/validation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace kvr::controller {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::Status CheckModelAvailable(absl::string_view model, const ModelPresence& presence) {
  if (model.empty()) return absl::OkStatus();  // ParseGenerateRequest names the field
  if (presence.prefill_nodes > 0 && presence.decode_nodes > 0) return absl::OkStatus();
  const std::string live =
      absl::StrCat("live nodes serving model '", model, "': ", presence.prefill_nodes, " prefill, ",
                   presence.decode_nodes, " decode");
  if (!presence.any_model_served) {
    return absl::UnavailableError(absl::StrCat(
        "model: no model is served yet (no prefill and decode node registered; after a "
        "controller restart nodes register again within a heartbeat); ",
        live, "; retry"));
  }
  if (presence.ever_registered) {
    return absl::UnavailableError(absl::StrCat(
        "model: '", model, "' has no live prefill and decode node now (", live, "); retry"));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequestId(absl::string_view id) {
  if (id.size() > kMaxRequestIdLength) {
    return Invalid("request_id", absl::StrCat("longer than ", kMaxRequestIdLength, " characters"));
  }
  for (char c : id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != ':' &&
        c != '-') {
      return Invalid("request_id", "may only contain [A-Za-z0-9._:-]");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerateParams> ParseGenerateRequest(const kvr::v1::GenerateRequest& request,
                                                    absl::Span<const ModelSummary> models,
                                                    const RequestDefaults& defaults) {
  GenerateParams out;
  if (absl::Status s = ValidateRequestId(request.request_id()); !s.ok()) return s;
  out.request_id = request.request_id();

  // Model.
  if (request.model().empty()) return Invalid("model", "empty; see ListModels");
  auto model_it = std::find_if(models.begin(), models.end(), [&](const ModelSummary& m) {
    return m.info.name == request.model();
  });
  if (model_it == models.end()) {
    std::vector<std::string> names;
    for (const ModelSummary& m : models) names.push_back(m.info.name);
    return Invalid("model", absl::StrCat("unknown model '", request.model(), "'; served: [",
                                         absl::StrJoin(names, ", "), "]"));
  }
  const ModelInfo& model = model_it->info;
  out.model = model.name;
  const uint32_t context = model.context_length;

  // Prompt.
  switch (request.input_case()) {
    case kvr::v1::GenerateRequest::kPrompt:
      if (request.prompt().empty()) return Invalid("prompt", "empty");
      out.prompt = request.prompt();
      out.prompt_tokens_bound = std::min<uint64_t>(request.prompt().size(), context);
      break;
    case kvr::v1::GenerateRequest::kTokenIds: {
      const auto& ids = request.token_ids().ids();
      if (ids.empty()) return Invalid("token_ids", "empty");
      if (static_cast<uint64_t>(ids.size()) >= context) {
        return Invalid("token_ids",
                       absl::StrCat(ids.size(), " prompt tokens leave no room in the ",
                                    "context of ", context, " tokens of model '", model.name, "'"));
      }
      out.prompt = std::vector<uint32_t>(ids.begin(), ids.end());
      out.prompt_tokens_bound = ids.size();
      break;
    }
    case kvr::v1::GenerateRequest::kChat: {
      const auto& msgs = request.chat().messages();
      if (msgs.empty()) return Invalid("chat.messages", "empty");
      std::vector<ChatMessage> chat;
      uint64_t bytes = 0;
      bool any_content = false;
      for (int i = 0; i < msgs.size(); ++i) {
        if (msgs[i].role().empty()) {
          return Invalid(absl::StrCat("chat.messages[", i, "].role"), "empty");
        }
        any_content |= !msgs[i].content().empty();
        bytes += msgs[i].content().size() + msgs[i].role().size();
        chat.push_back({msgs[i].role(), msgs[i].content()});
      }
      if (!any_content) return Invalid("chat.messages", "every message's content is empty");
      out.prompt = std::move(chat);
      // The template adds a few tokens per message on top of the content.
      out.prompt_tokens_bound = std::min<uint64_t>(bytes + 16 * msgs.size(), context);
      break;
    }
    case kvr::v1::GenerateRequest::INPUT_NOT_SET:
      return Invalid("prompt", "no input: set one of prompt, token_ids or chat");
  }

  // Sampling.
  const kvr::v1::SamplingParams& sp = request.sampling();
  SamplingParams& s = out.sampling;
  s.max_tokens = sp.has_max_tokens() ? sp.max_tokens() : defaults.max_tokens;
  if (s.max_tokens == 0) return Invalid("sampling.max_tokens", "must be at least 1");
  if (std::holds_alternative<std::vector<uint32_t>>(out.prompt)) {
    // Exact prompt length known: it and the completion must fit the context. With an explicit
    // max_tokens that is an error; a default max_tokens is clamped to what fits.
    const uint64_t room = context - out.prompt_tokens_bound;
    if (s.max_tokens > room) {
      if (sp.has_max_tokens()) {
        return Invalid("sampling.max_tokens",
                       absl::StrCat(s.max_tokens, " + ", out.prompt_tokens_bound,
                                    " prompt tokens exceed the context of ", context, " tokens"));
      }
      s.max_tokens = static_cast<uint32_t>(room);
    }
  } else if (s.max_tokens >= context) {
    return Invalid("sampling.max_tokens",
                   absl::StrCat(s.max_tokens, " leaves no room for a prompt ", "in the context of ",
                                context, " tokens"));
  }
  if (!std::isfinite(sp.temperature()) || sp.temperature() < 0) {
    return Invalid("sampling.temperature", "must be a finite number >= 0");
  }
  s.temperature = sp.temperature();
  s.top_p = sp.has_top_p() ? sp.top_p() : 1.0f;
  if (!(s.top_p > 0 && s.top_p <= 1)) return Invalid("sampling.top_p", "must be in (0, 1]");
  s.top_k = sp.top_k();
  if (sp.has_seed()) s.seed = sp.seed();
  if (static_cast<size_t>(sp.stop_size()) > kMaxStopStrings) {
    return Invalid("sampling.stop", absl::StrCat("more than ", kMaxStopStrings, " stop strings"));
  }
  for (int i = 0; i < sp.stop_size(); ++i) {
    if (sp.stop(i).empty()) return Invalid(absl::StrCat("sampling.stop[", i, "]"), "empty");
    s.stop.push_back(sp.stop(i));
  }
  s.ignore_eos = sp.ignore_eos();

  // Retrieval.
  const kvr::v1::RetrievalParams& rp = request.retrieval();
  RetrievalParams& r = out.retrieval;
  r.method = rp.method().empty() ? defaults.method : rp.method();
  const bool known = std::any_of(model.retrieval_methods.begin(), model.retrieval_methods.end(),
                                 [&](const RetrievalMethodInfo& m) { return m.name == r.method; });
  if (!known) {
    std::vector<std::string> names;
    for (const RetrievalMethodInfo& m : model.retrieval_methods) names.push_back(m.name);
    return Invalid("retrieval.method",
                   absl::StrCat("unknown method '", r.method, "' for model '", model.name,
                                "'; supported: [", absl::StrJoin(names, ", "), "]"));
  }
  r.budget = rp.has_budget() ? rp.budget() : defaults.budget;
  if (r.budget == 0) return Invalid("retrieval.budget", "must be at least 1");
  r.n_sink = rp.has_n_sink() ? rp.n_sink() : defaults.n_sink;
  r.local_window = rp.has_local_window() ? rp.local_window() : defaults.local_window;
  if (r.local_window == 0) {
    // The newest token must always be attended; a zero window could not hold it.
    return Invalid("retrieval.local_window", "must be at least 1");
  }
  for (const auto& [k, v] : rp.options()) {
    if (k.empty()) return Invalid("retrieval.options", "empty key");
    r.options[k] = v;
  }

  out.stream.skip_text = request.stream_options().skip_text();
  out.stream.skip_token_ids = request.stream_options().skip_token_ids();
  out.stream.continuous_usage = request.stream_options().continuous_usage();
  out.resume_on_failure = request.resume_on_failure();
  if (request.cache_salt().size() > 256) {
    return Invalid("cache_salt", "at most 256 bytes");
  }
  out.cache_salt = request.cache_salt();
  out.prefix_cache = !request.has_prefix_cache() || request.prefix_cache();
  if (out.stream.skip_text && out.stream.skip_token_ids) {
    return Invalid("stream_options",
                   "skip_text and skip_token_ids together leave nothing to stream");
  }
  return out;
}

}  // namespace kvr::controller
