#include "kvr/controller/placement.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvr::controller {
namespace {

const ModelInfo* FindModelInfo(const NodeSnapshot& node, absl::string_view model) {
  for (const ModelInfo& m : node.registration.capacity.models) {
    if (m.name == model) return &m;
  }
  return nullptr;
}

const RetrievalMethodInfo* FindMethod(const ModelInfo& model, absl::string_view method) {
  for (const RetrievalMethodInfo& m : model.retrieval_methods) {
    if (m.name == method) return &m;
  }
  return nullptr;
}

uint32_t FreeSlots(const NodeSnapshot& d) {
  const uint32_t slots = d.registration.capacity.batch_slots;
  const uint32_t used = d.effective_load.running_sequences;
  return used >= slots ? 0 : slots - used;
}

}  // namespace

absl::StatusOr<PlacementDecision> Placement::Place(const PlacementRequest& req) {
  absl::MutexLock lock(&mu_);
  const std::vector<NodeSnapshot> nodes = membership_->LiveNodes();
  const uint64_t tokens = req.prompt_tokens + req.max_tokens;

  // Prefill: least queued tokens among nodes with queue room.
  const NodeSnapshot* best_p = nullptr;
  int p_candidates = 0;
  uint64_t kv_bytes_per_token = 0;
  for (const NodeSnapshot& n : nodes) {
    if (n.registration.role != NodeRole::kPrefill || req.excluded.contains(n.id)) continue;
    const ModelInfo* m = FindModelInfo(n, req.model);
    if (m == nullptr) continue;
    ++p_candidates;
    kv_bytes_per_token = std::max(kv_bytes_per_token, m->kv_bytes_per_token);
    const uint64_t limit = n.registration.capacity.max_queued_prefill_tokens;
    if (limit != 0 && n.effective_load.queued_prefill_tokens + req.prompt_tokens > limit) continue;
    // `nodes` is in registration order and only a strictly smaller queue replaces the best,
    // so ties go to the earliest registration.
    if (best_p == nullptr ||
        n.effective_load.queued_prefill_tokens < best_p->effective_load.queued_prefill_tokens) {
      best_p = &n;
    }
  }
  if (p_candidates == 0) {
    return absl::NotFoundError(absl::StrCat("no live prefill node serves model '", req.model, "'"));
  }
  if (best_p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prefill queue: all ", p_candidates, " prefill nodes of model '", req.model,
                     "' would exceed their queued prefill token limit with ", req.prompt_tokens,
                     " more tokens"));
  }

  // Decode: a free slot and summary memory; most free slots, then most free memory.
  struct DecodeChoice {
    const NodeSnapshot* node;
    uint64_t summary_bytes;
  };
  std::vector<DecodeChoice> decodes;  // every decode node that fits, best first (below)
  int d_candidates = 0, d_with_slot = 0;
  uint64_t needed_summary_bytes = 0;
  for (const NodeSnapshot& n : nodes) {
    if (n.registration.role != NodeRole::kDecode || req.excluded.contains(n.id)) continue;
    const ModelInfo* m = FindModelInfo(n, req.model);
    if (m == nullptr) continue;
    const RetrievalMethodInfo* method = FindMethod(*m, req.method);
    if (method == nullptr) continue;
    ++d_candidates;
    kv_bytes_per_token = std::max(kv_bytes_per_token, m->kv_bytes_per_token);
    if (FreeSlots(n) == 0) continue;
    ++d_with_slot;
    const auto bytes = static_cast<uint64_t>(
        std::ceil(method->summary_bytes_per_token * static_cast<double>(tokens)));
    needed_summary_bytes = std::max(needed_summary_bytes, bytes);
    if (n.effective_load.free_memory_bytes < bytes) continue;
    decodes.push_back({&n, bytes});
  }
  if (d_candidates == 0) {
    return absl::NotFoundError(absl::StrCat("no live decode node serves model '", req.model,
                                            "' with retrieval method '", req.method, "'"));
  }
  if (d_with_slot == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("decode batch slots: all ", d_candidates,
                                                     " decode nodes of model '", req.model,
                                                     "' have every batch slot taken"));
  }
  if (decodes.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "decode summary memory: no decode node with a free slot has ", needed_summary_bytes,
        " bytes free for the summaries of ", tokens, " tokens (method '", req.method, "')"));
  }
  std::stable_sort(
      decodes.begin(), decodes.end(), [](const DecodeChoice& a, const DecodeChoice& b) {
        const uint32_t fa = FreeSlots(*a.node), fb = FreeSlots(*b.node);
        if (fa != fb) return fa > fb;
        return a.node->effective_load.free_memory_bytes > b.node->effective_load.free_memory_bytes;
      });

  // Store: among stores with room for the KV, fewest sequences (held + placed since the last
  // heartbeat), then most free bytes; a tie left after both goes round robin, starting after
  // the store picked last. Free bytes alone sent every request of a light load to the first
  // store (equal pools tie, and a finished sequence gives its pages back), so one store held
  // every sequence and its death failed them all. A decode node that reads the store's pages in
  // place (needs_local_store: --device cuda) takes only a store of its own host; the best decode
  // node that has one wins.
  const uint64_t kv_bytes = kv_bytes_per_token * tokens;
  int s_candidates = 0;
  uint64_t most_free = 0;
  // Rank in the rotation: stores registered after the last pick come first.
  auto rotation = [&](const NodeSnapshot& n) {
    return n.serial > last_store_serial_ ? n.serial - last_store_serial_
                                         : n.serial + (uint64_t{1} << 62);
  };
  auto best_store_for = [&](const NodeSnapshot* d) -> const NodeSnapshot* {
    const NodeSnapshot* best_s = nullptr;
    for (const NodeSnapshot& n : nodes) {
      if (n.registration.role != NodeRole::kStore || req.excluded.contains(n.id)) continue;
      if (d != nullptr && d->registration.needs_local_store &&
          (d->registration.host_id.empty() || n.registration.host_id != d->registration.host_id)) {
        continue;
      }
      if (n.effective_load.free_memory_bytes < kv_bytes) continue;
      if (n.id == req.preferred_store) return &n;
      if (best_s == nullptr) {
        best_s = &n;
        continue;
      }
      const uint32_t seqs = n.effective_load.running_sequences;
      const uint32_t best_seqs = best_s->effective_load.running_sequences;
      const uint64_t free = n.effective_load.free_memory_bytes;
      const uint64_t best_free = best_s->effective_load.free_memory_bytes;
      if (seqs < best_seqs || (seqs == best_seqs && free > best_free) ||
          (seqs == best_seqs && free == best_free && rotation(n) < rotation(*best_s))) {
        best_s = &n;
      }
    }
    return best_s;
  };
  for (const NodeSnapshot& n : nodes) {
    if (n.registration.role != NodeRole::kStore || req.excluded.contains(n.id)) continue;
    ++s_candidates;
    most_free = std::max(most_free, n.effective_load.free_memory_bytes);
  }
  if (s_candidates == 0) return absl::NotFoundError("no live store node");
  if (best_store_for(nullptr) == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("store memory: no store has ", kv_bytes, " bytes free for the KV of ", tokens,
                     " tokens (most free: ", most_free, " bytes on ", s_candidates, " stores)"));
  }
  const NodeSnapshot* best_d = nullptr;
  const NodeSnapshot* best_s = nullptr;
  uint64_t best_d_bytes = 0;
  for (const DecodeChoice& d : decodes) {
    if (const NodeSnapshot* s = best_store_for(d.node); s != nullptr) {
      best_d = d.node;
      best_s = s;
      best_d_bytes = d.summary_bytes;
      break;
    }
  }
  if (best_d == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("store memory: the ", decodes.size(),
                     " decode nodes that could take the request read the store's pages in place "
                     "(--device cuda), and no store on their hosts has ",
                     kv_bytes, " bytes free for the KV of ", tokens, " tokens"));
  }

  PlacementDecision decision{*best_p, *best_d, *best_s, kv_bytes, best_d_bytes};
  membership_->AddPending(best_p->id, {.prefill_tokens = req.prompt_tokens});
  membership_->AddPending(best_d->id, {.sequences = 1, .memory_bytes = best_d_bytes});
  membership_->AddPending(best_s->id, {.sequences = 1, .memory_bytes = kv_bytes});
  last_store_serial_ = best_s->serial;
  return decision;
}

void Admission::Ticket::Release() {
  if (owner_ == nullptr) return;
  absl::MutexLock lock(&owner_->mu_);
  --owner_->in_flight_;
  owner_ = nullptr;
}

absl::StatusOr<Admission::Ticket> Admission::Admit() {
  absl::MutexLock lock(&mu_);
  if (in_flight_ >= max_in_flight_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "requests in flight: the controller's limit of ", max_in_flight_, " is reached"));
  }
  ++in_flight_;
  return Ticket(this);
}

uint32_t Admission::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

}  // namespace kvr::controller
