#pragma once
// The comparison every selector row makes: one launch's ids and counts against the CPU index's
// Select of the same request, row by row (the contract of each row, equal counts, the sets'
// agreement).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/retrieval/index.h"

namespace kvr::gpu_parity {

// ids [batch * n_kv_heads, budget] and counts [batch * n_kv_heads] of a launch over candidates
// [begin[b], end[b]); `cpu(b, &selection)` selects sequence b on the CPU. Every row obeys the
// contract (kvr::cuda::testing::CheckIdRow, no count left poisoned), its count equals the CPU's,
// and `agree` adds the row. `where` names the launch in failure messages.
inline void CompareWithCpuSelect(const std::vector<int32_t>& ids,
                                 const std::vector<int32_t>& counts, int budget, int n_kv_heads,
                                 const std::vector<int32_t>& begin, const std::vector<int32_t>& end,
                                 const std::function<absl::Status(int, retrieval::Selection*)>& cpu,
                                 const std::string& where,
                                 kvr::cuda::testing::SetAgreement* agree) {
  for (size_t b = 0; b < begin.size(); ++b) {
    retrieval::Selection sel;
    ASSERT_OK(cpu(static_cast<int>(b), &sel));
    for (int h = 0; h < n_kv_heads; ++h) {
      const std::string at = where + " seq " + std::to_string(b) + " head " + std::to_string(h);
      const size_t row = b * n_kv_heads + h;
      ASSERT_NE(counts[row], kvr::cuda::testing::kPoison) << at;
      const auto got = kvr::cuda::testing::CheckIdRow(ids.data() + row * budget, counts[row],
                                                      budget, begin[b], end[b], at);
      const auto& want = sel.per_head[h];
      ASSERT_EQ(got.size(), want.size()) << at;
      agree->Add(got, want);
    }
  }
}

}  // namespace kvr::gpu_parity
