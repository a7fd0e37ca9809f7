#pragma once
// Small CUDA runtime helpers shared by every CUDA component (retrieval kernels, the CUDA model
// backend, the decode node's GPU path). Include only from CUDA-enabled translation units (the
// `kvr::common_cuda` target exists only when the build found nvcc).
//
// - KVR_CUDA_RETURN_IF_ERROR(expr): turn a cudaError_t into an absl::Status naming the call.
// - CudaStream, CudaEvent, DeviceBuffer<T>, PinnedBuffer<T>: move-only RAII owners
//  . Allocation failures come back as Status, never as exceptions.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvr::cuda {

// Status of a CUDA runtime call; `what` names the call for the error message.
[[nodiscard]] inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const absl::StatusCode code = (err == cudaErrorMemoryAllocation)
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(
      code, absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

#define KVR_CUDA_RETURN_IF_ERROR(expr)                                      \
  do {                                                                      \
    if (cudaError_t kvr_cuda_err_ = (expr); kvr_cuda_err_ != cudaSuccess) { \
      return ::kvr::cuda::CudaStatus(kvr_cuda_err_, #expr);                 \
    }                                                                       \
  } while (false)

// The last error of a kernel launch (launch configuration errors) as a Status.
[[nodiscard]] inline absl::Status LastLaunchStatus(const char* kernel) {
  return CudaStatus(cudaGetLastError(), kernel);
}

class CudaStream {
 public:
  CudaStream() = default;
  [[nodiscard]] static absl::StatusOr<CudaStream> Create(unsigned flags = cudaStreamNonBlocking) {
    CudaStream s;
    KVR_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream_, flags));
    return s;
  }
  CudaStream(CudaStream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      Reset();
      stream_ = std::exchange(o.stream_, nullptr);
    }
    return *this;
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream() { Reset(); }

  cudaStream_t get() const { return stream_; }
  [[nodiscard]] absl::Status Synchronize() const {
    return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  void Reset() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  [[nodiscard]] static absl::StatusOr<CudaEvent> Create(unsigned flags = cudaEventDefault) {
    CudaEvent e;
    KVR_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e.event_, flags));
    return e;
  }
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    if (this != &o) {
      Reset();
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() { Reset(); }

  cudaEvent_t get() const { return event_; }

 private:
  void Reset() {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

// Device memory for `n` elements of T (uninitialised).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  [[nodiscard]] static absl::StatusOr<DeviceBuffer> Create(size_t n) {
    DeviceBuffer b;
    if (n > 0)
      KVR_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&b.data_), n * sizeof(T)));
    b.size_ = n;
    return b;
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }

 private:
  void Reset() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  size_t size_ = 0;
};

// Page-locked host memory for `n` elements of T. `flags` as cudaHostAlloc (cudaHostAllocMapped
// for zero-copy access from kernels through device_pointer()).
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  [[nodiscard]] static absl::StatusOr<PinnedBuffer> Create(size_t n,
                                                           unsigned flags = cudaHostAllocDefault) {
    PinnedBuffer b;
    if (n > 0) {
      KVR_CUDA_RETURN_IF_ERROR(
          cudaHostAlloc(reinterpret_cast<void**>(&b.data_), n * sizeof(T), flags));
    }
    b.size_ = n;
    return b;
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Reset(); }

  T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return size_ * sizeof(T); }
  // The device-side address of mapped memory (cudaHostAllocMapped).
  [[nodiscard]] absl::StatusOr<T*> device_pointer() const {
    T* p = nullptr;
    KVR_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(reinterpret_cast<void**>(&p), data_, 0));
    return p;
  }

 private:
  void Reset() {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  size_t size_ = 0;
};

// Whether a CUDA device is usable here (false on CI machines: nvcc but no GPU). GPU tests carry
// the CTest label `gpu` and are not run there; this lets a binary say why it cannot run.
[[nodiscard]] inline bool HaveCudaDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Allocates `b` anew for `n` elements (sparse and dense state buffers of the CUDA runtime). A
// failed cudaMalloc is also the runtime's "last error": it is cleared, or the next kernel launch
// check (cudaGetLastError) would report this allocation's failure as its own.
template <typename T>
[[nodiscard]] absl::Status Alloc(DeviceBuffer<T>& b, int64_t n) {
  absl::StatusOr<DeviceBuffer<T>> created = DeviceBuffer<T>::Create(static_cast<size_t>(n));
  if (!created.ok()) {
    cudaGetLastError();
    return created.status();
  }
  b = *std::move(created);
  return absl::OkStatus();
}
template <typename T>
[[nodiscard]] absl::Status AllocPinned(PinnedBuffer<T>& b, int64_t n) {
  absl::StatusOr<PinnedBuffer<T>> created = PinnedBuffer<T>::Create(static_cast<size_t>(n));
  if (!created.ok()) return created.status();
  b = *std::move(created);
  return absl::OkStatus();
}

}  // namespace kvr::cuda
