#include "kvr/eval_endpoint/gate.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvr::eval_endpoint {
namespace {

absl::Status Missing(const std::string& field, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("gate: '", field, "' must be ", want));
}

}  // namespace

absl::StatusOr<Gate> ParseGate(const nlohmann::json& j) {
  if (!j.is_object()) return Missing("(file)", "a JSON object");
  Gate g;
  const nlohmann::json& run = j.value("run", nlohmann::json());
  if (!run.is_object()) return Missing("run", "an object");
  auto strings = [&](const char* key, std::vector<std::string>* out) -> absl::Status {
    if (!run.contains(key)) return absl::OkStatus();
    if (!run[key].is_array()) return Missing(absl::StrCat("run.", key), "a list of names");
    for (const auto& v : run[key]) {
      if (!v.is_string()) return Missing(absl::StrCat("run.", key), "a list of names");
      out->push_back(v.get<std::string>());
    }
    return absl::OkStatus();
  };
  auto count = [&](const char* key, bool required) -> absl::StatusOr<std::optional<uint32_t>> {
    if (!run.contains(key)) {
      if (required) return Missing(absl::StrCat("run.", key), "a positive integer");
      return std::optional<uint32_t>();
    }
    if (!run[key].is_number_unsigned()) {
      return Missing(absl::StrCat("run.", key), "a non-negative integer");
    }
    return std::optional<uint32_t>(run[key].get<uint32_t>());
  };
  if (absl::Status s = strings("tasks", &g.run.tasks); !s.ok()) return s;
  if (absl::Status s = strings("methods", &g.run.methods); !s.ok()) return s;
  auto budget = count("budget", true);
  if (!budget.ok()) return budget.status();
  auto length = count("length", true);
  if (!length.ok()) return length.status();
  auto samples = count("samples", true);
  if (!samples.ok()) return samples.status();
  auto seed = count("seed", false);
  if (!seed.ok()) return seed.status();
  auto sink = count("n_sink", false);
  if (!sink.ok()) return sink.status();
  auto local = count("local_window", false);
  if (!local.ok()) return local.status();
  g.run.budgets = {**budget};
  g.run.lengths = {**length};
  g.run.samples = **samples;
  g.run.seed = seed->value_or(0);
  g.run.n_sink = *sink;
  g.run.local_window = *local;
  const nlohmann::json& acc = j.value("accuracy", nlohmann::json());
  if (!acc.is_object() || acc.empty()) return Missing("accuracy", "an object method -> 0..1");
  for (const auto& [method, v] : acc.items()) {
    if (!v.is_number() || v.get<double>() < 0 || v.get<double>() > 1) {
      return Missing(absl::StrCat("accuracy.", method), "a number in [0, 1]");
    }
    g.accuracy[method] = v.get<double>();
  }
  for (const auto& [key, out] : {std::pair<const char*, double*>{"tolerance", &g.tolerance},
                                 {"exact_margin", &g.exact_margin}}) {
    if (!j.contains(key)) continue;
    if (!j[key].is_number()) return Missing(key, "a number");
    *out = j[key].get<double>();
  }
  if (j.contains("floor_method")) {
    if (!j["floor_method"].is_string()) return Missing("floor_method", "a method name");
    g.floor_method = j["floor_method"].get<std::string>();
  }
  if (g.run.methods.empty()) {
    for (const auto& [method, v] : g.accuracy) g.run.methods.push_back(method);
  }
  return g;
}

GateOutcome CheckGate(const Gate& gate, const std::vector<GroupResult>& groups) {
  GateOutcome out;
  const uint32_t length = gate.run.lengths.empty() ? 0 : gate.run.lengths[0];
  const uint32_t budget = gate.run.budgets.empty() ? 0 : gate.run.budgets[0];
  std::map<std::string, std::pair<double, int>> sum;  // method -> (accuracy sum, tasks)
  for (const GroupResult& g : groups) {
    if (g.length != length) continue;
    if (g.method == kReferenceMethod ? g.budget != 0 : g.budget != budget) continue;
    sum[g.method].first += g.accuracy;
    sum[g.method].second += 1;
  }
  for (const auto& [method, s] : sum) out.accuracy[method] = s.first / s.second;
  auto fail = [&](std::string why) {
    out.report += absl::StrCat("gate: FAIL ", why, "\n");
    out.failures.push_back(std::move(why));
  };
  auto points = [](double x) { return absl::StrFormat("%.1f", 100 * x); };
  for (const auto& [method, recorded] : gate.accuracy) {
    const auto it = out.accuracy.find(method);
    if (it == out.accuracy.end()) {
      fail(absl::StrCat(method, ": no result at length ", length,
                        method == kReferenceMethod ? "" : absl::StrCat(" budget ", budget)));
      continue;
    }
    out.report += absl::StrCat("gate: ", method, " accuracy ", points(it->second), " (recorded ",
                               points(recorded), ")\n");
    if (it->second < recorded - gate.tolerance - 1e-9) {
      fail(absl::StrCat(method, ": accuracy ", points(it->second), " is more than ",
                        points(gate.tolerance), " points under its recorded ", points(recorded)));
    }
  }
  const auto floor = out.accuracy.find(gate.floor_method);
  if (floor != out.accuracy.end()) {
    for (const auto& [method, a] : out.accuracy) {
      if (method != gate.floor_method && a < floor->second - 1e-9) {
        fail(absl::StrCat(method, ": accuracy ", points(a), " is below ", gate.floor_method, "'s ",
                          points(floor->second)));
      }
    }
  }
  const auto full = out.accuracy.find(kReferenceMethod);
  const auto exact = out.accuracy.find("exact");
  if (full != out.accuracy.end() && exact != out.accuracy.end() &&
      exact->second < full->second - gate.exact_margin - 1e-9) {
    fail(absl::StrCat("exact: accuracy ", points(exact->second), " is more than ",
                      points(gate.exact_margin), " points under full's ", points(full->second)));
  }
  out.report +=
      out.passed() ? "gate: pass\n" : absl::StrCat("gate: ", out.failures.size(), " failure(s)\n");
  return out;
}

absl::StatusOr<std::vector<GroupResult>> GroupsFromJson(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("groups") || !j["groups"].is_array() || j["groups"].empty()) {
    return absl::InvalidArgumentError("result file: no \"groups\" (write one with --json)");
  }
  std::vector<GroupResult> out;
  // nlohmann's get<> throws on a field of the wrong type: caught here, answered as a status.
  try {
    for (const nlohmann::json& g : j["groups"]) {
      for (const char* key : {"task", "length", "method", "budget", "accuracy"}) {
        if (!g.is_object() || !g.contains(key)) {
          return absl::InvalidArgumentError(
              absl::StrCat("result file: a group has no \"", key, "\""));
        }
      }
      GroupResult r;
      r.task = g["task"].get<std::string>();
      r.length = g["length"].get<uint32_t>();
      r.method = g["method"].get<std::string>();
      r.budget = g["budget"].get<uint32_t>();
      r.accuracy = g["accuracy"].get<double>();
      r.samples = g.value("samples", 0u);
      r.failed = g.value("failed", 0u);
      if (g.contains("agreement_with_full") && g["agreement_with_full"].is_number()) {
        r.agreement = g["agreement_with_full"].get<double>();
      }
      r.tokens_per_s = g.value("output_tokens_per_s", 0.0);
      r.mean_ttft_ms = g.value("mean_ttft_ms", 0.0);
      r.mean_prompt_tokens = g.value("mean_prompt_tokens", 0.0);
      out.push_back(std::move(r));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("result file: ", e.what()));
  }
  return out;
}

}  // namespace kvr::eval_endpoint
