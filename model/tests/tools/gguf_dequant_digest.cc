// gguf_dequant_digest: dequantises every tensor of a GGUF file to float32 and prints one line
// per tensor, `<name>\t<type>\t<n_elements>\t<sha256 of the float32 bytes>`, so that
// model/tests/scripts/gguf_dequant_compare.py can check it against the gguf Python package.
// The dequantisation time (without hashing) goes to stderr.
//
//   gguf_dequant_digest MODEL.gguf [--threads N]

#include <openssl/evp.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "kvr/common/thread_pool.h"
#include "kvr/model/gguf.h"

namespace {

std::string Sha256Hex(const void* data, size_t n) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, n, md, &len, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[md[i] >> 4]);
    out.push_back(kHex[md[i] & 15]);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Dequantise every tensor of a GGUF file and print sha256 digests"};
  std::string path;
  size_t threads = 1;
  app.add_option("model", path, "GGUF file")->required();
  app.add_option("--threads", threads, "threads for dequantisation (0 = all cores)");
  CLI11_PARSE(app, argc, argv);

  auto file = kvr::model::GgufFile::Open(path);
  if (!file.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(file.status().message()).c_str());
    return 1;
  }
  kvr::ThreadPool pool(threads);
  std::vector<float> buffer;
  double seconds = 0;
  int64_t elements = 0;
  uint64_t bytes = 0;
  for (const kvr::model::GgufTensorInfo& info : file->tensors()) {
    buffer.resize(static_cast<size_t>(info.n_elements));
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = file->DequantizeTensorInto(info, buffer, &pool);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!s.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    elements += info.n_elements;
    bytes += info.n_bytes;
    std::printf("%s\t%s\t%lld\t%s\n", info.name.c_str(),
                kvr::model::GgmlTypeName(info.type).c_str(),
                static_cast<long long>(info.n_elements),
                Sha256Hex(buffer.data(), buffer.size() * sizeof(float)).c_str());
  }
  std::fprintf(stderr,
               "dequantised %zu tensors, %lld elements (%.1f MB in, %.1f MB out) in %.1f ms "
               "with %zu threads: %.0f M elements/s\n",
               file->tensors().size(), static_cast<long long>(elements), bytes / 1e6,
               elements * 4 / 1e6, seconds * 1e3, pool.size(), elements / seconds / 1e6);
  return 0;
}
