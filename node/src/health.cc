#include "kvr/node/health.h"

#include <grpcpp/ext/health_check_service_server_builder_option.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvr::node {
namespace {

namespace hv1 = ::grpc::health::v1;

// How often a Watch stream with nothing to report looks at whether its call was cancelled.
constexpr absl::Duration kWatchPoll = absl::Milliseconds(500);

hv1::HealthCheckResponse::ServingStatus StatusOf(std::optional<bool> serving) {
  if (!serving.has_value()) return hv1::HealthCheckResponse::SERVICE_UNKNOWN;
  return *serving ? hv1::HealthCheckResponse::SERVING : hv1::HealthCheckResponse::NOT_SERVING;
}

class HealthService final : public hv1::Health::Service {
 public:
  explicit HealthService(const ServingStatuses* statuses) : statuses_(statuses) {}

  grpc::Status Check(grpc::ServerContext*, const hv1::HealthCheckRequest* request,
                     hv1::HealthCheckResponse* response) override {
    const std::optional<bool> serving = statuses_->Get(request->service());
    if (!serving.has_value()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service");
    response->set_status(StatusOf(serving));
    return grpc::Status::OK;
  }

  // The current status at once, then every change, until the client cancels or the server
  // shuts down.
  grpc::Status Watch(grpc::ServerContext* context, const hv1::HealthCheckRequest* request,
                     grpc::ServerWriter<hv1::HealthCheckResponse>* writer) override {
    std::optional<hv1::HealthCheckResponse::ServingStatus> sent;
    while (!context->IsCancelled()) {
      const uint64_t seen = statuses_->version();
      const hv1::HealthCheckResponse::ServingStatus now =
          StatusOf(statuses_->Get(request->service()));
      if (sent != now) {
        hv1::HealthCheckResponse response;
        response.set_status(now);
        if (!writer->Write(response)) break;
        sent = now;
      }
      (void)statuses_->WaitForChange(seen, kWatchPoll);
    }
    return grpc::Status::OK;
  }

 private:
  const ServingStatuses* statuses_;
};

// Stands in for gRPC's default health service on the health-only port: a server given one does
// not make the default (which would register grpc.health.v1.Health a second time). Statuses are
// read from ServingStatuses, so there is nothing to set here.
class ExternalHealthStatuses final : public grpc::HealthCheckServiceInterface {
 public:
  void SetServingStatus(const std::string&, bool) override {}
  void SetServingStatus(bool) override {}
};

// Drops the process-wide builder plugins (server reflection, which the main port's
// InitProtoReflectionServerBuilderPlugin installs for every builder): the health-only port
// serves health alone.
class WithoutPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

}  // namespace

ServingStatuses::ServingStatuses(grpc::HealthCheckServiceInterface* main) : main_(main) {
  serving_[""] = true;
}

void ServingStatuses::Set(const std::string& service, bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  serving_[service] = serving;
  ++version_;
  if (main_ != nullptr) main_->SetServingStatus(service, serving);
}

void ServingStatuses::SetAll(bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  for (auto& [service, value] : serving_) value = serving;
  ++version_;
  if (main_ != nullptr) main_->SetServingStatus(serving);
}

void ServingStatuses::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  for (auto& [service, value] : serving_) value = false;
  shut_down_ = true;
  ++version_;
  if (main_ != nullptr) main_->SetServingStatus(false);
  main_ = nullptr;
}

std::optional<bool> ServingStatuses::Get(const std::string& service) const {
  absl::MutexLock lock(&mu_);
  auto it = serving_.find(service);
  if (it == serving_.end()) return std::nullopt;
  return it->second;
}

uint64_t ServingStatuses::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

bool ServingStatuses::WaitForChange(uint64_t seen, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto moved = [this, seen]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return version_ != seen; };
  return mu_.AwaitWithTimeout(absl::Condition(&moved), timeout);
}

absl::StatusOr<std::unique_ptr<HealthOnlyServer>> HealthOnlyServer::Start(
    const std::string& address, const ServingStatuses* statuses) {
  std::unique_ptr<HealthOnlyServer> out(new HealthOnlyServer());
  out->service_ = std::make_unique<HealthService>(statuses);
  grpc::ServerBuilder builder;
  // Plaintext on purpose: this port exists for clients that cannot present a certificate.
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &out->port_);
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(
      std::make_unique<ExternalHealthStatuses>()));
  builder.SetOption(std::make_unique<WithoutPlugins>());
  builder.RegisterService(out->service_.get());
  out->server_ = builder.BuildAndStart();
  if (out->server_ == nullptr || out->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for health checks on ", address));
  }
  return out;
}

HealthOnlyServer::~HealthOnlyServer() { Shutdown(absl::Now()); }

void HealthOnlyServer::Shutdown(absl::Time deadline) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  server_->Shutdown(absl::ToChronoTime(deadline));
  server_->Wait();
}

}  // namespace kvr::node
