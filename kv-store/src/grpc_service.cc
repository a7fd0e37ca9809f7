#include "grpc_service.h"

#include <chrono>

#include "conversions.h"
#include "kvr/kv_store/wire.h"

namespace kvr::kv_store {
namespace {

// Work that arrives with its deadline already past (or cancelled) is refused, not done.
grpc::Status CheckLive(grpc::ServerContext* ctx) {
  if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "call cancelled");
  if (ctx->deadline() < std::chrono::system_clock::now()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        "request arrived after its deadline");
  }
  return grpc::Status::OK;
}

absl::Duration Millis(uint64_t ms) { return absl::Milliseconds(static_cast<int64_t>(ms)); }

// A malformed capability becomes none, which matches no sequence: the caller gets the same
// PERMISSION_DENIED as for a wrong one.
template <typename Request>
SequenceRef RefOf(const Request& req) {
  return {req.sequence_id(), Capability::FromBytesOrNone(req.capability())};
}

}  // namespace

grpc::Status KvStoreGrpcService::CreateSequence(grpc::ServerContext* ctx,
                                                const store::v1::CreateSequenceRequest* req,
                                                store::v1::CreateSequenceResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  absl::StatusOr<SequenceShape> shape = FromProto(req->shape());
  if (!shape.ok()) return ToGrpcStatus(shape.status());
  absl::StatusOr<Capability> cap = Capability::FromBytes(req->capability());
  if (!cap.ok()) return ToGrpcStatus(cap.status());
  absl::StatusOr<CreateResult> result = store_.CreateSequence(
      {req->sequence_id(), *cap}, *shape, req->expected_tokens(), Millis(req->lease_ms()));
  if (!result.ok()) return ToGrpcStatus(result.status());
  resp->set_tokens_per_page(result->tokens_per_page);
  resp->set_reserved_bytes(result->reserved_bytes);
  return grpc::Status::OK;
}

grpc::Status KvStoreGrpcService::Append(grpc::ServerContext* ctx,
                                        const store::v1::AppendRequest* req,
                                        store::v1::AppendResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  LayerRows rows{.sequence = RefOf(*req),
                 .layer = req->layer(),
                 .start_row = req->at_end() ? LayerRows::kAtEnd : req->start_row(),
                 .n_rows = req->n_rows(),
                 .k = {reinterpret_cast<const uint8_t*>(req->k().data()), req->k().size()},
                 .v = {reinterpret_cast<const uint8_t*>(req->v().data()), req->v().size()}};
  absl::StatusOr<uint64_t> committed = store_.Write(rows);
  if (!committed.ok()) return ToGrpcStatus(committed.status());
  resp->set_committed_rows(*committed);
  return grpc::Status::OK;
}

grpc::Status KvStoreGrpcService::Release(grpc::ServerContext* ctx,
                                         const store::v1::ReleaseRequest* req,
                                         store::v1::ReleaseResponse*) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  return ToGrpcStatus(store_.Release(RefOf(*req), Millis(req->keep_ms())));
}

grpc::Status KvStoreGrpcService::Lease(grpc::ServerContext* ctx,
                                       const store::v1::LeaseRequest* req,
                                       store::v1::LeaseResponse*) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  return ToGrpcStatus(store_.Lease(RefOf(*req), Millis(req->lease_ms())));
}

grpc::Status KvStoreGrpcService::GetSequence(grpc::ServerContext* ctx,
                                             const store::v1::GetSequenceRequest* req,
                                             store::v1::GetSequenceResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  absl::StatusOr<SequenceInfo> info = store_.GetSequence(RefOf(*req));
  if (!info.ok()) return ToGrpcStatus(info.status());
  ToProto(info->shape, resp->mutable_shape());
  for (uint64_t rows : info->committed_rows) resp->add_committed_rows(rows);
  resp->set_tokens_per_page(info->tokens_per_page);
  resp->set_pages(info->pages);
  resp->set_lease_expiry_unix_ms(info->lease_expiry_unix_ms);
  resp->set_released_kept(info->released_kept);
  resp->set_thinned_pages(info->thinned_pages);
  resp->set_intact_rows(info->intact_rows);
  return grpc::Status::OK;
}

