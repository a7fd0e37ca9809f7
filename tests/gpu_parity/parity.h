#pragma once
// The GPU parity table: every CUDA kernel of the tree against its CPU reference, one row per
// (kernel, case). A row names the kernel, the case (shapes, dtypes, parameters), the CPU
// reference and the comparison; its body runs the kernel on poisoned outputs, compares with the
// reference and records its measurements (kvr::cuda::testing::ExpectMeasure and friends).
// Each family's rows are one value-parameterised instantiation of GpuParity.Row (the family is
// the instantiation's prefix: --gtest_filter='Select/*'); checks that are no rows (launchers
// refusing bad shapes, contracts over several launches) are plain TESTs beside them.
// main.cc prints every row's measurements as one table and exits non-zero on any failure.

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/gpu_testing.h"

namespace kvr::gpu_parity {

struct ParityRow {
  std::string kernel;      // the launcher under test, e.g. "ExactSelect"
  std::string shape;       // the case: shapes, dtype, parameters
  std::string reference;   // the CPU reference it is compared with
  std::string comparison;  // how: bit-equal, tolerance, near-ties only, recall ...
  std::function<void()> run;
};

// gtest prints a parameter in failure messages and --gtest_list_tests.
inline void PrintTo(const ParityRow& row, std::ostream* os) {
  *os << row.kernel << " " << row.shape;
}

// The test name of a row: kernel and case with every other character '_'.
std::string RowName(const ::testing::TestParamInfo<ParityRow>& info);

class GpuParity : public ::testing::TestWithParam<ParityRow> {
 protected:
  // Records the row (so that the table lists it even when skipped), then skips without a device.
  void SetUp() override;
};

// The families' rows (one file each).
std::vector<ParityRow> SelectRows();       // topk, exact, quest, clusterkv selection
std::vector<ParityRow> QuantSelectRows();  // pariskv encode / select, ctkvr, a2ats selection
std::vector<ParityRow> BuildRows();        // summary builds at prefill
std::vector<ParityRow> AssignRows();       // clusterkv's pre-split assignment kernel
std::vector<ParityRow> AttendRows();       // gather, decode attention, hot cache
std::vector<ParityRow> ModelOpsRows();     // the CUDA model's kernels

}  // namespace kvr::gpu_parity
