#include "kvr/controller/http_server.h"

#include <httplib.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "https_certificates.h"
#include "kvr/controller/openai_api.h"
#include "spdlog/spdlog.h"

namespace kvr::controller {

namespace oa = ::kvr::controller::openai;

// One generate request, shared by its HTTP worker, its generation thread (streaming) and the
// response's content provider; it lives until the last of them lets go. `mu` guards what the
// generation thread hands to the writer.
struct OpenAiHttpServer::Exchange {
  explicit Exchange(oa::ParsedRequest request) : parsed(std::move(request)) {}

  const oa::ParsedRequest parsed;
  absl::Time started;
  // Made by the sink factory; used by the generation thread (streaming) or the worker.
  std::optional<oa::ResponseBuilder> builder;
  // Streaming: runs Generate; joined by the worker (an error before the stream) or by the
  // response's resource releaser.
  std::thread generation;

  absl::Mutex mu;
  // Set while Generate runs with a token (it lives in Generator::Generate).
  CancellationToken* token ABSL_GUARDED_BY(mu) = nullptr;
  // Streaming: SSE bytes produced and not yet written.
  std::string pending ABSL_GUARDED_BY(mu);
  bool any_event ABSL_GUARDED_BY(mu) = false;
  // Generate returned `status`.
  bool finished ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  bool headers_sent ABSL_GUARDED_BY(mu) = false;  // the stream answered 200
  bool broken ABSL_GUARDED_BY(mu) = false;        // a write failed: the client is gone
};

namespace {

void SendJson(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, "application/json");
}

void SendError(httplib::Response& res, const oa::ApiError& e) {
  if (e.retry_after_seconds > 0) res.set_header("Retry-After", absl::StrCat(e.retry_after_seconds));
  if (e.http_status == 401) res.set_header("WWW-Authenticate", "Bearer");
  SendJson(res, e.http_status, oa::ErrorBody(e));
}

void SendStatus(httplib::Response& res, const absl::Status& status, oa::Endpoint endpoint) {
  SendError(res, oa::ErrorFromStatus(status, endpoint));
}

void CancelLocked(OpenAiHttpServer::Exchange& x, const absl::Status& why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(x.mu) {
  if (x.token != nullptr) x.token->Cancel(why);
}

// The request's events to its client: collected for one JSON body, or SSE bytes queued for the
// response's content provider.
class HttpSink final : public ResponseSink {
 public:
  explicit HttpSink(OpenAiHttpServer::Exchange* exchange) : x_(exchange) {}
  absl::Status Send(const GenerateEvent& event) override {
    if (!x_->parsed.stream) {
      x_->builder->Add(event);
      return absl::OkStatus();
    }
    const std::string data = x_->builder->StreamEvents(event);
    absl::MutexLock lock(&x_->mu);
    if (x_->broken) return absl::CancelledError("client disconnected");
    x_->pending += data;
    x_->any_event = true;
    return absl::OkStatus();
  }

 private:
  OpenAiHttpServer::Exchange* x_;
};

// OpenSSL's queued errors as one line (they name the file, the PEM problem, ...).
std::string OpenSslErrors() {
  std::string out;
  for (unsigned long e; (e = ERR_get_error()) != 0;) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "unknown OpenSSL error" : out;
}

// The server's TLS: its certificate and key, and with a client CA, client certificates that
// must chain to it.
absl::Status ConfigureTls(SSL_CTX& ctx, const HttpTlsOptions& tls) {
  ERR_clear_error();
  SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(&ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
  if (SSL_CTX_use_certificate_chain_file(&ctx, tls.cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("http_tls_cert '", tls.cert_file,
                                                   "': not a readable PEM certificate (",
                                                   OpenSslErrors(), ")"));
  }
  if (SSL_CTX_use_PrivateKey_file(&ctx, tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "http_tls_key '", tls.key_file, "': not a readable PEM private key of http_tls_cert '",
        tls.cert_file, "' (", OpenSslErrors(), ")"));
  }
  if (SSL_CTX_check_private_key(&ctx) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("http_tls_key '", tls.key_file,
                                                   "' is not the key of http_tls_cert '",
                                                   tls.cert_file, "' (", OpenSslErrors(), ")"));
  }
  if (!tls.client_ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(&ctx, tls.client_ca_file.c_str(), nullptr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("http_tls_client_ca '", tls.client_ca_file,
                                                     "': not a readable PEM certificate (",
                                                     OpenSslErrors(), ")"));
    }
    // The CA names sent in the handshake, so that a client picks a matching certificate.
    if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(tls.client_ca_file.c_str())) {
      SSL_CTX_set_client_CA_list(&ctx, names);
    }
    SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return absl::OkStatus();
}

