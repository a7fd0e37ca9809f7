# Every external dependency, found once. All come from Debian packages
# (scripts/install-deps.sh) or the CUDA toolkit.
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(fmt CONFIG REQUIRED)
find_package(spdlog CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(yaml-cpp CONFIG REQUIRED)
find_package(GTest CONFIG REQUIRED)
find_package(benchmark CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
# cpp-httplib (libcpp-httplib-dev, built against OpenSSL 3): the controller's OpenAI-compatible
# HTTP(S) server. Through pkg-config, whose flags carry the CPPHTTPLIB_*_SUPPORT definitions
# the shared library was built with (the header's class layouts depend on them).
pkg_check_modules(CPP_HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
include(GoogleTest)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_program(KVR_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
find_package(ucx CONFIG REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
# libcurl (libcurl4-openssl-dev): the HTTP client of `kvr bench --backend openai-*`.
find_package(CURL REQUIRED)
