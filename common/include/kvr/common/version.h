#pragma once
// The build's version: the CMake project version and, where the source tree was a git checkout
// at configure time, its `git describe` (for example "0.1.0 (git a86aaaf)").

#include <string>
#include <string_view>

namespace kvr {

// "0.1.0" or "0.1.0 (git a86aaaf)".
const std::string& Version();
// What every binary's --version prints: "<binary> <Version()>".
std::string VersionLine(std::string_view binary);

}  // namespace kvr
