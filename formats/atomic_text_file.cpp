#include "formats/atomic_text_file.h"

#include <unistd.h>

#include <fstream>
#include <system_error>

#include "formats/input_error.h"
#include "formats/remove_on_failure.h"

namespace kvforge {

void write_text_file_atomically(const std::filesystem::path& path, std::string_view text, const std::string& what) {
  const std::filesystem::path temporary = path.string() + ".tmp." + std::to_string(::getpid());
  RemoveOnFailure cleanup(temporary);
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) throw InputError(path.string(), "", "a writable path for " + what);
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) throw InputError(path.string(), "", "a writable path for " + what + " (" + error.message() + ")");
  cleanup.release();
}

}  // namespace kvforge
