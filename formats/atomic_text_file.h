#pragma once
// Writing a text output (JSON, an HTML report) with no partial file left
// behind: the text goes to a temporary file beside the target (same file
// system; the pid keeps concurrent writers apart), which is renamed over the
// target once complete and removed when anything fails.
#include <filesystem>
#include <string>
#include <string_view>

namespace kvforge {

// InputError(path, "", "a writable path for <what>") when the file cannot be
// written or renamed into place.
void write_text_file_atomically(const std::filesystem::path& path, std::string_view text, const std::string& what);

}  // namespace kvforge
