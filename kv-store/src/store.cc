#include "kvr/kv_store/store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/str_format.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/common/key_diff.h"
#include "kvr/common/status.h"

namespace kvr::kv_store {

class PagedKvStore::Sequence {
 public:
  // A page list entry whose page thinning dropped.
  static constexpr PageId kNoPage = ~PageId{0};

  Sequence(SequenceId id, const Capability& cap, const SequenceShape& shape,
           uint32_t tokens_per_page, PagePool* pool)
      : id_(id),
        cap_(cap),
        shape_(shape),
        tokens_per_page_(tokens_per_page),
        row_bytes_(shape.RowBytes()),
        pool_(pool),
        pages_(size_t{shape.n_layers} * shape.n_kv_heads),
        committed_(std::make_unique<std::atomic<uint64_t>[]>(shape.n_layers)) {
    absl::MutexLock lock(&mu_);
    reserved_.assign(shape.n_layers, 0);
    attachments_.resize(shape.n_layers);
  }

  ~Sequence() {
    // Runs when the last reference (index or in-flight operation) drops: only then may the
    // pages be reused. Free drops this sequence's reference; a page shared with a fork (or a
    // parent) stays with the sequences that still hold it.
    absl::MutexLock lock(&mu_);
    for (const std::vector<PageId>& list : pages_) {
      if (thinned_pages_ == 0) {
        pool_->Free(list);
        continue;
      }
      std::vector<PageId> held;
      for (PageId p : list) {
        if (p != kNoPage) held.push_back(p);
      }
      pool_->Free(held);
    }
    for (const StoredAttachment& a : attachments_) pool_->Free(a.pages);
  }

  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  SequenceId id() const { return id_; }
  const Capability& cap() const { return cap_; }
  const SequenceShape& shape() const { return shape_; }
  uint32_t tokens_per_page() const { return tokens_per_page_; }
  size_t row_bytes() const { return row_bytes_; }
  uint64_t Committed(uint32_t layer) const {
    return committed_[layer].load(std::memory_order_acquire);
  }

  // False when thinning dropped the page of row `row` of (layer, head) (the page must be in the
  // list or dropped).
  bool HasRow(uint32_t layer, uint32_t head, uint64_t row) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return pages_[size_t{layer} * shape_.n_kv_heads + head][row / tokens_per_page_] != kNoPage;
  }

