#include "kvr/controller/http_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kvr/controller/openai_api.h"
#include "spdlog/spdlog.h"

namespace kvr::controller {

namespace oa = ::kvr::controller::openai;

// The connection of one generate request and what has been written on it. `mu` serializes the
// handler's writes with the watcher's keep-alives.
struct OpenAiHttpServer::Exchange {
  mg_connection* conn = nullptr;
  bool streaming = false;
  absl::Time started;
  // Set once the request runs (its token lives in Generator::Generate).
  CancellationToken* token ABSL_GUARDED_BY(mu) = nullptr;
  absl::Mutex mu;
  bool headers_sent ABSL_GUARDED_BY(mu) = false;
  bool broken ABSL_GUARDED_BY(mu) = false;  // a write failed: the client is gone
  absl::Time last_write ABSL_GUARDED_BY(mu);
};

namespace {

bool WriteAll(mg_connection* conn, absl::string_view data) {
  return data.empty() || mg_write(conn, data.data(), data.size()) == static_cast<int>(data.size());
}

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 409:
      return "Conflict";
    case 413:
      return "Payload Too Large";
    case 429:
      return "Too Many Requests";
    case 499:
      return "Client Closed Request";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    default:
      return "Internal Server Error";
  }
}

// A whole response with a JSON body. Every response closes its connection (civetweb's
// keep-alive is off), which also ends a streamed body.
int SendJson(mg_connection* conn, int status, absl::string_view body,
             absl::string_view extra_headers = "") {
  const std::string head =
      absl::StrCat("HTTP/1.1 ", status, " ", Reason(status),
                   "\r\nContent-Type: application/json\r\nContent-Length: ", body.size(), "\r\n",
                   extra_headers, "Connection: close\r\n\r\n");
  WriteAll(conn, head);
  WriteAll(conn, body);
  return status;
}

int SendError(mg_connection* conn, const oa::ApiError& e) {
  std::string extra;
  if (e.retry_after_seconds > 0)
    extra = absl::StrCat("Retry-After: ", e.retry_after_seconds, "\r\n");
  if (e.http_status == 401) extra += "WWW-Authenticate: Bearer\r\n";
  return SendJson(conn, e.http_status, oa::ErrorBody(e), extra);
}

int SendStatus(mg_connection* conn, const absl::Status& status, oa::Endpoint endpoint) {
  return SendError(conn, oa::ErrorFromStatus(status, endpoint));
}

constexpr char kStreamHeaders[] =
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    "X-Accel-Buffering: no\r\nConnection: close\r\n\r\n";

// Writes `data` to a streaming exchange, sending the headers first if they are not out yet.
// False when the client is gone.
bool StreamWrite(OpenAiHttpServer::Exchange& x, absl::string_view data)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(x.mu) {
  if (x.broken) return false;
  if (!x.headers_sent) {
    x.headers_sent = true;
    if (!WriteAll(x.conn, kStreamHeaders)) x.broken = true;
  }
  if (!x.broken && !WriteAll(x.conn, data)) x.broken = true;
  x.last_write = absl::Now();
  return !x.broken;
}

// The request's events to its client, as SSE or collected for one JSON body.
class HttpSink final : public ResponseSink {
 public:
  HttpSink(OpenAiHttpServer::Exchange* exchange, oa::ResponseBuilder* builder)
      : exchange_(exchange), builder_(builder) {}
  absl::Status Send(const GenerateEvent& event) override {
    if (!exchange_->streaming) {
      builder_->Add(event);
      return absl::OkStatus();
    }
    const std::string data = builder_->StreamEvents(event);
    absl::MutexLock lock(&exchange_->mu);
    if (data.empty() && exchange_->headers_sent) return absl::OkStatus();
    if (!StreamWrite(*exchange_, data)) return absl::CancelledError("client disconnected");
    return absl::OkStatus();
  }

 private:
  OpenAiHttpServer::Exchange* exchange_;
  oa::ResponseBuilder* builder_;
};

}  // namespace