absl::Status CheckTlsOptions(const HttpTlsOptions& tls) {
  if (!tls.enabled()) {
    if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "http_tls_client_ca: set without http_tls_cert and http_tls_key (client certificates "
          "need HTTPS)");
    }
    return absl::OkStatus();
  }
  if (tls.cert_file.empty()) {
    return absl::InvalidArgumentError("http_tls_cert: empty while http_tls_key is set");
  }
  if (tls.key_file.empty()) {
    return absl::InvalidArgumentError("http_tls_key: empty while http_tls_cert is set");
  }
  return absl::OkStatus();
}

}  // namespace

OpenAiHttpServer::OpenAiHttpServer(Generator* generator, HttpServerOptions options)
    : generator_(generator), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> OpenAiHttpServer::Start(
    Generator* generator, HttpServerOptions options) {
  if (absl::Status s = CheckTlsOptions(options.tls); !s.ok()) return s;
  const size_t colon = options.listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(options.listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("http listen address '", options.listen, "' is not host:port"));
  }
  const std::string host = options.listen.substr(0, colon);
  std::unique_ptr<OpenAiHttpServer> server(new OpenAiHttpServer(generator, std::move(options)));
  if (server->options_.tls.enabled()) {
    absl::Status tls_status;
    server->server_ = std::make_unique<httplib::SSLServer>([&](SSL_CTX& ctx) {
      tls_status = ConfigureTls(ctx, server->options_.tls);
      return tls_status.ok();
    });
    if (!tls_status.ok()) return tls_status;
    if (!server->server_->is_valid()) {
      return absl::InternalError(absl::StrCat("http: no TLS context (", OpenSslErrors(), ")"));
    }
    // The SSL_CTX holds the files as read by ConfigureTls (which checked them); every handshake
    // replaces them with what HttpsCertificates read last.
    absl::StatusOr<std::unique_ptr<HttpsCertificates>> certificates =
        HttpsCertificates::Load(server->options_.tls);
    if (!certificates.ok()) return certificates.status();
    server->certificates_ = std::move(*certificates);
    SSL_CTX* ctx = static_cast<httplib::SSLServer&>(*server->server_).ssl_context();
    server->certificates_->Install(*ctx);
  } else {
    server->server_ = std::make_unique<httplib::Server>();
  }
  httplib::Server& http = *server->server_;
  const int threads = server->options_.threads;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // One request per connection: a kept-alive idle connection would hold a worker thread.
  http.set_keep_alive_max_count(1);
  http.set_payload_max_length(server->options_.max_body_bytes);
  // SO_REUSEADDR (a restart may take the port of its predecessor's TIME_WAIT sockets) but not
  // cpp-httplib's default SO_REUSEPORT, with which a second server would share a port in use
  // instead of failing to listen.
  http.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Every method and path reaches Handle, which answers unknown routes itself (after the API
  // key for /v1/*), as one table.
  const auto handle = [s = server.get()](const httplib::Request& req, httplib::Response& res) {
    s->Handle(req, res);
  };
  http.Get(".*", handle);
  http.Post(".*", handle);
  http.Put(".*", handle);
  http.Patch(".*", handle);
  http.Delete(".*", handle);
  http.Options(".*", handle);
  // What cpp-httplib answers by itself (a body over the limit: 413; a malformed request: 400)
  // gets an OpenAI error body too.
  const size_t max_body = server->options_.max_body_bytes;
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [max_body](const httplib::Request&, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        SendError(res, oa::ApiError{
                           .http_status = res.status,
                           .type = "invalid_request_error",
                           .message = res.status == 413
                                          ? absl::StrCat("the body exceeds ", max_body, " bytes")
                                          : absl::StrCat("the request could not be served (HTTP ",
                                                         res.status, ")"),
                       });
        return httplib::Server::HandlerResponse::Handled;
      }));
  if (port == 0) {
    port = http.bind_to_any_port(host);
  } else if (!http.bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("http: cannot listen on ", server->options_.listen));
  }
  server->port_ = port;
  auto listen_returned = std::make_shared<std::atomic<bool>>(false);
  server->listener_ = std::thread([s = server.get(), listen_returned] {
    if (!s->server_->listen_after_bind()) spdlog::warn("http: the accept loop ended with an error");
    *listen_returned = true;
  });
  // stop() stops only a server that runs: wait until it does, so that destroying the server
  // right after Start cannot leave its accept loop behind.
  while (!http.is_running() && !*listen_returned) absl::SleepFor(absl::Milliseconds(1));
  if (server->certificates_ != nullptr &&
      server->options_.tls.reload_interval != absl::InfiniteDuration()) {
    server->reloader_ = std::thread([s = server.get()] {
      for (;;) {
        {
          absl::MutexLock lock(&s->reload_mu_);
          if (s->reload_mu_.AwaitWithTimeout(absl::Condition(&s->reload_stop_),
                                             s->options_.tls.reload_interval)) {
            return;
          }
        }
        (void)s->ReloadTls();  // logs what it did
      }
    });
  }
  return server;
}