  // Address of row `row` of (layer, head); the row's page must exist.
  uint8_t* RowPtr(uint32_t layer, uint32_t head, uint64_t row) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const std::vector<PageId>& list = pages_[size_t{layer} * shape_.n_kv_heads + head];
    return pool_->PageData(list[row / tokens_per_page_]) + (row % tokens_per_page_) * row_bytes_;
  }

  // Calls run(rows, bytes) with the address and size of each page-sized run of the rows of
  // `range` (checked against this sequence), in order: rows inside a page are contiguous.
  // ThinnedRowError for the first row of a run whose page thinning dropped.
  template <typename Run>
  absl::Status ForEachPageRun(const RangeEntry& range, Run&& run) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const bool holes = thinned_pages_ > 0;
    const uint64_t end = range.start + range.n_rows;
    for (uint64_t row = range.start; row < end;) {
      const uint64_t n = std::min<uint64_t>(tokens_per_page_ - row % tokens_per_page_, end - row);
      if (holes && !HasRow(range.layer, range.head, row)) {
        return ThinnedRowError(range.sequence.id, range.layer, range.head, row);
      }
      run(static_cast<const uint8_t*>(RowPtr(range.layer, range.head, row)), n * row_bytes_);
      row += n;
    }
    return absl::OkStatus();
  }

  // Pages needed so that every head of `layer` holds `rows` rows.
  size_t PagesToGrow(uint32_t layer, uint64_t rows) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const size_t want = (rows + tokens_per_page_ - 1) / tokens_per_page_;
    const size_t have = pages_[size_t{layer} * shape_.n_kv_heads].size();
    return want > have ? (want - have) * shape_.n_kv_heads : 0;
  }
  // Hands `fresh` (PagesToGrow(layer, rows) of them) to the heads of `layer`.
  void Grow(uint32_t layer, uint64_t rows, const std::vector<PageId>& fresh)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t want = (rows + tokens_per_page_ - 1) / tokens_per_page_;
    size_t next = 0;
    for (uint32_t h = 0; h < shape_.n_kv_heads; ++h) {
      std::vector<PageId>& list = pages_[size_t{layer} * shape_.n_kv_heads + h];
      while (list.size() < want) list.push_back(fresh[next++]);
    }
  }
  // Most pages any (layer, head) has.
  uint64_t MaxListPages() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    size_t n = 0;
    for (const std::vector<PageId>& list : pages_) n = std::max(n, list.size());
    return n;
  }
  // Pages needed so that every (layer, head) has `per_list` pages.
  uint64_t PagesToGrowAll(uint64_t per_list) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    uint64_t n = 0;
    for (const std::vector<PageId>& list : pages_) {
      if (list.size() < per_list) n += per_list - list.size();
    }
    return n;
  }
  // Appends pages from `fresh` (at least PagesToGrowAll(per_list) of them) until every
  // (layer, head) has `per_list`; returns how many it took.
  size_t GrowAll(uint64_t per_list, std::span<const PageId> fresh)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t next = 0;
    for (std::vector<PageId>& list : pages_) {
      while (list.size() < per_list) list.push_back(fresh[next++]);
    }
    return next;
  }
  // [n_layers, n_kv_heads, per_list]; every list has at least `per_list` pages.
  void CopyPages(uint64_t per_list, std::vector<PageId>& out) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    out.clear();
    out.reserve(pages_.size() * per_list);
    for (const std::vector<PageId>& list : pages_) {
      out.insert(out.end(), list.begin(), list.begin() + static_cast<ptrdiff_t>(per_list));
    }
  }
  // Row pages and attachment pages.
  uint64_t PageCount() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    uint64_t n = 0;
    for (const std::vector<PageId>& list : pages_) n += list.size();
    for (const StoredAttachment& a : attachments_) n += a.pages.size();
    return n - thinned_pages_;
  }
  // Page list of (layer, head) number `list` = layer * n_kv_heads + head.
  const std::vector<PageId>& List(size_t list) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return pages_[list];
  }
  // A fork's starting state, before the sequence is in the index: `lists` (one per (layer,
  // head), references already held) become its pages and `rows` its watermark in every layer.
  void Adopt(std::vector<std::vector<PageId>> lists, uint64_t rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pages_ = std::move(lists);
    for (uint32_t layer = 0; layer < shape_.n_layers; ++layer) {
      reserved_[layer] = rows;
      Publish(layer, rows);
    }
  }

  // One layer's attachment (PagedKvStore::PutAttachment): `bytes` bytes laid over `pages` in
  // order. Its pages are never written after the put, so a fork may share them.
  struct StoredAttachment {
    bool present = false;
    uint64_t rows = 0;
    uint64_t bytes = 0;
    std::vector<PageId> pages;
  };

  // Thins this released-and-kept sequence (PagedKvStore class comment): per (layer, head) the
  // pages of committed rows that KeyDiffPagesToDrop picks, at most all but
  // ceil(keep_fraction * pages) of them, sparing pages another sequence shares. Returns the
  // pages freed. Runs once: later calls return 0. With `mu_` held exclusively, readers wait, so
  // none is between its hole check and its copy.
  uint64_t Thin(double keep_fraction, const KeyDiffPagePolicy& policy)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (thin_tried_) return 0;
    thin_tried_ = true;
    const size_t dim = shape_.head_dim;
    std::vector<float> keys;    // [rows, head_dim]
    std::vector<float> scores;  // [rows]
    std::vector<PageId> freed;
    for (size_t l = 0; l < pages_.size(); ++l) {
      std::vector<PageId>& list = pages_[l];
      const uint64_t rows = Committed(static_cast<uint32_t>(l / shape_.n_kv_heads));
      const uint64_t n_pages = (rows + tokens_per_page_ - 1) / tokens_per_page_;
      if (n_pages <=
          static_cast<uint64_t>(std::ceil(keep_fraction * static_cast<double>(n_pages)))) {
        continue;  // nothing could go: skip reading the keys
      }
      keys.resize(rows * dim);
      scores.resize(rows);
      for (uint64_t r = 0; r < rows; ++r) {
        const uint8_t* k =
            pool_->PageData(list[r / tokens_per_page_]) + (r % tokens_per_page_) * row_bytes_;
        StoredRowToFloats(shape_.dtype, static_cast<uint32_t>(dim), k, keys.data() + r * dim,
                          /*v=*/nullptr);
      }
      KeyDiffScores(keys.data(), rows, dim, dim, scores.data());
      std::unique_ptr<bool[]> pinned(new bool[n_pages]);
      for (uint64_t p = 0; p < n_pages; ++p) pinned[p] = pool_->references(list[p]) > 1;
      for (uint64_t p : KeyDiffPagesToDrop(scores, tokens_per_page_, keep_fraction, policy,
                                           std::span<const bool>(pinned.get(), n_pages))) {
        freed.push_back(list[p]);
        list[p] = kNoPage;
      }
    }
    thinned_pages_ += freed.size();
    if (!freed.empty()) {
      intact_rows_ = ~uint64_t{0};
      for (size_t l = 0; l < pages_.size(); ++l) {
        const std::vector<PageId>& list = pages_[l];
        const auto hole =
            static_cast<uint64_t>(std::find(list.begin(), list.end(), kNoPage) - list.begin());
        intact_rows_ = std::min(intact_rows_,
                                std::min(hole * tokens_per_page_,
                                         Committed(static_cast<uint32_t>(l / shape_.n_kv_heads))));
      }
    }
    pool_->Free(freed);  // lock order: sequence -> pool
    return freed.size();
  }
  // Pages thinning dropped; rows [0, intact_rows()) are whole in every list when it is > 0.
  uint64_t thinned_pages() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return thinned_pages_; }
  uint64_t intact_rows() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return intact_rows_; }
  bool thin_tried() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return thin_tried_; }

  mutable absl::Mutex mu_;
  std::vector<uint64_t> reserved_ ABSL_GUARDED_BY(mu_);  // [n_layers] rows incl. in-flight
  std::vector<StoredAttachment> attachments_ ABSL_GUARDED_BY(mu_);  // [n_layers]
  absl::Time expiry_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool released_kept_ ABSL_GUARDED_BY(mu_) = false;
  // Tick of PagedKvStore::use_clock_ at the last use; relaxed (an eviction order, not a sync).
  mutable std::atomic<uint64_t> last_use_{0};

  void Publish(uint32_t layer, uint64_t rows) {
    committed_[layer].store(rows, std::memory_order_release);
  }

 private:
  const SequenceId id_;
  const Capability cap_;
  const SequenceShape shape_;
  const uint32_t tokens_per_page_;
  const size_t row_bytes_;
  PagePool* const pool_;
  // [n_layers * n_kv_heads] page lists; a list only grows, under mu_ held exclusively, except
  // that Thin replaces dropped pages by kNoPage.
  std::vector<std::vector<PageId>> pages_ ABSL_GUARDED_BY(mu_);
  bool thin_tried_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t thinned_pages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t intact_rows_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> committed_;  // [n_layers] reader-visible rows
};

namespace {

// The one answer to an unknown id and to a wrong capability.
absl::Status Denied(SequenceId id) {
  return absl::PermissionDeniedError(absl::StrFormat("no sequence %d with this capability", id));
}

// Denied() for entry `entry` of a batch.
absl::Status DeniedEntry(size_t entry, SequenceId id) {
  return absl::PermissionDeniedError(
      absl::StrFormat("entry %d: no sequence %d with this capability", entry, id));
}

// True when `ref` names `seq` with its capability (constant time in the capability).
template <typename Seq>
bool Admits(const Seq& seq, const SequenceRef& ref) {
  return seq.id() == ref.id && seq.cap().Matches(ref.cap);
}

// Validates one (sequence, layer, head) target and names it in errors.
absl::Status CheckTarget(const SequenceShape& shape, SequenceId id, uint32_t layer,
                         uint32_t head, size_t entry) {
  if (layer >= shape.n_layers) {
    return absl::OutOfRangeError(absl::StrFormat(
        "entry %d: layer %d out of range for sequence %d (%d layers)", entry, layer, id,
        shape.n_layers));
  }
  if (head >= shape.n_kv_heads) {
    return absl::OutOfRangeError(absl::StrFormat(
        "entry %d: kv head %d out of range for sequence %d (%d kv heads)", entry, head, id,
        shape.n_kv_heads));
  }
  return absl::OkStatus();
}

}  // namespace

