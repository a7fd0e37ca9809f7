// gpu_parity_test: runs every row of the GPU parity table (parity.h) and prints the table.
// Without a CUDA device every row skips and the table says SKIP. Exit status: gtest's (non-zero
// on any failure).

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "parity.h"

namespace kvr::gpu_parity {

std::string RowName(const ::testing::TestParamInfo<ParityRow>& info) {
  std::string n = info.param.kernel + "_" + info.param.shape;
  for (char& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

void GpuParity::SetUp() {
  const ParityRow& row = GetParam();
  RecordProperty("parity_row",
                 row.kernel + "\t" + row.shape + "\t" + row.reference + "\t" + row.comparison);
  KVR_SKIP_WITHOUT_GPU();
}

TEST_P(GpuParity, Row) { GetParam().run(); }

INSTANTIATE_TEST_SUITE_P(Select, GpuParity, ::testing::ValuesIn(SelectRows()), RowName);
INSTANTIATE_TEST_SUITE_P(QuantSelect, GpuParity, ::testing::ValuesIn(QuantSelectRows()), RowName);
INSTANTIATE_TEST_SUITE_P(Build, GpuParity, ::testing::ValuesIn(BuildRows()), RowName);
INSTANTIATE_TEST_SUITE_P(ArgmaxSplit, GpuParity, ::testing::ValuesIn(AssignRows()), RowName);
INSTANTIATE_TEST_SUITE_P(Attend, GpuParity, ::testing::ValuesIn(AttendRows()), RowName);
INSTANTIATE_TEST_SUITE_P(ModelOps, GpuParity, ::testing::ValuesIn(ModelOpsRows()), RowName);

namespace {

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out(1);
  for (char ch : s) {
    if (ch == '\t') {
      out.emplace_back();
    } else {
      out.back() += ch;
    }
  }
  return out;
}

// Collects each test's row and measurements; prints them as one table when the program ends.
class TablePrinter : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    const ::testing::TestResult& r = *info.result();
    const char* outcome = r.Skipped() ? "SKIP" : r.Failed() ? "FAIL" : "PASS";
    std::string kernel = info.test_suite_name(), shape = info.name(), reference = "-";
    std::vector<std::vector<std::string>> measures;
    for (int i = 0; i < r.test_property_count(); ++i) {
      const ::testing::TestProperty& p = r.GetTestProperty(i);
      const std::string key = p.key();
      if (key == "parity_row") {
        const std::vector<std::string> f = Split(p.value());
        if (f.size() == 4) {
          kernel = f[0];
          shape = f[1];
          reference = f[2] + ", " + f[3];
        }
      } else if (key.rfind("parity_", 0) == 0) {
        std::vector<std::string> f = Split(p.value());
        if (f.size() == 4) measures.push_back(std::move(f));
      }
    }
    bool any_failed = false;
    for (const auto& m : measures) any_failed = any_failed || m[3] == "FAIL";
    if (measures.empty() || (r.Failed() && !any_failed) || r.Skipped()) {
      // No measurement, or a failure no measurement shows: the row's own verdict.
      measures.push_back({r.Skipped() ? "-" : "assertions", "-", "-", outcome});
    }
    for (const auto& m : measures) lines_.push_back({kernel, shape, m[0], m[1], m[2], m[3]});
    if (reference != "-" && std::find(references_.begin(), references_.end(),
                                      kernel + ": " + reference) == references_.end()) {
      references_.push_back(kernel + ": " + reference);
    }
  }

  void OnTestProgramEnd(const ::testing::UnitTest& unit) override {
    size_t w[6] = {6, 4, 6, 5, 5, 6};
    for (const auto& l : lines_)
      for (int i = 0; i < 6; ++i) w[i] = std::max(w[i], l[i].size());
    auto row = [&](const std::vector<std::string>& l) {
      std::printf("%-*s  %-*s  %-*s  %*s  %-*s  %s\n", static_cast<int>(w[0]), l[0].c_str(),
                  static_cast<int>(w[1]), l[1].c_str(), static_cast<int>(w[2]), l[2].c_str(),
                  static_cast<int>(w[3]), l[3].c_str(), static_cast<int>(w[4]), l[4].c_str(),
                  l[5].c_str());
    };
    int pass = 0, fail = 0, skip = 0;
    for (const auto& l : lines_) {
      pass += l[5] == "PASS";
      fail += l[5] == "FAIL";
      skip += l[5] == "SKIP";
    }
    std::printf("=== GPU parity table\n");
    row({"kernel", "case", "metric", "value", "bound", "result"});
    for (const auto& l : lines_) row(l);
    std::printf("=== CPU references and comparisons\n");
    for (const std::string& r : references_) std::printf("%s\n", r.c_str());
    std::printf("=== end of GPU parity table: %d PASS, %d FAIL, %d SKIP lines; %d tests failed\n",
                pass, fail, skip, unit.failed_test_count());
    std::fflush(stdout);
  }

 private:
  std::vector<std::vector<std::string>> lines_;
  std::vector<std::string> references_;  // "kernel: reference, comparison", once each
};

}  // namespace
}  // namespace kvr::gpu_parity

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // gtest owns and deletes appended listeners.
  ::testing::UnitTest::GetInstance()->listeners().Append(new kvr::gpu_parity::TablePrinter);
  return RUN_ALL_TESTS();
}