absl::StatusOr<bool> OpenAiHttpServer::ReloadTls() {
  if (certificates_ == nullptr) return absl::FailedPreconditionError("http: not serving HTTPS");
  absl::StatusOr<bool> reloaded = certificates_->Reload();
  if (!reloaded.ok()) {
    spdlog::warn("http: TLS files changed but cannot be used ({}); still presenting {}",
                 reloaded.status().ToString(), certificates_->Describe());
  } else if (*reloaded) {
    spdlog::info("http: TLS files reloaded; presenting {}", certificates_->Describe());
  }
  return reloaded;
}

OpenAiHttpServer::~OpenAiHttpServer() {
  {
    absl::MutexLock lock(&reload_mu_);
    reload_stop_ = true;
  }
  if (reloader_.joinable()) reloader_.join();
  Shutdown(absl::Now());
  // Closes the listening socket, which ends the accept loop; listen_after_bind then waits for
  // the worker threads (every request has ended above).
  if (server_ != nullptr) server_->stop();
  if (listener_.joinable()) listener_.join();
}

bool OpenAiHttpServer::Enter(Exchange* x) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  running_.insert(x);
  return true;
}

void OpenAiHttpServer::Leave(Exchange* x) {
  absl::MutexLock lock(&mu_);
  running_.erase(x);
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
      CancelLocked(*x, absl::UnavailableError("the controller is stopping"));
    }
    mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Milliseconds(50));
  }
}

void OpenAiHttpServer::Handle(const httplib::Request& req, httplib::Response& res) {
  const std::string& method = req.method;
  const std::string& uri = req.path;
  const auto not_found = [&] {
    SendError(res, oa::ApiError{.http_status = 404,
                                .type = "invalid_request_error",
                                .message = absl::StrCat("no route ", method, " ", uri),
                                .code = "not_found"});
  };
  if (uri == "/health") {
    if (method != "GET") return not_found();
    return SendJson(res, 200, R"({"status":"ok"})");
  }
  if (uri == "/ready") {
    if (method != "GET") return not_found();
    return generator_->Models().empty() ? SendJson(res, 503, R"({"status":"not ready"})")
                                        : SendJson(res, 200, R"({"status":"ready"})");
  }
  if (!absl::StartsWith(uri, "/v1/")) return not_found();
  const std::string authorization = req.get_header_value("Authorization");
  if (absl::Status s = oa::CheckApiKey(
          options_.api_key, req.has_header("Authorization") ? authorization.c_str() : nullptr);
      !s.ok()) {
    return SendStatus(res, s, oa::Endpoint::kCompletions);
  }
  if (uri == "/v1/models" && method == "GET") {
    return SendJson(res, 200, oa::ModelsBody(generator_->Models()));
  }
  if (uri == "/v1/completions" && method == "POST") return HandleGenerate(req, res, false);
  if (uri == "/v1/chat/completions" && method == "POST") return HandleGenerate(req, res, true);
  return not_found();
}

