#pragma once
// The store's UCX data-plane handlers: parse wire.h messages, run them against the
// PagedKvStore on a WorkQueue, reply with rows or with an error naming what was wrong. A
// malformed request only ever costs its sender an error reply. Private to kv-store.

#include "absl/status/status.h"
#include "kvr/kv_store/store.h"
#include "kvr/transport/ucx.h"
#include "work_queue.h"

namespace kvr::kv_store {

// Installs the handlers for every wire::MessageType on `worker`. `store` and `queue` must
// outlive the worker's handlers (i.e. shut the worker down first).
[[nodiscard]] absl::Status RegisterDataPlaneHandlers(transport::Worker& worker,
                                                     PagedKvStore& store, WorkQueue& queue);

}  // namespace kvr::kv_store