PagedKvStore::PagedKvStore(StoreOptions options, PagePool pool)
    : options_(std::move(options)), pool_(std::move(pool)) {}

PagedKvStore::~PagedKvStore() {
  absl::MutexLock lock(&mu_);
  sequences_.clear();
}

absl::StatusOr<std::unique_ptr<PagedKvStore>> PagedKvStore::Create(StoreOptions options) {
  KVR_ASSIGN_OR_RETURN(PagePool pool, PagePool::Create(options.pool));
  if (!options.now) options.now = [] { return absl::Now(); };
  return std::unique_ptr<PagedKvStore>(new PagedKvStore(std::move(options), std::move(pool)));
}

absl::StatusOr<std::shared_ptr<PagedKvStore::Sequence>> PagedKvStore::Find(
    const SequenceRef& ref) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = sequences_.find(ref.id);
  // A missing capability is all zero, which no sequence has (CreateSequence refuses it).
  if (it == sequences_.end() || !it->second->cap().Matches(ref.cap)) return Denied(ref.id);
  return it->second;
}

absl::StatusOr<CreateResult> PagedKvStore::CreateSequence(const SequenceRef& ref,
                                                          const SequenceShape& shape,
                                                          uint64_t expected_tokens,
                                                          absl::Duration lease) {
  const SequenceId id = ref.id;
  if (ref.cap.IsNone()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sequence %d: a sequence needs a capability (got none)", id));
  }
  KVR_RETURN_IF_ERROR(shape.Validate());
  const size_t row_bytes = shape.RowBytes();
  if (row_bytes > pool_.page_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "row of %d bytes (2 x head_dim %d x %s) does not fit a page of %d bytes", row_bytes,
        shape.head_dim, DTypeName(shape.dtype), pool_.page_bytes()));
  }
  if (lease < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lease must not be negative");
  }
  const auto tokens_per_page = static_cast<uint32_t>(pool_.page_bytes() / row_bytes);
  auto seq = std::make_shared<Sequence>(id, ref.cap, shape, tokens_per_page, &pool_);
  {
    absl::ReaderMutexLock lock(&mu_);
    if (sequences_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrFormat("sequence %d already exists", id));
    }
  }
  CreateResult result;
  result.tokens_per_page = tokens_per_page;
  if (expected_tokens > 0) {
    const uint64_t per_list = (expected_tokens + tokens_per_page - 1) / tokens_per_page;
    const uint64_t total = per_list * shape.n_layers * shape.n_kv_heads;
    if (total > pool_.total_pages()) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "sequence %d: need %d bytes for %d expected tokens, more than the store's capacity of "
          "%d bytes",
          id, total * pool_.page_bytes(), expected_tokens, pool_.capacity_bytes()));
    }
    std::vector<PageId> fresh;
    const SequenceId keep[] = {id};
    absl::Status st = AllocatePages(total, fresh, keep);
    if (!st.ok()) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "sequence %d (%d expected tokens): %s", id, expected_tokens, st.message()));
    }
    absl::MutexLock lock(&seq->mu_);
    for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
      std::vector<PageId> part(fresh.begin() + layer * per_list * shape.n_kv_heads,
                               fresh.begin() + (layer + 1) * per_list * shape.n_kv_heads);
      seq->Grow(layer, per_list * tokens_per_page, part);
    }
    result.reserved_bytes = total * pool_.page_bytes();
  }
  KVR_RETURN_IF_ERROR(Publish(id, std::move(seq), lease));
  return result;
}

absl::Status PagedKvStore::Publish(SequenceId id, std::shared_ptr<Sequence> seq,
                                   absl::Duration lease) {
  {
    absl::MutexLock lock(&seq->mu_);
    if (lease > absl::ZeroDuration()) seq->expiry_ = options_.now() + lease;
  }
  Touch(*seq);
  absl::MutexLock lock(&mu_);
  if (!sequences_.emplace(id, std::move(seq)).second) {
    // Lost a race with another create of the same id; the new sequence gives its pages (or
    // page references) back on destruction.
    return absl::AlreadyExistsError(absl::StrFormat("sequence %d already exists", id));
  }
  return absl::OkStatus();
}

