// A decode loop's tap on CPU, as an XLA FFI custom call: each call writes its int32 vector to a pipe
// as one message (its length, then the values), from XLA's thread, without Python. The Python tap it
// replaces held the loop until it got the GIL (0.2-0.45 ms an iteration while the core's other
// threads ran Python). The core's Python threads write to the same pipe through
// jaxinfra_pipe_write, under the same lock, so no message is ever split by another.

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::mutex write_lock;

// Write all of `size` bytes unless the pipe fails (its reader gone: the message is dropped).
int WriteAll(int fd, const char* data, size_t size) {
  std::lock_guard<std::mutex> lock(write_lock);
  while (size > 0) {
    const ssize_t n = write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

ffi::Error PipeTap(ffi::Buffer<ffi::S32> values, int64_t fd, ffi::ResultBuffer<ffi::S32> receipt) {
  const int32_t n = static_cast<int32_t>(values.element_count());
  std::vector<char> message(sizeof(int32_t) * (n + 1));
  std::memcpy(message.data(), &n, sizeof(int32_t));
  std::memcpy(message.data() + sizeof(int32_t), values.typed_data(), sizeof(int32_t) * n);
  WriteAll(static_cast<int>(fd), message.data(), message.size());  // a closed stream drops the tokens:
  receipt->typed_data()[0] = 0;  // the loop's results still carry them
  return ffi::Error::Success();
}

}  // namespace

extern "C" int jaxinfra_pipe_write(int fd, const char* data, size_t size) { return WriteAll(fd, data, size); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinfraPipeTap, PipeTap,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().Attr<int64_t>("fd").Ret<ffi::Buffer<ffi::S32>>());
