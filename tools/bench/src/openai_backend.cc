// The openai-chat and openai-completions backends: streamed POSTs to an OpenAI-compatible
// server through libcurl's multi interface. One thread runs every transfer (curl_multi_poll),
// so a run of thousands of concurrent requests needs no thread per request, as the gRPC
// backend's callback API needs none. Send hands a prepared transfer to that thread and wakes
// it (curl_multi_wakeup).

#include <curl/curl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "kvr/loadgen/backend.h"
#include "kvr/loadgen/openai_wire.h"
#include "nlohmann/json.hpp"

namespace kvr::loadgen {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// A refused request's body is kept up to this size, for its error message.
constexpr size_t kMaxErrorBody = 64 * 1024;

// libcurl's process-wide state must be set up once before the first handle, and
// curl_global_init is not thread-safe; it is never torn down, since other code in the process
// may use libcurl too.
void InitCurlOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct EasyDeleter {
  void operator()(CURL* easy) const { curl_easy_cleanup(easy); }
};
struct SlistDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};
using EasyHandle = std::unique_ptr<CURL, EasyDeleter>;
using HeaderList = std::unique_ptr<curl_slist, SlistDeleter>;

HeaderList Headers(const std::string& api_key, bool json_body) {
  curl_slist* list = nullptr;
  if (json_body) {
    list = curl_slist_append(list, "Content-Type: application/json");
    // libcurl would send "Expect: 100-continue" for bodies over 1 KiB and wait for the server
    // to answer it (up to 1 s with servers that do not): a long prompt would look slow.
    list = curl_slist_append(list, "Expect:");
  }
  if (!api_key.empty()) {
    list = curl_slist_append(list, absl::StrCat("Authorization: Bearer ", api_key).c_str());
  }
  return HeaderList(list);
}

// A transport failure (no HTTP status) as a status-code name, as the gRPC backend reports it.
std::string CodeNameOfCurlError(CURLcode code) {
  switch (code) {
    case CURLE_OPERATION_TIMEDOUT:
      return "DEADLINE_EXCEEDED";
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
      return "UNAVAILABLE";
    default:
      return "INTERNAL";
  }
}

std::string CurlMessage(CURLcode code, const char* error_buffer) {
  return error_buffer[0] != '\0' ? std::string(error_buffer) : curl_easy_strerror(code);
}

// One streamed request: its handle, the buffers libcurl reads from and writes to, and the
// reader that turns the events into its RequestResult. Lives on the transfer thread from the
// moment it is queued until its on_done has been called.
struct Transfer {
  Transfer(OpenAiEndpoint endpoint, Clock::time_point sent, RequestResult* r,
           std::function<void()> done)
      : reader(endpoint, sent, r), result(r), on_done(std::move(done)) {}

  EasyHandle easy;
  HeaderList headers;
  std::string body;  // libcurl reads the POST body from here (CURLOPT_POSTFIELDS: not copied)
  std::string error_body;
  long status = 0;
  SseParser sse;
  OpenAiStreamReader reader;
  RequestResult* result;
  std::function<void()> on_done;
  char error_buffer[CURL_ERROR_SIZE] = {};
};

size_t OnResponseBytes(char* data, size_t size, size_t count, void* user) {
  const Clock::time_point now = Clock::now();
  auto* t = static_cast<Transfer*>(user);
  const size_t bytes = size * count;
  if (t->status == 0) curl_easy_getinfo(t->easy.get(), CURLINFO_RESPONSE_CODE, &t->status);
  if (t->status != 200) {
    if (t->error_body.size() < kMaxErrorBody) {
      t->error_body.append(data, std::min(bytes, kMaxErrorBody - t->error_body.size()));
    }
    return bytes;
  }
  for (const std::string& event : t->sse.Feed(std::string_view(data, bytes))) {
    t->reader.OnEvent(event, now);
  }
  return bytes;
}

size_t AppendToString(char* data, size_t size, size_t count, void* user) {
  auto* out = static_cast<std::string*>(user);
  const size_t bytes = size * count;
  if (out->size() < kMaxErrorBody) out->append(data, std::min(bytes, kMaxErrorBody - out->size()));
  return bytes;
}

class OpenAiBackend final : public Backend {
 public:
  OpenAiBackend(OpenAiEndpoint endpoint, std::string base_url, std::string api_key, TlsConfig tls)
      : endpoint_(endpoint),
        base_url_(std::move(base_url)),
        api_key_(std::move(api_key)),
        tls_(std::move(tls)),
        url_(absl::StrCat(base_url_, endpoint == OpenAiEndpoint::kChatCompletions
                                         ? "/chat/completions"
                                         : "/completions")),
        multi_(curl_multi_init()) {
    loop_ = std::thread([this] { Loop(); });
  }

