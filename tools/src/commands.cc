#include "commands.h"

#include <iostream>

#include <CLI/CLI.hpp>

namespace kvr::tools {

void ExitIfError(std::string_view command, const absl::Status& status, int exit_code) {
  if (status.ok()) return;
  std::cerr << "kvr " << command << ": " << status << "\n";
  throw CLI::RuntimeError(exit_code);
}

}  // namespace kvr::tools