absl::StatusOr<ForkResult> PagedKvStore::ForkSequence(const SequenceRef& child,
                                                      const SequenceRef& parent_ref,
                                                      uint64_t rows, uint64_t expected_tokens,
                                                      absl::Duration lease) {
  const SequenceId id = child.id;
  if (child.cap.IsNone()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sequence %d: a sequence needs a capability (got none)", id));
  }
  if (lease < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lease must not be negative");
  }
  // The parent holds its pages alive through this reference even if it is released or
  // evicted meanwhile, so the pages shared below cannot be reused under the child.
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> parent, Find(parent_ref));
  if (id == parent_ref.id) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sequence %d cannot be forked into itself", id));
  }
  {
    absl::ReaderMutexLock lock(&mu_);
    if (sequences_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrFormat("sequence %d already exists", id));
    }
  }
  Touch(*parent);
  const SequenceShape& shape = parent->shape();
  const uint32_t tpp = parent->tokens_per_page();
  const uint64_t lists = uint64_t{shape.n_layers} * shape.n_kv_heads;
  // Watermarks only grow, so rows [0, n) stay committed, hence immutable, from here on.
  uint64_t n = rows;
  for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
    n = std::min(n, parent->Committed(layer));
  }
  const uint64_t full = n / tpp;       // parent pages wholly inside [0, n): shared
  const uint64_t tail = n % tpp;       // rows of the partly covered page: copied
  const uint64_t have = full + (tail != 0 ? 1 : 0);
  // Division first: `expected_tokens` may be anything up to 2^64 - 1.
  const uint64_t want = expected_tokens / tpp + (expected_tokens % tpp != 0 ? 1 : 0);
  if (want > pool_.total_pages() / lists) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "sequence %d: %d expected tokens per (layer, kv head) need %d pages for each of %d "
        "(layer, kv head) lists, more than the store's %d pages (%d bytes)",
        id, expected_tokens, want, lists, pool_.total_pages(), pool_.capacity_bytes()));
  }
  const uint64_t per_list = std::max(have, want);
  const uint64_t fresh_per_list = per_list - full;
  std::vector<PageId> fresh;
  if (fresh_per_list > 0) {
    const SequenceId keep[] = {id, parent_ref.id};
    absl::Status st = AllocatePages(fresh_per_list * lists, fresh, keep);
    if (!st.ok()) {
      return absl::Status(
          st.code(), absl::StrFormat("sequence %d (fork of %d at %d rows, %d expected tokens): %s",
                                     id, parent_ref.id, n, expected_tokens, st.message()));
    }
  }
  auto seq = std::make_shared<Sequence>(id, child.cap, shape, tpp, &pool_);
  std::vector<std::vector<PageId>> child_lists(lists);
  std::vector<PageId> shared;
  shared.reserve(full * lists);
  std::vector<Sequence::StoredAttachment> child_attachments(shape.n_layers);
  std::vector<PageId> shared_attachment_pages;
  {
    // A writer of the parent may grow its lists meanwhile (under its exclusive lock) and copy
    // rows past its watermark (under a shared lock): never rows below n, which are read here.
    absl::ReaderMutexLock lock(&parent->mu_);
    if (parent->thinned_pages() > 0 && n > parent->intact_rows()) {
      // Thinned (perhaps while the pages above were allocated): rows past the first hole are
      // not the parent's rows any more.
      pool_.Free(fresh);
      return absl::FailedPreconditionError(absl::StrFormat(
          "sequence %d (fork of %d at %d rows): the parent was thinned, only rows [0, %d) are "
          "whole",
          id, parent_ref.id, n, parent->intact_rows()));
    }
    for (uint64_t i = 0; i < lists; ++i) {
      const std::vector<PageId>& src = parent->List(i);
      std::vector<PageId>& dst = child_lists[i];
      dst.reserve(per_list);
      dst.assign(src.begin(), src.begin() + static_cast<ptrdiff_t>(full));
      shared.insert(shared.end(), dst.begin(), dst.end());
      dst.insert(dst.end(), fresh.begin() + static_cast<ptrdiff_t>(i * fresh_per_list),
                 fresh.begin() + static_cast<ptrdiff_t>((i + 1) * fresh_per_list));
      if (tail != 0) {
        std::memcpy(pool_.PageData(dst[full]), pool_.PageData(src[full]),
                    tail * parent->row_bytes());
      }
    }
    // Attachments describing rows the child shares go with it (their pages shared); one
    // describing rows past n does not describe the child.
    for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
      const Sequence::StoredAttachment& a = parent->attachments_[layer];
      if (!a.present || a.rows > n) continue;
      child_attachments[layer] = a;
      shared_attachment_pages.insert(shared_attachment_pages.end(), a.pages.begin(), a.pages.end());
    }
    // Lock order: sequence -> pool.
    pool_.Share(shared);
    pool_.Share(shared_attachment_pages);
  }
  {
    absl::MutexLock lock(&seq->mu_);
    seq->Adopt(std::move(child_lists), n);
    seq->attachments_ = std::move(child_attachments);
  }
  KVR_RETURN_IF_ERROR(Publish(id, std::move(seq), lease));
  forks_.fetch_add(1, std::memory_order_relaxed);
  forked_rows_.fetch_add(n, std::memory_order_relaxed);
  return ForkResult{.tokens_per_page = tpp,
                    .reserved_bytes = fresh.size() * pool_.page_bytes(),
                    .rows = n,
                    .shared_pages = shared.size()};
}

absl::Status PagedKvStore::ThinnedRowError(SequenceId id, uint32_t layer, uint32_t head,
                                           uint64_t row) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "row %d of sequence %d layer %d head %d was thinned away (its page was freed to make room; "
      "the sequence's summaries stay)",
      row, id, layer, head));
}

void PagedKvStore::Touch(const Sequence& seq) const {
  seq.last_use_.store(use_clock_.fetch_add(1, std::memory_order_relaxed) + 1,
                      std::memory_order_relaxed);
}

absl::Status PagedKvStore::AllocatePages(size_t n, std::vector<PageId>& out,
                                         std::span<const SequenceId> keep) {
  for (;;) {
    absl::Status st = pool_.Allocate(n, out);
    if (st.ok() || !EvictionOn() || !absl::IsResourceExhausted(st)) return st;
    // Another allocation may take what was freed before this one retries: go on while
    // eviction makes progress (every round removes a sequence, so this ends).
    if (EvictFor(n, keep) == 0) return st;
  }
}

size_t PagedKvStore::EvictFor(size_t pages_wanted, std::span<const SequenceId> keep) {
  size_t evicted = 0;
  while (pool_.free_pages() < pages_wanted) {
    const size_t round =
        EvictRound(pages_wanted, keep, options_.evict_cached, /*hopeless_evicts_nothing=*/true);
    if (round == 0) break;
    evicted += round;
  }
  return evicted;
}