OpenAiHttpServer::OpenAiHttpServer(Generator* generator, HttpServerOptions options)
    : generator_(generator), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    Generator* generator, HttpServerOptions options) {
  std::unique_ptr<OpenAiHttpServer> server(new OpenAiHttpServer(generator, std::move(options)));
  const std::string threads = std::to_string(server->options_.threads);
  const char* mg_options[] = {"listening_ports",
                              server->options_.listen.c_str(),
                              "num_threads",
                              threads.c_str(),
                              "enable_keep_alive",
                              "no",
                              nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  // civetweb's own errors (a port in use, ...) reach the log instead of vanishing.
  callbacks.log_message = [](const mg_connection*, const char* message) {
    spdlog::warn("http: {}", message);
    return 1;
  };
  server->context_ = mg_start(&callbacks, nullptr, mg_options);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("http: cannot listen on ", server->options_.listen));
  }
  mg_server_port ports[4];
  const int n = mg_get_server_ports(server->context_, 4, ports);
  if (n <= 0 || ports[0].port <= 0) {
    return absl::UnavailableError(
        absl::StrCat("http: no listening port reported for ", server->options_.listen));
  }
  server->port_ = ports[0].port;
  mg_set_request_handler(server->context_, "/", &OpenAiHttpServer::HandleRequest, server.get());
  server->watcher_ = std::make_unique<std::thread>([s = server.get()] { s->WatchLoop(); });
  return server;
}

OpenAiHttpServer::~OpenAiHttpServer() {
  Shutdown(absl::Now());
  {
    absl::MutexLock lock(&mu_);
    stop_watch_ = true;
  }
  if (watcher_ != nullptr) watcher_->join();
  if (context_ == nullptr) return;
  // mg_stop waits for civetweb's accept loop, which looks at its stop flag only between polls
  // of 2 s (civetweb's SOCKET_TIMEOUT_QUANTUM) unless a connection arrives: connect to our own
  // port until it returns, so that stopping takes milliseconds, not seconds.
  absl::Notification stopped;
  std::thread waker([this, &stopped] {
    std::string host = options_.listen.substr(0, options_.listen.rfind(':'));
    if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port_));
    if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) return;
    do {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return;
      (void)connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
      close(fd);
    } while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  });
  // Waits for the worker threads; every request has ended above.
  mg_stop(context_);
  stopped.Notify();
  waker.join();
}

void OpenAiHttpServer::Shutdown(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return running_.empty(); };
  mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  // Past the grace period: cancel what still runs (each then ends and leaves the set). A
  // request still being validated has no token yet; its sink factory sees `stopping_`, and
  // this loop retries until every one has ended.
  while (!running_.empty()) {
    for (Exchange* x : running_) {
      absl::MutexLock xl(&x->mu);
      if (x->token != nullptr)
        x->token->Cancel(absl::UnavailableError("the controller is stopping"));
    }
    mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Milliseconds(50));
  }
}

void OpenAiHttpServer::WatchLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_watch_) {
    const absl::Time now = absl::Now();
    for (Exchange* x : running_) {
      if (!x->streaming) continue;
      // A handler in the middle of a write is not idle: skip rather than wait behind it.
      if (!x->mu.TryLock()) continue;
      const bool due = x->headers_sent ? now - x->last_write >= options_.keepalive_period
                                       : now - x->started >= options_.headers_after;
      if (due && !x->broken && !StreamWrite(*x, ": keep-alive\n\n") && x->token != nullptr) {
        x->token->Cancel(absl::CancelledError("client disconnected"));
      }
      x->mu.Unlock();
    }
    // Entries leave the set only under mu_, so the pointers above stay valid during the scan.
    mu_.AwaitWithTimeout(absl::Condition(&stop_watch_), options_.keepalive_period / 4);
  }
}

int OpenAiHttpServer::HandleRequest(mg_connection* conn, void* self) {
  return static_cast<OpenAiHttpServer*>(self)->Handle(conn);
}