  ~OpenAiBackend() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    curl_multi_wakeup(multi_);
    loop_.join();
    curl_multi_cleanup(multi_);
  }

  OpenAiBackend(const OpenAiBackend&) = delete;
  OpenAiBackend& operator=(const OpenAiBackend&) = delete;

  absl::StatusOr<std::string> ResolveModel(const std::string& wanted) override {
    const std::string url = absl::StrCat(base_url_, "/models");
    EasyHandle easy(curl_easy_init());
    HeaderList headers = Headers(api_key_, /*json_body=*/false);
    std::string body;
    char error_buffer[CURL_ERROR_SIZE] = {};
    curl_easy_setopt(easy.get(), CURLOPT_URL, url.c_str());
    curl_easy_setopt(easy.get(), CURLOPT_HTTPHEADER, headers.get());
    curl_easy_setopt(easy.get(), CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(easy.get(), CURLOPT_TIMEOUT_MS, 10000L);
    curl_easy_setopt(easy.get(), CURLOPT_WRITEFUNCTION, &AppendToString);
    curl_easy_setopt(easy.get(), CURLOPT_WRITEDATA, &body);
    curl_easy_setopt(easy.get(), CURLOPT_ERRORBUFFER, error_buffer);
    SetTls(easy.get());
    const CURLcode code = curl_easy_perform(easy.get());
    if (code != CURLE_OK) {
      return absl::UnavailableError(
          absl::StrCat("GET ", url, " failed: ", CurlMessage(code, error_buffer)));
    }
    long status = 0;
    curl_easy_getinfo(easy.get(), CURLINFO_RESPONSE_CODE, &status);
    if (status != 200) {
      RequestResult refused;
      HttpErrorToResult(status, body, &refused);
      const std::string message = absl::StrCat("GET ", url, ": ", refused.error);
      return status == 401 ? absl::UnauthenticatedError(message) : absl::UnavailableError(message);
    }
    const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
    std::vector<std::string> names;
    if (!j.is_discarded() && j.is_object() && j.contains("data") && j["data"].is_array()) {
      for (const json& m : j["data"]) {
        if (m.is_object() && m.contains("id") && m["id"].is_string()) {
          names.push_back(m["id"].get<std::string>());
        }
      }
    } else {
      return absl::UnavailableError(absl::StrCat(
          "GET ", url,
          " did not answer a model list ({\"data\": [{\"id\"...}]}): ", body.substr(0, 200)));
    }
    if (names.empty()) return absl::NotFoundError(absl::StrCat(url, " lists no model"));
    if (wanted.empty()) return names.front();
    for (const std::string& n : names) {
      if (n == wanted) return n;
    }
    return absl::NotFoundError(absl::StrCat("model ", wanted, " is not listed by ", url,
                                            " (lists: ", absl::StrJoin(names, ", "), ")"));
  }

  absl::Status CheckPrompt(const Prompt& prompt) const override {
    if (endpoint_ == OpenAiEndpoint::kCompletions && !prompt.messages.empty()) {
      return absl::InvalidArgumentError(
          "the openai-completions backend sends a prompt string, and this dataset has chat "
          "messages: use --backend openai-chat");
    }
    return absl::OkStatus();
  }

  void Send(const RequestSpec& spec, const Prompt& prompt, RequestResult* result,
            std::function<void()> on_done) override {
    auto t = std::make_unique<Transfer>(endpoint_, Clock::now(), result, std::move(on_done));
    t->body = OpenAiRequestBody(endpoint_, spec, prompt);
    t->headers = Headers(api_key_, /*json_body=*/true);
    t->easy.reset(curl_easy_init());
    CURL* easy = t->easy.get();
    curl_easy_setopt(easy, CURLOPT_URL, url_.c_str());
    curl_easy_setopt(easy, CURLOPT_HTTPHEADER, t->headers.get());
    curl_easy_setopt(easy, CURLOPT_POSTFIELDS, t->body.c_str());
    curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(t->body.size()));
    curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(easy, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, static_cast<long>(spec.timeout_s * 1000.0));
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, &OnResponseBytes);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, t.get());
    curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, t->error_buffer);
    SetTls(easy);
    {
      absl::MutexLock lock(&mu_);
      queued_.push_back(std::move(t));
    }
    curl_multi_wakeup(multi_);
  }

 private:
  // HTTPS: the server is verified against --tls-ca instead of the system's CAs, and
  // --tls-cert/--tls-key are presented to a server that asks for a client certificate.
  void SetTls(CURL* easy) const {
    if (!tls_.ca_file.empty()) curl_easy_setopt(easy, CURLOPT_CAINFO, tls_.ca_file.c_str());
    if (!tls_.cert_file.empty()) {
      curl_easy_setopt(easy, CURLOPT_SSLCERT, tls_.cert_file.c_str());
      curl_easy_setopt(easy, CURLOPT_SSLKEY, tls_.key_file.c_str());
    }
  }

  // The transfer thread: adds queued transfers, drives every transfer, completes the finished
  // ones; returns once stopping and nothing is queued or running.
  void Loop() {
    // Transfers in flight by handle; only this thread touches it.
    std::unordered_map<CURL*, std::unique_ptr<Transfer>> active;
    while (true) {
      std::vector<std::unique_ptr<Transfer>> incoming;
      {
        absl::MutexLock lock(&mu_);
        incoming.swap(queued_);
        if (stopping_ && incoming.empty() && active.empty()) return;
      }
      for (std::unique_ptr<Transfer>& t : incoming) {
        CURL* easy = t->easy.get();
        curl_multi_add_handle(multi_, easy);
        active.emplace(easy, std::move(t));
      }
      int running = 0;
      curl_multi_perform(multi_, &running);
      int left = 0;
      while (CURLMsg* msg = curl_multi_info_read(multi_, &left)) {
        if (msg->msg != CURLMSG_DONE) continue;
        CURL* easy = msg->easy_handle;
        const CURLcode code = msg->data.result;  // msg is invalid once the handle is removed
        auto it = active.find(easy);
        std::unique_ptr<Transfer> t = std::move(it->second);
        active.erase(it);
        curl_multi_remove_handle(multi_, easy);
        Complete(*t, code, Clock::now());
        std::function<void()> on_done = std::move(t->on_done);
        t.reset();
        on_done();
      }
      curl_multi_poll(multi_, nullptr, 0, /*timeout_ms=*/1000, nullptr);
    }
  }

  static void Complete(Transfer& t, CURLcode code, Clock::time_point end) {
    if (code != CURLE_OK) {
      t.reader.Finish(end);  // latency; the transport error below replaces any stream error
      t.result->success = false;
      t.result->error_code = CodeNameOfCurlError(code);
      t.result->error = CurlMessage(code, t.error_buffer);
      return;
    }
    if (t.status == 0) curl_easy_getinfo(t.easy.get(), CURLINFO_RESPONSE_CODE, &t.status);
    if (t.status != 200) {
      t.reader.Finish(end);
      HttpErrorToResult(t.status, t.error_body, t.result);
      return;
    }
    t.reader.Finish(end);
  }

  const OpenAiEndpoint endpoint_;
  const std::string base_url_;
  const std::string api_key_;
  const TlsConfig tls_;
  const std::string url_;
  CURLM* const multi_;  // owned; curl_multi_wakeup may be called from any thread
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Transfer>> queued_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread loop_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeOpenAiBackend(const BackendOptions& options) {
  const std::string name(BackendName(options.kind));
  if (options.kind == BackendKind::kKvrGrpc) {
    return absl::InvalidArgumentError("MakeOpenAiBackend: kvr-grpc is not an OpenAI backend");
  }
  if (options.base_url.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", name, " backend needs a base URL (--base-url http://HOST:PORT/v1)"));
  }
  if (!absl::StartsWith(options.base_url, "http://") &&
      !absl::StartsWith(options.base_url, "https://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("base URL '", options.base_url, "' must start with http:// or https://"));
  }
  // The files are read by libcurl at each handshake: a missing one is named here, not as a
  // failed request.
  for (const auto& [flag, file] : {std::pair{"--tls-ca", &options.tls.ca_file},
                                   std::pair{"--tls-cert", &options.tls.cert_file},
                                   std::pair{"--tls-key", &options.tls.key_file}}) {
    if (!file->empty() && access(file->c_str(), R_OK) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " '", *file, "': cannot be read (", strerror(errno), ")"));
    }
  }
  if (options.tls.cert_file.empty() != options.tls.key_file.empty()) {
    return absl::InvalidArgumentError(options.tls.cert_file.empty()
                                          ? "--tls-key: given without --tls-cert"
                                          : "--tls-cert: given without --tls-key");
  }
  InitCurlOnce();
  std::string base_url = options.base_url;
  while (!base_url.empty() && base_url.back() == '/') base_url.pop_back();
  return std::make_unique<OpenAiBackend>(options.kind == BackendKind::kOpenAiChat
                                             ? OpenAiEndpoint::kChatCompletions
                                             : OpenAiEndpoint::kCompletions,
                                         std::move(base_url), options.api_key, options.tls);
}

}  // namespace kvr::loadgen