size_t PagedKvStore::EvictRound(size_t pages_wanted, std::span<const SequenceId> keep,
                                bool cached, bool hopeless_evicts_nothing) {
  const absl::Time now = options_.now();
  // Victims are destroyed (page references dropped) after the index lock is dropped.
  std::vector<std::shared_ptr<Sequence>> victims;
  uint64_t expired_victims = 0;
  uint64_t thinned = 0;        // sequences thinned this round
  uint64_t thinned_pages = 0;  // pages that freed
  {
    absl::MutexLock lock(&mu_);
    // Eviction order: expired leases by expiry, then released-and-kept sequences by last use.
    struct Candidate {
      bool cached;     // false: expired
      int64_t order;   // expiry (ns since the epoch) or last-use tick
      SequenceId id;
      uint64_t pages;  // page references it holds: an upper bound of what evicting it frees
      bool operator<(const Candidate& o) const {
        return std::tie(cached, order, id) < std::tie(o.cached, o.order, o.id);
      }
    };
    std::vector<Candidate> candidates;
    uint64_t evictable = 0;
    for (const auto& [id, seq] : sequences_) {
      if (std::find(keep.begin(), keep.end(), id) != keep.end()) continue;
      absl::ReaderMutexLock seq_lock(&seq->mu_);
      if (options_.evict_expired && seq->expiry_ <= now) {
        candidates.push_back({false, absl::ToUnixNanos(seq->expiry_), id, seq->PageCount()});
      } else if (cached && seq->released_kept_) {
        candidates.push_back(
            {true, static_cast<int64_t>(seq->last_use_.load(std::memory_order_relaxed)), id,
             seq->PageCount()});
      } else {
        continue;
      }
      evictable += candidates.back().pages;
    }
    std::sort(candidates.begin(), candidates.end());
    uint64_t freed = pool_.free_pages();
    // An allocation that would not fit even with every candidate gone is refused without
    // throwing the cache away.
    if (hopeless_evicts_nothing && freed + evictable < pages_wanted) return 0;
    // Page counts overstate what a victim frees (pages it shares with another sequence stay),
    // so a round evicts no more than needed and EvictFor runs another while still short.
    auto evict = [&](const Candidate& c) {
      auto it = sequences_.find(c.id);
      freed += c.pages;
      if (!c.cached) ++expired_victims;
      victims.push_back(std::move(it->second));
      sequences_.erase(it);
    };
    // Expired ones first (they sort first), then, with thinning, every cached one not yet
    // thinned is thinned before any goes whole. Thinning runs here, under the index lock
    // (index -> sequence -> pool), so that the candidates cannot leave the index meanwhile;
    // it reads each (layer, head)'s committed keys once.
    auto first_cached = std::find_if(candidates.begin(), candidates.end(),
                                     [](const Candidate& c) { return c.cached; });
    for (auto c = candidates.begin(); c != first_cached && freed < pages_wanted; ++c) evict(*c);
    if (cached && options_.cached_eviction == CachedEviction::kThin) {
      for (auto c = first_cached; c != candidates.end() && freed < pages_wanted; ++c) {
        const std::shared_ptr<Sequence>& seq = sequences_.find(c->id)->second;
        absl::MutexLock seq_lock(&seq->mu_);
        if (seq->thin_tried()) continue;
        const uint64_t pages = seq->Thin(options_.thin_keep_fraction, options_.thin_policy);
        if (pages == 0) continue;
        freed += pages;
        c->pages -= pages;
        ++thinned;
        thinned_pages += pages;
      }
    }
    for (auto c = first_cached; c != candidates.end() && freed < pages_wanted; ++c) evict(*c);
  }
  evictions_expired_.fetch_add(expired_victims, std::memory_order_relaxed);
  evictions_cached_lru_.fetch_add(victims.size() - expired_victims, std::memory_order_relaxed);
  thinned_sequences_.fetch_add(thinned, std::memory_order_relaxed);
  thinned_pages_.fetch_add(thinned_pages, std::memory_order_relaxed);
  return victims.size() + thinned;
}

size_t PagedKvStore::SweepExpired() {
  if (!options_.evict_expired) return 0;
  return EvictRound(~size_t{0}, {}, /*cached=*/false, /*hopeless_evicts_nothing=*/false);
}

absl::StatusOr<uint64_t> PagedKvStore::Write(const LayerRows& rows) {
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(rows.sequence));
  const SequenceId id = rows.sequence.id;
  const SequenceShape& shape = seq->shape();
  if (rows.layer >= shape.n_layers) {
    return absl::OutOfRangeError(absl::StrFormat(
        "layer %d out of range for sequence %d (%d layers)", rows.layer, id, shape.n_layers));
  }
  if (rows.n_rows == 0) return absl::InvalidArgumentError("write of 0 rows");
  const size_t half = shape.TokenHalfBytes();
  const uint64_t want = uint64_t{rows.n_rows} * half;
  if (rows.k.size() != want || rows.v.size() != want) {
    const std::string written = shape.dtype == DType::kFp8E4m3
                                    ? "bf16 (the store encodes them to fp8_e4m3)"
                                    : DTypeName(shape.dtype);
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence %d layer %d: %d rows of [%d kv heads x head_dim %d x %s] need %d bytes each "
        "of k and v, got k=%d v=%d",
        id, rows.layer, rows.n_rows, shape.n_kv_heads, shape.head_dim, written, want, rows.k.size(),
        rows.v.size()));
  }

  // Phase 1: reserve the rows and their pages.
  uint64_t start = 0;
  for (;;) {
    absl::ReleasableMutexLock lock(&seq->mu_);
    if (seq->released_kept_) {
      return absl::FailedPreconditionError(
          absl::StrFormat("sequence %d was released and is kept read-only for reuse", id));
    }
    const uint64_t reserved = seq->reserved_[rows.layer];
    if (reserved != seq->Committed(rows.layer)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("sequence %d layer %d: another write is in flight", id, rows.layer));
    }
    start = rows.start_row == LayerRows::kAtEnd ? reserved : rows.start_row;
    if (start != reserved) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "sequence %d layer %d: rows are append-only; write starts at row %d but the layer "
          "has %d rows",
          id, rows.layer, start, reserved));
    }
    const uint64_t end = start + rows.n_rows;
    const size_t grow = seq->PagesToGrow(rows.layer, end);
    std::vector<PageId> fresh;
    if (grow > 0) {
      absl::Status st = pool_.Allocate(grow, fresh);
      if (!st.ok()) {
        if (EvictionOn() && absl::IsResourceExhausted(st)) {
          // Evicting needs the index lock, which ranks above this sequence's lock. Every
          // eviction removes a sequence, so the retries end.
          lock.Release();
          const SequenceId keep[] = {id};
          if (EvictFor(grow, keep) > 0) continue;
        }
        return absl::ResourceExhaustedError(absl::StrFormat("sequence %d layer %d, %d rows: %s", id,
                                                            rows.layer, rows.n_rows, st.message()));
      }
      seq->Grow(rows.layer, end, fresh);
    }
    seq->reserved_[rows.layer] = end;
    break;
  }

  // Phase 2: copy. Only this writer touches rows [start, end) of the layer, and readers do not
  // look past the committed watermark, so a shared lock (keeping page lists stable) suffices.
  {
    absl::ReaderMutexLock lock(&seq->mu_);
    const size_t head_bytes = half / shape.n_kv_heads;  // [head_dim] of one of k or v, as written
    if (shape.dtype == DType::kFp8E4m3) {
      // bf16 k and v of one (row, head) widened side by side, then encoded as one fp8 row.
      const Fp8RowLayout layout{2, static_cast<int>(shape.head_dim)};
      std::vector<float> kv(2 * size_t{shape.head_dim});  // [2, head_dim]
      for (uint32_t r = 0; r < rows.n_rows; ++r) {
        for (uint32_t h = 0; h < shape.n_kv_heads; ++h) {
          const size_t src = size_t{r} * half + size_t{h} * head_bytes;
          Bf16BytesToFloats(rows.k.data() + src, shape.head_dim, kv.data());
          Bf16BytesToFloats(rows.v.data() + src, shape.head_dim, kv.data() + shape.head_dim);
          EncodeFp8Row(layout, kv.data(), seq->RowPtr(rows.layer, h, start + r));
        }
      }
    } else {
      for (uint32_t r = 0; r < rows.n_rows; ++r) {
        for (uint32_t h = 0; h < shape.n_kv_heads; ++h) {
          uint8_t* dst = seq->RowPtr(rows.layer, h, start + r);
          const size_t src = size_t{r} * half + size_t{h} * head_bytes;
          std::memcpy(dst, rows.k.data() + src, head_bytes);
          std::memcpy(dst + head_bytes, rows.v.data() + src, head_bytes);
        }
      }
    }
  }
  // Phase 3: publish.
  const uint64_t end = start + rows.n_rows;
  seq->Publish(rows.layer, end);
  // Bytes stored (for an fp8 sequence fewer than the bf16 bytes handed in).
  bytes_written_.fetch_add(uint64_t{rows.n_rows} * shape.n_kv_heads * shape.RowBytes(),
                           std::memory_order_relaxed);
  return end;
}

