// libFuzzer target: GgufFile::Open on arbitrary bytes (kvr reads model files it did not
// write), then every accessor a loader uses on what it accepted: metadata getters, tensor
// data views and, for small tensors, dequantisation. A parse error is fine; a crash,
// sanitizer report or a tensor view outside the file is not.

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvr/model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // GgufFile maps a path: hand it the bytes as an in-memory file.
  const int fd = memfd_create("gguf-fuzz", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, data + written, size - written);
    if (n <= 0) std::abort();
    written += static_cast<size_t>(n);
  }
  {
    absl::StatusOr<kvr::model::GgufFile> file =
        kvr::model::GgufFile::Open("/proc/self/fd/" + std::to_string(fd));
    if (file.ok()) {
      for (const auto& [key, value] : file->metadata()) {
        (void)file->GetString(key);
        (void)file->GetInt(key);
        (void)file->GetFloat(key);
        (void)file->GetBool(key);
        (void)file->GetStringArray(key);
        (void)file->GetArray<int32_t>(key);
        (void)file->GetArray<float>(key);
      }
      for (const kvr::model::GgufTensorInfo& t : file->tensors()) {
        const std::span<const uint8_t> bytes = file->TensorData(t);
        // The parser promised the tensor lies inside the file.
        if (file->data_offset() + t.offset + bytes.size() > size) std::abort();
        if (t.n_elements > 0 && t.n_elements <= 4096) {
          (void)file->DequantizeTensor(t.name);
        }
      }
    }
  }
  close(fd);
  return 0;
}
