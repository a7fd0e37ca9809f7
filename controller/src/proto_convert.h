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
#include "kvr/v1/generation.pb.h"

namespace kvr::controller {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

void SetDuration(absl::Duration d, google::protobuf::Duration* out);
absl::Duration FromProtoDuration(const google::protobuf::Duration& d);
void SetTimestamp(absl::Time t, google::protobuf::Timestamp* out);

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
