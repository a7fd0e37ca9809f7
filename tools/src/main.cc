// kvr: the command-line entry point. Subcommands register themselves through commands.h.

#include <CLI/CLI.hpp>

#include "commands.h"
#include "kvr/common/version.h"

int main(int argc, char** argv) {
  CLI::App app{"kvr: long-context LLM serving with KV retrieval"};
  app.set_version_flag("--version", kvr::VersionLine("kvr"));
  app.require_subcommand(1);
  kvr::tools::AddGenerateCommand(app);
  kvr::tools::AddTokenizeCommand(app);
  kvr::tools::AddEvalCommand(app);
  kvr::tools::AddCalibrateCommand(app);
  kvr::tools::AddUpCommand(app);
  kvr::tools::AddBenchCommand(app);
  kvr::tools::AddBenchDecodeCommand(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
