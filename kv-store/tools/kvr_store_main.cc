// kvr-store: the CPU-memory KV store service. See kvr/kv_store/server.h.
#include <pthread.h>
#include <signal.h>

#include <cstdio>

#include "kvr/kv_store/config.h"
#include "kvr/kv_store/server.h"

int main(int argc, char** argv) {
  using kvr::kv_store::ParseStoreConfig;
  absl::StatusOr<kvr::kv_store::StoreConfig> config =
      ParseStoreConfig(argc, argv, kvr::kv_store::ProcessEnv());
  if (!config.ok()) {
    if (absl::IsCancelled(config.status())) {  // --help
      std::printf("%s", std::string(config.status().message()).c_str());
      return 0;
    }
    std::fprintf(stderr, "kvr-store: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  // SIGTERM/SIGINT are blocked before any thread starts (threads inherit the mask) and taken
  // synchronously below with sigwait: shutdown then runs on the main thread, outside any
  // signal handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::printf("kvr-store effective config:\n%s", config->Describe().c_str());
  absl::StatusOr<std::unique_ptr<kvr::kv_store::StoreServer>> server =
      kvr::kv_store::StoreServer::Start(config->ToServerOptions());
  if (!server.ok()) {
    std::fprintf(stderr, "kvr-store: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  if ((*server)->metrics_port() > 0) {
    std::printf("kvr-store metrics port=%d\n", (*server)->metrics_port());
  }
  const kvr::kv_store::StoreStats stats = (*server)->store().Stats();
  // Tests and launchers read the port from this line.
  std::printf("kvr-store listening port=%d capacity_bytes=%llu pages=%llu page_backing=%s\n",
              (*server)->port(), static_cast<unsigned long long>(stats.capacity_bytes),
              static_cast<unsigned long long>(stats.total_pages), stats.page_backing.c_str());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("kvr-store: signal %d, shutting down\n", sig);
  std::fflush(stdout);
  (*server)->Shutdown();
  server->reset();
  std::printf("kvr-store: stopped\n");
  return 0;
}
