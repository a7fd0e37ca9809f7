#pragma once
// Helpers for the metric sets of the node roles (each role's metrics.cc): families registered
// by name and help, and a label-value cache over a family. Only the sets' implementations
// include this header (it brings in prometheus-cpp); their public headers forward-declare
// prometheus::Registry through kvr/common/metrics.h.

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvr::metrics {

// One metric family with a fixed list of label names, and a cache from label values to the
// child metric. prometheus::Family::Add would construct (and for histograms allocate buckets
// for) a new child on every call before finding the existing one; the cache avoids that.
template <typename T>
class Labelled {
 public:
  Labelled(prometheus::Family<T>& family, std::vector<std::string> names,
           std::vector<double> buckets = {})
      : family_(family), names_(std::move(names)), buckets_(std::move(buckets)) {}

  T& Get(std::initializer_list<std::string_view> values) {
    std::string key;
    for (std::string_view v : values) absl::StrAppend(&key, std::string(v), "\x1f");
    {
      absl::ReaderMutexLock lock(&mu_);
      auto it = children_.find(key);
      if (it != children_.end()) return *it->second;
    }
    prometheus::Labels labels;
    size_t i = 0;
    for (std::string_view v : values) labels.emplace(names_.at(i++), std::string(v));
    absl::MutexLock lock(&mu_);
    T* child;
    if constexpr (std::is_same_v<T, prometheus::Histogram>) {
      child = &family_.Add(labels, buckets_);
    } else {
      child = &family_.Add(labels);
    }
    children_.emplace(std::move(key), child);
    return *child;
  }

 private:
  prometheus::Family<T>& family_;
  const std::vector<std::string> names_;
  const std::vector<double> buckets_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, T*> children_ ABSL_GUARDED_BY(mu_);
};

inline prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& r,
                                                       const std::string& name,
                                                       const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}
inline prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& r, const std::string& name,
                                                   const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}
inline prometheus::Family<prometheus::Histogram>& HistogramFamily(prometheus::Registry& r,
                                                           const std::string& name,
                                                           const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}

using CounterL = Labelled<prometheus::Counter>;
using GaugeL = Labelled<prometheus::Gauge>;
using HistogramL = Labelled<prometheus::Histogram>;

}  // namespace kvr::metrics