grpc::Status KvStoreGrpcService::Stats(grpc::ServerContext* ctx, const store::v1::StatsRequest*,
                                       store::v1::StatsResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  ToProto(store_.Stats(), resp);
  return grpc::Status::OK;
}

grpc::Status KvStoreGrpcService::GetDataPlaneInfo(grpc::ServerContext* ctx,
                                                  const store::v1::GetDataPlaneInfoRequest*,
                                                  store::v1::GetDataPlaneInfoResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  resp->set_worker_address(info_.worker_address);
  resp->set_pool_base(info_.pool_base);
  resp->set_pool_bytes(info_.pool_bytes);
  resp->set_pool_rkey(info_.pool_rkey);
  resp->set_page_bytes(store_.pool().page_bytes());
  resp->set_wire_version(wire::kVersion);
  resp->set_instance_id(info_.instance_id);
  resp->set_local_socket(info_.local_socket);
  resp->set_host_id(info_.host_id);
  resp->set_pool_id(info_.pool_id);
  return grpc::Status::OK;
}

grpc::Status KvStoreGrpcService::ReservePageTable(grpc::ServerContext* ctx,
                                                  const store::v1::ReservePageTableRequest* req,
                                                  store::v1::ReservePageTableResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  absl::StatusOr<PageTable> table = store_.ReservePageTable(RefOf(*req), req->rows());
  if (!table.ok()) return ToGrpcStatus(table.status());
  ToProto(*table, resp);
  return grpc::Status::OK;
}

grpc::Status KvStoreGrpcService::ForkSequence(grpc::ServerContext* ctx,
                                              const store::v1::ForkSequenceRequest* req,
                                              store::v1::ForkSequenceResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  // The child's capability is being set, so a malformed one is refused as at creation; the
  // parent's is only checked, so a malformed one reads like a wrong one.
  absl::StatusOr<Capability> child_cap = Capability::FromBytes(req->child_capability());
  if (!child_cap.ok()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("child_capability: ", child_cap.status().message())));
  }
  absl::StatusOr<ForkResult> result = store_.ForkSequence(
      {req->child_sequence_id(), *child_cap},
      {req->parent_sequence_id(), Capability::FromBytesOrNone(req->parent_capability())},
      req->rows(), req->expected_tokens(), Millis(req->lease_ms()));
  if (!result.ok()) return ToGrpcStatus(result.status());
  resp->set_tokens_per_page(result->tokens_per_page);
  resp->set_reserved_bytes(result->reserved_bytes);
  resp->set_rows(result->rows);
  resp->set_shared_pages(result->shared_pages);
  return grpc::Status::OK;
}

grpc::Status KvStoreGrpcService::PutAttachment(grpc::ServerContext* ctx,
                                               const store::v1::PutAttachmentRequest* req,
                                               store::v1::PutAttachmentResponse*) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  const std::string& data = req->data();
  return ToGrpcStatus(
      store_.PutAttachment(RefOf(*req), req->layer(), req->rows(),
                           {reinterpret_cast<const uint8_t*>(data.data()), data.size()}));
}

grpc::Status KvStoreGrpcService::GetAttachment(grpc::ServerContext* ctx,
                                               const store::v1::GetAttachmentRequest* req,
                                               store::v1::GetAttachmentResponse* resp) {
  if (grpc::Status st = CheckLive(ctx); !st.ok()) return st;
  absl::StatusOr<Attachment> got = store_.GetAttachment(RefOf(*req), req->layer());
  if (!got.ok()) return ToGrpcStatus(got.status());
  resp->set_rows(got->rows);
  resp->set_data(got->bytes.data(), got->bytes.size());
  return grpc::Status::OK;
}

}  // namespace kvr::kv_store
