#pragma once
// The OpenAI-compatible HTTP server of kvr-controller, on civetweb (the HTTP library
// prometheus-cpp already links). Thin: routes, reads bodies, checks the API
// key, and writes what openai_api.h converts; requests run through the same Generator as the
// gRPC Generate, in process.
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

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/controller/generator.h"

struct mg_context;
struct mg_connection;

namespace kvr::controller {

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
};

class OpenAiHttpServer {
 public:
  // `generator` must outlive the server. UNAVAILABLE when it cannot listen.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(
      Generator* generator, HttpServerOptions options);
  // Cancels running requests and stops (see Shutdown).
  ~OpenAiHttpServer();
  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  int port() const { return port_; }

  // New requests get 503; running ones may finish until `deadline`, then are cancelled.
  // Returns when none runs.
  void Shutdown(absl::Time deadline);

  // One running request's connection (opaque to callers; public for the handler's helpers).
  struct Exchange;

 private:
  OpenAiHttpServer(Generator* generator, HttpServerOptions options);
  static int HandleRequest(mg_connection* conn, void* self);
  int Handle(mg_connection* conn);
  int HandleGenerate(mg_connection* conn, bool chat);
  void WatchLoop();

  Generator* const generator_;
  const HttpServerOptions options_;
  mg_context* context_ = nullptr;
  int port_ = 0;

  absl::Mutex mu_;
  // Requests running now; the watcher writes their keep-alives.
  absl::flat_hash_set<Exchange*> running_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_watch_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<std::thread> watcher_;
};

}  // namespace kvr::controller