absl::StatusOr<uint64_t> PagedKvStore::CheckGather(
    std::span<const GatherEntry> entries, std::vector<std::shared_ptr<Sequence>>* seqs) const {
  uint64_t total = 0;
  std::shared_ptr<Sequence> seq;
  for (size_t i = 0; i < entries.size(); ++i) {
    const GatherEntry& e = entries[i];
    // Every entry is checked, also one naming the previous entry's sequence.
    if (seq == nullptr || !Admits(*seq, e.sequence)) {
      absl::StatusOr<std::shared_ptr<Sequence>> found = Find(e.sequence);
      if (!found.ok()) return DeniedEntry(i, e.sequence.id);
      seq = *std::move(found);
    }
    if (seqs != nullptr) seqs->push_back(seq);
    KVR_RETURN_IF_ERROR(CheckTarget(seq->shape(), e.sequence.id, e.layer, e.head, i));
    // Watermarks only grow, so rows checked against this snapshot stay readable.
    const uint64_t committed = seq->Committed(e.layer);
    for (uint32_t index : e.indices) {
      if (index >= committed) {
        return absl::OutOfRangeError(absl::StrFormat(
            "entry %d: row %d of sequence %d layer %d head %d is not stored (layer has %d "
            "committed rows)",
            i, index, e.sequence.id, e.layer, e.head, committed));
      }
    }
    total += e.indices.size() * seq->row_bytes();
  }
  return total;
}

absl::StatusOr<uint64_t> PagedKvStore::GatherBytes(std::span<const GatherEntry> entries) const {
  return CheckGather(entries, nullptr);
}

absl::Status PagedKvStore::CopyEntries(std::string_view what,
                                       std::span<const std::shared_ptr<Sequence>> seqs,
                                       uint64_t total, std::span<uint8_t> out,
                                       EntryCopy copy_entry) const {
  if (out.size() != total) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s output buffer has %d bytes, the rows need %d", what, out.size(), total));
  }
  uint8_t* dst = out.data();
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Sequence& seq = *seqs[i];
    if (i == 0 || seqs[i] != seqs[i - 1]) Touch(seq);
    absl::ReaderMutexLock lock(&seq.mu_);
    KVR_ASSIGN_OR_RETURN(dst, copy_entry(seq, i, dst));
  }
  bytes_read_.fetch_add(total, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status PagedKvStore::Gather(std::span<const GatherEntry> entries,
                                  std::span<uint8_t> out) const {
  // Validate everything before copying anything; the references taken here keep the
  // sequences' pages alive through the copy even if they are released meanwhile.
  std::vector<std::shared_ptr<Sequence>> seqs;
  seqs.reserve(entries.size());
  KVR_ASSIGN_OR_RETURN(const uint64_t total, CheckGather(entries, &seqs));
  return CopyEntries("gather", seqs, total, out,
                     [&](const Sequence& seq, size_t i, uint8_t* dst) -> absl::StatusOr<uint8_t*> {
                       const GatherEntry& e = entries[i];
                       const size_t row_bytes = seq.row_bytes();
                       const bool holes = seq.thinned_pages() > 0;
                       for (uint32_t index : e.indices) {
                         if (holes && !seq.HasRow(e.layer, e.head, index)) {
                           return ThinnedRowError(e.sequence.id, e.layer, e.head, index);
                         }
                         std::memcpy(dst, seq.RowPtr(e.layer, e.head, index), row_bytes);
                         dst += row_bytes;
                       }
                       return dst;
                     });
}

absl::StatusOr<uint64_t> PagedKvStore::CheckRanges(
    std::span<const RangeEntry> ranges, std::vector<std::shared_ptr<Sequence>>* seqs) const {
  uint64_t total = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const RangeEntry& r = ranges[i];
    absl::StatusOr<std::shared_ptr<Sequence>> found = Find(r.sequence);
    if (!found.ok()) return DeniedEntry(i, r.sequence.id);
    const Sequence& seq = **found;
    KVR_RETURN_IF_ERROR(CheckTarget(seq.shape(), r.sequence.id, r.layer, r.head, i));
    const uint64_t committed = seq.Committed(r.layer);
    if (r.start > committed || r.n_rows > committed - r.start) {
      return absl::OutOfRangeError(absl::StrFormat(
          "entry %d: rows [%d, %d) of sequence %d layer %d head %d are not stored (layer has %d "
          "committed rows)",
          i, r.start, r.start + r.n_rows, r.sequence.id, r.layer, r.head, committed));
    }
    total += r.n_rows * seq.row_bytes();
    if (seqs != nullptr) seqs->push_back(*std::move(found));
  }
  return total;
}

absl::StatusOr<uint64_t> PagedKvStore::RangeBytes(std::span<const RangeEntry> ranges) const {
  return CheckRanges(ranges, nullptr);
}

absl::Status PagedKvStore::RangeRead(std::span<const RangeEntry> ranges,
                                     std::span<uint8_t> out) const {
  std::vector<std::shared_ptr<Sequence>> seqs;
  seqs.reserve(ranges.size());
  KVR_ASSIGN_OR_RETURN(const uint64_t total, CheckRanges(ranges, &seqs));
  return CopyEntries(
      "range", seqs, total, out,
      [&](const Sequence& seq, size_t i, uint8_t* dst) -> absl::StatusOr<uint8_t*> {
        KVR_RETURN_IF_ERROR(seq.ForEachPageRun(ranges[i], [&](const uint8_t* rows, uint64_t bytes) {
          std::memcpy(dst, rows, bytes);
          dst += bytes;
        }));
        return dst;
      });
}

