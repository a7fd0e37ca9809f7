#pragma once
// The quality gate of `kvr eval endpoint --gate FILE`: a run's per-method accuracy against
// figures recorded in a small JSON file (tools/eval/gate/), with the run's settings beside them
// so that the gate always measures what was recorded:
//
//   {"run": {"tasks": [...], "methods": [...], "budget": 64, "length": 1024, "samples": 2,
//            "seed": 0, "n_sink": 16, "local_window": 128},
//    "accuracy": {"full": 0.5, "exact": 0.5, "streaming": 0.25},
//    "tolerance": 0.05, "exact_margin": 0.02, "floor_method": "streaming"}
//
// A method's accuracy is the mean over the tasks of its accuracy at (length, budget; full at
// no budget). The gate fails when
//   - a method of the file has no result (it was not run, or every task is missing);
//   - a method is below `floor_method` (streaming attends only sink and window: a method that
//     selects should never do worse);
//   - exact is more than `exact_margin` under full (exact is the oracle top-k);
//   - a method is more than `tolerance` under its recorded accuracy.
// Accuracies are fractions: 0.02 is 2 points.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/eval_endpoint/suite.h"
#include "nlohmann/json.hpp"

namespace kvr::eval_endpoint {

struct Gate {
  SuiteOptions run;  // tasks, methods, budgets {budget}, lengths {length}, samples, seed, sink
  std::map<std::string, double> accuracy;
  double tolerance = 0.05;
  double exact_margin = 0.02;
  std::string floor_method = "streaming";
};

// InvalidArgument naming the field that is missing or of the wrong type.
[[nodiscard]] absl::StatusOr<Gate> ParseGate(const nlohmann::json& j);

struct GateOutcome {
  std::map<std::string, double> accuracy;  // per method, this run
  std::vector<std::string> failures;       // empty: passed
  std::string report;                      // a line per method and per failure
  bool passed() const { return failures.empty(); }
};

GateOutcome CheckGate(const Gate& gate, const std::vector<GroupResult>& groups);

// The groups of a result file written by --json (ToJson's "groups"). InvalidArgument when it
// has none or a group lacks a field.
[[nodiscard]] absl::StatusOr<std::vector<GroupResult>> GroupsFromJson(const nlohmann::json& j);

}  // namespace kvr::eval_endpoint
