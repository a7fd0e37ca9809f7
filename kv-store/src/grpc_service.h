#pragma once
// The kvr.store.v1.KvStore gRPC service: thin handlers that convert protos
// to domain types, call PagedKvStore and convert the status back. Private to kv-store.

#include <string>

#include "kvr/kv_store/store.h"
#include "kvr/store/v1/store.grpc.pb.h"

namespace kvr::kv_store {

// What GetDataPlaneInfo reports; filled by the server once the UCX side is up.
struct DataPlaneInfo {
  std::string worker_address;
  uint64_t pool_base = 0;
  uint64_t pool_bytes = 0;
  std::string pool_rkey;
  // Same-host handover (local_pool.h): socket path (empty: off), boot id, pool id.
  std::string local_socket;
  std::string host_id;
  std::string pool_id;
  // Drawn at start (kvr::NewInstanceId): a store restarted on the same address has a new one.
  std::string instance_id;
};

class KvStoreGrpcService final : public store::v1::KvStore::Service {
 public:
  // `store` must outlive the service.
  KvStoreGrpcService(PagedKvStore& store, DataPlaneInfo info)
      : store_(store), info_(std::move(info)) {}

  grpc::Status CreateSequence(grpc::ServerContext* ctx,
                              const store::v1::CreateSequenceRequest* req,
                              store::v1::CreateSequenceResponse* resp) override;
  grpc::Status Append(grpc::ServerContext* ctx, const store::v1::AppendRequest* req,
                      store::v1::AppendResponse* resp) override;
  grpc::Status Release(grpc::ServerContext* ctx, const store::v1::ReleaseRequest* req,
                       store::v1::ReleaseResponse* resp) override;
  grpc::Status Lease(grpc::ServerContext* ctx, const store::v1::LeaseRequest* req,
                     store::v1::LeaseResponse* resp) override;
  grpc::Status GetSequence(grpc::ServerContext* ctx, const store::v1::GetSequenceRequest* req,
                           store::v1::GetSequenceResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const store::v1::StatsRequest* req,
                     store::v1::StatsResponse* resp) override;
  grpc::Status GetDataPlaneInfo(grpc::ServerContext* ctx,
                                const store::v1::GetDataPlaneInfoRequest* req,
                                store::v1::GetDataPlaneInfoResponse* resp) override;
  grpc::Status ReservePageTable(grpc::ServerContext* ctx,
                                const store::v1::ReservePageTableRequest* req,
                                store::v1::ReservePageTableResponse* resp) override;
  grpc::Status ForkSequence(grpc::ServerContext* ctx, const store::v1::ForkSequenceRequest* req,
                            store::v1::ForkSequenceResponse* resp) override;
  grpc::Status PutAttachment(grpc::ServerContext* ctx, const store::v1::PutAttachmentRequest* req,
                             store::v1::PutAttachmentResponse* resp) override;
  grpc::Status GetAttachment(grpc::ServerContext* ctx, const store::v1::GetAttachmentRequest* req,
                             store::v1::GetAttachmentResponse* resp) override;

 private:
  PagedKvStore& store_;
  const DataPlaneInfo info_;
};

}  // namespace kvr::kv_store
