// Linked into the node executables (kvr::thread_stack_floor, common/CMakeLists.txt): replaces
// pthread_attr_setstacksize for the whole process.
//
// Why: cuBLASLt (linked for the CUDA backends, loaded at start whatever --device says) holds
// ~92 KiB of static TLS, which glibc takes out of every thread's stack; civetweb (prometheus-
// cpp's /metrics server) asks for 100 KiB stacks, so its pthread_create fails with EINVAL and the
// node cannot start ("null context when constructing CivetServer"). Every explicit stack size in
// the process is raised to at least 1 MiB here; the real function does the rest. The symbol is
// exported from the executable (the target's link option), so civetweb's call binds to it.

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (real == nullptr) return EINVAL;
  return real(attr, std::max<size_t>(size, size_t{1} << 20));
}