absl::StatusOr<std::vector<PagedKvStore::Segment>> PagedKvStore::LocateRange(
    const RangeEntry& range) const {
  KVR_RETURN_IF_ERROR(RangeBytes(std::span<const RangeEntry>(&range, 1)).status());
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(range.sequence));
  Touch(*seq);
  std::vector<Segment> segments;
  absl::ReaderMutexLock lock(&seq->mu_);
  KVR_RETURN_IF_ERROR(seq->ForEachPageRun(range, [&](const uint8_t* rows, uint64_t bytes) {
    const uint64_t offset = static_cast<uint64_t>(rows - pool_.base());
    if (!segments.empty() && segments.back().pool_offset + segments.back().bytes == offset) {
      segments.back().bytes += bytes;
    } else {
      segments.push_back({offset, bytes});
    }
  }));
  return segments;
}

absl::StatusOr<PageTable> PagedKvStore::ReservePageTable(const SequenceRef& ref, uint64_t rows) {
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(ref));
  Touch(*seq);
  const SequenceId id = ref.id;
  const SequenceShape& shape = seq->shape();
  const uint32_t tpp = seq->tokens_per_page();
  const uint64_t lists = uint64_t{shape.n_layers} * shape.n_kv_heads;
  // Division first: `rows` may be anything up to 2^64 - 1.
  const uint64_t want = rows / tpp + (rows % tpp != 0 ? 1 : 0);
  if (want > pool_.total_pages() / lists) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "sequence %d: %d rows per (layer, kv head) need %d pages for each of %d (layer, kv "
        "head) lists, more than the store's %d pages (%d bytes)",
        id, rows, want, lists, pool_.total_pages(), pool_.capacity_bytes()));
  }
  // Pages are allocated without the sequence lock (eviction takes the index lock, which ranks
  // above it), then handed out under it. A concurrent write may have grown some lists
  // meanwhile: what it covered is given back, and a shortfall (it grew them past our target)
  // takes another round.
  for (int attempt = 0;; ++attempt) {
    uint64_t per_list = 0;
    uint64_t need = 0;
    {
      absl::ReaderMutexLock lock(&seq->mu_);
      if (seq->thinned_pages() > 0) {
        // A page table is dense: it cannot say which pages are gone.
        return absl::FailedPreconditionError(absl::StrFormat(
            "sequence %d was thinned (%d pages dropped; rows [0, %d) whole): no page table", id,
            seq->thinned_pages(), seq->intact_rows()));
      }
      per_list = std::max<uint64_t>(want, seq->MaxListPages());
      need = seq->PagesToGrowAll(per_list);
      if (need > 0 && seq->released_kept_) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "sequence %d was released and is kept read-only for reuse; its pages cannot grow", id));
      }
      if (need == 0) {
        PageTable table;
        table.shape = shape;
        table.tokens_per_page = tpp;
        table.page_bytes = pool_.page_bytes();
        table.pages_per_head = static_cast<uint32_t>(per_list);
        for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
          table.committed_rows.push_back(seq->Committed(layer));
        }
        seq->CopyPages(per_list, table.pages);
        return table;
      }
    }
    std::vector<PageId> fresh;
    const SequenceId keep[] = {id};
    absl::Status st = AllocatePages(need, fresh, keep);
    if (!st.ok()) {
      return absl::Status(st.code(),
                          absl::StrFormat("sequence %d, page table for %d rows per (layer, kv "
                                          "head) (%d more pages): %s",
                                          id, rows, need, st.message()));
    }
    absl::MutexLock lock(&seq->mu_);
    const uint64_t still = seq->PagesToGrowAll(per_list);
    if (still <= fresh.size() && !seq->released_kept_ && seq->MaxListPages() <= per_list) {
      const size_t used = seq->GrowAll(per_list, fresh);
      pool_.Free(std::span<const PageId>(fresh).subspan(used));
    } else {
      pool_.Free(fresh);
      if (attempt >= 8) {
        return absl::AbortedError(
            absl::StrFormat("sequence %d: page table kept changing under concurrent writes", id));
      }
    }
  }
}

absl::Status PagedKvStore::PutAttachment(const SequenceRef& ref, uint32_t layer, uint64_t rows,
                                         std::span<const uint8_t> bytes) {
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(ref));
  if (layer >= seq->shape().n_layers) {
    return absl::OutOfRangeError(absl::StrFormat(
        "layer %d out of range for sequence %d (%d layers)", layer, ref.id, seq->shape().n_layers));
  }
  if (bytes.size() > kMaxAttachmentBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sequence %d layer %d: attachment of %d bytes, more than the %d allowed",
                        ref.id, layer, bytes.size(), kMaxAttachmentBytes));
  }
  {
    absl::ReaderMutexLock lock(&seq->mu_);
    if (seq->released_kept_) {
      return absl::FailedPreconditionError(
          absl::StrFormat("sequence %d was released and is kept read-only for reuse", ref.id));
    }
  }
  // Fresh pages, filled before they are published: the old attachment (if any) stays whole
  // until the swap below.
  const size_t page_bytes = pool_.page_bytes();
  Sequence::StoredAttachment fresh{.present = true, .rows = rows, .bytes = bytes.size()};
  const size_t n_pages = (bytes.size() + page_bytes - 1) / page_bytes;
  if (n_pages > 0) {
    const SequenceId keep[] = {ref.id};
    absl::Status st = AllocatePages(n_pages, fresh.pages, keep);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrFormat("sequence %d layer %d, attachment of %d "
                                                     "bytes: %s",
                                                     ref.id, layer, bytes.size(), st.message()));
    }
  }
  for (size_t i = 0; i < fresh.pages.size(); ++i) {
    const size_t at = i * page_bytes;
    std::memcpy(pool_.PageData(fresh.pages[i]), bytes.data() + at,
                std::min(page_bytes, bytes.size() - at));
  }
  absl::MutexLock lock(&seq->mu_);
  if (seq->released_kept_) {  // released meanwhile
    pool_.Free(fresh.pages);
    return absl::FailedPreconditionError(
        absl::StrFormat("sequence %d was released and is kept read-only for reuse", ref.id));
  }
  std::swap(seq->attachments_[layer], fresh);
  pool_.Free(fresh.pages);  // the replaced attachment's (lock order: sequence -> pool)
  return absl::OkStatus();
}

