#pragma once
// Registration of the `kvr` subcommands. Each Add*Command adds one subcommand (with its
// options and its callback) to the top-level app; main.cc calls each once.

#include <string_view>

#include "absl/status/status.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvr::tools {

void AddGenerateCommand(CLI::App& app);  // kvr generate
void AddTokenizeCommand(CLI::App& app);  // kvr tokenize
void AddEvalCommand(CLI::App& app);      // kvr eval retrieval (retrieval/eval), kvr eval endpoint
// kvr eval endpoint (tools/eval) under `eval`, the subcommand AddEvalCommand makes.
void AddEvalEndpointCommand(CLI::App& eval);
void AddCalibrateCommand(CLI::App& app);  // kvr calibrate (A2ATS codebooks)
void AddUpCommand(CLI::App& app);         // kvr up (local cluster)
void AddBenchCommand(CLI::App& app);      // kvr bench (load generator, tools/bench)
// kvr bench decode (GPU decode throughput, kvr::model_cuda); after AddBenchCommand.
void AddBenchDecodeCommand(CLI::App& app);

// How a subcommand's callback ends on an error: prints "kvr <command>: <status>" on stderr and
// throws CLI::RuntimeError(exit_code), which main turns into the process's exit status.
// Nothing when `status` is OK.
void ExitIfError(std::string_view command, const absl::Status& status, int exit_code = 1);

}  // namespace kvr::tools
