#pragma once
// Registration of the `kvr` subcommands. Each Add*Command adds one subcommand (with its
// options and its callback) to the top-level app; main.cc calls each once.

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

}  // namespace kvr::tools