void OpenAiHttpServer::HandleGenerate(const httplib::Request& req, httplib::Response& res,
                                      bool chat) {
  const oa::Endpoint endpoint = chat ? oa::Endpoint::kChatCompletions : oa::Endpoint::kCompletions;
  absl::StatusOr<oa::ParsedRequest> parsed = oa::ParseRequest(endpoint, req.body);
  if (!parsed.ok()) return SendStatus(res, parsed.status(), endpoint);
  if (absl::Status s = oa::CheckModelFound(parsed->request.model(),
                                           generator_->Presence(parsed->request.model()));
      !s.ok()) {
    return SendStatus(res, s, endpoint);
  }
  auto x = std::make_shared<Exchange>(*std::move(parsed));
  x->started = absl::Now();
  if (!Enter(x.get())) {
    return SendStatus(res, absl::UnavailableError("the controller is stopping"), endpoint);
  }
  // Runs the request to its end on the calling thread.
  const auto run = [this](Exchange* x) {
    const absl::Status status = generator_->Generate(
        x->parsed.request, absl::InfiniteFuture(),
        [&](const GenerateParams& params, CancellationToken* token) {
          x->builder.emplace(x->parsed, params, absl::ToUnixSeconds(absl::Now()));
          bool stopping;
          {
            absl::MutexLock lock(&mu_);
            stopping = stopping_;
          }
          absl::MutexLock lock(&x->mu);
          x->token = token;
          if (x->broken) token->Cancel(absl::CancelledError("client disconnected"));
          if (stopping) token->Cancel(absl::UnavailableError("the controller is stopping"));
          return std::make_unique<HttpSink>(x);
        });
    // The token is gone: no one may use it from here on.
    absl::MutexLock lock(&x->mu);
    x->token = nullptr;
    x->finished = true;
    x->status = status;
  };

  if (!x->parsed.stream) {
    run(x.get());
    Leave(x.get());
    absl::MutexLock lock(&x->mu);
    if (x->status.ok()) return SendJson(res, 200, x->builder->Body());
    return SendStatus(res, x->status, endpoint);
  }

  x->generation = std::thread([run, x] { run(x.get()); });
  absl::Status failed;
  {
    absl::MutexLock lock(&x->mu);
    auto started_or_done = [&x]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(x->mu) {
      return x->finished || x->any_event;
    };
    x->mu.AwaitWithDeadline(absl::Condition(&started_or_done), x->started + options_.headers_after);
    // An error before the first event (validation, admission, no node ...) has its own HTTP
    // status; from the first event on, or once headers_after passed, the stream says 200.
    if (x->finished && !x->any_event && !x->status.ok()) {
      failed = x->status;
    } else {
      x->headers_sent = true;
    }
  }
  if (!failed.ok()) {
    x->generation.join();
    Leave(x.get());
    return SendStatus(res, failed, endpoint);
  }
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      // Writes what the request produced, or a keep-alive comment after keepalive_period
      // without any; the write that fails (the client is gone) cancels the request.
      [this, x, endpoint](size_t, httplib::DataSink& sink) {
        std::string out;
        bool done;
        {
          absl::MutexLock lock(&x->mu);
          auto ready = [&x]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(x->mu) {
            return x->finished || !x->pending.empty();
          };
          x->mu.AwaitWithTimeout(absl::Condition(&ready), options_.keepalive_period);
          done = x->finished;
          out.swap(x->pending);
          // The stream already said 200: an error goes as an event (the openai client raises
          // it).
          if (done && !x->status.ok()) {
            out += oa::ResponseBuilder::StreamError(oa::ErrorFromStatus(x->status, endpoint));
          }
        }
        if (out.empty()) out = ": keep-alive\n\n";
        if (!sink.write(out.data(), out.size())) {
          absl::MutexLock lock(&x->mu);
          x->broken = true;
          CancelLocked(*x, absl::CancelledError("client disconnected"));
          return false;
        }
        if (done) sink.done();
        return true;
      },
      // When the response is gone (written, or the connection failed): a request still running
      // has lost its client.
      [this, x](bool) {
        if (!x->generation.joinable()) return;
        {
          absl::MutexLock lock(&x->mu);
          if (!x->finished) {
            x->broken = true;
            CancelLocked(*x, absl::CancelledError("client disconnected"));
          }
        }
        x->generation.join();
        Leave(x.get());
      });
}

}  // namespace kvr::controller
