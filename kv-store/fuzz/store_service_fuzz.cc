// libFuzzer target: the store's gRPC handlers (KvStoreGrpcService) called directly with
// fuzzed request protos, against a fresh small PagedKvStore per input, as any client of the
// store's control plane can call them. An input is a script of calls:
//   [method: 1 byte][length: 2 bytes LE][a serialized request of that method]...
// so that a call can act on a sequence an earlier call of the same input created (with the
// capability the input chose). Bytes that do not parse as the request are skipped (gRPC
// refuses them before the handler). Checked beyond "no crash": no handler answers UNKNOWN
// or INTERNAL, and the pool never reports more bytes used than it has.

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "grpc_service.h"
#include "kvr/kv_store/store.h"
#include "kvr/store/v1/store.pb.h"

namespace sv1 = ::kvr::store::v1;

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

void CheckStatus(const grpc::Status& s) {
  Check(s.error_code() != grpc::StatusCode::UNKNOWN &&
        s.error_code() != grpc::StatusCode::INTERNAL);
}

template <typename Request, typename Response, typename Handler>
void Call(const uint8_t* data, size_t size, Handler handler) {
  Request request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return;
  Response response;
  grpc::ServerContext ctx;
  CheckStatus(handler(&ctx, &request, &response));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvr::kv_store::KvStoreGrpcService;
  kvr::kv_store::StoreOptions options;
  options.pool = {.capacity_bytes = 1 << 20, .page_bytes = 4096, .try_huge_pages = false};
  auto store = kvr::kv_store::PagedKvStore::Create(options);
  if (!store.ok()) std::abort();
  KvStoreGrpcService service(**store, {.worker_address = "w", .instance_id = "fuzz"});
  size_t at = 0;
  while (at + 3 <= size) {
    const uint8_t method = data[at];
    const size_t len = std::min<size_t>(data[at + 1] | (data[at + 2] << 8), size - at - 3);
    const uint8_t* body = data + at + 3;
    at += 3 + len;
    KvStoreGrpcService* s = &service;
    switch (method % 11) {
      case 0:
        Call<sv1::CreateSequenceRequest, sv1::CreateSequenceResponse>(
            body, len, [s](auto... a) { return s->CreateSequence(a...); });
        break;
      case 1:
        Call<sv1::AppendRequest, sv1::AppendResponse>(
            body, len, [s](auto... a) { return s->Append(a...); });
        break;
      case 2:
        Call<sv1::ReleaseRequest, sv1::ReleaseResponse>(
            body, len, [s](auto... a) { return s->Release(a...); });
        break;
      case 3:
        Call<sv1::LeaseRequest, sv1::LeaseResponse>(
            body, len, [s](auto... a) { return s->Lease(a...); });
        break;
      case 4:
        Call<sv1::GetSequenceRequest, sv1::GetSequenceResponse>(
            body, len, [s](auto... a) { return s->GetSequence(a...); });
        break;
      case 5:
        Call<sv1::StatsRequest, sv1::StatsResponse>(
            body, len, [s](auto... a) { return s->Stats(a...); });
        break;
      case 6:
        Call<sv1::GetDataPlaneInfoRequest, sv1::GetDataPlaneInfoResponse>(
            body, len, [s](auto... a) { return s->GetDataPlaneInfo(a...); });
        break;
      case 7:
        Call<sv1::ReservePageTableRequest, sv1::ReservePageTableResponse>(
            body, len, [s](auto... a) { return s->ReservePageTable(a...); });
        break;
      case 8:
        Call<sv1::ForkSequenceRequest, sv1::ForkSequenceResponse>(
            body, len, [s](auto... a) { return s->ForkSequence(a...); });
        break;
      case 9:
        Call<sv1::PutAttachmentRequest, sv1::PutAttachmentResponse>(
            body, len, [s](auto... a) { return s->PutAttachment(a...); });
        break;
      case 10:
        Call<sv1::GetAttachmentRequest, sv1::GetAttachmentResponse>(
            body, len, [s](auto... a) { return s->GetAttachment(a...); });
        break;
    }
    const kvr::kv_store::StoreStats stats = (*store)->Stats();
    Check(stats.used_bytes <= stats.capacity_bytes && stats.free_pages <= stats.total_pages);
    Check((*store)->pool().refcount_errors() == 0);
  }
  return 0;
}