absl::StatusOr<Attachment> PagedKvStore::GetAttachment(const SequenceRef& ref,
                                                       uint32_t layer) const {
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(ref));
  if (layer >= seq->shape().n_layers) {
    return absl::OutOfRangeError(absl::StrFormat(
        "layer %d out of range for sequence %d (%d layers)", layer, ref.id, seq->shape().n_layers));
  }
  Touch(*seq);
  absl::ReaderMutexLock lock(&seq->mu_);
  const Sequence::StoredAttachment& a = seq->attachments_[layer];
  if (!a.present) {
    return absl::NotFoundError(
        absl::StrFormat("sequence %d layer %d has no attachment", ref.id, layer));
  }
  Attachment out;
  out.rows = a.rows;
  out.bytes.resize(a.bytes);
  const size_t page_bytes = pool_.page_bytes();
  for (size_t i = 0; i < a.pages.size(); ++i) {
    const size_t at = i * page_bytes;
    std::memcpy(out.bytes.data() + at, pool_.PageData(a.pages[i]),
                std::min<size_t>(page_bytes, a.bytes - at));
  }
  bytes_read_.fetch_add(a.bytes, std::memory_order_relaxed);
  return out;
}

absl::Status PagedKvStore::Release(const SequenceRef& ref, absl::Duration keep) {
  if (keep < absl::ZeroDuration()) return absl::InvalidArgumentError("keep must not be negative");
  std::shared_ptr<Sequence> victim;  // destroyed (pages freed) after the index lock is dropped
  absl::ReleasableMutexLock lock(&mu_);
  auto it = sequences_.find(ref.id);
  if (it == sequences_.end() || !it->second->cap().Matches(ref.cap)) return Denied(ref.id);
  if (keep == absl::ZeroDuration()) {
    victim = std::move(it->second);
    sequences_.erase(it);
    lock.Release();
    return absl::OkStatus();
  }
  absl::MutexLock seq_lock(&it->second->mu_);
  it->second->released_kept_ = true;
  it->second->expiry_ = options_.now() + keep;
  Touch(*it->second);
  return absl::OkStatus();
}

absl::Status PagedKvStore::Lease(const SequenceRef& ref, absl::Duration lease) {
  if (lease < absl::ZeroDuration()) return absl::InvalidArgumentError("lease must not be negative");
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(ref));
  absl::MutexLock lock(&seq->mu_);
  seq->expiry_ = lease == absl::ZeroDuration() ? absl::InfiniteFuture() : options_.now() + lease;
  return absl::OkStatus();
}

absl::StatusOr<SequenceInfo> PagedKvStore::GetSequence(const SequenceRef& ref) const {
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(ref));
  SequenceInfo info;
  info.shape = seq->shape();
  info.tokens_per_page = seq->tokens_per_page();
  for (uint32_t layer = 0; layer < info.shape.n_layers; ++layer) {
    info.committed_rows.push_back(seq->Committed(layer));
  }
  absl::ReaderMutexLock lock(&seq->mu_);
  info.pages = seq->PageCount();
  info.released_kept = seq->released_kept_;
  info.thinned_pages = seq->thinned_pages();
  info.intact_rows = info.thinned_pages > 0 ? seq->intact_rows() : ~uint64_t{0};
  for (uint64_t rows : info.committed_rows) info.intact_rows = std::min(info.intact_rows, rows);
  info.lease_expiry_unix_ms =
      seq->expiry_ == absl::InfiniteFuture() ? 0 : absl::ToUnixMillis(seq->expiry_);
  return info;
}

StoreStats PagedKvStore::Stats() const {
  StoreStats stats;
  stats.capacity_bytes = pool_.capacity_bytes();
  stats.page_bytes = pool_.page_bytes();
  stats.total_pages = pool_.total_pages();
  stats.free_pages = pool_.free_pages();
  stats.used_bytes = (stats.total_pages - stats.free_pages) * stats.page_bytes;
  stats.page_backing = PageBackingName(pool_.backing());
  stats.evictions_expired = evictions_expired_.load(std::memory_order_relaxed);
  stats.evictions_cached_lru = evictions_cached_lru_.load(std::memory_order_relaxed);
  stats.evictions = stats.evictions_expired + stats.evictions_cached_lru;
  stats.evictions_thinned = thinned_sequences_.load(std::memory_order_relaxed);
  stats.thinned_pages = thinned_pages_.load(std::memory_order_relaxed);
  stats.shared_pages = pool_.shared_pages();
  stats.forks = forks_.load(std::memory_order_relaxed);
  stats.forked_rows = forked_rows_.load(std::memory_order_relaxed);
  stats.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  stats.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  const absl::Time now = options_.now();
  absl::ReaderMutexLock lock(&mu_);
  stats.sequences = sequences_.size();
  for (const auto& [id, seq] : sequences_) {
    absl::ReaderMutexLock seq_lock(&seq->mu_);
    if (seq->expiry_ <= now) ++stats.expired_sequences;
    if (seq->released_kept_) ++stats.cached_sequences;
  }
  if (stats.cached_sequences > 0 && options_.evict_cached) {
    // Pages of cached sequences that no live sequence shares (a fork of a cached prefix keeps
    // the prefix's pages when the cached one goes): one mark per pool page.
    enum : uint8_t { kCached = 1, kLive = 2 };
    std::vector<uint8_t> mark(stats.total_pages, 0);
    for (const auto& [id, seq] : sequences_) {
      absl::ReaderMutexLock seq_lock(&seq->mu_);
      const uint8_t m = seq->released_kept_ ? kCached : kLive;
      for (size_t l = 0; l < size_t{seq->shape().n_layers} * seq->shape().n_kv_heads; ++l) {
        for (PageId p : seq->List(l)) {
          if (p != Sequence::kNoPage) mark[p] |= m;
        }
      }
      for (const Sequence::StoredAttachment& a : seq->attachments_) {
        for (PageId p : a.pages) mark[p] |= m;
      }
    }
    const uint64_t reclaimable =
        static_cast<uint64_t>(std::count(mark.begin(), mark.end(), uint8_t{kCached}));
    stats.cached_bytes = reclaimable * stats.page_bytes;
  }
  return stats;
}

}  // namespace kvr::kv_store
