#include "kvr/loadgen/backend.h"

#include "absl/strings/str_cat.h"

namespace kvr::loadgen {

absl::StatusOr<BackendKind> ParseBackendKind(std::string_view name) {
  if (name == "kvr-grpc") return BackendKind::kKvrGrpc;
  if (name == "openai-chat") return BackendKind::kOpenAiChat;
  if (name == "openai-completions") return BackendKind::kOpenAiCompletions;
  return absl::InvalidArgumentError(absl::StrCat(
      "backend '", std::string(name), "' is not one of kvr-grpc, openai-chat, openai-completions"));
}

std::string_view BackendName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kKvrGrpc:
      return "kvr-grpc";
    case BackendKind::kOpenAiChat:
      return "openai-chat";
    case BackendKind::kOpenAiCompletions:
      return "openai-completions";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options) {
  if (options.kind == BackendKind::kKvrGrpc) {
    if (options.target.empty()) {
      return absl::InvalidArgumentError("the kvr-grpc backend needs a target host:port");
    }
    absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(options.tls);
    if (!security.ok()) return security.status();
    return MakeGrpcBackend(options.target, options.chat, *std::move(security));
  }
  return MakeOpenAiBackend(options);
}

}  // namespace kvr::loadgen
