#include "kvr/node/membership_client.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "kvr/common/instance_id.h"
#include "kvr/proto/convert.h"

namespace kvr::node {

namespace cv1 = ::kvr::cluster::v1;

namespace {

// gRPC's own reconnect backoff grows to 120 s by default: a node started long before its
// controller would then register up to two minutes late. Cap it at our retry backoff.
std::shared_ptr<grpc::Channel> MakeChannel(const MembershipClient::Options& o) {
  grpc::ChannelArguments args;
  const int initial_ms = static_cast<int>(absl::ToInt64Milliseconds(o.initial_backoff));
  const int max_ms = static_cast<int>(absl::ToInt64Milliseconds(o.max_backoff));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::max(initial_ms, 1));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::max(initial_ms, 1));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, std::max(max_ms, 1));
  return o.security.CreateChannel(o.controller, args);
}

}  // namespace

namespace {

MembershipClient::Options WithInstanceId(MembershipClient::Options o) {
  if (o.registration.instance_id().empty()) o.registration.set_instance_id(NewInstanceId());
  if (o.registration.host_id().empty()) o.registration.set_host_id(HostId());
  return o;
}

}  // namespace

MembershipClient::MembershipClient(Options options)
    : options_(WithInstanceId(std::move(options))),
      stub_(cv1::Membership::NewStub(MakeChannel(options_))),
      thread_([this] { Loop(); }) {}

MembershipClient::~MembershipClient() { Stop(); }

std::string MembershipClient::node_id() const {
  absl::MutexLock lock(&mu_);
  return node_id_;
}

bool MembershipClient::WaitRegistered(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !node_id_.empty() || stopped_; };
  mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  return !node_id_.empty();
}

void MembershipClient::Stop() {
  absl::MutexLock stop_lock(&stop_mu_);
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    id = std::exchange(node_id_, "");
  }
  if (options_.on_cluster_view) options_.on_cluster_view(0);  // on Stop()'s caller's thread
  if (id.empty()) return;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  cv1::DeregisterRequest request;
  request.set_node_id(id);
  cv1::DeregisterResponse response;
  const grpc::Status s = stub_->Deregister(&ctx, request, &response);
  spdlog::info("deregister {} from controller {}: {}", id, options_.controller,
               s.ok() ? "ok" : s.error_message());
}

cv1::NodeLoad MembershipClient::Load() const {
  return options_.load ? options_.load() : cv1::NodeLoad();
}

void MembershipClient::NoteFailure(const std::string& what, const std::string& error) {
  const std::string state = what + ": " + error;
  if (state == last_error_) return;
  last_error_ = state;
  spdlog::warn("{} (controller {}); retrying, logged again only when this changes", state,
               options_.controller);
}

void MembershipClient::NoteSuccess(const std::string& what) {
  if (!last_error_.empty())
    spdlog::info("{} with controller {} ok again", what, options_.controller);
  last_error_.clear();
}

bool MembershipClient::Register() {
  cv1::RegisterRequest request = options_.registration;
  *request.mutable_load() = Load();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  cv1::RegisterResponse response;
  const grpc::Status s = stub_->Register(&ctx, request, &response);
  if (!s.ok()) {
    NoteFailure("register", s.error_message());
    return false;
  }
  NoteSuccess("register");
  interval_ = ::kvr::proto::FromProto(response.heartbeat_interval());
  if (interval_ <= absl::ZeroDuration()) interval_ = absl::Seconds(1);
  {
    absl::MutexLock lock(&mu_);
    node_id_ = response.node_id();
  }
  spdlog::info("registered with controller {} as {} (heartbeat every {})", options_.controller,
               response.node_id(), absl::FormatDuration(interval_));
  if (options_.on_registered) options_.on_registered(response.node_id());
  if (options_.on_cluster_view) options_.on_cluster_view(response.live_stores());
  return true;
}

void MembershipClient::Loop() {
  bool registered = false;
  absl::Duration backoff = options_.initial_backoff;
  std::string id;  // this thread's copy of node_id_
  while (!stop_.HasBeenNotified()) {
    if (!registered) {
      registered = Register();
      if (!registered) {
        if (stop_.WaitForNotificationWithTimeout(backoff)) break;
        backoff = std::min(backoff * 2, options_.max_backoff);
        continue;
      }
      backoff = options_.initial_backoff;
      id = node_id();
    }
    if (stop_.WaitForNotificationWithTimeout(interval_)) break;
    cv1::HeartbeatRequest hb;
    hb.set_node_id(id);
    *hb.mutable_load() = Load();
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    cv1::HeartbeatResponse response;
    const grpc::Status s = stub_->Heartbeat(&ctx, hb, &response);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      spdlog::warn("controller {} forgot node {}: registering again", options_.controller, id);
      registered = false;
      if (options_.on_cluster_view) options_.on_cluster_view(0);
      absl::MutexLock lock(&mu_);
      node_id_.clear();
    } else if (!s.ok()) {
      // The lease may still be alive; keep heartbeating (a NOT_FOUND will follow if not).
      NoteFailure("heartbeat", s.error_message());
    } else {
      NoteSuccess("heartbeat");
      if (options_.on_cluster_view) options_.on_cluster_view(response.live_stores());
    }
  }
}

}  // namespace kvr::node
