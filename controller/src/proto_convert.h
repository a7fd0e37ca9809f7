#pragma once
// Conversions between the controller's domain types and the kvr.v1 / kvr.cluster.v1 protos,
// and between absl::Status and grpc::Status. Private to the controller.

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"
#include "google/protobuf/timestamp.pb.h"
#include "kvr/cluster/v1/cluster.pb.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/node_clients.h"
#include "kvr/controller/request_runner.h"
#include "kvr/controller/types.h"
#include "kvr/proto/convert.h"
#include "kvr/v1/generation.pb.h"

namespace kvr::controller {

using ::kvr::proto::FromGrpcStatus;
using ::kvr::proto::SetDuration;
using ::kvr::proto::SetTimestamp;
using ::kvr::proto::ToGrpcStatus;
inline absl::Duration FromProtoDuration(const google::protobuf::Duration& d) {
  return ::kvr::proto::FromProto(d);
}

NodeRegistration FromProto(const kvr::cluster::v1::RegisterRequest& request);
NodeLoad FromProto(const kvr::cluster::v1::NodeLoad& load);
void ToProto(const NodeSnapshot& node, kvr::cluster::v1::NodeRef* out);

kvr::cluster::v1::PrefillRequest ToPrefillRequest(const PrefillCall& call);
PrefillResult FromProto(const kvr::cluster::v1::PrefillResponse& response);

FinishReason FromProto(kvr::v1::FinishReason reason);
kvr::v1::FinishReason ToProto(FinishReason reason);
Completion FromProto(const kvr::v1::Completion& completion);

// The client-facing message of one event.
kvr::v1::GenerateResponse ToGenerateResponse(const GenerateEvent& event,
                                             const GenerateParams& params);

kvr::v1::ListModelsResponse ToListModelsResponse(const std::vector<ModelSummary>& models);

}  // namespace kvr::controller
