#pragma once
// Runs a helper program (the plot scripts of kvr bench and kvr eval endpoint) and waits for it.

#include <spawn.h>
#include <sys/wait.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

extern char** environ;

namespace kvr::tools {

// argv[0] is looked up on PATH. InternalError naming `what` when it cannot start or exits
// other than 0.
[[nodiscard]] inline absl::Status RunAndWait(std::vector<std::string> argv,
                                             const std::string& what) {
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0].c_str(), nullptr, nullptr, args.data(), environ) != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], " for ", what));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat(
        what, ": ", argv[0], " ", argv.size() > 1 ? argv[1] : "", " failed (status ", status, ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvr::tools
