#include "selection_trace.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace kvr::retrieval::eval {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'R', 'S', 'E', 'L', 'T', '1'};

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Reads fixed-size values from a byte string; any read past the end marks it truncated.
class Reader {
 public:
  explicit Reader(const std::string& bytes) : bytes_(bytes) {}
  template <typename T>
  T Get() {
    T v{};
    if (at_ + sizeof(T) > bytes_.size()) {
      truncated_ = true;
      return v;
    }
    std::memcpy(&v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string GetString(size_t n) {
    if (at_ + n > bytes_.size()) {
      truncated_ = true;
      return {};
    }
    std::string s = bytes_.substr(at_, n);
    at_ += n;
    return s;
  }
  bool truncated() const { return truncated_; }
  bool at_end() const { return at_ == bytes_.size(); }
  size_t remaining() const { return bytes_.size() - at_; }

 private:
  const std::string& bytes_;
  size_t at_ = 0;
  bool truncated_ = false;
};

}  // namespace

absl::Status WriteSelectionTrace(const std::string& path, const SelectionTrace& t) {
  std::string out(kMagic, sizeof(kMagic));
  Put<uint32_t>(out, static_cast<uint32_t>(t.method.size()));
  out += t.method;
  for (int32_t v : {t.n_layers, t.n_kv_heads, t.budget, t.n_sink, t.local_window}) Put(out, v);
  Put<int64_t>(out, t.prompt_tokens);
  Put<uint32_t>(out, static_cast<uint32_t>(t.steps.size()));
  const size_t heads = static_cast<size_t>(t.n_layers) * t.n_kv_heads;
  for (const SelectionTrace::Step& s : t.steps) {
    if (s.heads.size() != heads) {
      return absl::InvalidArgumentError(absl::StrCat("selection trace ", path, ": a step has ",
                                                     s.heads.size(), " heads, not ", heads));
    }
    Put<int64_t>(out, s.position);
    for (const std::vector<int32_t>& ids : s.heads) {
      Put<uint32_t>(out, static_cast<uint32_t>(ids.size()));
      out.append(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t));
    }
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("cannot write selection trace ", path));
  return absl::OkStatus();
}

absl::StatusOr<SelectionTrace> ReadSelectionTrace(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read selection trace ", path));
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto bad = [&](auto... what) {
    return absl::InvalidArgumentError(absl::StrCat("selection trace ", path, ": ", what...));
  };
  Reader r(bytes);
  if (r.GetString(sizeof(kMagic)) != std::string(kMagic, sizeof(kMagic))) {
    return bad("not a selection trace (magic KVRSELT1 expected)");
  }
  SelectionTrace t;
  const uint32_t name = r.Get<uint32_t>();
  if (name > 256) return bad("method name of ", name, " bytes");
  t.method = r.GetString(name);
  t.n_layers = r.Get<int32_t>();
  t.n_kv_heads = r.Get<int32_t>();
  t.budget = r.Get<int32_t>();
  t.n_sink = r.Get<int32_t>();
  t.local_window = r.Get<int32_t>();
  t.prompt_tokens = r.Get<int64_t>();
  const uint32_t n_steps = r.Get<uint32_t>();
  if (r.truncated()) return bad("truncated header");
  if (t.n_layers < 1 || t.n_kv_heads < 1 || t.budget < 1 || t.n_sink < 0 || t.local_window < 1 ||
      t.n_layers > 4096 || t.n_kv_heads > 4096 || t.budget > (1 << 20) || t.prompt_tokens < 1) {
    return bad("implausible shape: ", t.n_layers, " layers, ", t.n_kv_heads, " KV heads, budget ",
               t.budget, ", sink ", t.n_sink, ", window ", t.local_window, ", prompt tokens ",
               t.prompt_tokens);
  }
  const size_t heads = static_cast<size_t>(t.n_layers) * t.n_kv_heads;
  for (uint32_t i = 0; i < n_steps; ++i) {
    SelectionTrace::Step s;
    s.position = r.Get<int64_t>();
    // Every head takes at least its count: a file too short for them is refused before any
    // allocation.
    if (r.truncated() || r.remaining() < heads * sizeof(uint32_t)) {
      return bad("truncated at step ", i);
    }
    if (s.position < t.prompt_tokens) {
      return bad("step ", i, " at position ", s.position, ", before the prompt's end ",
                 t.prompt_tokens);
    }
    s.heads.resize(heads);
    for (size_t h = 0; h < heads; ++h) {
      const uint32_t n = r.Get<uint32_t>();
      if (r.truncated()) return bad("truncated at step ", i);
      if (n > static_cast<uint32_t>(t.budget)) {
        return bad("step ", i, " head ", h, " has ", n, " ids, more than the budget ", t.budget);
      }
      if (r.remaining() < size_t{n} * sizeof(int32_t)) return bad("truncated at step ", i);
      s.heads[h].resize(n);
      for (uint32_t k = 0; k < n; ++k) {
        const int32_t id = r.Get<int32_t>();
        if (r.truncated()) return bad("truncated at step ", i);
        if (id < 0 || id >= s.position || (k > 0 && id <= s.heads[h][k - 1])) {
          return bad("step ", i, " head ", h, ": id ", id,
                     " outside [0, position) or not ascending");
        }
        s.heads[h][k] = id;
      }
    }
    t.steps.push_back(std::move(s));
  }
  if (!r.at_end()) return bad("bytes after the last step");
  return t;
}

}  // namespace kvr::retrieval::eval
