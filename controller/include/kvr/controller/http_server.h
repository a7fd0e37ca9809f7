#pragma once
// The OpenAI-compatible HTTP server of kvr-controller, on cpp-httplib (Debian's
// libcpp-httplib, built against the system OpenSSL), plaintext or HTTPS. Thin: routes, reads
// bodies, checks the API key, and writes what openai_api.h converts; requests run through the
// same Generator as the gRPC Generate, in process.
//
//   POST /v1/completions, POST /v1/chat/completions  (stream or not)
//   GET  /v1/models
//   GET  /health  200 while the process runs (liveness)
//   GET  /ready   200 while some model has a live prefill and decode node, else 503
//
// A client that goes away cancels its request: a streaming response writes every event as it
// comes and, while no token is due, an SSE comment line every `keepalive_period`; the write
// that fails cancels the request's token, which cancels its downstream calls (the decode node
// frees the slot, the store the pages). A non-streaming response has nothing to write until
// the end, so its client's disconnect is noticed only then.
//
// Threads: a non-streaming request runs on its HTTP worker thread. A streaming one runs on a
// thread of its own while its worker writes the events (cpp-httplib sends a response's status
// line only when the handler returns, and a stream's status is known only once its first
// event or its error came, or `headers_after` passed); every response closes its connection,
// so an idle client holds no worker.

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/common/tls.h"
#include "kvr/controller/generator.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kvr::controller {

class HttpsCertificates;

// HTTPS of the server: PEM files. All empty: plaintext HTTP. A certificate needs its key;
// a client CA needs both. The files are read again every `reload_interval`: a renewed
// certificate, key or client CA is what new handshakes get, without a restart (connections
// already open keep theirs). Changed files that do not form a usable set (a key of another
// certificate, a half-written file) are logged and the set in use is kept.
struct HttpTlsOptions {
  std::string cert_file;  // certificate (chain) the server presents
  std::string key_file;   // its private key
  // When set, a client must present a certificate that chains to this CA (mutual TLS);
  // empty: any client may connect (the API key, if set, still applies).
  std::string client_ca_file;
  // absl::InfiniteDuration(): read at start only (and by ReloadTls).
  absl::Duration reload_interval = kTlsReloadInterval;
  [[nodiscard]] bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

struct HttpServerOptions {
  // host:port (IPv4); port 0 picks a free port (port()).
  std::string listen = "127.0.0.1:0";
  // When set, /v1/* requires "Authorization: Bearer <api_key>".
  std::string api_key;
  // Worker threads: each running request holds one, as a synchronous gRPC call does.
  int threads = 64;
  // A streaming response idle this long gets an SSE comment (which clients ignore) so that a
  // gone client is noticed.
  absl::Duration keepalive_period = absl::Milliseconds(200);
  // A streaming request still waiting for its first token this long gets its 200 headers and
  // keep-alives: errors before then have their own HTTP status; later ones are an SSE error
  // event.
  absl::Duration headers_after = absl::Seconds(1);
  // Largest request body.
  size_t max_body_bytes = 64 << 20;
  // HTTPS when set (TLS 1.2 or later).
  HttpTlsOptions tls;
};

class OpenAiHttpServer {
 public:
  // `generator` must outlive the server. INVALID_ARGUMENT naming the file for TLS files that
  // cannot be used; UNAVAILABLE when it cannot listen.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(
      Generator* generator, HttpServerOptions options);
  // Cancels running requests and stops (see Shutdown).
  ~OpenAiHttpServer();
  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  int port() const { return port_; }
  bool tls() const { return options_.tls.enabled(); }

  // Reads the HTTPS files again now, as every reload_interval does: true when they changed and
  // new handshakes use them, false when unchanged; an error naming the file when they changed
  // but cannot be used (the set in use stays). FAILED_PRECONDITION when serving plaintext.
  [[nodiscard]] absl::StatusOr<bool> ReloadTls();

  // New requests get 503; running ones may finish until `deadline`, then are cancelled.
  // Returns when none runs.
  void Shutdown(absl::Time deadline);

  // One running request (opaque to callers; public for the handler's helpers).
  struct Exchange;

 private:
  OpenAiHttpServer(Generator* generator, HttpServerOptions options);
  void Handle(const httplib::Request& req, httplib::Response& res);
  void HandleGenerate(const httplib::Request& req, httplib::Response& res, bool chat);
  // Registers `x` as running; false (and nothing registered) while stopping.
  bool Enter(Exchange* x);
  void Leave(Exchange* x);

  Generator* const generator_;
  const HttpServerOptions options_;
  // HTTPS: the certificates every handshake of server_ takes (declared first: destroyed after
  // server_ and the reloader).
  std::unique_ptr<HttpsCertificates> certificates_;
  std::unique_ptr<httplib::Server> server_;
  std::thread listener_;
  // HTTPS with a finite reload_interval: calls ReloadTls every interval until
  // reload_stop_.
  std::thread reloader_;
  absl::Mutex reload_mu_;
  bool reload_stop_ ABSL_GUARDED_BY(reload_mu_) = false;
  int port_ = 0;

  absl::Mutex mu_;
  // Requests running now (Shutdown cancels them).
  absl::flat_hash_set<Exchange*> running_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvr::controller