int OpenAiHttpServer::Handle(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  const absl::string_view method = info->request_method;
  const absl::string_view uri = info->local_uri != nullptr ? info->local_uri : "";
  const auto not_found = [&] {
    return SendError(conn, oa::ApiError{.http_status = 404,
                                        .type = "invalid_request_error",
                                        .message = absl::StrCat("no route ", method, " ", uri),
                                        .code = "not_found"});
  };
  if (uri == "/health") {
    return method == "GET" ? SendJson(conn, 200, R"({"status":"ok"})") : not_found();
  }
  if (uri == "/ready") {
    if (method != "GET") return not_found();
    return generator_->Models().empty() ? SendJson(conn, 503, R"({"status":"not ready"})")
                                        : SendJson(conn, 200, R"({"status":"ready"})");
  }
  if (!absl::StartsWith(uri, "/v1/")) return not_found();
  if (absl::Status s = oa::CheckApiKey(options_.api_key, mg_get_header(conn, "Authorization"));
      !s.ok()) {
    return SendStatus(conn, s, oa::Endpoint::kCompletions);
  }
  if (uri == "/v1/models" && method == "GET") {
    return SendJson(conn, 200, oa::ModelsBody(generator_->Models()));
  }
  if (uri == "/v1/completions" && method == "POST") return HandleGenerate(conn, false);
  if (uri == "/v1/chat/completions" && method == "POST") return HandleGenerate(conn, true);
  return not_found();
}

int OpenAiHttpServer::HandleGenerate(mg_connection* conn, bool chat) {
  const oa::Endpoint endpoint = chat ? oa::Endpoint::kChatCompletions : oa::Endpoint::kCompletions;
  std::string body;
  // On the heap: civetweb's worker stacks are small (kvr::thread_stack_floor raises them to
  // 1 MiB), and the request still has the whole Generate path to run on this one.
  std::vector<char> buf(1 << 16);
  for (int n; (n = mg_read(conn, buf.data(), buf.size())) > 0;) {
    body.append(buf.data(), n);
    if (body.size() > options_.max_body_bytes) {
      return SendError(
          conn, oa::ApiError{.http_status = 413,
                             .type = "invalid_request_error",
                             .message = absl::StrCat("the body exceeds ", options_.max_body_bytes,
                                                     " bytes")});
    }
  }
  absl::StatusOr<oa::ParsedRequest> parsed = oa::ParseRequest(endpoint, body);
  if (!parsed.ok()) return SendStatus(conn, parsed.status(), endpoint);
  if (absl::Status s = oa::CheckModelFound(parsed->request.model(),
                                           generator_->Presence(parsed->request.model()));
      !s.ok()) {
    return SendStatus(conn, s, endpoint);
  }

  Exchange exchange;
  exchange.conn = conn;
  exchange.streaming = parsed->stream;
  exchange.started = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      return SendStatus(conn, absl::UnavailableError("the controller is stopping"), endpoint);
    }
    running_.insert(&exchange);
  }
  std::optional<oa::ResponseBuilder> builder;
  const absl::Status status =
      generator_->Generate(parsed->request, absl::InfiniteFuture(),
                           [&](const GenerateParams& params, CancellationToken* token) {
                             builder.emplace(*parsed, params, absl::ToUnixSeconds(absl::Now()));
                             bool stopping;
                             {
                               absl::MutexLock lock(&mu_);
                               stopping = stopping_;
                             }
                             absl::MutexLock lock(&exchange.mu);
                             exchange.token = token;
                             if (exchange.broken)
                               token->Cancel(absl::CancelledError("client disconnected"));
                             if (stopping)
                               token->Cancel(absl::UnavailableError("the controller is stopping"));
                             return std::make_unique<HttpSink>(&exchange, &*builder);
                           });
  {
    // The token is gone: no one may use it from here on.
    absl::MutexLock lock(&exchange.mu);
    exchange.token = nullptr;
  }
  int code = 200;
  if (status.ok()) {
    if (!parsed->stream) code = SendJson(conn, 200, builder->Body());
  } else {
    const oa::ApiError error = oa::ErrorFromStatus(status, endpoint);
    absl::MutexLock lock(&exchange.mu);
    if (exchange.headers_sent) {
      // The stream already said 200: the error goes as an event (the openai client raises it).
      StreamWrite(exchange, oa::ResponseBuilder::StreamError(error));
    } else {
      code = SendError(conn, error);
    }
  }
  absl::MutexLock lock(&mu_);
  running_.erase(&exchange);
  return code;
}

}  // namespace kvr::controller
